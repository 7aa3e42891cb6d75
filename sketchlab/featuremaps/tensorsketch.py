r"""TensorSketch (Pham & Pagh 2013): CountSketch of each factor, multiplied in the Fourier domain.

With ``p`` independent CountSketches :math:`C_j(x) \in \mathbb R^m`,
:math:`C_j(x)_c = \sum_{i : h_j(i) = c} s_j(i)\, x_i` (hashes :math:`h_j : [d] \to [m]`, signs
:math:`s_j : [d] \to \{\pm 1\}`, all uniform and independent), the sketch is their circular
convolution

.. math:: \phi(x) = \mathcal F^{-1}\Big(\prod_{j=1}^p \mathcal F\, C_j(x)\Big),

i.e. the CountSketch of :math:`x^{\otimes p}` under the hash :math:`(i_1..i_p) \mapsto \sum_j
h_j(i_j) \bmod m` and sign :math:`\prod_j s_j(i_j)`. It is unbiased,
:math:`E\langle\phi(x),\phi(y)\rangle = (x^\top y)^p`, with variance :math:`O(\|x\|^{2p}\|y\|^{2p}/m)`.
This is scikit-learn's ``PolynomialCountSketch(gamma=1, coef0=0, degree=p, n_components=m)``:
``index_hash`` / ``sign_hash`` play the roles of its ``indexHash_`` / ``bitHash_``.

References
----------
Pham, Pagh. *Fast and scalable polynomial kernels via explicit feature maps*, KDD 2013.
"""

from __future__ import annotations

import itertools
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
from ._common import check_dtype, check_features_finite, make_generator
from .base import FeatureMap, FittedMaps

__all__ = ["TensorSketchMap", "count_sketch_matrix", "tensorsketch_features", "tensorsketch_features_naive"]


