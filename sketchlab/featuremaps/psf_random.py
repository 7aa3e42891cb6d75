r"""PolySketchFormer's random polynomial sketch (Ahle et al. 2020; Kacham, Mirrokni, Zhong 2024):
:class:`PSFRandomMap` (``"psf-random"``).

For a degree ``q >= 2`` the sketch of ``x ∈ R^d`` with ``r`` outputs is

.. math:: S_q(x) = \frac{(S_a(x)\,G_1) \odot (S'_b(x)\,G_2)}{\sqrt r},
          \qquad a = \lceil q/2 \rceil,\; b = \lfloor q/2 \rfloor,

where :math:`S_a`, :math:`S'_b` are two *independent* recursive sketches (independent Gaussian
draws), :math:`S_1(x) = x` inside the recursion, and :math:`G_1, G_2` have i.i.d. N(0, 1) entries of
shape ``(d × r)`` when they act on ``x`` (the bottom of the tree) and ``(r × r)`` above. For ``p`` a
power of two this is the balanced tree of PolySketchFormer; for other ``p`` the tree is the
unbalanced split above (PolySketchFormer pads to a power of two instead; both are unbiased). A
sketch of degree ``p = 1`` is :math:`xG/\sqrt r` with ``G`` of shape ``(d × r)``.

Unbiasedness: by induction over the tree, :math:`E\langle S_q(x), S_q(y)\rangle = (x^\top y)^q`,
since :math:`E[(u^\top g_1)(v^\top g_2)(u'^\top g_1)(v'^\top g_2)] = (u^\top u')(v^\top v')` for
independent standard Gaussian columns ``g_1``, ``g_2``.

Non-negative variant (``non_negative=True``, even ``p``): self-tensoring of a degree-``p/2``
sketch ``s`` with ``r`` outputs, :math:`\phi(x) = s(x) \otimes s(x)` (``r²`` features), whose
kernel :math:`\langle s(x), s(y)\rangle^2 \ge 0`. It is *not* unbiased:
:math:`E\langle s(x),s(y)\rangle^2 = (x^\top y)^p + \mathrm{Var}\langle s(x), s(y)\rangle`.
Odd ``p`` has no non-negative variant (the target kernel :math:`(x^\top y)^p` itself takes negative
values); ``non_negative=True`` with odd ``p`` is rejected.

Output size ``m`` → ``r``: plain sketches use ``r = m``; non-negative ones ``r = ⌊√m⌋``, so the
feature count ``r² <= m`` (``m = 64`` gives ``r = 8``, 64 features).

References
----------
Kacham, Mirrokni, Zhong. *PolySketchFormer: Fast Transformers via Sketching Polynomial Kernels*, ICML 2024.
Ahle et al. *Oblivious Sketching of High-Degree Polynomial Kernels*, SODA 2020.
"""

from __future__ import annotations

import math

import torch

from .._validation import (
    DEFAULT_MAX_BYTES,
    as_float_tensor,
    check_degree,
    check_finite,
    check_memory,
    check_positive_int,
)
from ..polynomial import self_tensor
from ._common import check_dtype, check_features_finite, make_generator
from .base import FeatureMap, FittedMaps

__all__ = ["PSFRandomMap", "psf_features", "psf_features_naive", "psf_weight_shapes"]


def _split(q: int) -> tuple[int, int]:
    return (q + 1) // 2, q // 2


def psf_weight_shapes(d: int, p: int, r: int) -> list[tuple[int, int]]:
    """Shapes of the Gaussian matrices of a degree-``p`` sketch, in the order they are used.

    A node of degree ``q >= 2`` owns ``[G_1, G_2]`` followed by the matrices of its left (degree
    ``⌈q/2⌉``) and right (degree ``⌊q/2⌋``) subtrees (pre-order). ``G`` acting on a leaf (the
    input ``x``) is ``(d × r)``, otherwise ``(r × r)``. ``p = 1`` has one ``(d × r)`` matrix. A
    degree-``p`` tree has ``2(p − 1)`` matrices (``p >= 2``).
    """
    d = check_positive_int(d, "d")
    p = check_degree(p)
    r = check_positive_int(r, "r")
    if p == 1:
        return [(d, r)]
    shapes: list[tuple[int, int]] = []

    def visit(q: int) -> None:
        a, b = _split(q)
        shapes.append((d if a == 1 else r, r))
        shapes.append((d if b == 1 else r, r))
        if a >= 2:
            visit(a)
        if b >= 2:
            visit(b)

    visit(p)
    return shapes


