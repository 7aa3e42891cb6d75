r"""One side of a fit (queries or keys) as the fits see it: rows whose features are linear in each factor.

Every quantity of the direct fits (features, the partials of one factor, the normal matrices of
the ALS blocks, Jacobian-vector products) is a sum over rows of a bilinear form in
:math:`\psi_p(\text{row})`. So a side may be given by any rows with the same Gram matrix
:math:`\Psi^\top\Psi` as the tokens, and the fit's iterates do not change:

:class:`Tokens`
    The tokens themselves, ``x[B, n, d]`` (the rows are :math:`x_n^{\otimes p}`): partials are
    scalars times ``x`` (``O(n)`` per sweep).
:class:`Tensors`
    Rows that are general symmetric tensors ``T[B, N, d**p]``. :func:`compress_side` builds
    ``N <= D = C(d+p-1, p)`` of them from a square root of the Gram matrix, so a fit on
    ``n > D`` tokens costs the same per sweep whatever ``n`` (only the one Gram matrix grows with ``n``).

With :math:`\Psi_Q = U_Q R_Q` (orthonormal ``U_Q``) and likewise for ``K``, the loss
:math:`\|\Phi_Q\Phi_K^\top - \Psi_Q\Psi_K^\top\|_F = \|R_Q W_Q W_K^\top R_K^\top - R_Q R_K^\top\|_F`
is the same problem on the rows of ``R`` with the kernel ``R_Q R_K^\top`` (``N_q × N_k``).

Both classes offer the same methods; :class:`Tensors` built from the tokens' own rank-1 tensors
gives exactly what :class:`Tokens` gives (tested), and :func:`token_normal_naive` is the float64
loop twin of the normal matrices.
"""

from __future__ import annotations

import math

import torch

from .._validation import DEFAULT_MAX_BYTES, check_memory
from ..polynomial import feature_gram_root, symmetric_to_full
from .maps import feature_partials, features_jvp, features_vjp, llops_features

__all__ = ["Tensors", "Tokens", "compress_side", "token_normal_naive"]

#: Bytes of one block of token products (pairs) formed at a time.
_BLOCK_BYTES = 64 * 2**20


def _pairs(x: torch.Tensor) -> torch.Tensor:
    r"""The products :math:`x_{n,d}\,x_{n,e}`, ``d <= e`` (row-major over the upper triangle), ``[B, n, d(d+1)/2]``."""
    d = x.shape[-1]
    return torch.cat([x[..., i : i + 1] * x[..., i:] for i in range(d)], -1)  # slices: faster than a gather


