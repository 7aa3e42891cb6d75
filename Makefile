# The README's two commands: `make demo` and `make test`. Both set up .venv on a fresh machine
# (Python 3.11, pip, gcc) and are quick to re-run once it exists.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sketchlab-installed
# Torch is pinned to the CPU wheel that lies on disk; a looser pin pulls several GB of CUDA.
TORCH ?= torch==2.13.0

.PHONY: setup test demo data analysis clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# One intra-op thread: the suite is many small tensor ops, which extra threads only slow down.
# Without a GPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, fp32 only);
# tests/conftest.py sets the same for a bare `pytest`, notebooks get it from here.
TRITON_INTERPRET ?= 1
test: setup
	OMP_NUM_THREADS=1 TRITON_INTERPRET=$(TRITON_INTERPRET) $(PY) -m pytest -q -p no:cacheprovider tests notebooks --nbmake

demo: setup
	$(PY) -m sketchlab.demo

# Retrain the MQAR softmax model and rewrite data/mqar_softmax_qk.safetensors (+ checkpoint in
# data/mqar_softmax/) from the seed; settings and the measured accuracy are in data/README.md.
data: setup
	$(PY) analysis/train_mqar.py --out data --no-progress

# Regenerate every table and figure under analysis/results/ (one script per artefact, one thread
# each, run one after the other on the 2-core machine). Scripts not in this checkout are listed and
# skipped, so the target works while figure2.py / recall.py are still on their branches.
ANALYSIS_SCRIPTS ?= table3 figure2 figure3 degree_sweep spectrum bench_fit recall
analysis: setup
	@missing=""; for s in $(ANALYSIS_SCRIPTS); do \
	  if [ -f analysis/$$s.py ]; then \
	    echo "== analysis/$$s.py"; OMP_NUM_THREADS=1 $(PY) analysis/$$s.py || exit 1; \
	  else missing="$$missing $$s.py"; fi; \
	done; if [ -n "$$missing" ]; then echo "not in this checkout (skipped):$$missing"; fi

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
