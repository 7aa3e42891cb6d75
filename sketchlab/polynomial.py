r"""Exact polynomial features :math:`\psi_p` and the polynomial kernel.

The degree-``p`` polynomial kernel :math:`\kappa(x, y) = (x^\top y)^p` has the exact feature map
:math:`\psi_p(x) = \mathrm{vec}(x^{\otimes p}) \in \mathbb{R}^{d^p}` with
:math:`\langle \psi_p(x), \psi_p(y) \rangle = (x^\top y)^p`.  Its symmetric form keeps one
coordinate per multiset :math:`\alpha` of ``p`` indices (``|α| = p``), weighted by the square root
of the multinomial coefficient :math:`c_\alpha = p! / \prod_i \alpha_i!`, giving
:math:`\binom{d+p-1}{p}` coordinates with the same inner products (multinomial theorem).

Coordinate order. Full features use row-major order of the index tuple ``(i_1, …, i_p)``, i.e.
``psi.reshape(..., d, …, d)[..., i_1, …, i_p] = x[i_1] ⋯ x[i_p]``. Symmetric features are ordered
like ``itertools.combinations_with_replacement(range(d), p)``.

Every fast function here has a naive float64 twin (suffix ``_naive``) that writes the formula out
with Python loops; the tests compare the two.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from ._validation import (
    DEFAULT_MAX_BYTES,
    as_float_tensor,
    check_degree,
    check_finite,
    check_memory,
    check_positive_int,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "check_power_overflow",
    "feature_gram_root",
    "full_to_symmetric",
    "num_poly_features",
    "poly_features",
    "poly_features_naive",
    "poly_kernel",
    "self_tensor",
    "symmetric_index",
    "symmetric_to_full",
]

def check_power_overflow(out: torch.Tensor, base: torch.Tensor, p: int, what: str) -> None:
    r"""Raise ``FloatingPointError`` if ``out`` (a degree-``p`` power of ``base``) is not finite.

    Called after computing a power of finite inputs: a non-finite value there can only be an
    overflow of ``out.dtype``. The message names ``what``, the dtype, ``p``, the largest
    ``|base|`` and the size its ``p``-th power would have (computed in log space, so it is
    printed even when it exceeds float64), and the way out (scale the inputs down, e.g.
    ``scale="sqrt-d"``, or compute in float64).
    """
    if out.is_meta:
        return  # shapes only, no values
    bad = ~torch.isfinite(out)
    if not bool(bad.any()):
        return
    top = float(base.detach().abs().max().to(torch.float64))
    log10 = p * math.log10(top) if top > 0 else -math.inf
    limit = torch.finfo(out.dtype).max
    first = tuple(int(i) for i in bad.nonzero()[0])  # leading axes are the batch: (layer, head, ...) for a dump
    raise FloatingPointError(
        f"{what} overflows {out.dtype}: {int(bad.sum())} of {out.numel()} values are non-finite, the first at "
        f"index {first} (p={p}, the largest |base| is {top:.4g}, and {top:.4g}^{p} ≈ 1e{log10:.0f} exceeds the "
        f"dtype's maximum {limit:.3g}); the input scale is too large for this degree: scale q and k down (e.g. "
        "scale='sqrt-d' or a smaller factor, so that |qᵀk| stays near 1), lower p, or use float64"
    )


def _central_counts(d: int, p: int) -> list[int]:
    """Multiplicities of the most balanced multiset of size ``p`` over ``d`` indices (largest c_α)."""
    return [p // d + (1 if i < p % d else 0) for i in range(d)]


def num_poly_features(d: int, p: int, symmetric: bool = False) -> int:
    """Number of exact features: ``d**p`` (full) or ``C(d+p-1, p)`` (symmetric)."""
    return _num_features(check_positive_int(d, "d"), check_degree(p), symmetric)


def _num_features(d: int, p: int, symmetric: bool) -> int:
    """:func:`num_poly_features` for checked ``d, p >= 1`` (trusts its inputs)."""
    return math.comb(d + p - 1, p) if symmetric else d**p


_LOG_FLOAT64_MAX = math.log(torch.finfo(torch.float64).max)


@functools.lru_cache(maxsize=64)
def _symmetric_index_cpu(d: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    combos = torch.tensor(
        list(itertools.combinations_with_replacement(range(d), p)), dtype=torch.long
    ).reshape(-1, p)  # [C, p]
    log_fact_p = math.lgamma(p + 1)
    weights = []
    for row in combos.tolist():
        counts = [len(list(g)) for _, g in itertools.groupby(row)]
        log_c = log_fact_p - sum(math.lgamma(c + 1) for c in counts)
        # √c_α exceeds float64 (1.8e308) for large p (e.g. p = 500, d = 2): stored as inf, and
        # poly_features(symmetric=True) reports it instead of returning inf features
        weights.append(math.exp(0.5 * log_c) if 0.5 * log_c < _LOG_FLOAT64_MAX else math.inf)
    return combos, torch.tensor(weights, dtype=torch.float64)  # [C, p], [C]


def symmetric_index(d: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Multisets of size ``p`` over ``range(d)`` and their weights :math:`\sqrt{c_\alpha}`.

    Returns
    -------
    index : LongTensor ``[C, p]``
        Row ``a`` lists the (non-decreasing) indices of multiset ``α_a``.
    weight : float64 Tensor ``[C]``
        :math:`\sqrt{p! / \prod_i \alpha_i!}`.
    """
    d = check_positive_int(d, "d")
    p = check_degree(p)
    return _symmetric_index_cpu(d, p)


