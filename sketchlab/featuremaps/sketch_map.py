r"""A fitted :class:`~sketchlab.sketch.Sketch` as a member of the family, and back.

A sketch (``sketchlab.sketches``, LLoPS) is what ``fit_sketch`` fits and reports on: one pair of maps
``φ_Q, φ_K`` over ``x [..., n, d]`` with a batch shape ``[L, H]``, ``[H]`` or ``[]``. A
:class:`~sketchlab.featuremaps.FeatureMap` is one side of one layer over ``x [B, T, H, D]``: what
attention, conversion and training take. :func:`sketch_feature_maps` turns a fitted sketch into the
pair of maps of one layer (two :class:`~sketchlab.featuremaps.LLoPSMap` for LLoPS, so the fused kernel
runs; a :class:`SketchMap` per side for every other sketch), and :class:`FeatureMapSketch` turns a
pair of registered maps into a sketch, so ``fit_sketch`` fits any registered map by name.

Why an adapter rather than the sketch classes implementing :class:`FeatureMap` themselves: the two
interfaces index differently (a fit holds every layer and head of a dump in one batch shape, a map
one layer's heads in the ``H`` axis of ``[B, T, H, D]``), several sketches are plain objects holding
fixed random tensors rather than modules, and the sketches sit below the attention layer
(``tests/test_layers.py``). The adapter costs nothing at run time: ``features`` is the sketch's own
fast path, ``features_naive`` its own float64 twin (:meth:`sketchlab.sketch.Sketch.features_naive`).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ..sketch import Sketch
from .base import FeatureMap, WrappedMap, _check_heads, _init_heads
from .heads import batch_features

__all__ = ["FeatureMapSketch", "HeadSelection", "SketchMap", "sketch_feature_maps"]


def _tensor_slots(sketch) -> list[tuple[str, int | None]]:
    """``(attribute, index)`` of every tensor a plain (non-module) sketch holds: a tensor attribute
    (index ``None``) or an item of a list/tuple of tensors."""
    slots = []
    for name, value in vars(sketch).items():
        if isinstance(value, torch.Tensor):
            slots.append((name, None))
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            slots.extend((name, i) for i in range(len(value)))
    return slots


class SketchMap(FeatureMap):
    r"""One side (``"q"`` or ``"k"``) of a fitted sketch as a :class:`FeatureMap` of ``heads`` heads.

    The sketch's batch shape must be ``[]`` (one map for every head) or hold ``heads`` maps: ``[H]`` (one
    map per head; a layer of an ``[L, H]`` fit is ``sketch.select(l)``, as :func:`sketch_feature_maps`
    does), or ``[L, H']`` with ``L·H' = heads``, flattened row-major as
    :func:`~sketchlab.featuremaps.heads.batch_features` flattens it (layer ``l``, head ``j`` → head
    ``l·H' + j``: a whole fit as one map). A module sketch (MLP, element-wise, LLoPS) is a submodule: its parameters train with the
    model. A plain one's tensors (PSF's Gaussians, TensorSketch's hashes, BASED's projection) are
    buffers, saved with the model and moved by ``.to``.
    """

    def __init__(self, sketch: Sketch, side: str = "q", *, heads: int, head_dim: int):
        super().__init__()
        if not isinstance(sketch, Sketch):
            raise TypeError(f"sketch must be a sketchlab.Sketch, got {type(sketch).__name__}")
        if side not in ("q", "k"):
            raise ValueError(f"side must be 'q' or 'k', got {side!r}")
        _init_heads(self, heads, head_dim)
        self.side = side
        if isinstance(sketch, nn.Module):
            self.sketch = sketch
            self._slots = []
        else:
            self.__dict__["sketch"] = sketch
            self._slots = _tensor_slots(sketch)
            for name, i in self._slots:
                value = getattr(sketch, name)
                self.register_buffer(f"{name}_{i}" if i is not None else name, value if i is None else value[i])
        tensors = [t for t in (list(sketch.parameters()) if isinstance(sketch, nn.Module) else list(self.buffers()))
                   if t.is_floating_point()]
        like = tensors[0] if tensors else torch.empty(0)
        with torch.no_grad():
            probe = self._side(torch.zeros(1, self.head_dim, dtype=like.dtype, device=like.device))  # [*batch, 1, M]
        batch = tuple(probe.shape[:-2])
        if batch and math.prod(batch) != self.heads:
            raise ValueError(f"{type(sketch).__name__} has batch shape {list(batch)}; a feature map of heads={self.heads} "
                             f"needs [] or a batch of {self.heads} maps (one layer: sketch_feature_maps(sketch, layer=l) "
                             "or sketch.select(l))")
        self._batch = batch
        self._m = probe.shape[-1]

    def _side(self, x):
        return self.sketch.features_q(x) if self.side == "q" else self.sketch.features_k(x)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self._slots:  # the buffers were replaced: point the plain sketch at them again
            for name, i in self._slots:
                buf = getattr(self, f"{name}_{i}" if i is not None else name)
                if i is None:
                    setattr(self.sketch, name, buf)
                else:
                    items = list(getattr(self.sketch, name))
                    items[i] = buf
                    setattr(self.sketch, name, items)
        return self

    @property
    def num_features(self) -> int:
        return self._m

    @property
    def degree(self) -> int | None:
        return self.sketch.degree

    @property
    def non_negative(self) -> bool:
        return self.sketch.non_negative

    def select_heads(self, index) -> FeatureMap:
        """Heads ``index`` as a :class:`HeadSelection` (the sketch's tensors need not lead with the heads)."""
        return HeadSelection(self, index)

    def _features(self, x):
        B, T, H, D = x.shape
        heads = x.transpose(1, 2).reshape(B, *(self._batch or (H,)), T, D)  # [B, *batch, T, D]: head h at its index
        return self._side(heads).reshape(B, H, T, self._m).transpose(1, 2)  # [B, *batch, T, M] -> [B, T, H, M]

    def _features_naive(self, x, head):
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(head), self._batch)) if self._batch else ()
        return self.sketch.features_naive(x, self.side, index)


