r"""The one training loop and MQAR training on it (curriculum, held-out evaluation, resume, DDP).

:func:`training_steps` is the loop every task runs (:func:`train_mqar`; text:
:func:`~sketchlab.tasks.text.train_lm`): AdamW from :meth:`~sketchlab.tasks.TransformerLM.configure_optimizers`,
one :func:`train_step` per batch at the warm-up + cosine rate :func:`lr_at`; the caller evaluates and
checkpoints between the steps it yields.

:func:`train_mqar` with ``out=DIR`` checkpoints every ``checkpoint_every`` steps and at the end
(:mod:`sketchlab.tasks.checkpoint`); called again with the same ``out`` it resumes from the newest:
weights, optimiser moments, learning-rate step, data stream (its ``torch.Generator``) and loss
history, so the resumed run computes exactly the steps of the uninterrupted one (bit for bit with
one thread and ``torch.use_deterministic_algorithms(True)``). Another run configuration's
checkpoint (model, curriculum, batch, optimiser settings, seed, ``run_info``) is refused, naming
the differing fields.

Under ``torchrun`` (:func:`init_distributed`) the model is wrapped in ``DistributedDataParallel``;
``batch_size`` is the *global* batch: every rank draws the same global batch from the seeded stream
and keeps its contiguous slice of ``batch_size / world_size`` sequences (``DistributedSampler``'s
role for this infinite stream), so the run sees the data and losses (to round-off) of one process
with that batch. Rank ``r`` seeds ``torch``'s global generator with ``seed + r``; rank 0 writes
the checkpoints.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import check_nonnegative_int, check_positive_int, check_real
from .checkpoint import latest_checkpoint, load_checkpoint, read_training_state, save_checkpoint, write_training_state
from .model import TransformerLM
from .mqar import HELDOUT_OFFSET, IGNORE_INDEX, MQARConfig, MQARMixture, mqar_batch

__all__ = [
    "TrainResult", "check_evaluation_work", "evaluate_mqar", "init_distributed", "latest_checkpoint",
    "load_checkpoint", "lr_at", "save_checkpoint", "train_mqar", "train_step", "training_steps",
]



@dataclass
class TrainResult:
    """Outcome of :func:`train_mqar`.

    ``heldout_accuracy``: of the last stage; ``seconds``: wall time of this call (from the resume, if
    resumed); ``steps``: done in total; ``history``: per stage, its held-out accuracy at its end
    (:func:`evaluate_mqar`; a mixture's also per component, ``"component_accuracies"``); ``losses``: the
    training loss of every step (global batch); ``evals``: ``{"step", "stage", "heldout_accuracy"}``
    (and ``"component_accuracies"``) every ``eval_every`` steps and at each stage's end;
    ``resumed_from``: the step this call resumed from (``None``: a fresh run).
    """

    heldout_accuracy: float
    seconds: float
    steps: int
    history: list[dict] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    resumed_from: int | None = None


def _check_seed(seed, name: str = "seed") -> int:
    """A seed is an integer >= 0 (``torch.Generator.manual_seed`` also needs it below 2**64)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= 0, got {seed!r} ({type(seed).__name__})")
    if not 0 <= seed < 2**64 - HELDOUT_OFFSET:
        raise ValueError(f"{name} must be an integer in [0, 2**64 - {HELDOUT_OFFSET}), got {seed}")
    return int(seed)


def check_evaluation_work(model: TransformerLM, tasks, num_sequences: int) -> None:
    """Refuse, before any work, evaluations that would run for hours: ``num_sequences`` held-out sequences
    of every task component (:func:`evaluate_mqar`) cost about ``num_sequences · Σ seq_len · params``
    multiply-adds (a forward pass costs about one multiply-add per parameter and token)."""
    from .._validation import check_work

    lengths = [c.seq_len for t in tasks for c in (t.components if isinstance(t, MQARMixture) else (t,))]
    params = sum(p.numel() for p in model.parameters())
    check_work(float(num_sequences) * sum(lengths) * params,
               what=f"evaluating {num_sequences} sequences of each task component (lengths {sorted(set(lengths))}) "
                    f"on a {params}-parameter model",
               way_out="pass fewer evaluation sequences (eval_sequences= / --eval-sequences)")


def evaluate_mqar(model: TransformerLM, task: MQARConfig | MQARMixture, *, num_sequences: int = 256, seed: int = 0,
                  batch_size: int = 64) -> float:
    """Held-out accuracy on ``num_sequences`` sequences (per component of a mixture) from ``seed + 1_000_003``.

    The training stream uses ``seed`` itself, so held-out sequences come from a disjoint stream. The
    model runs in eval mode (its mode restored, also when the forward pass raises); logits are computed
    at the query positions only (:class:`~sketchlab.tasks.zoology.QueryLogits`).

    Notes
    -----
    An :class:`MQARConfig`: correct / total over the query positions (``targets != IGNORE_INDEX``).
    An :class:`MQARMixture` with components ``c_0 … c_{n-1}``: the unweighted mean ``(1/n) Σ_i acc(c_i)``,
    each ``acc(c_i)`` on its own ``num_sequences`` sequences (Zoology's headline is the mean over its
    test slices), never the one or two components a few random batches would hit.
    """
    accs = _component_accuracies(model, task, num_sequences=num_sequences, seed=seed, batch_size=batch_size)
    return math.fsum(accs) / len(accs)


@torch.no_grad()
def _component_accuracies(model: TransformerLM, task: MQARConfig | MQARMixture, *, num_sequences: int = 256,
                          seed: int = 0, batch_size: int = 64) -> list[float]:
    """Held-out accuracy of each component ``i`` of ``task`` (an :class:`MQARConfig`: one, ``i = 0``), as
    :func:`evaluate_mqar` scores it, on sequences seeded ``(seed + 1_000_003 + i) mod 2**64`` (as
    :func:`~sketchlab.tasks.zoology.evaluate_slices` seeds its slices), in batches of ``batch_size``."""
    from .zoology import QueryLogits

    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    if not isinstance(task, (MQARConfig, MQARMixture)):
        raise TypeError(f"task must be an MQARConfig or MQARMixture, got {type(task).__name__}")
    num_sequences = check_positive_int(num_sequences, "num_sequences")
    batch_size = check_positive_int(batch_size, "batch_size")
    seed = _check_seed(seed)
    components = task.components if isinstance(task, MQARMixture) else (task,)
    was_training = model.training
    model.eval()
    head = QueryLogits(model)
    device = next(model.parameters()).device
    out = []
    try:
        for i, component in enumerate(components):
            gen = torch.Generator().manual_seed((seed + HELDOUT_OFFSET + i) % 2**64)
            correct = total = 0
            for start in range(0, num_sequences, batch_size):
                b = min(batch_size, num_sequences - start)
                inputs, targets = mqar_batch(component, b, generator=gen)
                mask = targets != IGNORE_INDEX  # query positions of this batch
                pred = head(inputs.to(device), mask.to(device)).argmax(-1).cpu()  # [N]
                correct += int((pred == targets[mask]).sum())
                total += int(mask.sum())
            out.append(correct / total)
    finally:
        model.train(was_training)
    return out


def init_distributed(device: str = "cpu") -> tuple[int, int]:
    """Initialise ``torch.distributed`` from the ``torchrun`` environment; returns ``(rank, world_size)``.

    Without ``torchrun`` (no ``WORLD_SIZE`` in the environment) nothing is initialised and
    ``(0, 1)`` is returned. The backend is ``gloo`` for ``device="cpu"`` and ``nccl`` for CUDA
    (each rank then uses ``cuda:LOCAL_RANK``).
    """
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def lr_at(s: int, *, lr: float, warmup: int, total: int) -> float:
    """Learning rate of step ``s`` (from 0) of ``total``: ``lr · min(1, (s+1)/warmup) · ½(1 + cos(π s/total))``
    (a linear warm-up over ``warmup`` steps, none if 0, then a cosine decay)."""
    ramp = min(1.0, (s + 1) / warmup) if warmup else 1.0
    return lr * ramp * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))