def _check_weights(weights, d: int, p: int) -> list[torch.Tensor]:
    if not isinstance(weights, (list, tuple)):
        raise TypeError(
            f"weights must be a list of tensors [..., in, r] (see psf_weight_shapes), got {type(weights).__name__}"
        )
    if len(weights) == 0:
        raise ValueError(
            f"weights must be a non-empty list of tensors [..., in, r]: a degree-{p} sketch needs "
            f"{len(psf_weight_shapes(d, p, 1))} matrices, got an empty list"
        )
    weights = [as_float_tensor(w, f"weights[{i}]") for i, w in enumerate(weights)]
    r = weights[0].shape[-1]
    expected = psf_weight_shapes(d, p, r)
    if len(weights) != len(expected):
        raise ValueError(f"a degree-{p} sketch needs {len(expected)} weight matrices, got {len(weights)}")
    for i, (w, shape) in enumerate(zip(weights, expected)):
        if w.ndim < 2 or tuple(w.shape[-2:]) != shape or w.shape[:-2] != weights[0].shape[:-2]:
            raise ValueError(
                f"weights[{i}] must have shape [..., {shape[0]}, {shape[1]}] (with the batch shape of "
                f"weights[0]) for d={d}, p={p}, r={r}; got {tuple(w.shape)}"
            )
    return weights


def psf_features(x: torch.Tensor, weights: list[torch.Tensor], p: int) -> torch.Tensor:
    r"""Plain (possibly signed) recursive polynomial sketch :math:`S_p(x)`.

    Parameters
    ----------
    x : Tensor ``[..., n, d]``
    weights : list of Tensor ``[..., in, r]``
        Gaussian matrices in the order of :func:`psf_weight_shapes`; leading axes broadcast
        against those of ``x`` (one independent sketch per head).
    p : int
        Degree, ``>= 1``.

    Returns
    -------
    Tensor ``[..., n, r]`` with :math:`E\langle S_p(x), S_p(y)\rangle = (x^\top y)^p`.

    Raises
    ------
    TypeError
        ``weights`` is not a list/tuple of floating tensors.
    ValueError
        ``weights`` is empty, has the wrong count or shapes for ``d = x.shape[-1]`` and ``p``, or
        ``x`` is not ``[..., n, d]``.

    Notes
    -----
    :math:`S_q(x) = (S_a(x)G_1 \odot S'_b(x)G_2)/\sqrt r`, ``a = ⌈q/2⌉``, ``b = ⌊q/2⌋``,
    :math:`S_1(x) = x` inside the tree; :math:`S_1(x) = xG/\sqrt r` at the root.
    Cost ``O(n (d + r) r p)``.
    """
    p = check_degree(p)
    x = as_float_tensor(x, "x")
    if x.ndim < 2 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape [..., n, d] with d >= 1, got {tuple(x.shape)}")
    check_finite(x, "x", allow_meta=True)
    weights = _check_weights(weights, x.shape[-1], p)
    r = weights[0].shape[-1]
    x = x.to(weights[0].dtype)
    scale = 1.0 / math.sqrt(r)
    if p == 1:
        return check_features_finite((x @ weights[0]) * scale, x, p, "PolySketch")  # [..., n, r]
    pos = 0

    def node(q: int) -> torch.Tensor:
        nonlocal pos
        if q == 1:
            return x
        a, b = _split(q)
        g1, g2 = weights[pos], weights[pos + 1]
        pos += 2
        left = node(a)  # [..., n, d or r]
        right = node(b)  # [..., n, d or r]
        return (left @ g1) * (right @ g2) * scale  # [..., n, r]

    return check_features_finite(node(p), x, p, "PolySketch")


