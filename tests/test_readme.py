"""Every command in README.md, run in a fresh temporary directory.

The commands are read from README.md itself: each ``python`` code block is one command, each
non-empty line of a ``bash`` code block another (its trailing ``# comment`` dropped). Each must
full-match exactly one entry of :data:`SMALL`, whose substitutions (regexes on the command's text)
make it small enough for the suite (one head of the shipped dump, a handful of steps, a tiny
stand-in model for ``./my-local-model``); then it runs in a temporary directory holding a copy of
``data/``, the stand-in ``my-local-model/`` and a ``prompt.txt``, and must succeed and write every
output it names. A README command that no entry covers, or that an entry's substitution no longer
changes, fails the test: the mapping and the README cannot drift apart.

``sketchlab ...`` lines run in this process through :func:`sketchlab.cli.main` (no interpreter
start-up per line); the ``torchrun`` line runs its ``train`` command there too, on one process
(DDP itself is tested by ``tests/test_ddp.py``); ``make demo`` runs ``python -m sketchlab.demo``
(the recipe, checked against the Makefile) on the small dump; ``make test`` is the suite this file
belongs to, so only its recipe is checked.

As a script (``make readme-check``; not part of ``make test``) every command runs exactly as
written, each in a fresh process, in a temporary directory prepared the same way (``make`` lines
in the repository, where the Makefile is), and its wall time is printed: the times the README
quotes come from there.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DUMP = "data/mqar_softmax_qk.safetensors"
SMALL_DUMP = "small_qk.safetensors"  # layer 0, head 0 of the shipped dump: [1, 1, 512, 32]
WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", ".", "a", "dog", "ran", "and", "hid"]

_FEW_STEPS = (r"--steps \d+", "--steps 2 --eval-sequences 16 --batch-size 8 --no-progress")

#: (name, full-match regex of the README command, [(regex, replacement), ...]): how each README
#: command is made small. Every substitution must change the command (so it keeps matching the README).
SMALL = [
    ("make demo", r"make demo",
     [(r"^make demo$", f"python -m sketchlab.demo --dump {SMALL_DUMP} --m 8 --target 0.3 --methods optimal,llops,psf "
       "--out out/demo")]),
    ("make test", r"make test", []),  # the suite this test is part of: its recipe is checked, not run
    ("tour", r"(?s)import tempfile, torch, sketchlab as sl\n.*",
     [(r'sl\.load_qk\(f"\{DATA\}/mqar_softmax_qk\.safetensors"\)',  # one head of each layer
       'sl.load_qk(f"{DATA}/mqar_softmax_qk.safetensors", heads=[0])'),
      (r"sl\.compare\(dump, p=2, m=64, layers=\[0, 3\]\)",  # the cheap methods only
       'sl.compare(dump, p=2, m=64, layers=[0, 3], methods=("optimal", "llops", "psf"), progress=False)')]),
    ("hybrid block", r"(?s)import torch, sketchlab as sl\n\nblock = sl\.LLoPSAttention\(.*", []),  # already small
    ("capture", r"sketchlab capture --model-dir \./my-local-model --text prompt\.txt --out \S+", []),
    ("dump command", r"sketchlab (verify|spectrum|compare|fit) +" + re.escape(DUMP) + r" .*",
     [(re.escape(DUMP), SMALL_DUMP)]),
    ("advise", r"sketchlab advise +" + re.escape(DUMP) + r" .*--target 0\.05 .*",  # a shorter search for m
     [(re.escape(DUMP), SMALL_DUMP), (r"--target 0\.05", "--target 0.3")]),
    ("train", r"sketchlab train .*--steps \d+ .*", [_FEW_STEPS]),
    ("linearize toy", r"sketchlab linearize data/mqar_softmax .*--steps \d+ .*",
     [(r"--m 64", "--m 8"), (r"--steps \d+", "--steps 2 --eval-sequences 16 --capture-sequences 2 --no-progress")]),
    ("linearize pretrained", r"sketchlab linearize --model-dir \./my-local-model --text prompt\.txt .*--transfer-steps \d+ .*",
     [(r"--transfer-steps \d+", "--transfer-steps 2 --seq-len 32 --no-progress")]),
    ("torchrun", r"torchrun --nproc_per_node \d+ -m sketchlab\.cli -- train .*--steps \d+ .*",
     [(r"^torchrun --nproc_per_node \d+ -m sketchlab\.cli -- ", "sketchlab "), _FEW_STEPS]),
]


def readme_commands(text: str | None = None) -> list[str]:
    """The README's commands in order: each ``python`` block whole, each line of each ``bash`` block."""
    text = README.read_text(encoding="utf-8") if text is None else text
    commands = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if lang == "python":
            commands.append(body.rstrip("\n"))
        elif lang in ("bash", "sh", "shell"):
            for line in body.splitlines():
                line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment ("  # ...")
                if line and not line.startswith("#"):
                    commands.append(line)
        else:
            raise AssertionError(f"README.md: a code block in {lang or 'no language'!r}: the test runs only python and bash")
    return commands


