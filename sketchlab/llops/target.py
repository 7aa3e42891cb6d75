r"""The fitting target :math:`A = (QK^\top)^{\circ p}`, accessed only through products.

Every LLoPS fit needs :math:`A\Phi_K`, :math:`A^\top\Phi_Q`, :math:`\|A\|_F^2` and the loss
:math:`\|\Phi_Q\Phi_K^\top - A\|_F^2`, never ``A`` itself. :class:`KernelTarget` provides them by
one of two routes, chosen per problem by cost and memory (both tested equal):

``"kernel"``
    ``A`` is formed once, ``[B, n_q, n_k]`` (checked against the memory budget first); a product
    costs ``n_q n_k m``. Cheaper when ``n`` is at most about the feature dimension ``D``.
``"features"``
    :math:`A\Phi_K = \psi_p(Q)\,(\psi_p(K)^\top\Phi_K)`, with the symmetric features ``ψ`` of
    ``D = C(d+p-1, p)`` coordinates formed in token blocks (never ``n × n``); a product costs
    ``(n_q + n_k) D m``. The loss is the moment form
    :math:`\|A\|^2 - 2\langle\psi_Q^\top\Phi_Q, \psi_K^\top\Phi_K\rangle + \langle\Phi_Q^\top\Phi_Q, \Phi_K^\top\Phi_K\rangle`.
``"compressed"``
    Each side is replaced by at most ``D`` rows with its Gram matrix
    (:func:`~sketchlab.llops.sides.compress_side`) and ``A`` by the small kernel
    :math:`R_Q R_K^\top` of those rows (:meth:`KernelTarget.compressed`): the same loss, and per
    sweep a cost independent of ``n``. Cheaper when ``n`` is well above ``D`` (``p = 2``).

:func:`fit_problem` picks the route and builds the two sides (:mod:`~sketchlab.llops.sides`) with it.

:math:`\|A\|_F^2` comes from :func:`sketchlab.metrics.kernel_sq_norm` (moments of degree ``2p``
or row blocks, whichever is cheaper).
"""

from __future__ import annotations

import math

import torch

from .._validation import DEFAULT_MAX_BYTES, check_memory
from ..metrics import _kernel_sq_norm
from ..polynomial import _GRAM_PARTS, poly_features
from .sides import _BLOCK_BYTES, Tokens, compress_bytes, compress_side

__all__ = ["ROUTES", "KernelTarget", "fit_problem", "iteration_flops"]

ROUTES = ("auto", "kernel", "features", "compressed")


def _sym_dim(d: int, p: int) -> int:
    return math.comb(d + p - 1, p)