def psf_features_naive(x: torch.Tensor, weights: list[torch.Tensor], p: int) -> torch.Tensor:
    """Float64 twin of :func:`psf_features` for ``x[n, d]`` and 2-D weights: explicit sums per coordinate."""
    x = as_float_tensor(x, "x").to(torch.float64)
    p = check_degree(p)
    if x.ndim != 2:
        raise ValueError(f"psf_features_naive takes x[n, d], got shape {tuple(x.shape)}")
    weights = _check_weights(weights, x.shape[1], p)
    if weights[0].ndim != 2:
        raise ValueError("psf_features_naive takes unbatched 2-D weight matrices")
    weights = [w.to(torch.float64) for w in weights]
    n = x.shape[0]
    r = weights[0].shape[1]

    def project(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(n, g.shape[1], dtype=torch.float64)
        for i in range(g.shape[1]):
            for a in range(g.shape[0]):
                out[:, i] += u[:, a] * g[a, i]
        return out

    if p == 1:
        return project(x, weights[0]) / math.sqrt(r)
    pos = 0

    def node(q: int) -> torch.Tensor:
        nonlocal pos
        if q == 1:
            return x
        a, b = _split(q)
        g1, g2 = weights[pos], weights[pos + 1]
        pos += 2
        left, right = node(a), node(b)
        u, v = project(left, g1), project(right, g2)
        out = torch.empty(n, r, dtype=torch.float64)
        for i in range(r):
            out[:, i] = u[:, i] * v[:, i] / math.sqrt(r)
        return out

    return node(p)


class PSFRandomMap(FeatureMap):
    r"""PolySketchFormer's random sketch per head with fixed Gaussian matrices (``"psf-random"``; one map for
    queries and keys).

    Parameters
    ----------
    weights : list of Tensor ``[H, in, r]``
        The Gaussian matrices (order of :func:`psf_weight_shapes`) of the plain degree-``p`` sketch, or of the
        degree-``p/2`` sketch ``s`` when ``non_negative``: one independent draw per head
        (:attr:`per_head_parameters`: :meth:`select_heads` slices them). Stored as buffers ``weights_0``, ….
    p : int
        Kernel degree.
    non_negative : bool
        Self-tensor: :math:`\phi = s \otimes s` with ``s`` of degree ``p/2`` (``p`` even), ``r²`` features.

    Notes
    -----
    Build random instances with :meth:`draw`; the constructor takes given matrices so that the map is a pure
    function of them. :attr:`num_parameters` counts the Gaussian entries (one map, shared by both sides).
    """

    def __init__(self, weights: list[torch.Tensor], p: int, *, non_negative: bool = False):
        super().__init__()
        p = check_degree(p)
        if not isinstance(non_negative, bool):
            raise TypeError(f"non_negative must be a bool, got {non_negative!r}")
        if non_negative and p % 2:
            raise ValueError(
                f"non_negative=True needs an even degree p (φ = s ⊗ s with s of degree p/2); got p={p}. "
                "For odd p the target (qᵀk)^p takes negative values; use non_negative=False"
            )
        if not isinstance(weights, (list, tuple)):
            raise TypeError(
                f"weights must be a list of tensors [H, in, r] (see psf_weight_shapes), got {type(weights).__name__}"
            )
        if len(weights) == 0:
            raise ValueError("weights must be a non-empty list of tensors [H, in, r], got an empty list")
        self.p = p
        self._non_negative = non_negative
        self.inner_degree = p // 2 if non_negative else p
        # the last matrix in pre-order belongs to a node without internal children, so it acts on x
        d = as_float_tensor(weights[-1], f"weights[{len(weights) - 1}]").shape[-2]
        weights = _check_weights(weights, d, self.inner_degree)
        if weights[0].ndim != 3:
            raise ValueError(f"weights must be tensors [H, in, r] (one draw per head), got {tuple(weights[0].shape)}")
        self.heads, self.head_dim = weights[0].shape[0], d
        self._count = len(weights)
        for i, w in enumerate(weights):
            self.register_buffer(f"weights_{i}", w)

    @classmethod
    def draw(cls, heads: int, head_dim: int, *, p: int, m: int, non_negative: bool = False, seed: int | None = None,
             generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> PSFRandomMap:
        """Draw a map of ``heads`` independent sketches with ``m`` features or fewer (``r = m``, or ``r = ⌊√m⌋``
        when non-negative).

        All entries come from ``generator`` (or a generator seeded with ``seed``) here, once, on the CPU in
        float64 (so a seed gives the same map on every device), then are cast to ``dtype`` and moved to
        ``device`` (default: CPU). The ``2(p−1)`` matrices (``r × r`` above the leaves) are checked against
        ``max_bytes`` before drawing (:func:`sketchlab._validation.check_memory`).
        """
        heads = check_positive_int(heads, "heads")
        d = check_positive_int(head_dim, "d")
        p = check_degree(p)
        m = check_positive_int(m, "m (the sketch size)")
        dtype = check_dtype(dtype)
        if non_negative and p % 2:
            raise ValueError(f"non_negative=True needs an even degree p, got p={p}")
        gen = make_generator(seed, generator)
        r = math.isqrt(m) if non_negative else m
        inner = p // 2 if non_negative else p
        shapes = psf_weight_shapes(d, inner, r)
        check_memory(
            heads * sum(a * b for a, b in shapes) * 8,
            what=f"the {len(shapes)} Gaussian matrices of a degree-{inner} PolySketch (d={d}, r={r}, "
            f"{heads} heads, drawn in float64)",
            way_out="use a smaller degree p or sketch size m, or fewer heads at a time",
            max_bytes=max_bytes,
        )
        weights = [torch.randn(heads, *shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
                   for shape in shapes]
        return cls(weights, p, non_negative=non_negative)

    @property
    def weights(self) -> list[torch.Tensor]:
        """The Gaussian matrices ``[H, in, r]``, in the order of :func:`psf_weight_shapes`."""
        return [getattr(self, f"weights_{i}") for i in range(self._count)]

    @property
    def r(self) -> int:
        """Outputs of the plain sketch ``s``."""
        return self.weights_0.shape[-1]

    @property
    def num_features(self) -> int:
        return self.r * self.r if self._non_negative else self.r

    @property
    def degree(self) -> int:
        return self.p

    @property
    def non_negative(self) -> bool:
        return self._non_negative

    def inner_features(self, x: torch.Tensor) -> torch.Tensor:
        """The plain sketch ``s(x)`` (degree ``p/2`` when non-negative, else ``p``): ``x [B, T, H, D]`` →
        ``[B, T, H, r]``."""
        return psf_features(x.transpose(1, 2), self.weights, self.inner_degree).transpose(1, 2)

    def _features(self, x):
        s = self.inner_features(x)  # [B, T, H, r]
        if not self._non_negative:
            return s
        return check_features_finite(self_tensor(s), x, self.p, "PolySketch (self-tensored s ⊗ s)")  # [B, T, H, r²]

    def _features_naive(self, x, head):
        s = psf_features_naive(x, [w[head] for w in self.weights], self.inner_degree)  # [n, r]
        if not self._non_negative:
            return s
        n, r = s.shape
        out = torch.empty(n, r * r, dtype=torch.float64)
        for a in range(r):
            for b in range(r):
                out[:, a * r + b] = s[:, a] * s[:, b]
        return out


def _fit_psf(q, k, *, p: int, m: int, seed: int = 0, non_negative: bool | None = None) -> FittedMaps:
    """``fit_sketch("psf-random", ...)``: data-independent; only ``d``, the batch shape and dtype are read.

    ``non_negative=None`` (default) self-tensors for even ``p`` (PolySketchFormer's choice, ``r =
    ⌊√m⌋``) and uses the plain sketch for odd ``p`` (``r = m``). One independent draw per head of ``prod(batch)``.
    """
    if non_negative is None:
        non_negative = p % 2 == 0
    fmap = PSFRandomMap.draw(math.prod(q.shape[:-2]), q.shape[-1], p=p, m=m, non_negative=non_negative, seed=seed,
                              dtype=q.dtype, device=q.device)
    return FittedMaps(fmap, fmap, {"steps": 0, "converged": True, "r": fmap.r, "non_negative": non_negative})