def small(command: str) -> tuple[str, str]:
    """``(entry name, the command made small)`` through the one :data:`SMALL` entry that matches it."""
    hits = [(name, subs) for name, pattern, subs in SMALL if re.fullmatch(pattern, command)]
    assert len(hits) == 1, f"README command covered by {len(hits)} entries of SMALL (must be 1): {command!r}"
    name, subs = hits[0]
    for pattern, repl in subs:
        new = re.sub(pattern, repl, command, flags=re.M)
        assert new != command, f"SMALL[{name!r}]: {pattern!r} no longer changes {command!r}"
        command = new
    return name, command


def make_small_dump(directory: Path) -> None:
    import sketchlab as sl

    dump = sl.load_qk(directory / DUMP, layers=[0], heads=[0])
    sl.save_qk(directory / SMALL_DUMP, dump.q, dump.k, dump.v, meta=dump.meta)


def make_workdir(directory: Path) -> None:
    """A copy of ``data/``, a tiny random GPT-2 with a word-level tokenizer as ``my-local-model``
    (a stand-in for the reader's model: nothing is downloaded) and a ``prompt.txt`` in its words."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(ROOT / "data", directory / "data", ignore=shutil.ignore_patterns("README.md"))
    model_dir = directory / "my-local-model"
    cfg = transformers.GPT2Config(vocab_size=len(WORDS), n_embd=32, n_layer=2, n_head=2, n_positions=512,
                                  bos_token_id=0, eos_token_id=0)  # head dim 16: C(17, 2) = 136 >= m = 64
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(model_dir)
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(1, len(WORDS), (600,), generator=gen).tolist()
    (directory / "prompt.txt").write_text(" ".join(WORDS[i] for i in words) + "\n", encoding="utf-8")


def _outputs(argv: list[str]) -> list[str]:
    """The files/directories a command names after ``--out``, ``--json``, ``--markdown``, ``--plot``."""
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--out", "--json", "--markdown", "--plot")
            and argv[i + 1] != "-"]


def _makefile_recipe(target: str) -> str:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    found = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, flags=re.M)
    assert found, f"Makefile: no target {target!r}"
    return found.group(1)


def _run_small(name: str, command: str, workdir: Path) -> None:
    from sketchlab import demo
    from sketchlab.cli import main

    if name == "make test":
        assert "-m pytest" in _makefile_recipe("test") and "tests notebooks --nbmake" in _makefile_recipe("test")
        return
    if name in ("tour", "hybrid block"):
        namespace: dict = {"__name__": "__readme__"}
        exec(compile(command, f"README.md ({name})", "exec"), namespace)
        if name == "tour":  # its last lines ran: the table has every method on both layers, the Θ file exists
            rows = namespace["table"].rows
            assert {r.method for r in rows} == {"optimal", "llops", "psf"} and {r.layer for r in rows} == {0, 3}
            assert Path(namespace["out"], "theta.safetensors").stat().st_size > 0
        return
    argv = shlex.split(command)
    if argv[:3] == ["python", "-m", "sketchlab.demo"]:
        assert "$(PY) -m sketchlab.demo" in _makefile_recipe("demo")
        assert demo.main(argv[3:]) == 0
        assert (workdir / "out/demo/comparison.md").stat().st_size > 0
        return
    assert argv[0] == "sketchlab", command
    rc = main(argv[1:])
    assert rc == 0, f"{command!r} (README: {name}) exited with {rc}"
    for out in _outputs(argv):
        assert (workdir / out).exists(), f"{command!r} did not write {out}"


def test_every_readme_command_runs_small(tmp_path, monkeypatch, capsys):
    commands = readme_commands()
    assert len(commands) >= 12, commands  # the two make lines, the two python blocks, the shell block
    made = [small(c) for c in commands]  # every command covered before anything runs
    assert {name for name, _ in made} == {name for name, _, _ in SMALL}, "an entry of SMALL matches no README command"
    make_workdir(tmp_path)
    monkeypatch.chdir(tmp_path)  # not the repository root: the tour must work from elsewhere
    make_small_dump(tmp_path)
    for name, command in made:
        _run_small(name, command, tmp_path)
    capsys.readouterr()


def test_small_rejects_an_uncovered_or_changed_command():
    import pytest

    with pytest.raises(AssertionError, match="covered by 0 entries"):
        small("sketchlab frobnicate qk.safetensors")
    with pytest.raises(AssertionError, match="covered by 0 entries"):  # a dump command on another dump
        small("sketchlab fit other.safetensors --out t.safetensors")
    text = "```bash\nmake demo   # a comment\n\nsketchlab train --task mqar --steps 300 --out runs/x\n```\n"
    assert readme_commands(text) == ["make demo", "sketchlab train --task mqar --steps 300 --out runs/x"]
    assert small("sketchlab train --task mqar --steps 300 --out runs/x")[1] == (
        "sketchlab train --task mqar --steps 2 --eval-sequences 16 --batch-size 8 --no-progress --out runs/x")


# ---- script: every command exactly as written, timed (make readme-check) -------------------------

def run_as_written(skip: str | None = None, out: str | None = None) -> int:
    """Run every README command exactly as written, each in a fresh process; print a markdown table of
    exit codes and wall times, and with ``out`` also write it there (atomically) under a header naming
    the command, the start time, the torch threads and the load averages at the start and the end.
    Returns 1 if any command failed, else 0."""
    import datetime
    import os
    import platform
    import tempfile

    from sketchlab.cli._common import write_text_atomic

    commands = readme_commands()
    for c in commands:
        small(c)  # the same coverage rule as the test
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    failed, rows = 0, []
    started, load0 = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="readme-check-") as tmp:
        workdir = Path(tmp)
        make_workdir(workdir)
        print(f"README commands exactly as written, in {workdir} (make lines in {ROOT}); "
              f"load average {os.getloadavg()[0]:.1f} at the start", flush=True)
        print("| command | exit | wall s |\n|---|---|---|", flush=True)
        for i, command in enumerate(commands):
            label = command.splitlines()[0] + (" …" if "\n" in command else "")
            if skip and re.search(skip, command):
                rows.append(f"| `{label}` | skipped | – |")
                print(rows[-1], flush=True)
                continue
            if "\n" in command:  # a python block
                script = workdir / f"readme_block_{i}.py"
                script.write_text(command + "\n", encoding="utf-8")
                argv, cwd = [sys.executable, script.name], workdir
            else:
                argv, cwd = ["bash", "-c", command], (ROOT if command.startswith("make ") else workdir)
            start = time.perf_counter()
            proc = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            seconds = time.perf_counter() - start
            failed += proc.returncode != 0
            rows.append(f"| `{label}` | {proc.returncode} | {seconds:.1f} |")
            print(rows[-1], flush=True)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], file=sys.stderr, flush=True)
    if out is not None:
        load1 = os.getloadavg()
        threads = os.environ.get("OMP_NUM_THREADS", f"torch's default ({os.cpu_count()} cores)")
        argv = " ".join(shlex.quote(a) for a in ["tests/test_readme.py", *sys.argv[1:]])
        header = [
            "# Every README command, exactly as written: wall times", "",
            f"`PYTHONPATH=$PWD .venv/bin/python {argv}` (`make readme-check` runs it), started "
            f"{started:%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} CPUs; intra-op threads: "
            f"{threads}; load average {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} (1 / 5 / 15 min) at the "
            f"start, {load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f} at the end (other jobs on the machine "
            "slow every command: upper bounds, not an idle machine's times). Each command in a fresh process, "
            "in a temporary directory with a copy of `data/`, a `prompt.txt` and a tiny random GPT-2 (2 layers, "
            "2 heads of 16) with a word-level tokenizer standing in for `./my-local-model`; `make` lines run in "
            "the checkout" + (f", those matching `{skip}` not run" if skip else "") + ".", "",
            "| command | exit | wall s |", "|---|---|---|"]
        write_text_atomic(out, "\n".join(header + rows) + "\n")
        print(f"wrote {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Run every README command exactly as written, timed.")
    parser.add_argument("--skip", help="regex: README commands matching it are not run (listed as skipped)")
    parser.add_argument("--out", help="also write the table as markdown here (e.g. analysis/results/readme_check.md)")
    args = parser.parse_args()
    sys.exit(run_as_written(args.skip, args.out))
