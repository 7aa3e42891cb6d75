"""Stage 1 (attention transfer) spread over processes: a gloo group of two ranks (the torchrun path) and
``processes=2`` (spawned workers) give every rank the single-process run's parameters and loss curves
bit for bit, the worker training alongside this process; mismatched ranks, and an argument one rank
refuses, are refused on every rank alike; bad ``processes``, ``group``, ``train_idx``, ``layers`` values,
a worker ending early and a too small /dev/shm are refused with one clear error.

Why bitwise: each layer draws its batches from its own ``(seed, layer)`` generator, so the rank that
trains it runs exactly the operations one process runs on that layer (float64, one thread everywhere:
no thread-count-dependent reduction order), and the broadcasts copy the values exactly. Skip the
broadcast (or share the generator across layers) and the other rank's layers keep their untrained
values (or train on other batches): the equalities fail by far more than round-off.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import sys
import time

import pytest
import torch

from sketchlab.convert.linearize import attention_transfer, teacher_attention

STEPS, BATCH, SEED = 6, 2, 3
TRAIN = torch.arange(5)  # of 6 sequences


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _setup():
    """A tiny random float64 Llama (GQA: 4 query heads, 2 KV heads; 3 layers, so two ranks share them
    unevenly), its recorded attention, and a Hedgehog hybrid (maps and gates train)."""
    import transformers

    from sketchlab.convert import convert_attention

    cfg = transformers.LlamaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():  # sharper attention than the random init's near-uniform one
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
    ids = torch.randint(1, 60, (6, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[4, 11:] = 0  # a padded training sequence
    layers = teacher_attention(model, ids, mask)
    sketches = convert_attention(model, attention="hedgehog", m=8, window=4, sinks=1)
    return sketches, layers, mask


def _params(sketches):
    return [p.detach().clone() for s in sketches for p in s.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def case():
    """The sketches before training, the recorded layers, and the single-process run's result."""
    sketches, layers, mask = _setup()
    reference = copy.deepcopy(sketches)
    with _one_thread():
        curves = attention_transfer(reference, layers, mask, TRAIN, steps=STEPS, batch_size=BATCH, seed=SEED)
    before, after = _params(sketches), _params(reference)
    # the comparisons below mean something: every layer trained (each map and gate moved, each curve is
    # STEPS distinct losses)
    assert len(curves) == 3 and all(len(c) == STEPS and len(set(c)) == STEPS for c in curves)
    assert all(not torch.equal(a, b) for a, b in zip(before, after))
    return sketches, layers, mask, after, curves


def _assert_same(params, curves, case, who):
    _, _, _, ref_params, ref_curves = case
    assert curves == ref_curves, f"{who}: loss curves differ from one process's"
    assert len(params) == len(ref_params)
    for i, (a, b) in enumerate(zip(params, ref_params)):
        gap = float((a - b).abs().max())
        assert torch.equal(a, b), f"{who}: trained tensor {i} differs from one process's by {gap}"


