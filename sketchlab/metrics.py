r"""Error metrics between an approximate and an exact kernel matrix.

All functions reduce over the last two axes and keep leading (batch) axes, so ``[L, H, n, n]``
inputs give ``[L, H]`` results. Inputs are compared in float64.
"""

from __future__ import annotations

import torch

from ._validation import as_float_tensor

__all__ = ["attention_error", "causal_attention", "optimality_ratio", "rel_fro", "rel_mae"]


def _pair(approx, exact) -> tuple[torch.Tensor, torch.Tensor]:
    approx = as_float_tensor(approx, "approx").to(torch.float64)
    exact = as_float_tensor(exact, "exact").to(torch.float64)
    if approx.shape != exact.shape or approx.ndim < 2:
        raise ValueError(
            f"approx and exact must have the same shape [..., n_q, n_k], got "
            f"{tuple(approx.shape)} and {tuple(exact.shape)}"
        )
    zero = exact.abs().amax((-2, -1)) == 0  # [...]
    if bool(zero.any()):
        first = tuple(int(i) for i in zero.nonzero()[0]) if zero.ndim else ()
        raise ValueError(
            f"exact must not be all zeros (relative errors are undefined): {int(zero.sum())} zero "
            f"matrix/matrices in the batch, the first at batch index {first}"
        )
    return approx, exact


def rel_mae(approx, exact) -> torch.Tensor:
    r"""Relative mean absolute error :math:`\sum|\hat A - A| / \sum |A|`.

    This is *our* definition of the LLoPS paper's "relative mean absolute error" (the paper's
    appendix, which defines it exactly, is not available to us): the ratio of the mean absolute
    error to the mean absolute kernel value, over all ``n_q × n_k`` entries.
    """
    approx, exact = _pair(approx, exact)
    return (approx - exact).abs().sum((-2, -1)) / exact.abs().sum((-2, -1))


def rel_fro(approx, exact) -> torch.Tensor:
    r"""Relative Frobenius error :math:`\|\hat A - A\|_F / \|A\|_F`."""
    approx, exact = _pair(approx, exact)
    return torch.linalg.matrix_norm(approx - exact) / torch.linalg.matrix_norm(exact)


def optimality_ratio(approx, exact, tail) -> torch.Tensor:
    r"""Error against the Theorem 3.1 floor: :math:`\|\hat A - A\|_F / \sqrt{\mathrm{tail}}`.

    ``tail`` is :math:`\sum_{i>m}\sigma_i(A)^2` (see :func:`sketchlab.tail_bound`), shaped like the
    batch axes. A ratio of 1 is optimal; no size-``m`` sketch goes below 1 on the data it is
    measured on. Where ``tail`` is 0 (``m >= rank A``) the ratio is ``inf`` unless the error is
    also exactly 0, where it is 1 (the exact kernel is the optimum).
    """
    approx, exact = _pair(approx, exact)
    tail = torch.as_tensor(tail, dtype=torch.float64, device=approx.device)
    if tail.shape != approx.shape[:-2] or not bool((tail >= 0).all()):  # also rejects NaN
        raise ValueError(
            f"tail must be non-negative (not NaN) with the batch shape {tuple(approx.shape[:-2])}, "
            f"got shape {tuple(tail.shape)} with minimum {tail.min().item() if tail.numel() else None}"
        )
    err = torch.linalg.matrix_norm(approx - exact)
    return torch.where((err == 0) & (tail == 0), torch.ones_like(err), err / tail.sqrt())


def causal_attention(kernel, v, *, eps: float = 1e-6, normalize: str = "sum", segments=None) -> torch.Tensor:
    r"""Causal kernel attention :math:`((A \odot M) V) / ((A \odot M)\mathbf 1 + \varepsilon)` (or unnormalised).

    The one definition of kernel attention in sketchlab:
    :func:`sketchlab.attention.kernel_attention_naive` with ``causal=True``.

    Parameters
    ----------
    kernel : Tensor ``[..., n, n]``
        Kernel scores between queries (rows) and keys (columns) of the same tokens.
    v : Tensor ``[..., n, d_v]``
    eps : float
        Added to the normaliser.
    normalize : ``"sum"`` or ``"none"``
        ``"sum"`` divides by the masked row sums (+ eps): only safe for non-negative kernels (a
        signed sketch's row sums can be ``≤ 0``); ``"none"`` returns :math:`(A \odot M)V`.
    segments : None, int or sequence of int
        Lengths of the sequences joined along the token axis (they sum to ``n``; an int is the
        common length): ``M`` never lets a token attend across them. The shipped dump
        ``data/mqar_softmax_qk.safetensors`` joins two 256-token sequences; its metadata key
        ``tokens`` holds ``[256, 256]`` (:func:`sketchlab.attention.dump_segments` reads it).

    Returns
    -------
    Tensor ``[..., n, d_v]`` in float64. ``M`` is the causal (lower-triangular) mask, block-diagonal
    over ``segments``.
    """
    from .attention.reference import kernel_attention_naive

    kernel = as_float_tensor(kernel, "kernel")
    if kernel.ndim < 2 or kernel.shape[-2] != kernel.shape[-1]:
        raise ValueError(f"kernel must be [..., n, n] (square: queries and keys of the same tokens), got {tuple(kernel.shape)}")
    return kernel_attention_naive(kernel, v, causal=True, normalize=normalize, eps=eps, segments=segments)


def attention_error(approx, exact, v, *, eps: float = 1e-6, normalize: str = "sum", segments=None) -> torch.Tensor:
    r"""Relative error of the causal attention output.

    :math:`\|O(\hat A) - O(A)\|_F / \|O(A)\|_F` with :math:`O` from :func:`causal_attention`
    (same ``eps``, ``normalize`` and ``segments``), per batch element.
    """
    approx, exact = _pair(approx, exact)
    out_hat = causal_attention(approx, v, eps=eps, normalize=normalize, segments=segments)
    out = causal_attention(exact, v, eps=eps, normalize=normalize, segments=segments)
    return torch.linalg.matrix_norm(out_hat - out) / torch.linalg.matrix_norm(out)
