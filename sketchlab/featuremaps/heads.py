r"""Where a batch of independent problems meets the heads axis: the one place ``[L, H]`` becomes heads.

A fit, a report and the dump-level tools hold one problem per layer and head, ``x [L, H, n, D]`` (or
``[H, n, D]``, ``[n, D]``); a :class:`~sketchlab.featuremaps.FeatureMap` holds one map per head of
``x [B, T, H, D]``. :func:`batch_features` maps the first with the second, the batch flattened row-major
into the heads (layer ``l``, head ``j`` of an ``[L, H]`` batch is the map's head ``l·H + j``), and
:func:`pair_features` gives the query and key features of whatever stands for a kernel's pair of maps (a
map or a pair of maps, e.g. a fit's ``fit.maps``), which is what the metrics and
``fit_sketch``'s report evaluate.
"""

from __future__ import annotations

import math

import torch

from .base import FeatureMap

__all__ = ["as_heads", "batch_features", "from_heads", "pair_features"]


def batch_features(fmap: FeatureMap, x: torch.Tensor) -> torch.Tensor:
    r"""The features of ``fmap`` on a batch of problems whose trailing batch axes are its heads.

    Parameters
    ----------
    fmap : FeatureMap
        ``H = fmap.heads`` heads of ``D = fmap.head_dim``.
    x : Tensor ``[..., n, D]``
        Its leading axes hold ``B·H`` problems, row-major: the trailing ones (product ``H``, e.g. ``[L, H']``
        with ``L·H' = H``) are the heads, any before them the map's batch ``B``.

    Returns
    -------
    Tensor ``[..., n, M]``
        ``out[..., i, :] = φ_h(x[..., i, :])`` with ``h`` the row-major index of the problem within its ``H``:
        ``x`` is mapped as ``x.reshape(B, H, n, D).transpose(1, 2)`` (``[B, n, H, D]``) and back.

    Raises
    ------
    ValueError
        When the leading axes do not hold a whole multiple of ``H`` problems (``x [n, D]`` is one problem:
        a map of one head), or ``x``'s last axis is not ``D``.
    """
    if x.ndim < 2:
        raise ValueError(f"x must have shape [..., n, D={fmap.head_dim}], got {tuple(x.shape)}")
    *lead, n, d = x.shape
    if math.prod(lead) % fmap.heads or d != fmap.head_dim:
        raise ValueError(f"x of shape {tuple(x.shape)} does not hold a whole number of the map's heads={fmap.heads} "
                         f"problems of head_dim={fmap.head_dim} (x [..., n, D], the leading axes flattened into "
                         "[B, H] row-major)")
    return from_heads(fmap.features(as_heads(x, fmap.heads)), x.shape[:-2])


def as_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x [..., n, F]`` whose leading axes hold ``B·heads`` problems → ``[B, n, heads, F]``, the batch flattened
    row-major (the rule of :func:`batch_features`; e.g. a dump's ``[L, H, n, d]`` with ``heads = L·H`` is one
    ``[1, n, L·H, d]`` input of a map or of the attention op). Trusts that the count divides."""
    n, f = x.shape[-2:]
    return x.reshape(-1, heads, n, f).transpose(1, 2)


def from_heads(y: torch.Tensor, batch: tuple) -> torch.Tensor:
    """The inverse of :func:`as_heads`: ``y [B, n, H, F]`` → ``[*batch, n, F]`` (``prod(batch) = B·H``)."""
    return y.transpose(1, 2).reshape(*batch, y.shape[1], y.shape[-1])


def pair_features(maps, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Φ_Q, Φ_K)`` of ``q [..., n_q, D]`` and ``k [..., n_k, D]`` in float64 (``[..., n, M]``), without
    autograd.

    ``maps``: a :class:`FeatureMap` (one map for both sides) or a pair ``(map_q, map_k)`` of maps (each through
    :func:`batch_features`), e.g. a fit's ``fit.maps``.
    """
    map_q, map_k = (maps, maps) if isinstance(maps, FeatureMap) else _pair(maps)
    with torch.no_grad():
        fq, fk = batch_features(map_q, q), batch_features(map_k, k)
        return fq.to(torch.float64), fk.to(torch.float64)


def _pair(maps) -> tuple[FeatureMap, FeatureMap]:
    """``maps`` as ``(map_q, map_k)``, checked: a tuple or list of two :class:`FeatureMap`."""
    if isinstance(maps, (tuple, list)) and len(maps) == 2 and all(isinstance(f, FeatureMap) for f in maps):
        return maps[0], maps[1]
    raise TypeError(f"expected a FeatureMap or a pair (map_q, map_k) of FeatureMaps, got {type(maps).__name__}")
