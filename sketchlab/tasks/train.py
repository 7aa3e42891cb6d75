"""CPU training loop for MQAR, held-out evaluation, and checkpoints (safetensors + JSON, no pickle)."""

from __future__ import annotations

import json
import math
import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from .._validation import check_nonnegative_int, check_positive_int, check_real
from ..io import atomic_write
from .model import TransformerConfig, TransformerLM
from .mqar import IGNORE_INDEX, MQARConfig, mqar_accuracy, mqar_batch

__all__ = ["TrainResult", "evaluate_mqar", "load_checkpoint", "save_checkpoint", "train_mqar"]

_HELDOUT_OFFSET = 1_000_003  # held-out data come from seed + this offset, never from the training stream


@dataclass
class TrainResult:
    """Outcome of :func:`train_mqar`: held-out accuracy on the last stage, wall time, per-stage log."""

    heldout_accuracy: float
    seconds: float
    steps: int
    history: list[dict] = field(default_factory=list)


def _check_seed(seed, name: str = "seed") -> int:
    """A seed is an integer >= 0 (``torch.Generator.manual_seed`` also needs it below 2**64)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= 0, got {seed!r} ({type(seed).__name__})")
    if not 0 <= seed < 2**64 - _HELDOUT_OFFSET:
        raise ValueError(f"{name} must be an integer in [0, 2**64 - {_HELDOUT_OFFSET}), got {seed}")
    return int(seed)


@torch.no_grad()
def evaluate_mqar(model: TransformerLM, task: MQARConfig, *, num_sequences: int = 256, seed: int = 0,
                  batch_size: int = 64) -> float:
    """Accuracy on ``num_sequences`` held-out sequences drawn from ``seed + 1_000_003``.

    The training stream uses ``seed`` itself, so held-out sequences come from a disjoint random
    stream (with keys and values drawn from a large space, repeats of training sequences are
    negligible). The model runs in eval mode; its previous mode is restored afterwards, also
    when the forward pass raises.

    Notes
    -----
    Each batch is scored with :func:`~sketchlab.tasks.mqar.mqar_accuracy`; the result is the
    average of the batch accuracies weighted by their query positions (``targets !=
    IGNORE_INDEX``), i.e. correct / total over all sequences.
    """
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    if not isinstance(task, MQARConfig):
        raise TypeError(f"task must be an MQARConfig, got {type(task).__name__}")
    num_sequences = check_positive_int(num_sequences, "num_sequences")
    batch_size = check_positive_int(batch_size, "batch_size")
    seed = _check_seed(seed)
    gen = torch.Generator().manual_seed(seed + _HELDOUT_OFFSET)
    was_training = model.training
    model.eval()
    weighted = 0.0
    total = 0
    try:
        for start in range(0, num_sequences, batch_size):
            b = min(batch_size, num_sequences - start)
            inputs, targets = mqar_batch(task, b, generator=gen)
            count = int((targets != IGNORE_INDEX).sum())  # query positions of this batch
            weighted += mqar_accuracy(model(inputs), targets) * count
            total += count
    finally:
        model.train(was_training)
    return weighted / total


def train_mqar(
    model: TransformerLM,
    stages: Sequence[tuple[MQARConfig, int]],
    *,
    batch_size: int = 32,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    warmup: int = 50,
    seed: int = 0,
    eval_sequences: int = 256,
    progress: bool = True,
) -> TrainResult:
    """Train ``model`` on MQAR with AdamW, a linear warm-up and a cosine decay over all steps.

    Parameters
    ----------
    model : TransformerLM
        Its ``vocab_size`` must cover every stage's vocabulary.
    stages : sequence of (MQARConfig, steps)
        A curriculum: each stage trains ``steps`` steps on its distribution, then reports its
        held-out accuracy. A single stage is plain training.
    batch_size : int >= 1
        Sequences per step.
    lr : float > 0
        Peak AdamW learning rate (finite).
    weight_decay : float >= 0
        AdamW decoupled weight decay of the matrices (not of embeddings, norms and biases).
    warmup : int >= 0
        Steps of linear warm-up (``0``: none) before the cosine decay.
    seed : int >= 0
        Seeds the data stream (``torch.Generator``); the model's initialisation is the caller's.
    eval_sequences : int
        Held-out sequences per stage evaluation (:func:`evaluate_mqar`).
    progress : bool
        Show a tqdm bar with the running loss.

    Returns
    -------
    TrainResult with the held-out accuracy of the last stage.
    """
    from tqdm.auto import tqdm

    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    if not stages:
        raise ValueError("stages must hold at least one (MQARConfig, steps) pair, got an empty sequence")
    for i, (task, steps) in enumerate(stages):
        if not isinstance(task, MQARConfig):
            raise TypeError(f"stages[{i}][0] must be an MQARConfig, got {type(task).__name__}")
        check_positive_int(steps, f"stages[{i}][1] (steps)")
        if task.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"stages[{i}] has vocab_size={task.vocab_size} > the model's {model.config.vocab_size}"
            )
    batch_size = check_positive_int(batch_size, "batch_size")
    lr = check_real(lr, "lr", positive=True)
    weight_decay = check_real(weight_decay, "weight_decay", positive=False)
    warmup = check_nonnegative_int(warmup, "warmup")
    seed = _check_seed(seed)
    eval_sequences = check_positive_int(eval_sequences, "eval_sequences")
    total = sum(steps for _, steps in stages)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.98),
    )
    def lr_factor(s: int) -> float:  # linear warm-up over `warmup` steps (none if 0), then cosine
        ramp = min(1.0, (s + 1) / warmup) if warmup else 1.0
        return ramp * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    history: list[dict] = []
    t0 = time.perf_counter()
    step = 0
    bar = tqdm(total=total, disable=not progress, desc="mqar", dynamic_ncols=True)
    for si, (task, steps) in enumerate(stages):
        for _ in range(steps):
            inputs, targets = mqar_batch(task, batch_size, generator=gen)
            logits = model(inputs)  # [B, T, vocab]
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 10 == 0 or step == total:
                bar.set_postfix(stage=si, loss=f"{loss.item():.3f}", acc=f"{mqar_accuracy(logits, targets):.2f}")
            bar.update(1)
        acc = evaluate_mqar(model, task, num_sequences=eval_sequences, seed=seed)
        history.append({"stage": si, "task": task.to_dict(), "steps": steps, "heldout_accuracy": acc,
                        "seconds": time.perf_counter() - t0})
        bar.write(f"stage {si} {task}: held-out accuracy {acc:.4f} after {step} steps, "
                  f"{time.perf_counter() - t0:.0f}s")
    bar.close()
    return TrainResult(heldout_accuracy=history[-1]["heldout_accuracy"], seconds=time.perf_counter() - t0,
                       steps=step, history=history)


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
    """Load a :func:`save_checkpoint` directory; returns ``(model in eval mode, extra)``."""
    from safetensors.torch import load_file

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
    model = TransformerLM(config)
    try:
        state = load_file(str(w_path))
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"checkpoint {w_path}: unreadable safetensors file ({err})") from err
    model.load_state_dict(state, strict=True)
    model.eval()
    return model, payload.get("extra", {})