def train_step(net: nn.Module, opt: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor, *,
               lr: float, clip: float | None, extra_loss: Callable[[], torch.Tensor] | None = None,
               world: int = 1) -> float:
    """One optimiser step on ``inputs, targets [B, T]``; returns the loss (the mean over the ``world`` ranks).

    The loss is the mean cross-entropy of ``net(inputs, mask) -> [N, vocab]`` (a
    :class:`~sketchlab.tasks.zoology.QueryLogits` or its DDP wrapper) at ``mask = targets != IGNORE_INDEX``;
    ``extra_loss()`` is added to the objective. Each group's rate is ``lr · lr_factor``; the global
    gradient norm is clipped to ``clip`` (``None``: not).
    """
    for g in opt.param_groups:
        g["lr"] = lr * g["lr_factor"]
    mask = targets != IGNORE_INDEX  # [B, T] the positions the loss reads
    loss = F.cross_entropy(net(inputs, mask), targets[mask])
    objective = loss if extra_loss is None else loss + extra_loss()
    opt.zero_grad(set_to_none=True)
    objective.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
    opt.step()
    logged = loss.detach()
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(logged)
        logged = logged / world
    return float(logged)


def training_steps(net: nn.Module, opt: torch.optim.Optimizer, batch: Callable[[], tuple], *, start: int, end: int,
                   total: int, lr: float, warmup: int, clip: float | None,
                   extra_loss: Callable[[], torch.Tensor] | None = None, world: int = 1) -> Iterator[tuple[int, float]]:
    """The training loop: steps ``s = start … end-1`` of a ``total``-step schedule, each :func:`train_step` on
    ``batch()`` at :func:`lr_at` ``(s)``; yields ``(s + 1, loss)``. A non-finite loss raises ``FloatingPointError``."""
    for s in range(start, end):
        inputs, targets = batch()
        value = train_step(net, opt, inputs, targets, lr=lr_at(s, lr=lr, warmup=warmup, total=total), clip=clip,
                           extra_loss=extra_loss, world=world)
        if not math.isfinite(value):
            raise FloatingPointError(f"training diverged: the loss at step {s + 1} is {value} (lower lr or clip)")
        yield s + 1, value