def _check_budget(batch_numel: int, num_features: int, itemsize: int, max_bytes: int, d: int, p: int, symmetric: bool) -> None:
    way_out = (
        "use smaller d or p, or fewer rows"
        if symmetric
        else f"use symmetric=True ({_num_features(d, p, True)} features instead of {d**p}), "
        "smaller d or p, or fewer rows"
    )
    check_memory(
        batch_numel * num_features * itemsize,
        what=f"poly_features(d={d}, p={p}, symmetric={symmetric}) of {batch_numel} x {num_features} features",
        way_out=way_out,
        max_bytes=max_bytes,
    )


def poly_features(x, p: int, symmetric: bool = False, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    r"""Exact polynomial features :math:`\psi_p(x)`.

    Parameters
    ----------
    x : Tensor ``[..., d]``
        Real floating input; leading dimensions are batch dimensions.
    p : int
        Degree, ``p >= 1``.
    symmetric : bool
        If true, return the ``C(d+p-1, p)`` symmetric (multinomially weighted) coordinates.
    max_bytes : int
        Memory budget for the output; exceeding it raises ``ValueError`` naming the size, the
        budget and the way out.

    Returns
    -------
    Tensor ``[..., d**p]`` or ``[..., C(d+p-1, p)]``, same dtype and device as ``x``.

    Notes
    -----
    Full: :math:`\psi_p(x)_{(i_1..i_p)} = \prod_j x_{i_j}` (row-major tuple order).
    Symmetric: :math:`\psi^{sym}_p(x)_\alpha = \sqrt{c_\alpha}\prod_j x_{\alpha_j}`,
    :math:`c_\alpha = p!/\prod_i \alpha_i!`. Both satisfy
    :math:`\langle\psi_p(x),\psi_p(y)\rangle = (x^\top y)^p`.
    """
    x = as_float_tensor(x, "x")
    p = check_degree(p)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape [..., d] with d >= 1, got {tuple(x.shape)}")
    check_finite(x, "x", allow_meta=True)
    return _poly_features(x, p, symmetric, max_bytes)


def _poly_features(x: torch.Tensor, p: int, symmetric: bool, max_bytes: int) -> torch.Tensor:
    """:func:`poly_features` for a checked input: a finite real floating ``x[..., d]`` (``d >= 1``)
    and an int ``p >= 1``. Trusts them; checks only what depends on the sizes (the memory budget,
    the multinomial weights, overflow of the result)."""
    d = x.shape[-1]
    batch = x.shape[:-1]
    num = _num_features(d, p, symmetric)
    _check_budget(math.prod(batch), num, x.element_size(), max_bytes, d, p, symmetric)
    if symmetric:
        index, weight = _symmetric_index_cpu(d, p)
        if not bool(torch.isfinite(weight.to(x.dtype)).all()):
            top = max(0.5 * (math.lgamma(p + 1) - sum(math.lgamma(c + 1) for c in _central_counts(d, p))), 0.0)
            raise FloatingPointError(
                f"poly_features(p={p}, symmetric=True): the multinomial weights √(p!/∏α_i!) reach "
                f"1e{top / math.log(10):.0f}, beyond {x.dtype} (max {torch.finfo(x.dtype).max:.3g}); lower p "
                "or use float64"
            )
        index = index.to(x.device)
        out = x[..., index[:, 0]]  # [..., C]
        for j in range(1, p):
            out = out * x[..., index[:, j]]
        out = out * weight.to(device=x.device, dtype=x.dtype)
    else:
        out = x
        for _ in range(p - 1):
            out = (out[..., :, None] * x[..., None, :]).reshape(*batch, -1)  # [..., d^j * d]
    check_power_overflow(out, x, p, f"poly_features(p={p}) of x {tuple(x.shape)}")
    return out


def poly_features_naive(x, p: int, symmetric: bool = False) -> torch.Tensor:
    """Float64 twin of :func:`poly_features`: one Python loop per coordinate, for ``x[n, d]``."""
    x = as_float_tensor(x, "x").to(torch.float64)
    p = check_degree(p)
    if x.ndim != 2:
        raise ValueError(f"poly_features_naive takes x[n, d], got shape {tuple(x.shape)}")
    n, d = x.shape
    if symmetric:
        tuples = list(itertools.combinations_with_replacement(range(d), p))
    else:
        tuples = list(itertools.product(range(d), repeat=p))
    out = torch.empty(n, len(tuples), dtype=torch.float64)
    for row in range(n):
        for col, idx in enumerate(tuples):
            value = 1.0
            for i in idx:
                value *= float(x[row, i])
            if symmetric:
                coeff = math.factorial(p)
                for _, group in itertools.groupby(idx):
                    coeff //= math.factorial(len(list(group)))
                value *= math.sqrt(coeff)
            out[row, col] = value
    return out


def poly_kernel(q, k, p: int, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    r"""Polynomial kernel matrix :math:`A = (Q K^\top)^{\circ p}`, batched over leading dims.

    Parameters
    ----------
    q : Tensor ``[..., n_q, d]``
    k : Tensor ``[..., n_k, d]``
        Finite real floating values; leading (batch) axes broadcast.
    p : int, ``>= 1``
    max_bytes : int
        Memory budget for the ``[..., n_q, n_k]`` result; checked before the product is formed
        (``ValueError`` naming the size, the budget and the way out).

    Returns
    -------
    Tensor ``[..., n_q, n_k]`` in the promoted dtype of ``q`` and ``k``.

    Raises
    ------
    FloatingPointError
        An entry of :math:`(QK^\top)^{\circ p}` overflows the dtype (the inputs are too large for
        this degree; the message names the largest :math:`|q^\top k|` and the way out). Never
        returns ``inf``.
    """
    q = as_float_tensor(q, "q")
    k = as_float_tensor(k, "k")
    p = check_degree(p)
    if q.ndim < 2 or k.ndim < 2:
        raise ValueError(f"q and k must have shape [..., n, d], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share d (last axis): q has {q.shape[-1]}, k has {k.shape[-1]}")
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"q and k must have broadcastable leading (batch) axes, got {tuple(q.shape[:-2])} and {tuple(k.shape[:-2])}"
        ) from None
    check_finite(q, "q", allow_meta=True)
    check_finite(k, "k", allow_meta=True)
    return _poly_kernel(q, k, p, max_bytes)


def _poly_kernel(q: torch.Tensor, k: torch.Tensor, p: int, max_bytes: int) -> torch.Tensor:
    """:func:`poly_kernel` for checked inputs (finite real floating ``q[..., n_q, d]``,
    ``k[..., n_k, d]`` with broadcastable batch axes, an int ``p >= 1``). Trusts them; checks
    the memory budget and overflow of the result."""
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    dtype = torch.promote_types(q.dtype, k.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    check_memory(
        math.prod(batch) * n_q * n_k * dtype.itemsize,
        what=f"the kernel matrix (QKᵀ)^p of shape {(*batch, n_q, n_k)} ({dtype})",
        way_out="use fewer tokens or heads at a time",
        max_bytes=max_bytes,
    )
    s = q @ k.mT  # [..., n_q, n_k]
    out = s**p
    check_power_overflow(out, s, p, f"poly_kernel: (qᵀk)^{p}")
    return out


#: Bytes of one block of token features formed at a time by :func:`feature_gram_root`.
_GRAM_BLOCK_BYTES = 64 * 2**20

#: Column blocks of the Gram matrix in :func:`feature_gram_root`: only the blocks on or above the
#: diagonal are multiplied, (k + 1) / (2k) of the full product for k blocks.
_GRAM_PARTS = 4



def self_tensor(phi: torch.Tensor) -> torch.Tensor:
    r"""The self-tensored features :math:`\phi\otimes\phi`: ``[..., M]`` → ``[..., M²]`` (materialised).

    :math:`\langle \phi(q)\otimes\phi(q), \phi(k)\otimes\phi(k)\rangle = (\phi(q)\cdot\phi(k))^2 \ge 0`:
    PolySketchFormer's remedy for a signed map (degree ``2p``, a kernel that is never negative).
    """
    return (phi[..., :, None] * phi[..., None, :]).flatten(-2)  # [..., M, M] -> [..., M²]

def feature_gram_root(x, p: int, symmetric: bool = False, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    r"""A square root ``R`` of the features' Gram matrix, :math:`R^\top R = \psi_p(X)^\top\psi_p(X)`.

    Any such ``R`` stands in for the tokens in every quantity that is a sum over tokens of a
    bilinear form in :math:`\psi_p(x)` (:math:`\psi_p(X) = UR` with orthonormal ``U``), with at
    most ``D`` rows whatever the number of tokens ``n``.

    Parameters
    ----------
    x : Tensor ``[..., n, d]``
    p : int
    symmetric : bool
        Symmetric features (``D = C(d+p-1, p)``, as :func:`poly_features`) or full (``D = d**p``).
    max_bytes : int
        Budget for ``G`` and its factor (``2 · D²`` float64 per head), checked first.

    Returns
    -------
    Tensor ``[..., N, D]``, float64. :math:`G = \psi^\top\psi` is summed over token blocks (of
    at most 64 MiB of features), multiplying only its blocks on and above the diagonal. When
    every head's ``G`` is numerically positive definite (Cholesky succeeds with every pivot²
    above ``D · eps · max G_jj``), ``R = Lᵀ`` (upper triangular, ``G = LLᵀ``, ``N = D``; ``D³/3``
    multiply-adds against several ``D³`` for an eigendecomposition).
    Otherwise :math:`R = \Lambda^{1/2}V^\top` from the eigendecomposition, without the
    eigenvalues at most ``D · eps · λ_max`` (round-off of ``G``): ``N`` is the largest number
    kept over the heads, the other heads' extra rows are 0 (they add nothing to any sum). Either
    way :math:`R^\top R = G` to about ``D · eps · ‖G‖``; the tests compare with
    :func:`poly_features_naive`.
    """
    x = as_float_tensor(x, "x").to(torch.float64)
    p = check_degree(p)
    if x.ndim < 2 or x.shape[-1] == 0:
        raise ValueError(f"x must have shape [..., n, d] with d >= 1, got {tuple(x.shape)}")
    check_finite(x, "x")
    return _feature_gram_root(x, p, symmetric, max_bytes)


def _feature_gram_root(x: torch.Tensor, p: int, symmetric: bool, max_bytes: int) -> torch.Tensor:
    """:func:`feature_gram_root` for a checked input (finite float64 ``x[..., n, d]``, an int
    ``p >= 1``); trusts it, checks the memory budget and overflow of the Gram matrix."""
    *batch, n, d = x.shape
    dim = _num_features(d, p, symmetric)
    heads = math.prod(batch)
    check_memory(16 * heads * dim * dim, what=f"the Gram matrix of ψ_{p} and its factor ({heads} x {dim} x {dim} float64, twice)",
                 way_out="use fewer heads at a time or a smaller d or p", max_bytes=max_bytes)
    flat = x.reshape(heads, n, d)
    block = max(1, min(_GRAM_BLOCK_BYTES, max_bytes // 8) // max(1, 8 * heads * dim))  # tokens per block
    gram = torch.zeros(heads, dim, dim, dtype=torch.float64, device=x.device)
    edges = [dim * i // _GRAM_PARTS for i in range(_GRAM_PARTS + 1)]  # column blocks of G
    for lo in range(0, n, block):
        psi = _poly_features(flat[:, lo : lo + block], p, symmetric, max_bytes)  # [B, b, D]
        for a, b in zip(edges[:-1], edges[1:]):  # block row a..b from its diagonal block on
            gram[:, a:b, a:] += psi[..., a:b].mT @ psi[..., a:]
    gram = gram.triu() + gram.triu(1).mT  # G is symmetric: mirror the upper triangle
    bad = ~torch.isfinite(gram).flatten(-2).all(-1)  # [B]
    if bool(bad.any()):
        raise FloatingPointError(
            f"feature_gram_root: ψ_{p}(x)ᵀψ_{p}(x) overflows float64 for {int(bad.sum())} head(s) (first flattened "
            f"batch index {int(bad.nonzero()[0])}); rescale x (x · d^-1/4 is the usual choice)")
    eps = dim * torch.finfo(torch.float64).eps
    chol, info = torch.linalg.cholesky_ex(gram)  # G = L Lᵀ
    pivots = chol.diagonal(dim1=-2, dim2=-1) ** 2  # [B, D]
    if bool((info == 0).all()) and bool((pivots > eps * gram.diagonal(dim1=-2, dim2=-1).amax(-1, keepdim=True)).all()):
        rows = chol.mT  # [B, D, D], upper triangular
    else:  # (numerically) singular: keep the eigen-directions above round-off
        lam, vec = torch.linalg.eigh(gram)  # ascending
        lam, vec = lam.flip(-1), vec.flip(-1)  # descending
        keep = lam > eps * lam[:, :1].clamp_min(0)  # [B, D]
        count = max(1, int(keep.sum(-1).max()))
        rows = (lam[:, :count].clamp_min(0).sqrt() * keep[:, :count])[..., None] * vec[..., :count].mT  # [B, N, D]
    return rows.reshape(*batch, rows.shape[-2], dim)


def symmetric_to_full(w, d: int, p: int) -> torch.Tensor:
    r"""Map a projector in the symmetric basis to the equivalent one in the full basis.

    Parameters
    ----------
    w : Tensor ``[..., C(d+p-1, p), m]``
        Columns act on symmetric features.

    Returns
    -------
    Tensor ``[..., d**p, m]``: the symmetric tensor with
    :math:`W_{(i_1..i_p)} = W^{sym}_\alpha / \sqrt{c_\alpha}` for every tuple in multiset α.

    Notes
    -----
    For every ``x``, :math:`\psi_p(x)^\top W = \psi^{sym}_p(x)^\top W^{sym}` (each α is hit by
    :math:`c_\alpha` tuples), and the map is an isometry: :math:`\|W\|_F = \|W^{sym}\|_F`.
    It is the minimum-norm full-basis projector with those features.
    """
    w = as_float_tensor(w, "w")
    index, weight = symmetric_index(d, p)
    if w.ndim < 2 or w.shape[-2] != index.shape[0]:
        raise ValueError(
            f"w must have shape [..., C(d+p-1, p)={index.shape[0]}, m] for d={d}, p={p}, "
            f"got {tuple(w.shape)}"
        )
    flat = _tuple_to_multiset(d, p).to(w.device)  # [d^p] position of each tuple's multiset
    scaled = w / weight.to(device=w.device, dtype=w.dtype)[:, None]
    return scaled[..., flat, :]


def full_to_symmetric(w, d: int, p: int) -> torch.Tensor:
    r"""Map a full-basis projector ``w[..., d**p, m]`` to the symmetric basis.

    Returns ``[..., C(d+p-1, p), m]`` with :math:`W^{sym}_\alpha = \sqrt{c_\alpha}\,
    \mathrm{mean}_{t \in \alpha} W_t`, so that :math:`\psi^{sym}_p(x)^\top W^{sym} =
    \psi_p(x)^\top W` for every ``x``; the inverse of :func:`symmetric_to_full` on symmetric ``W``.
    """
    w = as_float_tensor(w, "w")
    index, weight = symmetric_index(d, p)
    if w.ndim < 2 or w.shape[-2] != d**p:
        raise ValueError(f"w must have shape [..., d**p={d**p}, m] for d={d}, p={p}, got {tuple(w.shape)}")
    flat = _tuple_to_multiset(d, p).to(w.device)
    sums = torch.zeros(*w.shape[:-2], index.shape[0], w.shape[-1], dtype=w.dtype, device=w.device)
    sums.index_add_(w.ndim - 2, flat, w)  # Σ over the tuples of each multiset
    counts = (weight**2).to(device=w.device, dtype=w.dtype)  # c_α tuples per multiset
    return sums / counts[:, None] * weight.to(device=w.device, dtype=w.dtype)[:, None]


@functools.lru_cache(maxsize=64)
def _tuple_to_multiset(d: int, p: int) -> torch.Tensor:
    """For each full index tuple (row-major), the row of its multiset in :func:`symmetric_index`."""
    index, _ = symmetric_index(d, p)
    position = {tuple(row): a for a, row in enumerate(index.tolist())}
    tuples = itertools.product(range(d), repeat=p)
    return torch.tensor([position[tuple(sorted(t))] for t in tuples], dtype=torch.long)
