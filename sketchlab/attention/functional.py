r"""Functional attention API (layout ``[B, T, H, D]``): LLoPS, any sketch, exact polynomial, softmax.

Backends of :func:`llops_attention`:

``"triton"``
    the fused kernel :func:`sketchlab.attention.triton.llops_attention_triton` (CUDA, or the
    Triton interpreter on the CPU when ``TRITON_INTERPRET=1``);
``"torch"``
    :func:`sketchlab.attention.chunked.llops_attention_chunked` (chunked PyTorch);
``"reference"``
    :func:`sketchlab.attention.llops_attention_naive` (dense, float64; tests and small problems);
``"auto"``
    Triton when ``q`` is on CUDA and ``triton`` imports, otherwise torch.

Normalisation semantics are the same in every backend (see :mod:`sketchlab.attention.reference`).
"""

from __future__ import annotations

import importlib.util

import torch

from .._validation import DEFAULT_MAX_BYTES, check_degree, check_memory, check_positive_int, check_real
from ..sketch import Sketch
from ._checks import check_eps, check_flag, check_normalize, check_qkv, check_theta
from .chunked import DEFAULT_CHUNK_SIZE, feature_attention, llops_attention_chunked
from .reference import feature_attention_naive, llops_attention_naive

__all__ = ["BACKENDS", "llops_attention", "poly_attention", "resolve_backend", "sketch_attention", "softmax_attention"]

