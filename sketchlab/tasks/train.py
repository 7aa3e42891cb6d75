r"""Training loop for MQAR (AdamW, warm-up + cosine, clipping), held-out evaluation, and checkpoints.

Checkpoints are safetensors + JSON, never pickle. :func:`train_mqar` with ``out=DIR`` writes a
resumable checkpoint every ``checkpoint_every`` steps and at the end::

    DIR/checkpoints/step-00000100/model.safetensors     # the model's state_dict
    DIR/checkpoints/step-00000100/trainer.safetensors   # AdamW moments and steps, RNG states
    DIR/checkpoints/step-00000100/state.json            # run identity, step, losses, evaluations

Each ``step-N`` directory is written under a temporary name and renamed into place when it is
complete (a rename is atomic on POSIX), so an interruption at any instant leaves either the
previous checkpoints or the new one, never a half-written one; the newest ``keep_checkpoints`` are
kept. Calling :func:`train_mqar` again with the same ``out`` resumes from the newest one: the
weights, the optimiser moments, the learning-rate step, the data stream (its ``torch.Generator``
state) and the loss history are restored, so the resumed run computes exactly the steps the
uninterrupted run would have (bit for bit with one thread and
``torch.use_deterministic_algorithms(True)``). A checkpoint written by another run configuration
(model, curriculum, batch, optimiser settings, seed, ``run_info``) is refused with the differing
fields named.

Distributed data parallel: when ``torch.distributed`` is initialised (``torchrun``; see
:func:`init_distributed`), the model is wrapped in ``DistributedDataParallel``. ``batch_size`` is
the *global* batch: every rank draws the same global batch from the seeded stream and keeps its
contiguous slice of ``batch_size / world_size`` sequences (the role of ``DistributedSampler`` for
this infinite synthetic stream), so the run sees the same data, and the same losses to float
round-off, as one process with that batch. Rank ``r`` seeds ``torch``'s global generator with
``seed + r`` for any per-rank randomness; checkpoints are written by rank 0 only.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .._validation import check_nonnegative_int, check_positive_int, check_real
from ..io import atomic_write
from .model import TransformerConfig, TransformerLM
from .mqar import IGNORE_INDEX, MQARConfig, MQARMixture, mqar_batch

__all__ = [
    "TrainResult", "evaluate_mqar", "init_distributed", "latest_checkpoint", "load_checkpoint", "save_checkpoint",
    "train_mqar",
]

_HELDOUT_OFFSET = 1_000_003  # held-out data come from seed + this offset, never from the training stream


_STATE_FORMAT = "sketchlab.tasks.train/1"


@dataclass
class TrainResult:
    """Outcome of :func:`train_mqar`.

    ``heldout_accuracy``: of the last stage; ``seconds``: wall time of this call (a resumed run
    counts from the resume); ``steps``: steps done in total; ``history``: one entry per stage
    (held-out accuracy at its end, :func:`evaluate_mqar`'s: for a mixture stage the mean over all
    its components, each one's in ``"component_accuracies"``); ``losses``: the training loss of
    every step (global batch); ``evals``: ``{"step", "stage", "heldout_accuracy"}`` (and
    ``"component_accuracies"`` for a mixture) every ``eval_every`` steps and at the end of each
    stage; ``resumed_from``: the step of the checkpoint this call resumed from (``None``
    for a fresh run).
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
    if not 0 <= seed < 2**64 - _HELDOUT_OFFSET:
        raise ValueError(f"{name} must be an integer in [0, 2**64 - {_HELDOUT_OFFSET}), got {seed}")
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

    The training stream uses ``seed`` itself, so held-out sequences come from a disjoint random
    stream (with keys and values drawn from a large space, repeats of training sequences are
    negligible). A mixture is scored on every one of its components (:func:`_component_accuracies`),
    never on the one or two components a few randomly drawn batches would hit. The model runs
    in eval mode; its previous mode is restored afterwards, also when the forward pass raises.
    Logits are computed at the query positions only (:class:`~sketchlab.tasks.zoology.QueryLogits`).

    Notes
    -----
    An :class:`MQARConfig`: correct / total over the query positions (``targets != IGNORE_INDEX``)
    of the ``num_sequences`` sequences. An :class:`MQARMixture` with components ``c_0 … c_{n-1}``:
    the unweighted mean ``(1/n) Σ_i acc(c_i)`` of the components' accuracies (Zoology's headline
    is the mean over its test slices; the training weights say how often a length is trained, not
    how much it counts), each ``acc(c_i)`` on its own ``num_sequences`` sequences.
    """
    accs = _component_accuracies(model, task, num_sequences=num_sequences, seed=seed, batch_size=batch_size)
    return math.fsum(accs) / len(accs)


@torch.no_grad()
def _component_accuracies(model: TransformerLM, task: MQARConfig | MQARMixture, *, num_sequences: int = 256,
                          seed: int = 0, batch_size: int = 64) -> list[float]:
    """Held-out accuracy of each component of ``task`` (one entry for an :class:`MQARConfig`).

    Component ``i`` (in ``task.components`` order) is scored on ``num_sequences`` sequences of its
    own, drawn from a generator seeded ``(seed + 1_000_003 + i) mod 2**64`` (as
    :func:`~sketchlab.tasks.zoology.evaluate_slices` seeds its slices), in batches of
    ``batch_size``; its accuracy is correct / total over its query positions
    (``targets != IGNORE_INDEX``). An :class:`MQARConfig` is the one component ``i = 0``.
    The model runs in eval mode; its previous mode is restored, also when the forward pass raises.
    """
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
            gen = torch.Generator().manual_seed((seed + _HELDOUT_OFFSET + i) % 2**64)
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


def _describe(task) -> str:
    """A stage's task for the per-stage line: an MQARConfig's repr; a mixture by its components' (T, P)."""
    if isinstance(task, MQARMixture):
        return "mixture of " + ", ".join(f"(T={c.seq_len}, P={c.num_pairs})" for c in task.components)
    return str(task)


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