def _rank1(index, port, sketches, layers, mask, out):
    """Rank 1 of test_two_rank_group_matches_one_process, in a spawned process."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        mine = copy.deepcopy(sketches)
        curves = attention_transfer(mine, layers, mask, TRAIN, steps=STEPS, batch_size=BATCH, seed=SEED)
        torch.save({"params": _params(mine), "curves": curves}, f"{out}/rank1.pt")
        try:  # a rank called with other options: refused here as on rank 0, before any broadcast
            attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=STEPS + 1, batch_size=BATCH,
                               seed=SEED)
            refused = ""
        except ValueError as err:
            refused = str(err)
        try:  # an argument only this rank refuses: every rank refuses, none waits in a collective
            attention_transfer(copy.deepcopy(sketches), layers, mask, torch.tensor([0, 6]), steps=STEPS,
                               batch_size=BATCH, seed=SEED)
            alone = ""
        except ValueError as err:
            alone = str(err)
        try:  # a seed equal to rank 0's modulo 2**31 only: other batches, so refused
            attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=STEPS, batch_size=BATCH,
                               seed=SEED + 2**31)
            seed = ""
        except ValueError as err:
            seed = str(err)
        with open(f"{out}/rank1.json", "w") as f:
            json.dump({"refused": refused, "alone": alone, "seed": seed}, f)
    finally:
        dist.destroy_process_group()


def test_two_rank_group_matches_one_process(case, tmp_path):
    """The torchrun path: this process is rank 0 of an initialised gloo group, a spawned process rank 1;
    attention_transfer finds the group by itself. Both ranks end with one process's result."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    sketches, layers, mask = case[:3]
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)  # a free port
    ctx = mp.start_processes(_rank1, args=(store.port, sketches, layers, mask, str(tmp_path)), nprocs=1,
                             join=False, start_method="spawn")
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=datetime.timedelta(seconds=120))
        try:
            mine = copy.deepcopy(sketches)
            with _one_thread():
                curves = attention_transfer(mine, layers, mask, TRAIN, steps=STEPS, batch_size=BATCH, seed=SEED)
            with pytest.raises(ValueError, match=r"over 2 processes: the ranks disagree on steps \(6, 7 on ranks"):
                attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=STEPS, batch_size=BATCH,
                                   seed=SEED)
            with pytest.raises(ValueError, match=r"over 2 processes: rank 1 refused its arguments \(train_idx must be "
                                                 r"a non-empty list of integer sequence indices in \[0, 6\)"):
                attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=STEPS, batch_size=BATCH,
                                   seed=SEED)
            with pytest.raises(ValueError, match=r"the ranks disagree on seed \(low 32 bits\) \(3, 2147483651 on"):
                attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=STEPS, batch_size=BATCH,
                                   seed=SEED)
            while not ctx.join():  # rank 1 leaves the group first
                pass
        finally:
            dist.destroy_process_group()
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
    _assert_same(_params(mine), curves, case, "rank 0")
    theirs = torch.load(tmp_path / "rank1.pt", weights_only=True)
    _assert_same(theirs["params"], theirs["curves"], case, "rank 1")
    said = json.loads((tmp_path / "rank1.json").read_text())
    assert "the ranks disagree on steps" in said["refused"]
    assert said["alone"].startswith("train_idx must be a non-empty list of integer sequence indices in [0, 6)")
    assert "the ranks disagree on seed (low 32 bits)" in said["seed"]


#: How long this process's last layer waits for the worker to start training (test_processes_2_...): only a
#: deadlock breaker. The worker starts in seconds (imports: ~4 CPU s) when it trains alongside this process;
#: when it can only start after this process's share (the bug this guards), it never starts within the wait.
OVERLAP_WAIT = 180.0


class _Signalling(torch.nn.Module):
    """A converted layer whose first forward pass, before it computes, either marks the file ``path``
    (``role="mark"``: the worker's layer) or waits up to ``OVERLAP_WAIT`` seconds for it (``role="wait"``:
    a layer this process trains), recording in ``saw`` whether the mark came. No clock is compared: the
    mark exists only once the worker's training began."""

    def __init__(self, inner, path, role):
        super().__init__()
        self.inner, self.path, self.role, self.saw = inner, str(path), role, None

    @property
    def gate(self):
        return self.inner.gate

    def forward(self, *args, **kwargs):
        if self.role == "mark" and not os.path.exists(self.path):
            with open(self.path, "w") as f:
                f.write(str(os.getpid()))
        elif self.role == "wait" and self.saw is None:
            deadline = time.monotonic() + OVERLAP_WAIT
            while not os.path.exists(self.path) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.saw = os.path.exists(self.path)
        return self.inner(*args, **kwargs)


def test_processes_2_matches_one_process(case, tmp_path):
    """processes=2: one spawned worker, the recording shared; this process's sketches end trained as
    one process trains them, with the same curves; and the worker trains alongside this process, not
    after it: this process's last layer (2) does not train until the worker's layer (1) has begun."""
    sketches, layers, mask = case[:3]
    mine = copy.deepcopy(sketches)
    mark = tmp_path / "worker trains layer 1"
    mine[1], mine[2] = _Signalling(mine[1], mark, "mark"), _Signalling(mine[2], mark, "wait")
    with _one_thread():
        curves = attention_transfer(mine, layers, mask, TRAIN, steps=STEPS, batch_size=BATCH, seed=SEED, processes=2)
    assert mine[2].saw is True, (f"this process trained its last layer without the worker having started its own "
                                 f"within {OVERLAP_WAIT:.0f} s: the worker waits for this process's share")
    assert int(mark.read_text()) != os.getpid()  # marked by the worker, not here
    _assert_same(_params(mine), curves, case, "processes=2")


