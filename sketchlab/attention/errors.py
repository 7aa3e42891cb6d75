r"""The error of the causal attention output of an approximate kernel against the exact one.

Here rather than in :mod:`sketchlab.metrics` because it uses the attention package's one
definition of kernel attention (:func:`sketchlab.attention.reference.kernel_attention_naive`):
:mod:`sketchlab.metrics` stays below the sketches and fits, and this module above them.
"""

from __future__ import annotations

import torch

from .._validation import as_float_tensor
from ..metrics import check_approx_exact
from .reference import kernel_attention_naive

__all__ = ["attention_error", "causal_attention"]


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
    kernel = as_float_tensor(kernel, "kernel")
    if kernel.ndim < 2 or kernel.shape[-2] != kernel.shape[-1]:
        raise ValueError(f"kernel must be [..., n, n] (square: queries and keys of the same tokens), got {tuple(kernel.shape)}")
    return kernel_attention_naive(kernel, v, causal=True, normalize=normalize, eps=eps, segments=segments)


def attention_error(approx, exact, v, *, eps: float = 1e-6, normalize: str = "sum", segments=None) -> torch.Tensor:
    r"""Relative error of the causal attention output.

    :math:`\|O(\hat A) - O(A)\|_F / \|O(A)\|_F` with :math:`O` from :func:`causal_attention`
    (same ``eps``, ``normalize`` and ``segments``), per batch element.
    """
    approx, exact = check_approx_exact(approx, exact)
    out_hat = causal_attention(approx, v, eps=eps, normalize=normalize, segments=segments)
    out = causal_attention(exact, v, eps=eps, normalize=normalize, segments=segments)
    return torch.linalg.matrix_norm(out_hat - out) / torch.linalg.matrix_norm(out)