def _check_hashes(index_hash, sign_hash, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    index_hash = torch.as_tensor(index_hash)
    sign_hash = torch.as_tensor(sign_hash)
    if index_hash.dtype.is_floating_point or index_hash.dtype == torch.bool or index_hash.dtype.is_complex:
        raise TypeError(f"index_hash must be an integer tensor, got {index_hash.dtype}")
    if index_hash.ndim < 2 or index_hash.shape != sign_hash.shape or 0 in index_hash.shape:
        raise ValueError(
            f"index_hash and sign_hash must share a shape [..., p, d] with p, d >= 1, got "
            f"{tuple(index_hash.shape)} and {tuple(sign_hash.shape)}"
        )
    if bool(((index_hash < 0) | (index_hash >= m)).any()):
        raise ValueError(f"index_hash values must lie in [0, m) = [0, {m}), got range "
                         f"[{int(index_hash.min())}, {int(index_hash.max())}]")
    if bool(((sign_hash != 1) & (sign_hash != -1)).any()):
        raise ValueError("sign_hash values must be +1 or -1")
    return index_hash.long(), sign_hash


def _check_matrices_budget(hashes: int, m: int, dtype: torch.dtype) -> None:
    """The dense CountSketch matrices ``[..., p, d, m]`` (``hashes = Π batch · p · d``) within the budget."""
    check_memory(
        hashes * m * dtype.itemsize,
        what=f"the dense CountSketch matrices ({hashes} hashes x m={m}, {dtype})",
        way_out="use a smaller degree p or sketch size m, or fewer heads at a time",
    )


def count_sketch_matrix(index_hash, sign_hash, m: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense CountSketch matrices ``S[..., p, d, m]`` with ``S[j, i, h_j(i)] = s_j(i)`` and zeros elsewhere."""
    m = check_positive_int(m, "m (the sketch size)")
    index_hash, sign_hash = _check_hashes(index_hash, sign_hash, m)
    onehot = torch.nn.functional.one_hot(index_hash, m).to(dtype)  # [..., p, d, m]
    return onehot * sign_hash.to(dtype)[..., None]


def tensorsketch_features(x: torch.Tensor, matrices: torch.Tensor, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    r"""TensorSketch features from dense CountSketch matrices.

    Parameters
    ----------
    x : Tensor ``[..., n, d]``
    matrices : Tensor ``[..., p, d, m]``
        From :func:`count_sketch_matrix`; leading axes broadcast against ``x``'s.

    Returns
    -------
    Tensor ``[..., n, m]``: :math:`\mathcal F^{-1}(\prod_j \mathcal F(x S_j))` (real FFTs along the
    feature axis, so the product is a circular convolution of length ``m``).

    Raises
    ------
    ValueError
        ``matrices`` is not ``[..., p, d, m]`` or ``x`` is not ``[..., n, d]`` with the same ``d``;
        the ``p`` CountSketches ``[..., p, n, m]`` would exceed ``max_bytes``.
    FloatingPointError
        The product of the ``p`` spectra overflows the dtype (inputs too large for this degree).
    """
    x = as_float_tensor(x, "x")
    matrices = as_float_tensor(matrices, "matrices")
    if matrices.ndim < 3 or 0 in matrices.shape[-3:]:
        raise ValueError(f"matrices must have shape [..., p, d, m] with p, d, m >= 1, got {tuple(matrices.shape)}")
    if x.ndim < 2 or x.shape[-1] != matrices.shape[-2]:
        raise ValueError(
            f"x must have shape [..., n, d] with d = matrices.shape[-2] = {matrices.shape[-2]} "
            f"(matrices [..., p, d, m] = {tuple(matrices.shape)}), got x of shape {tuple(x.shape)}"
        )
    check_finite(x, "x", allow_meta=True)
    p, m = matrices.shape[-3], matrices.shape[-1]
    batch = torch.broadcast_shapes(x.shape[:-2], matrices.shape[:-3])
    check_memory(
        math.prod(batch) * p * x.shape[-2] * m * matrices.element_size(),
        what=f"the {p} CountSketches of {x.shape[-2]} tokens ({(*batch, p, x.shape[-2], m)}, {matrices.dtype})",
        way_out="use fewer tokens or heads at a time, or a smaller p or m",
        max_bytes=max_bytes,
    )
    counts = x.to(matrices.dtype)[..., None, :, :] @ matrices  # [..., p, n, m] CountSketches C_j(x)
    spectrum = torch.fft.rfft(counts, dim=-1).prod(dim=-3)  # [..., n, m//2+1]
    out = torch.fft.irfft(spectrum, n=m, dim=-1)  # [..., n, m]
    return check_features_finite(out, x, p, "TensorSketch")


def tensorsketch_features_naive(x, index_hash, sign_hash, m: int) -> torch.Tensor:
    """Float64 twin for ``x[n, d]`` and unbatched hashes ``[p, d]``: the CountSketch of ``x^{⊗p}``
    written out over all ``d^p`` index tuples."""
    x = as_float_tensor(x, "x").to(torch.float64)
    m = check_positive_int(m, "m (the sketch size)")
    index_hash, sign_hash = _check_hashes(index_hash, sign_hash, m)
    if x.ndim != 2 or index_hash.ndim != 2 or index_hash.shape[1] != x.shape[1]:
        raise ValueError(f"takes x[n, d] and hashes [p, d], got {tuple(x.shape)}, {tuple(index_hash.shape)}")
    p, d = index_hash.shape
    out = torch.zeros(x.shape[0], m, dtype=torch.float64)
    for idx in itertools.product(range(d), repeat=p):
        bucket = sum(int(index_hash[j, i]) for j, i in enumerate(idx)) % m
        value = torch.ones(x.shape[0], dtype=torch.float64)
        for j, i in enumerate(idx):
            value = value * float(sign_hash[j, i]) * x[:, i]
        out[:, bucket] += value
    return out


class TensorSketchMap(FeatureMap):
    r"""TensorSketch per head with fixed hashes (``"tensorsketch"``; one map for queries and keys).

    Parameters
    ----------
    index_hash : integer Tensor ``[H, p, D]`` with values in ``[0, m)``
    sign_hash : Tensor ``[H, p, D]`` of ±1
        One independent pair of hashes per head (:attr:`per_head_parameters`: :meth:`select_heads` slices them).
    m : int
        Number of features (FFT length).
    dtype : torch.dtype
        Dtype of the dense CountSketch matrices and of the features.
    device : torch.device, str or None
        Where the hashes and matrices are stored (after validation); ``None`` keeps ``index_hash``'s device.

    Notes
    -----
    Buffers ``index_hash``, ``sign_hash`` and ``matrices [H, p, D, m]``
    (:func:`count_sketch_matrix`, what :func:`tensorsketch_features` multiplies by), saved with a model.
    :attr:`num_parameters` counts the hash values, ``2·p·D`` per head (the matrices are derived from them).
    """

    def __init__(self, index_hash, sign_hash, m: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        m = check_positive_int(m, "m (the sketch size)")
        index_hash, sign_hash = _check_hashes(index_hash, sign_hash, m)
        if index_hash.ndim != 3:
            raise ValueError(f"index_hash and sign_hash must have shape [H, p, D], got {tuple(index_hash.shape)}")
        dtype = check_dtype(dtype)
        _check_matrices_budget(index_hash.numel(), m, dtype)
        self.heads, _, self.head_dim = index_hash.shape
        self.register_buffer("index_hash", index_hash.to(device))
        self.register_buffer("sign_hash", sign_hash.to(device))
        # built where the hashes were validated, then moved (one copy of [H, p, D, m])
        self.register_buffer("matrices", count_sketch_matrix(index_hash, sign_hash, m, dtype).to(device))

    @classmethod
    def draw(cls, heads: int, head_dim: int, *, p: int, m: int, seed: int | None = None,
             generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> TensorSketchMap:
        """Draw uniform hashes and signs once, independent per head.

        The hashes are drawn on the CPU ``generator`` (or one seeded with ``seed``: a seed gives the same map on
        every device), then moved to ``device`` (default: CPU), where the dense CountSketch matrices are built.
        """
        heads, d = check_positive_int(heads, "heads"), check_positive_int(head_dim, "head_dim")
        p = check_degree(p)
        m = check_positive_int(m, "m (the sketch size)")
        dtype = check_dtype(dtype)
        _check_matrices_budget(heads * p * d, m, dtype)  # before drawing the hashes
        gen = make_generator(seed, generator)
        index_hash = torch.randint(0, m, (heads, p, d), generator=gen)
        sign_hash = torch.randint(0, 2, (heads, p, d), generator=gen) * 2 - 1
        return cls(index_hash, sign_hash, m, dtype=dtype, device=device)

    @property
    def num_features(self) -> int:
        return self.matrices.shape[-1]

    @property
    def degree(self) -> int:
        return self.index_hash.shape[-2]

    @property
    def num_parameters(self) -> int:
        return self.index_hash.numel() + self.sign_hash.numel()

    def _features(self, x):
        return tensorsketch_features(x.transpose(1, 2), self.matrices).transpose(1, 2)  # [B, T, H, M]

    def _features_naive(self, x, head):
        return tensorsketch_features_naive(x, self.index_hash[head].cpu(), self.sign_hash[head].cpu(),
                                           self.num_features)


def _fit_tensorsketch(q, k, *, p: int, m: int, seed: int = 0) -> FittedMaps:
    """``fit_sketch("tensorsketch", ...)``: data-independent; one independent draw per head of ``prod(batch)``."""
    fmap = TensorSketchMap.draw(math.prod(q.shape[:-2]), q.shape[-1], p=p, m=m, seed=seed, dtype=q.dtype,
                                device=q.device)
    return FittedMaps(fmap, fmap, {"steps": 0, "converged": True})
