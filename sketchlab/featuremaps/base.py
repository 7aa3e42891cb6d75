r"""The one interface of the feature-map family (layout ``[B, T, H, D]``, one map per head).

A :class:`FeatureMap` turns per-head queries or keys ``x [B, T, H, D]`` into features
``[B, T, H, M]``; a *pair* of maps (one for queries, one for keys: the same object when the sketch
is tied) is what attention, conversion and training take. Every map has a naive float64 twin,
:meth:`FeatureMap.features_naive`, written one head and one token row at a time.
"""

from __future__ import annotations

import abc
import copy

import torch
from torch import nn

from .._validation import as_float_tensor, check_positive_int

__all__ = ["FeatureMap", "FittedMaps"]


def _check_x(x, heads: int, dim: int, name: str = "x") -> torch.Tensor:
    x = as_float_tensor(x, name)
    if x.ndim != 4 or x.shape[2] != heads or x.shape[3] != dim:
        raise ValueError(f"{name} must have layout [B, T, H={heads}, D={dim}], got shape {tuple(x.shape)}")
    return x


class FeatureMap(nn.Module, abc.ABC):
    """One feature map per head: ``features(x [B, T, H, D]) -> [B, T, H, M]``.

    Subclasses set ``heads``, ``head_dim``, implement :meth:`_features` (on validated input) and
    :meth:`_features_naive` (one head ``x [n, D]`` in float64 → ``[n, M]``) and the properties
    :attr:`num_features`, :attr:`degree` (the polynomial degree of the kernel, ``None`` when it is
    not a polynomial: the hybrid's ``local="poly"`` needs it) and :attr:`non_negative` (whether
    the kernel ``φ(q)·φ'(k)`` is provably ``>= 0`` for every input, ``φ'`` this map or another
    non-negative one of its kind, so ``normalize="sum"`` is safe).
    """

    heads: int
    head_dim: int
    #: Whether every parameter leads with the heads axis ``[H, ...]``, one independent set per head (a fit then
    #: keeps each head's best step); ``False`` where heads may share them (a user's module, :mod:`.custom`).
    per_head_parameters: bool = True

    @property
    @abc.abstractmethod
    def num_features(self) -> int:
        """``M``, the number of features per head."""

    @property
    def degree(self) -> int | None:
        return None

    @property
    def non_negative(self) -> bool:
        return False

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, H, D]`` → features ``[B, T, H, M]`` (the map's parameters' dtype promoted with ``x``'s)."""
        return self._features(_check_x(x, self.heads, self.head_dim))

    def features_naive(self, x: torch.Tensor) -> torch.Tensor:
        """Float64 twin of :meth:`features`, head by head and token by token."""
        x = _check_x(x, self.heads, self.head_dim).to(torch.float64)
        B, T, H, _ = x.shape
        return torch.stack([torch.stack([self._features_naive(x[b, :, h], h) for h in range(H)], 1)
                            for b in range(B)])  # [B, T, H, M]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)

    @property
    def num_parameters(self) -> int:
        """Stored numbers of this map (parameters and buffers), all heads."""
        return sum(t.numel() for t in self.parameters()) + sum(t.numel() for t in self.buffers())

    def select_heads(self, index) -> FeatureMap:
        """A copy of this map holding only the heads ``index`` (distinct head numbers, in the order given).

        ``select_heads(index).features(x)[:, :, j] == features(full)[:, :, index[j]]`` for any ``full`` that
        holds ``x[:, :, j]`` at head ``index[j]``. With :attr:`per_head_parameters` every parameter and buffer of
        the map (and of its submodules) leads with the heads axis, so the copy slices each at ``index`` (e.g.
        one layer of a fit over ``[L, H]`` problems: heads ``l·H … l·H + H − 1``); otherwise the heads share
        them and the copy keeps them whole. Gradients do not flow back to this map.
        """
        index = _check_heads(index, self.heads)
        out = copy.deepcopy(self)
        pick = torch.tensor(index)
        for module in out.modules():
            if isinstance(module, FeatureMap):
                module.heads = len(index)
            if not self.per_head_parameters:
                continue
            for name, t in list(module.named_parameters(recurse=False)):
                setattr(module, name, nn.Parameter(t.detach()[pick.to(t.device)].clone(), t.requires_grad))
            for name, t in list(module.named_buffers(recurse=False)):
                module.register_buffer(name, t[pick.to(t.device)].clone(), name not in module._non_persistent_buffers_set)
        return out

    @abc.abstractmethod
    def _features(self, x):
        """The map on checked ``x [B, T, H, D]`` → ``[B, T, H, M]``."""

    @abc.abstractmethod
    def _features_naive(self, x, head: int):
        """The float64 twin on one head's tokens ``x [T, D]`` → ``[T, M]``."""


def _check_heads(index, heads: int) -> list[int]:
    """``index`` as a list of distinct head numbers below ``heads``, or the error that says why not."""
    try:
        index = [int(i) for i in index]
    except (TypeError, ValueError):
        raise TypeError(f"index must be a sequence of head numbers, got {index!r}") from None
    if not index or len(set(index)) != len(index) or not all(0 <= i < heads for i in index):
        raise ValueError(f"index must be distinct heads of this map's heads={heads}, got {index}")
    return index


class WrappedMap(FeatureMap):
    """A map built on another, ``inner``: its ``num_features``, ``degree`` and ``non_negative`` are ``inner``'s
    (what it changes is the input: :class:`~sketchlab.featuremaps.normed.InputNormed`)."""

    inner: FeatureMap

    @property
    def num_features(self) -> int:
        return self.inner.num_features

    @property
    def degree(self) -> int | None:
        return self.inner.degree

    @property
    def non_negative(self) -> bool:
        return self.inner.non_negative

    def select_heads(self, index) -> FeatureMap:
        """This map's own tensors sliced as :meth:`FeatureMap.select_heads` slices them, over ``inner``'s own
        selection of the same heads."""
        index = _check_heads(index, self.heads)
        inner = self._modules.pop("inner")
        try:
            out = FeatureMap.select_heads(self, index)
        finally:
            self._modules["inner"] = inner
        out.inner = inner.select_heads(index)
        return out


def _init_heads(module: FeatureMap, heads, head_dim):
    module.heads = check_positive_int(heads, "heads")
    module.head_dim = check_positive_int(head_dim, "head_dim")


def _checked_theta(module: FeatureMap, theta, axes: tuple[str, ...]) -> torch.Tensor:
    """A float copy of ``theta`` laid out as ``axes`` (e.g. ``("H", "t", "D", "M")``): its ``"H"`` and ``"D"``
    axes must be ``module.heads`` and ``module.head_dim``; a ``ValueError`` says the shape wanted otherwise."""
    theta = as_float_tensor(theta, "theta").detach().clone()
    h, d = axes.index("H"), axes.index("D")
    if theta.ndim != len(axes) or theta.shape[h] != module.heads or theta.shape[d] != module.head_dim:
        want = ", ".join(f"H={module.heads}" if a == "H" else f"D={module.head_dim}" if a == "D" else a for a in axes)
        raise ValueError(f"theta must have shape [{want}], got {tuple(theta.shape)}")
    return theta


def _store(module: nn.Module, name: str, tensor: torch.Tensor, learn: bool) -> None:
    """``module.<name> = tensor`` as a trained parameter (``learn``) or a fixed buffer (saved either way)."""
    if learn:
        setattr(module, name, nn.Parameter(tensor))
    else:
        module.register_buffer(name, tensor)


class FittedMaps(tuple):
    """What a fitter returns: the pair ``(map_q, map_k)`` (one map twice when the sides are tied) and ``info``,
    the fit's own account of itself (the maps carry none).

    It unpacks and indexes as the pair. ``info`` is a dict: ``steps`` (int), ``converged`` (bool), any
    method-specific entries, and optionally ``kernel_core`` (a float64 ``[..., N_q, N_k]`` matrix with the
    singular values of the fitted kernel, which :func:`sketchlab.fit_sketch` reuses for its floor); the
    report's ``steps``, ``converged`` and ``info`` come from it.
    """

    info: dict

    def __new__(cls, map_q: FeatureMap, map_k: FeatureMap | None = None, info: dict | None = None):
        pair = super().__new__(cls, (map_q, map_q if map_k is None else map_k))
        pair.info = dict(info or {})
        return pair

    def __getnewargs__(self):
        return self[0], self[1], self.info

    @property
    def map_q(self) -> FeatureMap:
        return self[0]

    @property
    def map_k(self) -> FeatureMap:
        return self[1]

    @property
    def tied(self) -> bool:
        """Whether the key map is the query map."""
        return self[1] is self[0]