def test_bad_processes_and_groups_are_refused(case):
    import torch.distributed as dist

    sketches, layers, mask = case[:3]
    for bad in (0, -1, 1.5, True, "2", None):
        match = r"processes must be an integer >= 1 .*got " + repr(bad).replace(".", r"\.")
        with pytest.raises(ValueError, match=match):
            attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=1, processes=bad)
    with pytest.raises(ValueError, match=r"processes=4 exceeds the 3 layers to train .*use processes <= 3"):
        attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=1, processes=4)
    with pytest.raises(ValueError, match=r"train_idx must be .*\(not a boolean mask\), got \[True, False"):
        attention_transfer(copy.deepcopy(sketches), layers, mask, torch.tensor([True, False, True, False, True, True]),
                           steps=1)
    with pytest.raises(ValueError, match=r"layers must be LayerIO records \(teacher_attention\), got an item of "
                                         r"type tuple"):
        attention_transfer(copy.deepcopy(sketches), [tuple(vars(io).values()) for io in layers], mask, TRAIN, steps=1)
    with pytest.raises(ValueError, match=r"sketches must be converted attention modules .*type str"):
        attention_transfer(["a", "b", "c"], layers, mask, TRAIN, steps=1)
    with pytest.raises(ValueError, match=r"group must be a torch.distributed ProcessGroup or None, got str"):
        attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=1, group="world")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "is_available", lambda: False)
        with pytest.raises(ValueError, match=r"processes=2: this torch is built without torch.distributed"):
            attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=1, processes=2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.MonkeyPatch.context() as mp:  # a default group on NCCL (here a gloo one that says so)
            mp.setattr(dist, "get_backend", lambda group=None: "nccl")
            with pytest.raises(ValueError, match=r"the default torch.distributed group has backend 'nccl', which "
                                                 r"cannot broadcast .*group=torch.distributed.new_group\(backend="
                                                 r"\"gloo\"\)"):
                attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=1)
        with pytest.raises(ValueError, match=r"processes=2: this process already belongs to a torch.distributed group"):
            attention_transfer(copy.deepcopy(sketches), layers, mask, TRAIN, steps=1, processes=2)
        # a group of one rank: everything trains here, as without a group
        mine = copy.deepcopy(sketches)
        with _one_thread():
            curves = attention_transfer(mine, layers, mask, TRAIN, steps=STEPS, batch_size=BATCH, seed=SEED,
                                        group=dist.group.WORLD)
        _assert_same(_params(mine), curves, case, "a group of one")
    finally:
        dist.destroy_process_group()


class _Quitting(torch.nn.Module):
    """A converted layer whose forward pass ends the process with exit code 0 (as a worker that swallowed
    a KeyboardInterrupt does); run only by the worker that trains it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    @property
    def gate(self):
        return self.inner.gate

    def forward(self, *args, **kwargs):
        raise SystemExit(0)


def _fresh(layers):
    """The recorded layers in private (not shared) memory: an earlier spread moved the case's there."""
    import dataclasses

    return [dataclasses.replace(io, q=io.q.clone(), k=io.k.clone(), v=io.v.clone(), out=io.out.clone())
            for io in layers]


def test_processes_3_a_worker_ending_early_is_reported(case):
    """processes=3, worker 1 ends with exit code 0 before training its layer while worker 2 trains and
    waits for the group: refused at once, naming it (it used to wait for ever for worker 1); both workers
    reaped. A SIGALRM turns a hang into a failure."""
    import signal

    sketches, layers, mask = case[:3]
    mine = copy.deepcopy(sketches)
    mine[1] = _Quitting(mine[1])

    def hung(*_):
        raise TimeoutError("attention_transfer still waits for a worker that has ended")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(240)
    try:
        with _one_thread(), pytest.raises(RuntimeError, match=r"processes=3: spawned worker 1 ended \(exit code 0\) "
                                                              r"before training its layers"):
            attention_transfer(mine, layers, mask, TRAIN, steps=STEPS, batch_size=BATCH, seed=SEED, processes=3)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    if sys.platform.startswith("linux"):  # both workers ended and reaped (no zombie, none still ending): no
        # child process left but multiprocessing's resource tracker
        left = [child for child in _children() if b"resource_tracker" not in child[1]]
        assert not left, f"child processes left (state, command line): {left}"


