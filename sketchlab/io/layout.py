"""Axis roles of dump tensors: the ``layout`` metadata, normalisation to ``[L, H, n, d]``, and the
rule for selecting layers and heads.
"""

from __future__ import annotations

import numbers
import re

import torch

__all__ = ["as_lhnd", "parse_layout", "select_indices"]

#: The layout a tensor of each rank has when no ``layout`` metadata says otherwise.
LAYOUTS = {2: "n,d", 3: "H,n,d", 4: "L,H,n,d"}

#: Axis roles of a dump tensor and the spellings a ``layout`` metadata entry may use (case-insensitive).
_AXIS_NAMES = {
    "layer": ("layer", "layers", "l"),
    "head": ("head", "heads", "h"),
    "token": ("token", "tokens", "seq", "sequence", "n", "t"),
    "dim": ("dim", "d", "head_dim"),
}
_ROLE_OF = {name: role for role, names in _AXIS_NAMES.items() for name in names}
_ROLE_ORDER = ("layer", "head", "token", "dim")


def parse_layout(layout: str, rank: int, where: str) -> tuple[int, ...]:
    """Parse a ``layout`` metadata string by axis role; return the permutation to ``[.., n, d]`` order.

    The layout lists one name per axis, separated by commas (spaces, brackets and parentheses are
    ignored): layer (``layer``/``l``), head (``head``/``h``), token (``token``/``seq``/``n``/``t``)
    and dim (``dim``/``d``), in any order and case, each at most once; token and dim are required,
    layer and head optional. ``"layer,head,token,dim"``, ``"L,H,n,d"``, ``"[H, T, D]"`` and
    ``"seq,head,dim"`` are all understood. Returns the permutation ``perm`` such that
    ``x.permute(perm)`` has the given axes in the order layer, head, token, dim (missing ones are
    added by :func:`as_lhnd`). Anything else raises ``ValueError`` naming ``where``, the layout
    and the accepted names.
    """
    accepted = "; ".join(f"{role}: {'/'.join(names)}" for role, names in _AXIS_NAMES.items())
    names = [part for part in re.sub(r"[\s\[\]()]", "", str(layout)).split(",")]
    roles = []
    for name in names:
        role = _ROLE_OF.get(name.lower())
        if role is None:
            raise ValueError(
                f"{where}: metadata layout {layout!r} has an axis name {name!r} that is not understood; "
                f"accepted names (any case, comma-separated, token and dim required) are {accepted}"
            )
        if role in roles:
            raise ValueError(f"{where}: metadata layout {layout!r} names the {role} axis twice")
        roles.append(role)
    for role in ("token", "dim"):
        if role not in roles:
            raise ValueError(
                f"{where}: metadata layout {layout!r} has no {role} axis; accepted names are {accepted}"
            )
    if len(roles) != rank:
        raise ValueError(
            f"{where}: metadata layout {layout!r} names {len(roles)} axes but the tensor has rank {rank}"
        )
    return tuple(sorted(range(rank), key=lambda i: _ROLE_ORDER.index(roles[i])))


def _apply_layout(t: torch.Tensor, meta: dict, where: str) -> torch.Tensor:
    """Permute ``t`` to layer, head, token, dim order following ``meta["layout"]``, then to ``[L, H, n, d]``.

    Without a layout the rank decides (``[n, d]``, ``[H, n, d]``, ``[L, H, n, d]``). A layout
    without a head axis (e.g. ``"layer,token,dim"``) gets a size-1 head axis.
    """
    layout = meta.get("layout")
    if layout is None or t.ndim not in LAYOUTS:
        return as_lhnd(t, where)
    perm = parse_layout(layout, t.ndim, where)
    roles = [_ROLE_ORDER.index(_ROLE_OF[name.lower()])
             for name in re.sub(r"[\s\[\]()]", "", str(layout)).split(",")]
    t = t.permute(perm)  # axes now in layer, head, token, dim order (those present)
    present = sorted(roles)
    shape = [1, 1] + list(t.shape[-2:])  # [L, H, n, d] with missing axes of size 1
    for axis, size in zip(present[:-2], t.shape[:-2]):
        shape[axis] = size
    return t.reshape(shape).contiguous()  # [L, H, n, d]


def as_lhnd(x: torch.Tensor, where: str) -> torch.Tensor:
    """Normalise ``[n, d]``, ``[H, n, d]`` or ``[L, H, n, d]`` to ``[L, H, n, d]`` (a view).

    Missing leading axes become size 1. Any other rank raises ``ValueError`` naming ``where``
    (e.g. ``"dump.safetensors: tensor q"``), the accepted layouts and the shape.
    """
    if x.ndim not in LAYOUTS:
        raise ValueError(
            f"{where} must have rank 2 [n, d], 3 [H, n, d] or 4 [L, H, n, d], "
            f"got rank {x.ndim} with shape {tuple(x.shape)}"
        )
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))  # [L, H, n, d]


def select_indices(index, size: int, what: str, where: str) -> list[int]:
    """Validate a selection of ``what`` (``"layer"``/``"head"``) positions on an axis of ``size``.

    Rules: ``None`` selects all (``0 … size-1``); otherwise one integer or a non-empty list /
    tuple of integers (bools rejected). Negative indices count from the end, as in Python
    (``-1`` is the last), and are returned as their non-negative position. Duplicates, after
    that normalisation (``0`` and ``-size`` are the same position), are rejected: a repeated
    layer or head would be fitted and reported twice. The given order is kept.

    Every error is a ``ValueError`` naming ``where`` (the dump), the index and the valid range.
    """
    if index is None:
        return list(range(size))
    if isinstance(index, numbers.Integral) and not isinstance(index, bool):
        index = [index]
    if not isinstance(index, (list, tuple)) or not index:
        raise ValueError(f"{where}: {what}s must be a non-empty list of integers, got {index!r}")
    out = []
    for i in index:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise ValueError(f"{where}: {what}s must be a list of integers, got {list(index)!r}")
        if not -size <= i < size:
            raise ValueError(
                f"{where}: {what} {i} is out of range: the dump has {size} {what}s "
                f"(valid indices 0..{size - 1}, or -{size}..-1 from the end)"
            )
        out.append(int(i) % size)
    dups = sorted({i for i in out if out.count(i) > 1})
    if dups:
        raise ValueError(
            f"{where}: {what}s contain duplicates: {list(index)!r} selects position(s) {dups} more than once"
        )
    return out