class KernelTarget:
    r"""Products with :math:`A = (QK^\top)^{\circ p}` for a batch of heads.

    Parameters
    ----------
    q : float Tensor ``[B, n_q, d]``
    k : float Tensor ``[B, n_k, d]``
    p : int
    m : int
        Number of feature columns the products will carry (used to pick the route).
    route : {"auto", "kernel", "features"}
        ``"auto"`` takes the one with fewer flops per product whose memory fits ``max_bytes``
        (the ``"compressed"`` route is built by :meth:`compressed`).
    max_bytes : int
        Memory budget of the one big allocation (``A``, or the cached features).

    Attributes
    ----------
    route : str
        The route taken.
    sq_norm : Tensor ``[B]``
        :math:`\|A\|_F^2` per head.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, p: int, m: int, *, route: str = "auto",
                 max_bytes: int = DEFAULT_MAX_BYTES):
        if route not in ("auto", "kernel", "features"):
            raise ValueError(f"route must be 'auto', 'kernel' or 'features', got {route!r}")
        self.q, self.k, self.p = q, k, p
        B, n_q, d = q.shape
        n_k = k.shape[-2]
        dim = _sym_dim(d, p) if p > 1 else d
        self.dim = dim
        kernel_bytes = B * n_q * n_k * q.element_size()
        if route == "auto":
            cheaper = n_q * n_k <= (n_q + n_k) * dim
            route = "kernel" if cheaper and kernel_bytes <= max_bytes else "features"
        self.route = route
        if route == "kernel":
            check_memory(kernel_bytes, what=f"the kernel A = (QKᵀ)^p of {B} head(s) ({n_q} x {n_k}, {q.dtype})",
                         way_out="use route='features' (never forms A), fewer heads at a time, or fit_tokens",
                         max_bytes=max_bytes)
            self.a = (q @ k.mT) ** p  # [B, n_q, n_k]
            self.sq_norm = (self.a**2).sum((-2, -1))
            self._psi = None
        else:
            self.a = None
            self._block = max(1, min(_BLOCK_BYTES, max_bytes // 4) // max(1, B * dim * q.element_size()))  # tokens per block
            cache = B * (n_q + n_k) * dim * q.element_size()
            # keep ψ when it is small next to the budget; otherwise recompute it block by block
            self._psi = (self._features(q), self._features(k)) if cache <= max_bytes // 4 else None
            self.sq_norm = _kernel_sq_norm(q, k, p, max_bytes)

    @classmethod
    def compressed(cls, rows_q: torch.Tensor, rows_k: torch.Tensor) -> KernelTarget:
        r"""The target of the compressed rows ``rows_q[B, N_q, D]``, ``rows_k[B, N_k, D]``
        (:func:`~sketchlab.llops.sides.compress_side`): :math:`A' = R_Q R_K^\top`, ``[B, N_q, N_k]``."""
        self = cls.__new__(cls)
        self.route, self.p, self.q, self.k, self._psi = "compressed", None, None, None, None
        self.dim = rows_q.shape[-1]
        self.a = rows_q @ rows_k.mT
        self.sq_norm = (self.a**2).sum((-2, -1))
        return self

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return poly_features(x, self.p, self.p > 1 and x.shape[-1] > 1)  # [B, n, D]

    def _blocks(self, x: torch.Tensor, cached: torch.Tensor | None):
        """``(slice, ψ(x[:, slice]))`` over token blocks."""
        n = x.shape[-2]
        for lo in range(0, n, self._block if cached is None else n):
            hi = min(n, lo + (self._block if cached is None else n))
            yield slice(lo, hi), (cached if cached is not None else self._features(x[:, lo:hi]))

    def moments(self, f: torch.Tensor, side: str) -> torch.Tensor:
        r""":math:`\psi_p(X)^\top\Phi` for ``side`` ``"q"`` or ``"k"``, ``f[B, n, m]`` → ``[B, D, m]`` ("features" route)."""
        x, cached = (self.q, None if self._psi is None else self._psi[0]) if side == "q" else \
            (self.k, None if self._psi is None else self._psi[1])
        out = torch.zeros(f.shape[0], self.dim, f.shape[-1], dtype=f.dtype, device=f.device)
        for sl, psi in self._blocks(x, cached):
            out += psi.mT @ f[:, sl]
        return out

    def _apply(self, x: torch.Tensor, cached: torch.Tensor | None, mom: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[-2], mom.shape[-1], dtype=mom.dtype, device=mom.device)
        for sl, psi in self._blocks(x, cached):
            out[:, sl] = psi @ mom
        return out

    def cross(self, fk: torch.Tensor) -> torch.Tensor:
        r""":math:`A\Phi_K`, ``fk[B, n_k, m]`` → ``[B, n_q, m]``."""
        if self.a is not None:
            return self.a @ fk
        return self._apply(self.q, None if self._psi is None else self._psi[0], self.moments(fk, "k"))

    def cross_t(self, fq: torch.Tensor) -> torch.Tensor:
        r""":math:`A^\top\Phi_Q`, ``fq[B, n_q, m]`` → ``[B, n_k, m]``."""
        if self.a is not None:
            return self.a.mT @ fq
        return self._apply(self.k, None if self._psi is None else self._psi[1], self.moments(fq, "q"))

    def loss(self, fq: torch.Tensor, fk: torch.Tensor, cross: torch.Tensor | None = None) -> torch.Tensor:
        r""":math:`\|\Phi_Q\Phi_K^\top - A\|_F^2` per head, ``[B]``.

        With ``cross`` (:math:`A\Phi_K`, already computed) or on the "features" route the value is
        the moment form ``‖A‖² − 2⟨Φ_Q, AΦ_K⟩ + ⟨G_Q, G_K⟩`` (``O(n m²)``, no product with ``A``
        when ``cross`` is given), whose round-off is about ``1e-16 ‖A‖²`` (clamped at 0); otherwise
        the squared residual is summed directly.
        """
        if cross is None and self.a is not None:
            return ((fq @ fk.mT - self.a) ** 2).sum((-2, -1))
        if cross is None:
            cross = self.cross(fk)
        value = self.sq_norm - 2 * (fq * cross).sum((-2, -1)) + ((fq.mT @ fq) * (fk.mT @ fk)).sum((-2, -1))
        return value.clamp_min(0.0)


def _token_flops(n_q: int, n_k: int, d: int, dim: int, p: int, m: int, t: int) -> float:
    """Multiply-adds of one token-route iteration: normal matrices of every factor, two products with A."""
    normal = p * m * t * t * (n_q + n_k) * d * (d + 1) / 2
    return normal + 2 * m * min(n_q * n_k, (n_q + n_k) * dim)


def _compressed_flops(n_q: int, n_k: int, d: int, dim: int, p: int, m: int, t: int) -> tuple[float, float]:
    """Multiply-adds of the compression (Gram matrices and their Cholesky factors) and of one iteration on the rows."""
    rows_q, rows_k = min(n_q, dim), min(n_k, dim)
    setup = (n_q + n_k) * dim * dim * (_GRAM_PARTS + 1) / (2 * _GRAM_PARTS) + 2 * dim**3 / 3
    partials = p * t * m * (rows_q + rows_k) * d**p
    normal = p * m * (rows_q + rows_k) * (t * d) ** 2
    return setup, partials + normal + 2 * m * rows_q * rows_k


def iteration_flops(route: str, n_q: int, n_k: int, d: int, p: int, m: int, t: int) -> float:
    """Estimated multiply-adds of one fit iteration per head on ``route`` (a :class:`KernelTarget`'s
    ``route``): the normal matrices of every factor and two products with ``A``; this caps a fit's
    iterations (``work`` of :func:`~sketchlab.llops.fit_llops_direct`)."""
    dim = _sym_dim(d, p) if p > 1 else d
    if route == "compressed":
        return _compressed_flops(n_q, n_k, d, dim, p, m, t)[1]
    return _token_flops(n_q, n_k, d, dim, p, m, t)


def fit_problem(q: torch.Tensor, k: torch.Tensor, p: int, m: int, t: int, *, route: str = "auto",
                iterations: int = 38, max_bytes: int = DEFAULT_MAX_BYTES):
    """The two sides and the target of a direct fit, by ``route``.

    ``"kernel"`` and ``"features"`` keep the tokens (:class:`~sketchlab.llops.sides.Tokens`);
    ``"compressed"`` replaces them with at most ``D`` rows per side. ``"auto"`` takes
    ``"compressed"`` when its set-up plus ``iterations`` ALS sweeps and LM steps (the fit's budget;
    38 in the default preset) need fewer multiply-adds than the tokens' (and its memory fits
    ``max_bytes``), else the cheaper token route.

    Returns ``(side_q, side_k, target)``.
    """
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    B, n_q, d = q.shape
    n_k = k.shape[-2]
    dim = _sym_dim(d, p) if p > 1 else d
    if route == "auto":
        setup, per = _compressed_flops(n_q, n_k, d, dim, p, m, t)
        cheaper = setup + iterations * per < iterations * _token_flops(n_q, n_k, d, dim, p, m, t)
        route = "compressed" if cheaper and compress_bytes(B, d, p, m, t) <= max_bytes else "auto"
    if route == "compressed":
        check_memory(compress_bytes(B, d, p, m, t), what=f"the compressed rows of {B} head(s) (d={d}, p={p}, D={dim}, m={m}, t={t})",
                     way_out="use route='kernel' or 'features'", max_bytes=max_bytes)
        (side_q, rows_q), (side_k, rows_k) = compress_side(q, p, max_bytes=max_bytes), compress_side(k, p, max_bytes=max_bytes)
        return side_q, side_k, KernelTarget.compressed(rows_q, rows_k)
    return Tokens(q, max_bytes=max_bytes), Tokens(k, max_bytes=max_bytes), KernelTarget(q, k, p, m, route=route, max_bytes=max_bytes)