#: Accepted values of ``backend``.
BACKENDS = ("auto", "triton", "torch", "reference")


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend, device: torch.device) -> str:
    """The backend actually used for ``backend`` on ``device`` (``"auto"`` resolved)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if backend == "triton" and not _triton_importable():
        raise ValueError("backend='triton' needs the triton package, which is not importable here; "
                         "install triton or use backend='torch'")
    return backend


def llops_attention(q, k, v, theta_q, theta_k, *, causal: bool = True, normalize: str = "sum",
                    non_negative: bool = False, eps: float = 1e-6, backend: str = "auto",
                    chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    r"""Causal (or not) linear attention through per-head LLoPS feature maps.

    Parameters
    ----------
    q : Tensor ``[B, T, H, D]``
    k : Tensor ``[B, S, H, D]``
    v : Tensor ``[B, S, H, Dv]``
        One dtype and one device for all three.
    theta_q, theta_k : Tensor ``[H, t, p, D, M]``
        One LLoPS map per head (same shape, dtype and device as ``q``; finite).
    causal : bool
        ``s ≤ t`` only (``T == S``).
    normalize : ``"none"`` or ``"sum"``
        See :mod:`sketchlab.attention.reference`; ``"sum"`` is safe only for non-negative maps
        (rank-1 LLoPS with even ``p`` and tied Θ, or ``non_negative=True``).
    non_negative : bool
        Self-tensored features ``φ ⊗ φ``: kernel :math:`(\phi_Q(q)\cdot\phi_K(k))^2 \ge 0`,
        degree ``2p``, ``M²`` features.
    eps : float >= 0
        Added to the normaliser.
    backend : ``"auto"``, ``"triton"``, ``"torch"`` or ``"reference"``
        See the module docstring.
    chunk_size : int
        Tokens per chunk of the torch backend.

    Returns
    -------
    Tensor ``[B, T, H, Dv]``:
    :math:`o_t = \sum_{s} a_{ts} v_s\,[/(\sum_s a_{ts} + \varepsilon)]` with
    :math:`a_{ts} = \phi_Q(q_t)\cdot\phi_K(k_s)`,
    :math:`\phi(x)_i = \sum_r \prod_j \langle\theta_{r,j,:,i}, x\rangle`.
    The reference backend returns float64. Gradients reach ``q, k, v, theta_q, theta_k``.
    """
    check_flag(causal, "causal")
    check_flag(non_negative, "non_negative")
    normalize, eps = check_normalize(normalize), check_eps(eps)
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    q, k, v = check_qkv(q, k, v, causal=causal)
    theta_q, theta_k = check_theta(theta_q, theta_k, heads=q.shape[2], dim=q.shape[3], like=q)
    backend = resolve_backend(backend, q.device)
    if backend == "reference":
        return llops_attention_naive(q, k, v, theta_q, theta_k, causal=causal, normalize=normalize,
                                     non_negative=non_negative, eps=eps)
    if backend == "torch":
        return llops_attention_chunked(q, k, v, theta_q, theta_k, causal=causal, normalize=normalize,
                                       non_negative=non_negative, eps=eps, chunk_size=chunk_size, validate=False)
    from .triton import llops_attention_triton  # lazy: triton is optional

    return llops_attention_triton(q, k, v, theta_q, theta_k, causal=causal, normalize=normalize,
                                  non_negative=non_negative, eps=eps)


def _head_params(theta: torch.Tensor, heads: int, name: str) -> torch.Tensor:
    """LLoPS ``theta[..., t, p, D, M]`` with leading shape ``[]``, ``[1]``, ``[H]`` or ``[1, H]`` → ``[H, t, p, D, M]``."""
    lead = tuple(theta.shape[:-4])
    squeezed = tuple(s for s in lead if s != 1) if len(lead) > 1 else lead
    if squeezed in ((), (1,)):
        return theta.reshape(theta.shape[-4:]).expand(heads, *theta.shape[-4:])
    if squeezed == (heads,):
        return theta.reshape(heads, *theta.shape[-4:])
    raise ValueError(
        f"sketch {name} has leading (batch) shape {lead}; sketch_attention needs one map per head: "
        f"[], [1], [H={heads}] or [1, H] (select one layer of an [L, H] sketch first)"
    )


def sketch_attention(q, k, v, sketch: Sketch, *, causal: bool = True, normalize: str = "sum",
                     non_negative: bool = False, eps: float = 1e-6, backend: str = "auto",
                     chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    r"""Attention through any :class:`sketchlab.Sketch`: scores :math:`\phi_Q(q_t)\cdot\phi_K(k_s)`.

    Parameters
    ----------
    q : Tensor ``[B, T, H, D]``
    k : Tensor ``[B, S, H, D]``
    v : Tensor ``[B, S, H, Dv]``
    sketch : Sketch
        Its maps act on ``x[..., n, D]``; its parameters' leading (batch) shape must be ``[]``,
        ``[H]`` or broadcast against ``[B, H]`` (one map per head). An :class:`sketchlab.LLoPS`
        goes to :func:`llops_attention` (every backend, Θ cast to ``q``'s dtype); any other
        sketch computes ``features_q``/``features_k`` (its own dtype, promoted with ``v``'s) and
        runs :func:`sketchlab.attention.feature_attention` (``backend`` ``"auto"``/``"torch"``)
        or the dense float64 twin (``"reference"``); there is no fused kernel for them.
    causal, normalize, non_negative, eps, chunk_size
        As in :func:`llops_attention`.

    Returns
    -------
    Tensor ``[B, T, H, Dv]``.
    """
    from ..llops import LLoPS

    if not isinstance(sketch, Sketch):
        raise TypeError(f"sketch must be a sketchlab.Sketch, got {type(sketch).__name__}")
    check_flag(causal, "causal")
    q, k, v = check_qkv(q, k, v, causal=causal)
    if q.shape[-1] != _sketch_dim(sketch, q.shape[-1]):
        raise ValueError(f"sketch acts on d={_sketch_dim(sketch, q.shape[-1])} but q and k have D={q.shape[-1]}")
    H = q.shape[2]
    if isinstance(sketch, LLoPS):
        theta_k = sketch.theta_q if sketch.theta_k is None else sketch.theta_k
        tq = _head_params(sketch.theta_q, H, "theta_q").to(q.dtype)
        tk = _head_params(theta_k, H, "theta_k").to(q.dtype)
        return llops_attention(q, k, v, tq, tk, causal=causal, normalize=normalize, non_negative=non_negative,
                               eps=eps, backend=backend, chunk_size=chunk_size)
    backend = resolve_backend(backend, q.device)
    if backend == "triton":
        raise ValueError(f"backend='triton' fuses only LLoPS maps; {type(sketch).__name__} runs with backend='torch' "
                         "(its features through the chunked path) or 'reference'")
    fq = sketch.features_q(q.transpose(1, 2))  # [B, H, T, M]
    fk = sketch.features_k(k.transpose(1, 2))  # [B, H, S, M]
    if fq.shape[:2] != (q.shape[0], H) or fq.shape[-2] != q.shape[1]:
        raise ValueError(
            f"{type(sketch).__name__} features of q have shape {tuple(fq.shape)}, expected [B={q.shape[0]}, H={H}, "
            f"T={q.shape[1]}, M]: its batch shape must be [] or [H] (select one layer of an [L, H] sketch first)"
        )
    dtype = torch.promote_types(fq.dtype, v.dtype)
    fq, fk, vv = fq.to(dtype).transpose(1, 2), fk.to(dtype).transpose(1, 2), v.to(dtype)  # [B, T|S, H, ·]
    if backend == "reference":
        return feature_attention_naive(fq, fk, vv, causal=causal, normalize=normalize, eps=eps,
                                       non_negative=non_negative)
    return feature_attention(fq, fk, vv, causal=causal, normalize=normalize, eps=eps, non_negative=non_negative,
                             chunk_size=chunk_size)


def _sketch_dim(sketch: Sketch, default: int) -> int:
    """The input dimension a sketch's maps take, where it records one (else ``default``)."""
    value = getattr(sketch, "d", None)  # OptimalSketch, PolySketch
    if isinstance(value, int):
        return value
    theta = getattr(sketch, "theta_q", None)
    if isinstance(theta, torch.Tensor):
        return theta.shape[-2]
    return default


def poly_attention(q, k, v, p: int, *, causal: bool = True, normalize: str = "sum", eps: float = 1e-6,
                   block_size: int = 256, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    r"""Exact polynomial attention, scores :math:`a_{ts} = (q_t\cdot k_s)^p`, blocked over queries.

    Quadratic time (``T·S·D``); memory ``O(block_size · S)`` per (batch, head) for the scores of
    one query block, never ``T × S`` at once. ``q [B, T, H, D]``, ``k [B, S, H, D]``,
    ``v [B, S, H, Dv]`` → ``[B, T, H, Dv]``; no scaling applied. Causal blocks read only the keys
    up to their last query. ``normalize="sum"`` is safe for even ``p`` only.
    """
    p = check_degree(p)
    check_flag(causal, "causal")
    normalize, eps = check_normalize(normalize), check_eps(eps)
    block_size = check_positive_int(block_size, "block_size")
    q, k, v = check_qkv(q, k, v, causal=causal)
    B, T, H, _ = q.shape
    check_memory(B * H * block_size * k.shape[1] * q.element_size(),
                 what=f"the scores of one query block ([B={B}, H={H}, {block_size}, S={k.shape[1]}])",
                 way_out="lower block_size", max_bytes=max_bytes)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T|S, ·]
    outs = []
    for a in range(0, T, block_size):
        b = min(a + block_size, T)
        stop = b if causal else k.shape[1]
        scores = (qt[:, :, a:b] @ kt[:, :, :stop].mT) ** p  # [B, H, b - a, stop]
        if causal:
            rows = torch.arange(a, b, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(stop, device=q.device)[None, :] > rows, 0.0)
        out = scores @ vt[:, :, :stop]  # [B, H, b - a, Dv]
        if normalize == "sum":
            out = out / (scores.sum(-1, keepdim=True) + eps)
        outs.append(out)
    return torch.cat(outs, 2).transpose(1, 2)  # [B, T, H, Dv]


def softmax_attention(q, k, v, *, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    r"""Softmax attention through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).

    ``q [B, T, H, D]``, ``k [B, S, H, D]``, ``v [B, S, H, Dv]`` → ``[B, T, H, Dv]``:
    :math:`\mathrm{softmax}(q k^\top\cdot\mathrm{scale} + \text{mask})\,v`, ``scale`` default ``1/√D``.
    """
    check_flag(causal, "causal")
    q, k, v = check_qkv(q, k, v, causal=causal)
    if scale is not None:
        scale = check_real(scale, "scale", positive=True)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale)  # [B, H, T, Dv]
    return out.transpose(1, 2)