def sketch_feature_maps(sketch: Sketch, *, heads: int, head_dim: int, layer: int | None = None):
    """``(map_q, map_k)``: a fitted sketch as the feature maps of one layer (``layer`` of an ``[L, H]``
    fit), or with ``layer=None`` of the whole fit (batch shape ``[]``, or ``heads`` maps in any batch
    shape, flattened row-major into the heads: :class:`SketchMap`).

    A sketch with one map for both sides (PSF, TensorSketch, BASED, tied element-wise) one :class:`SketchMap`
    twice; one with two maps (MLP, untied element-wise) a :class:`SketchMap` per side, the key side
    over its own copy of the sketch (so each module is saved once).
    """
    if not isinstance(sketch, Sketch):
        raise TypeError(f"sketch must be a sketchlab.Sketch, got {type(sketch).__name__}")
    if layer is not None:
        sketch = sketch.select(layer)
    map_q = SketchMap(sketch, "q", heads=heads, head_dim=head_dim)
    if not _two_sided(sketch):
        return map_q, map_q
    other = copy.deepcopy(sketch) if isinstance(sketch, nn.Module) else sketch
    return map_q, SketchMap(other, "k", heads=heads, head_dim=head_dim)


def _two_sided(sketch: Sketch) -> bool:
    """Whether the key map differs from the query map: a key-side tensor that is set (an untied Θ's ``theta_k``, the
    optimum's ``w_k``)."""
    return any(getattr(sketch, name, None) is not None for name in ("theta_k", "w_k"))


