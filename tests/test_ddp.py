"""DistributedDataParallel: ``torchrun --nproc_per_node 2`` (gloo, CPU) trains like one process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sketchlab.cli import main

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")

# A tiny LLoPS model (2 layers, learnable Θ) and 4 steps of a global batch of 8 sequences.
ARGS = ["train", "--attention", "llops", "--p", "2", "--m", "6", "--init", "based", "--steps", "4",
        "--batch-size", "8", "--lr", "1e-2", "--warmup", "1", "--num-pairs", "4", "--seq-len", "16",
        "--vocab-size", "21", "--d-model", "16", "--n-heads", "2", "--n-layers", "2", "--eval-every", "0",
        "--eval-sequences", "8", "--checkpoint-every", "2", "--no-progress"]


def test_torchrun_two_ranks_gives_the_single_process_losses(tmp_path):
    # "--" ends torchrun's own options: without it torchrun reads "--m" as an abbreviation of its own
    assert TORCHRUN is not None, "torchrun (part of torch) must be installed beside the interpreter"
    assert main([*ARGS, "--out", str(tmp_path / "one")]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "sketchlab.cli", "--", *ARGS, "--out", str(tmp_path / "two")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "train.json").read_text())
    two = json.loads((tmp_path / "two" / "train.json").read_text())
    assert one["world_size"] == 1 and two["world_size"] == 2
    # Same global batch, each rank its half: the gradients differ only in the order of the float32
    # sums (two half-batch means averaged by all-reduce vs one mean), ~1e-7 relative, which AdamW's
    # normalised steps carry over 4 steps to ~1e-6 in the loss; 1e-5 leaves a margin and is far below
    # the loss changes between steps (~1e-2), so a rank that trained on the wrong slice would fail.
    assert len(one["losses"]) == len(two["losses"]) == 4
    for a, b in zip(one["losses"], two["losses"]):
        assert b == pytest.approx(a, rel=1e-5, abs=0)
    assert one["losses"][0] != one["losses"][-1]
    # rank 0 alone wrote the checkpoints and the final model
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert (tmp_path / "two" / "model.safetensors").is_file()