def train_mqar(model: TransformerLM, stages: Sequence[tuple[MQARConfig, int]], *, batch_size: int = 32,
               lr: float = 1e-3, weight_decay: float = 0.1, kernel_lr: float = 1.0, warmup: int = 50,
               clip: float | None = 1.0, seed: int = 0, eval_sequences: int = 256, eval_every: int = 0, out=None,
               checkpoint_every: int = 100, keep_checkpoints: int = 2, run_info: dict | None = None,
               extra_loss: Callable[[], torch.Tensor] | None = None, progress: bool = True) -> TrainResult:
    """Train ``model`` on MQAR with AdamW, a linear warm-up and a cosine decay over all steps.

    Parameters
    ----------
    model : TransformerLM
        Its ``vocab_size`` covers every stage's vocabulary; batches go to its parameters' device.
    stages : sequence of (MQARConfig or MQARMixture, steps)
        A curriculum: each stage trains ``steps`` steps on its distribution, then prints and
        records its held-out accuracy (:func:`evaluate_mqar`) in a line ``stage i …: held-out
        accuracy X after N steps …``. A single stage is plain training; a mixture stage is
        Zoology's protocol (one component per batch) and its accuracy is the mean over all its
        components, each one's printed after the mean.
    batch_size : int >= 1
        Sequences per step (the global batch under ``torchrun``: divisible by the world size).
    lr, weight_decay, kernel_lr : float
        Peak AdamW learning rate (> 0), weight decay of the matrices (>= 0), and the rate factor of the
        attention kernels' own parameters (> 0): :meth:`~sketchlab.tasks.TransformerLM.configure_optimizers`.
    warmup : int >= 0
        Steps of linear warm-up (``0``: none) before the cosine decay.
    clip : float > 0 or None
        Gradient clipping: the global gradient norm is scaled down to at most ``clip``.
    seed : int >= 0
        Seeds the data stream (``torch.Generator``); the model's initialisation is the caller's.
    eval_sequences : int
        Held-out sequences per evaluation (:func:`evaluate_mqar`; per component of a mixture).
    eval_every : int >= 0
        Also evaluate on the current stage's task every ``eval_every`` steps (and at step 0);
        ``0``: only at the end of each stage.
    out : str or Path, optional
        Checkpoint directory (module docstring); an existing checkpoint there is resumed.
    checkpoint_every : int >= 1
        Steps between checkpoints (one is always written after the last step).
    keep_checkpoints : int >= 1
        Newest checkpoints kept.
    run_info : dict, optional
        JSON-serialisable description of how the model was built (attention, initialisation);
        part of the run identity a resume must match.
    extra_loss : callable, optional
        ``extra_loss() -> Tensor`` added to the loss after each forward pass (e.g. an attention-transfer
        term collected by forward hooks).
    progress : bool
        Show a tqdm bar with the running loss (rank 0 only).

    Returns
    -------
    TrainResult

    Notes
    -----
    The steps are :func:`training_steps` over all stages, at the learning rate :func:`lr_at`. The
    loss is the mean next-token cross-entropy over query positions. Every MQAR sequence has the
    same number of queries, so the mean over a rank's slice times the ranks' average equals the
    mean over the global batch: DDP's gradient averaging gives exactly the global-batch gradient.
    """
    from tqdm.auto import tqdm

    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    if not stages:
        raise ValueError("stages must hold at least one (MQARConfig, steps) pair, got an empty sequence")
    for i, (task, steps) in enumerate(stages):
        if not isinstance(task, (MQARConfig, MQARMixture)):
            raise TypeError(f"stages[{i}][0] must be an MQARConfig or MQARMixture, got {type(task).__name__}")
        check_positive_int(steps, f"stages[{i}][1] (steps)")
        if task.vocab_size > model.config.vocab_size:
            raise ValueError(f"stages[{i}] has vocab_size={task.vocab_size} > the model's {model.config.vocab_size}")
    batch_size = check_positive_int(batch_size, "batch_size")
    lr = check_real(lr, "lr", positive=True)
    weight_decay = check_real(weight_decay, "weight_decay", positive=False)
    kernel_lr = check_real(kernel_lr, "kernel_lr", positive=True)
    warmup = check_nonnegative_int(warmup, "warmup")
    if clip is not None:
        clip = check_real(clip, "clip", positive=True)
    seed = _check_seed(seed)
    eval_sequences = check_positive_int(eval_sequences, "eval_sequences")
    check_evaluation_work(model, [task for task, _ in stages], eval_sequences)
    eval_every = check_nonnegative_int(eval_every, "eval_every")
    checkpoint_every = check_positive_int(checkpoint_every, "checkpoint_every")
    keep_checkpoints = check_positive_int(keep_checkpoints, "keep_checkpoints")
    if run_info is not None and not isinstance(run_info, dict):
        raise TypeError(f"run_info must be a JSON-serialisable dict, got {type(run_info).__name__}")
    if extra_loss is not None and not callable(extra_loss):
        raise TypeError(f"extra_loss must be a callable returning a scalar tensor, got {type(extra_loss).__name__}")
    rank, world = _world()
    if batch_size % world:
        raise ValueError(f"batch_size (the global batch) must be divisible by the world size {world}, got {batch_size}")
    local = batch_size // world
    torch.manual_seed(seed + rank)  # per-rank randomness; the data stream below is shared by all ranks

    identity = json.loads(json.dumps({
        "model": model.config.to_dict(),
        "stages": [[task.to_dict(), steps] for task, steps in stages],
        "batch_size": batch_size, "lr": lr, "weight_decay": weight_decay, "warmup": warmup, "clip": clip,
        **({} if kernel_lr == 1.0 else {"kernel_lr": kernel_lr}),
        "seed": seed, "eval_every": eval_every, "eval_sequences": eval_sequences, "run_info": run_info or {},
    }))  # through JSON: the same types a checkpoint's state.json gives back
    total = sum(steps for _, steps in stages)
    opt = model.configure_optimizers(lr=lr, weight_decay=weight_decay, kernel_lr=kernel_lr)
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    history: list[dict] = []
    losses: list[float] = []
    evals: list[dict] = []
    step = 0
    resumed_from = None
    found = None if out is None else latest_checkpoint(out)
    if found is not None:
        state = read_training_state(found, identity, model, opt, gen)
        step, history, losses, evals = state["step"], state["history"], state["losses"], state["evals"]
        resumed_from = step
    from .zoology import QueryLogits

    net = QueryLogits(model)  # logits at the query positions only (the loss reads no other)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)

    def evaluate(si: int, task) -> dict:
        accs = _component_accuracies(model, task, num_sequences=eval_sequences, seed=seed)
        entry = {"step": step, "stage": si, "heldout_accuracy": math.fsum(accs) / len(accs)}  # = evaluate_mqar
        if isinstance(task, MQARMixture):
            entry["component_accuracies"] = accs
        if not evals or evals[-1]["step"] != step:
            evals.append(entry)
        return entry

    def checkpoint() -> None:
        if out is not None and rank == 0:
            write_training_state(out, step, model, opt, gen, {
                "identity": identity, "history": history, "losses": losses, "evals": evals,
                "world_size": world}, keep_checkpoints)
        if world > 1:
            import torch.distributed as dist

            dist.barrier()

    model.train()
    t0 = time.perf_counter()
    bar = tqdm(total=total, initial=step, disable=not progress or rank != 0, desc="mqar", dynamic_ncols=True)
    start = 0
    for si, (task, steps) in enumerate(stages):
        end = start + steps
        if step >= end:  # stage finished before the checkpoint this run resumed from
            start = end
            continue
        if eval_every and step == 0:
            evaluate(si, task)

        def batch(task=task):
            inputs, targets = mqar_batch(task, batch_size, generator=gen)  # the global batch
            mine = slice(rank * local, (rank + 1) * local)  # [B/W, T]: this rank's slice
            return inputs[mine].to(device), targets[mine].to(device)

        for step, value in training_steps(net, opt, batch, start=step, end=end, total=total, lr=lr, warmup=warmup,
                                          clip=clip, extra_loss=extra_loss, world=world):
            losses.append(value)
            if step % 10 == 0 or step == total:
                bar.set_postfix(stage=si, loss=f"{value:.3f}")
            bar.update(1)
            if eval_every and step % eval_every == 0 and step != end:
                evaluate(si, task)
            if step % checkpoint_every == 0 and step != end:
                checkpoint()
        entry = evaluate(si, task)
        kept = {key: entry[key] for key in ("heldout_accuracy", "component_accuracies") if key in entry}
        history.append({"stage": si, "task": task.to_dict(), "steps": steps, **kept})
        if rank == 0:
            accs = entry.get("component_accuracies")  # a mixture's: it is named by its components' (T, P)
            what, parts = (str(task), "") if accs is None else (
                "mixture of " + ", ".join(f"(T={c.seq_len}, P={c.num_pairs})" for c in task.components),
                f" (the mean over its {len(accs)} components: " + ", ".join(f"{a:.4f}" for a in accs) + ")")
            bar.write(f"stage {si} {what}: held-out accuracy {entry['heldout_accuracy']:.4f} after {step} "
                      f"steps{parts}, {time.perf_counter() - t0:.0f}s")
        if step % checkpoint_every == 0 or step == total:
            checkpoint()
        start = end
    bar.close()
    return TrainResult(heldout_accuracy=history[-1]["heldout_accuracy"], seconds=time.perf_counter() - t0,
                       steps=step, history=history, losses=losses, evals=evals, resumed_from=resumed_from)