class HeadSelection(WrappedMap):
    r"""Heads ``index`` of a per-head map ``inner``, as a map of ``len(index)`` heads.

    A map's heads are independent (one map per head, :class:`FeatureMap`), so the selected heads'
    features are ``inner``'s on an input that holds ``x`` at those heads (zeros elsewhere, discarded):
    ``features(x)[:, :, j] = inner.features(full)[:, :, index[j]]``; the twin is ``inner``'s twin of
    head ``index[j]``. The inner map's parameters are shared, not copied. Cost: ``inner`` over all its
    heads.
    """

    def __init__(self, inner: FeatureMap, index):
        super().__init__()
        index = [int(i) for i in index]
        if not index or len(set(index)) != len(index) or not all(0 <= i < inner.heads for i in index):
            raise ValueError(f"index must be distinct heads of the inner map's {inner.heads}, got {index}")
        self.inner, self.index = inner, index
        self.heads, self.head_dim = len(index), inner.head_dim

    def select_heads(self, index) -> FeatureMap:
        return HeadSelection(self.inner, [self.index[i] for i in _check_heads(index, self.heads)])

    def _features(self, x):
        full = x.new_zeros(*x.shape[:2], self.inner.heads, self.head_dim)  # [B, T, H_inner, D]
        full[:, :, self.index] = x
        return self.inner._features(full)[:, :, self.index]

    def _features_naive(self, x, head):
        return self.inner._features_naive(x, self.index[head])


class FeatureMapSketch(nn.Module, Sketch):
    """A pair of feature maps as a :class:`~sketchlab.sketch.Sketch` of batch shape ``batch_shape``
    (its heads the maps' ``H = prod(batch_shape)``): what ``fit_sketch`` returns for a registered map.

    ``x [..., n, d]`` is mapped as ``[1, n, H, d]`` (the batch flattened into the heads).
    """

    def __init__(self, map_q: FeatureMap, map_k: FeatureMap | None = None, *, p: int, batch_shape: tuple = ()):
        super().__init__()
        self.map_q = map_q
        self.map_k = map_k
        self.p = p
        self.batch_shape = tuple(batch_shape)
        self.fit_info: dict = {}
        if map_q.heads != math.prod(self.batch_shape):
            raise ValueError(f"map_q has heads={map_q.heads}, the batch shape {list(batch_shape)} {math.prod(batch_shape)}")

    def _map(self, fmap, x):
        """``x [*lead, *batch_shape, n, d]`` (the batch part broadcast, so a shared ``x[n, d]`` reaches every
        head, as with the other sketches) → ``[*lead, *batch_shape, n, M]``."""
        n, d = x.shape[-2:]
        lead = x.shape[:max(x.ndim - 2 - len(self.batch_shape), 0)]
        return batch_features(fmap, torch.broadcast_to(x, (*lead, *self.batch_shape, n, d)))

    def features_q(self, x):
        return self._map(self.map_q, x)

    def features_k(self, x):
        return self._map(self.map_q if self.map_k is None else self.map_k, x)

    @property
    def degree(self) -> int:
        return self.p

    @property
    def num_features(self) -> int:
        return self.map_q.num_features

    @property
    def num_parameters(self) -> int:
        per_side = self.map_q.num_parameters // self.map_q.heads
        return per_side if self.map_k is None else 2 * per_side

    @property
    def non_negative(self) -> bool:
        return self.map_q.non_negative and (self.map_k is None or self.map_k.non_negative)

    def _heads(self, index) -> torch.Tensor:
        """The maps' head numbers at ``index`` of the batch shape (a tensor of that part's shape)."""
        return torch.arange(math.prod(self.batch_shape)).reshape(self.batch_shape)[index]

    def features_naive(self, x, side: str = "q", index: tuple = ()) -> torch.Tensor:
        fmap = self.map_q if side == "q" or self.map_k is None else self.map_k
        head = int(self._heads(index)) if self.batch_shape else 0
        return fmap._features_naive(torch.as_tensor(x, dtype=torch.float64), head)

    def select(self, index) -> FeatureMapSketch:
        """The sketch at ``index`` of its batch shape (e.g. one layer of an ``[L, H]`` fit): its maps
        restricted to those heads (:class:`HeadSelection`, parameters shared)."""
        if not self.batch_shape:
            raise ValueError("this sketch has batch shape [] (one map for every input): there is no batch to select from")
        heads = self._heads(index)
        pick = lambda fmap: None if fmap is None else HeadSelection(fmap, heads.flatten().tolist())  # noqa: E731
        sel = FeatureMapSketch(pick(self.map_q), pick(self.map_k), p=self.p, batch_shape=tuple(heads.shape))
        sel.fit_info = self.fit_info
        return sel