def _children() -> list[tuple[str, bytes]]:
    """``(state, command line)`` of this process's child processes (Linux ``/proc``; ``"Z"``: a zombie)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:  # ended meanwhile
            continue
        if int(ppid) == os.getpid():
            out.append((state, cmd))
    return out


def test_processes_2_small_dev_shm_is_refused(case, monkeypatch):
    """A recording that does not fit in /dev/shm (a container's 64 MiB): one error naming /dev/shm, the
    size and processes=1, before any worker is spawned (up front, or when moving the tensors fails)."""
    import importlib

    import torch.multiprocessing as mp

    spread = importlib.import_module("sketchlab.convert.spread")
    sketches, layers, mask = case[:3]
    fresh = _fresh(layers)
    need = sum(t.untyped_storage().nbytes() for io in fresh for t in (io.q, io.k, io.v, io.out)) \
        + mask.untyped_storage().nbytes() + TRAIN.untyped_storage().nbytes()

    def no_spawn(*args, **kwargs):
        raise AssertionError("a worker was spawned")

    monkeypatch.setattr(mp, "start_processes", no_spawn)
    monkeypatch.setattr(spread, "_shm_free", lambda: 1024)
    size = f"{need / 2**20:.1f} MiB"
    with pytest.raises(RuntimeError, match=rf"the recorded layers \({size}\) do not fit in shared memory /dev/shm "
                                           r"\(0.0 MiB free\); .*--shm-size\) or use processes=1"):
        attention_transfer(copy.deepcopy(sketches), fresh, mask.clone(), TRAIN.clone(), steps=1, processes=2)

    def full(self):
        raise RuntimeError("unable to write to file </torch_1_2_3>: No space left on device (28)")

    monkeypatch.setattr(spread, "_shm_free", lambda: None)
    monkeypatch.setattr(torch.Tensor, "share_memory_", full)
    with pytest.raises(RuntimeError, match=rf"\({size}\) do not fit in shared memory /dev/shm \(unable to write to "
                                           r"file </torch_1_2_3>: No space left on device \(28\)\);"):
        attention_transfer(copy.deepcopy(sketches), fresh, mask.clone(), TRAIN.clone(), steps=1, processes=2)


def _model_dir(root):
    """A tiny random GPT-2 of 3 layers and a text file of 300 words under ``root``."""
    from tests.test_cli_linearize_lm import _model_dir as model_dir
    from tests.test_cli_linearize_lm import _text_file

    model_dir(root / "m", n_layer=3)
    _text_file(root / "t.txt", 300)


def test_cli_processes_reach_the_transfer(tmp_path, capsys, monkeypatch):
    """``sketchlab linearize --processes 2`` hands ``processes=2`` to stage 1 (whose spread
    test_processes_2_matches_one_process checks; run here on one process to keep the test short) and
    records it in the report."""
    import importlib

    from sketchlab.cli import main

    lin = importlib.import_module("sketchlab.convert.linearize")  # the module (the package exports the function)

    real, seen = lin.attention_transfer, []

    def spy(*args, processes, **kwargs):
        seen.append(processes)
        return real(*args, processes=1, **kwargs)

    monkeypatch.setattr(lin, "attention_transfer", spy)
    _model_dir(tmp_path)
    out = tmp_path / "lin"
    assert main(["linearize", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"),
                 "--attention", "hedgehog", "--m", "8", "--window", "4", "--sinks", "1", "--seq-len", "32",
                 "--transfer-steps", "2", "--threads", "1", "--processes", "2", "--out", str(out),
                 "--no-progress"]) == 0
    summary = json.loads((out / "linearize.json").read_text())
    assert seen == [2] and summary["settings"]["processes"] == 2
    assert [s["name"] for s in summary["stages"]] == ["init", "transfer"]


def test_cli_more_processes_than_layers_exit_2(tmp_path, capsys):
    """--processes above the model's layer count (3): exit 2, one line naming both, before the teacher pass."""
    from sketchlab.cli import main

    _model_dir(tmp_path)
    capsys.readouterr()  # the model's saving
    rc = main(["linearize", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--seq-len", "32",
               "--threads", "1", "--processes", "4", "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "processes=4 exceeds the 3 layers to train" in err[0], err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "two"])
def test_cli_bad_processes_exit_2(value, tmp_path, capsys):
    from sketchlab.cli import main

    rc = main(["linearize", "--model-dir", str(tmp_path), "--text", str(tmp_path / "t.txt"), "--processes", value,
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("sketchlab: error: argument --processes: expected an "
                                                         "integer >= 1"), err
    assert not (tmp_path / "o").exists()


def test_cli_toy_path_refuses_processes(tmp_path, capsys):
    from pathlib import Path

    from sketchlab.cli import main

    teacher = Path(__file__).parent.parent / "data" / "mqar_softmax"
    rc = main(["linearize", str(teacher), "--processes", "2", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--processes: not read by the path of CHECKPOINT" in err[0], err
