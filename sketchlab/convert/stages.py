"""What :func:`sketchlab.linearize` checks around its stages: a teacher whose weights are finite, a
stage that diverges named with the way out, and a stage that makes a layer worse undone for that layer.

A stage keeps, per layer, what it started from where its own held-back measure (the attention-output
error on the held-out sequences, :func:`sketchlab.convert.evaluate.attention_errors`) got worse or
stopped being finite, and says so: in the report (``kept_initial``) and as a warning (stderr).
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings

import torch
from torch import nn

__all__ = ["check_teacher_finite", "keep_better", "named_divergence", "snapshot"]


def check_teacher_finite(model: nn.Module) -> None:
    """Refuse a teacher with a non-finite weight (``ValueError`` naming the first one): its outputs, and
    every measure of the run, would be NaN ("no valid next-token target" much later)."""
    for name, tensor in model.named_parameters():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"linearize: the teacher's weight {name!r} holds {bad} non-finite value(s) (NaN or inf) of "
                             f"{tensor.numel()}: the model is damaged or was cast to a dtype too narrow for its values; "
                             "load it again (in float32)")


@contextlib.contextmanager
def named_divergence(stage: str, model: nn.Module, way_out: str):
    """Turn a non-finite value inside ``stage`` (the attention's ``... must be finite``) into a
    ``FloatingPointError`` naming the stage and the way out (a half-precision model: float32)."""
    try:
        yield
    except ValueError as err:
        if "must be finite" not in str(err):
            raise
        dtype = next(model.parameters()).dtype
        if dtype in (torch.float16, torch.bfloat16):
            way_out = (f"the model is {str(dtype).removeprefix('torch.')}, whose range the sketch's features overflow: "
                       "convert it in float32 (model.float(), or load it with torch_dtype=torch.float32)")
        raise FloatingPointError(f"linearize: stage {stage} diverged ({err}); {way_out}") from None


def snapshot(sketches) -> list[dict]:
    """Each layer's parameters and buffers, copied (what :func:`keep_better` restores)."""
    return [copy.deepcopy(s.state_dict()) for s in sketches]


def keep_better(stage: str, sketches, saved: list[dict], before: list[float], after: list[float], *,
                way_out: str) -> tuple[list[float], list[int]]:
    """Restore ``saved`` in the layers whose held-back error got worse (or is not finite) after ``stage``;
    returns ``(the errors now, the layers restored)`` and warns naming them."""
    kept = [i for i, (b, a) in enumerate(zip(before, after)) if not (math.isfinite(a) and a <= b)]
    for i in kept:
        sketches[i].load_state_dict(saved[i])
    if kept:
        shown = ", ".join(f"{i} ({before[i]:.4g} → {after[i]:.4g})" for i in kept[:6]) + (", …" if len(kept) > 6 else "")
        warnings.warn(f"linearize: stage {stage} made the held-back attention error of {len(kept)} of {len(before)} "
                      f"layer(s) worse ({shown}); those layers keep what they had before the stage. {way_out}",
                      RuntimeWarning, stacklevel=3)
    return [before[i] if i in kept else a for i, a in enumerate(after)], kept