def _step_dir(root: Path, step: int) -> Path:
    return root / "checkpoints" / f"step-{step:08d}"


def latest_checkpoint(out) -> Path | None:
    """The newest complete ``step-N`` checkpoint directory under ``out/checkpoints`` (``None`` if none)."""
    root = Path(out) / "checkpoints"
    if not root.is_dir():
        return None
    found = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit())
    return found[-1] if found else None


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _write_checkpoint(out: Path, step: int, model, opt, gen: torch.Generator, state: dict, keep: int) -> Path:
    """Write ``out/checkpoints/step-N`` under a temporary name, then rename it into place (atomic)."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):  # left by a run killed while writing; never read
        shutil.rmtree(stale, ignore_errors=True)
    final = _step_dir(out, step)
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    tmp.mkdir()
    try:
        _fill_checkpoint(tmp, model, opt, gen, state, step)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # only after a crash between this rename and the next step: same content
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in sorted(p for p in root.iterdir() if p.name.startswith("step-"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fill_checkpoint(tmp: Path, model, opt, gen: torch.Generator, state: dict, step: int) -> None:
    from safetensors.torch import save_file

    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"))
    sd = opt.state_dict()
    tensors = {f"optim.{idx}.{key}": val.detach().cpu().contiguous()
               for idx, st in sd["state"].items() for key, val in st.items()}
    tensors["rng.data"] = gen.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    save_file(tensors, str(tmp / "trainer.safetensors"))
    payload = {**state, "format": _STATE_FORMAT, "step": step, "param_groups": sd["param_groups"]}
    (tmp / "state.json").write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    for name in ("model.safetensors", "trainer.safetensors", "state.json"):
        _fsync_file(tmp / name)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, each checked finite; ``ValueError`` names the file and tensor."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing")
    try:
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for truncated or foreign files
        raise ValueError(f"checkpoint file {path}: unreadable safetensors file ({err})") from err
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"checkpoint file {path}: tensor {name} holds {bad} non-finite value(s) (NaN/inf: a "
                             "diverged run or a damaged file); use an earlier checkpoint or start anew")
    return tensors


def _load_weights(model: nn.Module, weights: dict, path: Path) -> None:
    """``model.load_state_dict(weights)`` after checking the names and shapes; ``ValueError`` names the file."""
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or unexpected:
        raise ValueError(f"checkpoint file {path} does not hold this model's weights: missing {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                         f"{' ...' if len(unexpected) > 4 else ''}")
    for name, t in own.items():
        if tuple(weights[name].shape) != tuple(t.shape):
            raise ValueError(f"checkpoint file {path}: tensor {name} has shape {tuple(weights[name].shape)}, the model "
                             f"expects {tuple(t.shape)}")
    model.load_state_dict(weights, strict=True)


def _completed(identity):
    """A checkpoint's run identity with its model config completed as this version completes it: an
    attention option added since (e.g. ``affine``, default ``false``) then takes its default, so a run of
    the same settings still resumes. A config this version cannot build is left as it is (the comparison
    then names it)."""
    if not isinstance(identity, dict) or not isinstance(identity.get("model"), dict):
        return identity
    from .model import TransformerConfig

    try:
        model = json.loads(json.dumps(TransformerConfig(**identity["model"]).to_dict()))
    except (TypeError, ValueError):
        return identity
    return {**identity, "model": model}


def _read_checkpoint(path: Path, identity: dict, model, opt, gen: torch.Generator) -> dict:
    """Restore model, optimiser and generators from a ``step-N`` directory; returns its state.json.

    Everything is read and checked before anything is restored: a truncated, foreign or
    non-finite file raises ``ValueError`` naming the file (and the tensor or key), and leaves the
    model, optimiser and generators untouched.
    """
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint {path}: unreadable state.json ({err})") from err
    if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
        raise ValueError(f"checkpoint {path}: state.json is not a {_STATE_FORMAT} training state")
    theirs = _completed(state.get("identity", {}))
    if theirs != identity:
        keys = sorted(set(theirs) | set(identity))
        diffs = [f"{key}: {json.dumps(theirs.get(key), sort_keys=True)} in the checkpoint, "
                 f"{json.dumps(identity.get(key), sort_keys=True)} in this run"
                 for key in keys if theirs.get(key) != identity.get(key)]
        raise ValueError(
            f"checkpoint {path} was written by another run configuration, so this run cannot resume from it "
            f"({'; '.join(diffs)}); use another output directory or the checkpoint's settings"
        )
    for key, kind in (("step", int), ("history", list), ("losses", list), ("evals", list), ("param_groups", list)):
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise ValueError(f"checkpoint {path / 'state.json'}: {key!r} must be a JSON {kind.__name__}, "
                             f"got {state.get(key)!r:.60}")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in state["losses"]):
        raise ValueError(f"checkpoint {path / 'state.json'}: the recorded losses hold a non-finite value")
    weights = _read_tensors(path / "model.safetensors")
    tensors = _read_tensors(path / "trainer.safetensors")
    for name in ("rng.data", "rng.torch"):
        if name not in tensors or tensors[name].dtype != torch.uint8:
            raise ValueError(f"checkpoint file {path / 'trainer.safetensors'}: tensor {name} (a generator state, "
                             "uint8) is missing; not a sketchlab training state")
    per_param: dict[int, dict] = {}
    for name, val in tensors.items():
        if name.startswith("optim."):
            try:
                _, idx, key = name.split(".", 2)
                per_param.setdefault(int(idx), {})[key] = val
            except ValueError:
                raise ValueError(f"checkpoint file {path / 'trainer.safetensors'}: unexpected tensor {name}") from None
    params = [p for group in opt.param_groups for p in group["params"]]
    for idx, entry in per_param.items():
        if not 0 <= idx < len(params) or any(v.ndim and v.shape != params[idx].shape for v in entry.values()):
            raise ValueError(f"checkpoint file {path / 'trainer.safetensors'}: optimiser state {idx} does not match "
                             "this model's parameters")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _load_weights(model, weights, path / "model.safetensors")
    try:
        opt.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})
        gen.set_state(tensors["rng.data"])
        torch.set_rng_state(tensors["rng.torch"])
    except (ValueError, RuntimeError, KeyError, TypeError) as err:
        model.load_state_dict(before)
        raise ValueError(f"checkpoint {path}: the optimiser or generator state does not fit this run ({err})") from err
    return state


def train_mqar(
    model: TransformerLM,
    stages: Sequence[tuple[MQARConfig, int]],
    *,
    batch_size: int = 32,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    kernel_lr: float = 1.0,
    warmup: int = 50,
    clip: float | None = 1.0,
    seed: int = 0,
    eval_sequences: int = 256,
    eval_every: int = 0,
    out=None,
    checkpoint_every: int = 100,
    keep_checkpoints: int = 2,
    run_info: dict | None = None,
    extra_loss: Callable[[], torch.Tensor] | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train ``model`` on MQAR with AdamW, a linear warm-up and a cosine decay over all steps.

    Parameters
    ----------
    model : TransformerLM
        Its ``vocab_size`` must cover every stage's vocabulary. Batches go to the device of its
        parameters.
    stages : sequence of (MQARConfig or MQARMixture, steps)
        A curriculum: each stage trains ``steps`` steps on its distribution, then prints and
        records its held-out accuracy (:func:`evaluate_mqar`) in a line ``stage i …: held-out
        accuracy X after N steps …``. A single stage is plain training; a mixture stage is
        Zoology's protocol (one component per batch) and its accuracy is the mean over all its
        components, each one's printed after the mean.
    batch_size : int >= 1
        Sequences per step (the global batch under ``torchrun``: divisible by the world size).
    lr : float > 0
        Peak AdamW learning rate (finite).
    weight_decay : float >= 0
        AdamW decoupled weight decay of the matrices (not of embeddings, norms, biases and the
        attention kernels' feature-map parameters).
    kernel_lr : float > 0
        Learning-rate factor of the attention kernels' own parameters (``blocks.i.attention.attn.*``,
        e.g. LLoPS's Θ): their peak rate is ``kernel_lr · lr``. Adam moves every parameter by about
        its learning rate per step whatever the gradient's scale, so Θ started at an exact
        special case (BASED's 0/1 selection) leaves its non-negative kernel within tens of steps
        at the model's rate; a smaller factor keeps it near while the rest of the model learns.
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
        ``extra_loss() -> Tensor`` called after each forward pass and added to the loss (e.g. an
        attention-transfer term collected by forward hooks).
    progress : bool
        Show a tqdm bar with the running loss (rank 0 only).

    Returns
    -------
    TrainResult

    Notes
    -----
    Learning rate at step ``s`` of ``S``: ``lr · min(1, (s+1)/warmup) · ½(1 + cos(π s/S))``. The
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
            raise ValueError(
                f"stages[{i}] has vocab_size={task.vocab_size} > the model's {model.config.vocab_size}"
            )
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
    decay, no_decay, kernel = [], [], []
    for name, p in model.named_parameters():
        # matrices decay; embeddings, norms, biases and the attention kernels' feature maps (Θ) do not
        if ".attention.attn." in name:
            kernel.append(p)
        else:
            (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "lr_factor": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "lr_factor": 1.0}]
    if kernel:  # only when there are kernel parameters: a softmax run's optimiser state keeps its layout
        groups.append({"params": kernel, "weight_decay": 0.0, "lr_factor": kernel_lr})
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))

    def lr_at(s: int) -> float:  # linear warm-up over `warmup` steps (none if 0), then cosine
        ramp = min(1.0, (s + 1) / warmup) if warmup else 1.0
        return lr * ramp * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))

    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    history: list[dict] = []
    losses: list[float] = []
    evals: list[dict] = []
    step = 0
    resumed_from = None
    out = None if out is None else Path(out)
    if out is not None:
        found = latest_checkpoint(out)
        if found is not None:
            state = _read_checkpoint(found, identity, model, opt, gen)
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
            _write_checkpoint(out, step, model, opt, gen, {
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
        while step < end:
            inputs, targets = mqar_batch(task, batch_size, generator=gen)  # the global batch
            inputs = inputs[rank * local:(rank + 1) * local].to(device)  # [B/W, T]: this rank's slice
            targets = targets[rank * local:(rank + 1) * local].to(device)
            for g in opt.param_groups:
                g["lr"] = lr_at(step) * g["lr_factor"]
            mask = targets != IGNORE_INDEX  # [B/W, T] query positions
            logits = net(inputs, mask)  # [N, vocab]
            loss = F.cross_entropy(logits, targets[mask])
            objective = loss if extra_loss is None else loss + extra_loss()
            opt.zero_grad(set_to_none=True)
            objective.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            step += 1
            logged = loss.detach()
            if world > 1:
                import torch.distributed as dist

                dist.all_reduce(logged)
                logged = logged / world
            value = float(logged)
            if not math.isfinite(value):
                raise FloatingPointError(f"training diverged: the loss at step {step} is {value} (lower lr or clip)")
            losses.append(value)
            if step % 10 == 0 or step == total:
                bar.set_postfix(stage=si, loss=f"{value:.3f}")
            bar.update(1)
            if eval_every and step % eval_every == 0 and step != end:
                evaluate(si, task)
            if step % checkpoint_every == 0 and step != end:
                checkpoint()
        entry = evaluate(si, task)
        history.append({"stage": si, "task": task.to_dict(), "steps": steps,
                        "heldout_accuracy": entry["heldout_accuracy"],
                        **({"component_accuracies": entry["component_accuracies"]}
                           if "component_accuracies" in entry else {})})
        if rank == 0:
            parts = ""
            if "component_accuracies" in entry:
                parts = (f" (the mean over its {len(task.components)} components: "
                         + ", ".join(f"{a:.4f}" for a in entry["component_accuracies"]) + ")")
            bar.write(f"stage {si} {_describe(task)}: held-out accuracy {entry['heldout_accuracy']:.4f} after {step} "
                      f"steps{parts}, {time.perf_counter() - t0:.0f}s")
        if step % checkpoint_every == 0 or step == total:
            checkpoint()
        start = end
    bar.close()
    return TrainResult(heldout_accuracy=history[-1]["heldout_accuracy"], seconds=time.perf_counter() - t0,
                       steps=step, history=history, losses=losses, evals=evals, resumed_from=resumed_from)


def save_checkpoint(directory, model: TransformerLM, *, extra: dict | None = None) -> Path:
    """Write ``model.safetensors`` (weights) and ``config.json`` (config + ``extra``) into ``directory``.

    Both files are written atomically; ``extra`` must be JSON-serialisable (e.g. the task and
    the training result).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    with atomic_write(directory / "model.safetensors") as tmp:
        save_file(state, str(tmp))
    payload = {"format": "sketchlab.tasks.TransformerLM/1", "config": model.config.to_dict(), "extra": extra or {}}
    text = json.dumps(payload, indent=2, sort_keys=True)
    with atomic_write(directory / "config.json") as tmp:
        Path(tmp).write_text(text + "\n")
    return directory


def load_checkpoint(directory) -> tuple[TransformerLM, dict]:
    """Load a :func:`save_checkpoint` directory; returns ``(model in eval mode, extra)``.

    Raises ``FileNotFoundError`` when a file is missing and ``ValueError`` naming the file (and the
    tensor) for a config that is not a TransformerLM's, a truncated or foreign weights file, weights
    of another shape, or non-finite weights.
    """
    directory = Path(directory)
    cfg_path, w_path = directory / "config.json", directory / "model.safetensors"
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint {directory}: missing {p.name}")
    try:
        payload = json.loads(cfg_path.read_text())
        config = TransformerConfig(**payload["config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {cfg_path}: not a sketchlab TransformerLM config ({err})") from err
    if not isinstance(payload, dict) or not isinstance(payload.get("extra", {}), dict):
        raise ValueError(f"checkpoint {cfg_path}: not a sketchlab TransformerLM config (extra must be a JSON object)")
    model = TransformerLM(config)
    _load_weights(model, _read_tensors(w_path), w_path)  # names, shapes, finite values checked
    model.eval()
    return model, payload.get("extra", {})