def _token_normal(x: torch.Tensor, others: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:
    r"""Normal matrices of one factor of every column, ``[B, m, t·d, t·d]``.

    ``x[B, n, d]``, ``others[B, t, n, m]`` (the product of each column's other factors):
    :math:`N_i[(r,d),(s,e)] = \sum_n o_{r,n,i}\,o_{s,n,i}\,x_{n,d}\,x_{n,e}`, formed as one
    ``(t²·m) × n × d(d+1)/2`` matrix product per head with the products ``pairs`` (:func:`_pairs`;
    when not given, formed here in token blocks of at most ``_BLOCK_BYTES``).
    """
    B, t, n, m = others.shape
    d = x.shape[-1]
    row, col = torch.triu_indices(d, d, device=x.device)  # the order of _pairs
    out = torch.empty(B, t, t, m, d, d, dtype=x.dtype, device=x.device)
    step = n if pairs is not None else max(1, _BLOCK_BYTES // (x.element_size() * d * (d + 1) // 2))  # tokens per block
    for b in range(B):  # per head: [t·t·m, n] @ [n, d(d+1)/2]
        w = (others[b, :, None] * others[b, None, :]).transpose(-2, -1).reshape(t * t * m, n)  # [(t, s, m), n]
        packed = torch.zeros(t * t * m, d * (d + 1) // 2, dtype=x.dtype, device=x.device)
        for lo in range(0, n, step):  # uncached pairs: formed in token blocks of at most _BLOCK_BYTES
            head = pairs[b] if pairs is not None else _pairs(x[b, lo : lo + step])
            packed += w[:, lo : lo + step] @ head
        packed = packed.reshape(t, t, m, -1)  # [t, s, m, d(d+1)/2]
        out[b, :, :, :, row, col] = packed
        out[b, :, :, :, col, row] = packed
    return out.permute(0, 3, 1, 4, 2, 5).reshape(B, m, t * d, t * d)  # [B, m, (t, d), (s, e)]


def token_normal_naive(x: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """Float64 twin of :meth:`Tokens.factor`'s normal matrices: ``Z_iᵀ Z_i`` with
    ``Z_i[n, (r, d)] = others[r, n, i] · x[n, d]`` formed explicitly, column by column."""
    B, t, n, m = others.shape
    out = torch.zeros(B, m, t * x.shape[-1], t * x.shape[-1], dtype=torch.float64)
    for b in range(B):
        for i in range(m):
            z = torch.cat([others[b, r, :, i, None].double() * x[b].double() for r in range(t)], 1)  # [n, t·d]
            out[b, i] = z.T @ z
    return out


class _TokenFactor:
    """Factor ``j`` of every column on a :class:`Tokens` side: ``others[B, m, t, n]``."""

    def __init__(self, x: torch.Tensor, others: torch.Tensor, pairs: torch.Tensor | None):
        self.x, self.others, self.pairs = x, others, pairs

    def normal(self) -> torch.Tensor:
        r"""``[B, m, t·d, t·d]``: :math:`Z_i^\\top Z_i` per column ``i``."""
        return _token_normal(self.x, self.others.permute(0, 2, 3, 1), self.pairs)

    def rhs(self, i: int, target: torch.Tensor) -> torch.Tensor:
        r""":math:`Z_i^\\top v` for ``target[B, n]`` → ``[B, t, d]``."""
        return (self.others[:, i] * target[:, None]) @ self.x

    def column(self, i: int, theta: torch.Tensor) -> torch.Tensor:
        r"""Column ``i``'s features :math:`Z_i\\,\\theta` for its factor ``theta[B, t, d]`` → ``[B, n]``."""
        return (self.others[:, i] * (theta @ self.x.mT)).sum(1)


class _TensorFactor:
    """Factor ``j`` of every column on a :class:`Tensors` side: ``z[B, m, t·d, N]``, row ``s``'s
    tensor contracted with every other factor of column ``i`` (matrix products: no per-call einsum parsing)."""

    def __init__(self, g: torch.Tensor):
        B, m, t, N, d = g.shape
        self.t, self.d = t, d
        self.z = g.permute(0, 1, 2, 4, 3).reshape(B, m, t * d, N)  # [B, m, (t, d), N]

    def normal(self) -> torch.Tensor:
        return self.z @ self.z.mT

    def rhs(self, i: int, target: torch.Tensor) -> torch.Tensor:
        return (self.z[:, i] @ target[:, :, None]).reshape(-1, self.t, self.d)

    def column(self, i: int, theta: torch.Tensor) -> torch.Tensor:
        return (theta.reshape(-1, 1, self.t * self.d) @ self.z[:, i])[:, 0]


class Tokens:
    r"""A side given by its tokens ``x[B, n, d]``: row ``n`` is :math:`x_n^{\otimes p}`.

    Methods (shared with :class:`Tensors`); ``theta[B, t, p, d, m]``:

    - ``features(theta)`` → ``[B, n, m]``
    - ``partials(theta)`` → ``(features, parts)``, the partial derivatives of every factor
    - ``jvp(parts, v)`` → ``[B, n, m]``; ``vjp(parts, u)`` → ``[B, t, p, d, m]``
    - ``blocks(parts)`` → ``[B, p, m, t·d, t·d]``: the normal matrices of every factor and column
    - ``factor(theta, j)``: factor ``j``'s ALS block data (``normal()``, ``rhs(i, v)``, ``column(i, θ)``)

    Parameters
    ----------
    x : Tensor ``[B, n, d]``
    max_bytes : int
        The products :math:`x_{n,d}x_{n,e}` every normal matrix needs are kept when they take at
        most a quarter of this, else formed per head each time.
    """


    def __init__(self, x: torch.Tensor, *, max_bytes: int = DEFAULT_MAX_BYTES):
        self.x = x
        B, n, d = x.shape
        self.pairs = _pairs(x) if B * n * d * (d + 1) // 2 * x.element_size() <= max_bytes // 4 else None

    @property
    def rows(self) -> int:
        return self.x.shape[-2]

    def features(self, theta: torch.Tensor) -> torch.Tensor:
        return llops_features(self.x, theta)

    def partials(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return feature_partials(self.x, theta)  # others [B, t, p, n, m]

    def jvp(self, parts: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return features_jvp(self.x, parts, v)

    def vjp(self, parts: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return features_vjp(self.x, parts, u)

    def blocks(self, parts: torch.Tensor) -> torch.Tensor:
        return torch.stack([_token_normal(self.x, parts[:, :, j], self.pairs) for j in range(parts.shape[2])], 1)

    def factor(self, theta: torch.Tensor, j: int) -> _TokenFactor:
        proj = torch.einsum("bnd,btpdm->bmtpn", self.x, theta)  # [B, m, t, p, n] = ⟨θ_{r,l,:,i}, x_n⟩
        others = torch.cat([proj[:, :, :, :j], proj[:, :, :, j + 1 :]], 3).prod(3)  # [B, m, t, n]
        return _TokenFactor(self.x, others, self.pairs)


class Tensors:
    r"""A side given by rows that are symmetric tensors ``T[B, N, d**p]`` (row-major index tuples).

    Row ``s``'s features are :math:`\phi_i(T_s) = \sum_r T_s(\theta_{r,1,:,i}, \dots, \theta_{r,p,:,i})`;
    the partial of factor ``j`` is :math:`g_{r,j,i}(s) = T_s` contracted with every other factor
    (a ``d``-vector). ``Tensors(x^{⊗p})`` equals :class:`Tokens` ``(x)`` in every method. Same methods
    as :class:`Tokens`; ``parts`` is ``g[B, t, p, m, N, d]``. Memory ``t·p·m·N·d**(p-1)`` per head.

    Parameters
    ----------
    tensors : Tensor ``[B, N, d**p]``
    d, p : int
    """


    def __init__(self, tensors: torch.Tensor, d: int, p: int):
        self.tensors, self.d, self.p = tensors, d, p

    @property
    def rows(self) -> int:
        return self.tensors.shape[-2]

    def _partial(self, theta: torch.Tensor, j: int) -> torch.Tensor:
        """``[B, t, m, N, d]``: every row contracted with the factors ``l != j`` (any order: ``T`` is symmetric)."""
        B, t, p, d, m = theta.shape
        N = self.rows
        rest = [l for l in range(p) if l != j]
        if not rest:  # p = 1: the row itself
            return self.tensors[:, None, None].expand(B, t, m, N, d)
        y = torch.einsum("bsae,btam->btmse", self.tensors.reshape(B, N, d, d ** (p - 1)), theta[:, :, rest[0]])
        for l in rest[1:]:
            y = torch.einsum("btmsae,btam->btmse", y.reshape(B, t, m, N, d, -1), theta[:, :, l])
        return y  # [B, t, m, N, d]

    def features(self, theta: torch.Tensor) -> torch.Tensor:
        return torch.einsum("btmsd,btdm->bsm", self._partial(theta, theta.shape[2] - 1), theta[:, :, -1])

    def partials(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.stack([self._partial(theta, j) for j in range(theta.shape[2])], 2)  # [B, t, p, m, N, d]
        return torch.einsum("btmsd,btdm->bsm", g[:, :, -1], theta[:, :, -1]), g

    def jvp(self, parts: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Σ_{r,j,d} g[r,j,i,s,d] v[r,j,d,i]: batched matrix-vector products over (r, j, i), not an einsum
        B, t, p, m, N, d = parts.shape
        out = parts.reshape(B, t * p, m, N, d) @ v.transpose(-2, -1).reshape(B, t * p, m, d, 1)  # [B, tp, m, N, 1]
        return out.sum(1)[..., 0].mT  # [B, N, m]

    def vjp(self, parts: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        # Σ_s u[s,i] g[r,j,i,s,:]: row vector times matrix per (r, j, i)
        B, t, p, m, N, d = parts.shape
        out = u.mT.reshape(B, 1, m, 1, N) @ parts.reshape(B, t * p, m, N, d)  # [B, tp, m, 1, d]
        return out[..., 0, :].reshape(B, t, p, m, d).transpose(-2, -1)  # [B, t, p, d, m]

    def blocks(self, parts: torch.Tensor) -> torch.Tensor:
        B, t, p, m, N, d = parts.shape
        z = parts.permute(0, 2, 3, 4, 1, 5).reshape(B, p, m, N, t * d)  # [B, p, m, N, (t, d)]
        return z.mT @ z

    def factor(self, theta: torch.Tensor, j: int) -> _TensorFactor:
        return _TensorFactor(self._partial(theta, j).transpose(1, 2))  # [B, m, t, N, d]


def compress_bytes(batch: int, d: int, p: int, m: int, t: int) -> int:
    """Peak bytes of a compressed side: Gram matrix, rows (symmetric and full) and the partials of every factor."""
    dim = math.comb(d + p - 1, p)
    return 8 * batch * (2 * dim * dim + dim * d**p + t * p * m * dim * d ** max(p - 1, 1))


def compress_side(x: torch.Tensor, p: int, *, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[Tensors, torch.Tensor]:
    r"""At most ``D = C(d+p-1, p)`` rows with the tokens' Gram matrix: :math:`R^\top R = \Psi^\top\Psi`.

    Parameters
    ----------
    x : float64 Tensor ``[B, n, d]``
    p : int
    max_bytes : int
        Budget for the Gram matrix and the rows.

    Returns
    -------
    side : Tensors
        ``N`` rows, ``T_s`` = row ``s`` of ``R`` as a full symmetric tensor (:func:`~sketchlab.symmetric_to_full`).
    rows : Tensor ``[B, N, D]``
        ``R`` in the symmetric basis (:func:`~sketchlab.polynomial.feature_gram_root`: the Cholesky
        factor of :math:`\Psi^\top\Psi`, or its eigen-square-root without the null space when singular).
    """
    B, n, d = x.shape
    dim = math.comb(d + p - 1, p)
    check_memory(8 * B * (2 * dim * dim + dim * d**p), what=f"the Gram matrix of ψ_{p} ({B} x {dim} x {dim} float64) and its rows",
                 way_out="use route='kernel' or 'features'", max_bytes=max_bytes)
    rows = feature_gram_root(x, p, p > 1 and d > 1, max_bytes=max_bytes)  # [B, N, D]
    full = symmetric_to_full(rows.mT, d, p).mT if p > 1 and d > 1 else rows  # [B, N, d**p]
    return Tensors(full.contiguous(), d, p), rows
