r"""Chunked linear attention in PyTorch (layout ``[B, T, H, D]``): the CPU path's keyword entry points.

:func:`feature_attention` (given features) and :func:`llops_attention_chunked` (the LLoPS map computed block by
block from ``q``/``k``, so the whole ``[B, T, H, M]`` feature tensor is never held in the forward pass) check
their arguments and drive :func:`sketchlab.attention.ops.additive.chunk.chunk_attention`, the additive
mechanism's chunked path (its module says how chunks, blocks, memory and gradients go).
Normalisation semantics: see :mod:`sketchlab.attention.reference`.
"""

from __future__ import annotations

import torch

from .._validation import DEFAULT_MAX_BYTES, check_degree, check_positive_int
from ..llops.maps import llops_feature_fn
from ._checks import (
    check_chunk_size,
    check_denominator_check,
    check_eps,
    check_flag,
    check_hybrid,
    check_key_padding_mask,
    check_normalize,
    check_qkv,
    check_theta,
    check_window_lengths,
)
from ._entry import call_options, far_gate, keyword_defaults, memory_call
from .ops.additive.chunk import TokenRanges, chunk_attention
from .ops.additive.naive import feature_attention_naive
from .options import AttentionOptions, FarParams

__all__ = [
    "DEFAULT_BLOCK_CHUNKS",
    "DEFAULT_CHUNK_SIZE",
    "feature_attention",
    "llops_attention_chunked",
    "llops_feature_fn",
]

#: Tokens per chunk (the intra-chunk product is ``C × C``).
DEFAULT_CHUNK_SIZE = 64
#: Chunks processed together, vectorised, per step of the block loop.
DEFAULT_BLOCK_CHUNKS = 16


def _check_engine_args(causal, normalize, non_negative, eps, chunk_size, block_chunks):
    check_flag(causal, "causal")
    check_flag(non_negative, "non_negative")
    return (check_normalize(normalize), check_eps(eps), check_chunk_size(chunk_size),
            check_positive_int(block_chunks, "block_chunks"))


def feature_attention(phi_q, phi_k, v, *, q=None, k=None, options: AttentionOptions | None = None,
                      params: FarParams | None = None, causal: bool = True, normalize: str = "sum",
                      non_negative: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      block_chunks: int = DEFAULT_BLOCK_CHUNKS, max_bytes: int = DEFAULT_MAX_BYTES, window: int = 0,
                      sinks: int = 0, local: str = "softmax", local_scale=None, degree: int | None = None, gate=None,
                      key_padding_mask=None, initial_state=None, output_final_state: bool = False,
                      denominator_check: str = "warn"):
    r"""Linear attention through given features, chunked (``T × S`` scores only for a one-chunk call:
    the parallel form); optionally the sliding-window hybrid and a carried state.

    Parameters
    ----------
    phi_q : Tensor ``[B, T, H, M]``
        Query features.
    phi_k : Tensor ``[B, S, H, M]``
        Key features.
    v : Tensor ``[B, S, H, Dv]``
    q, k : Tensor ``[B, T, H, D]``, ``[B, S, H, D]`` or None
        The raw queries and keys of the exact local part (required when ``window > 0``).
    options : AttentionOptions or None
        Every option at once (DESIGN §7); the keyword options (``causal``, ``normalize``,
        ``non_negative``, ``eps``, ``chunk_size``, ``window`` … ``local_scale``,
        ``denominator_check``) must then be left at their defaults (refused naming the one passed
        too). ``normalize=None`` is ``"sum"``, ``non_negative=None`` is ``False`` (the features are
        given). ``backend="reference"`` runs the float64 twin
        (:func:`~sketchlab.attention.ops.additive.naive.feature_attention_naive`); ``"triton"`` is refused (no fused
        kernel for given features). Options with ``.memory`` run
        :func:`~sketchlab.attention.memory.memory_attention` (or its twin) on the features, self-tensored
        when ``non_negative``; the state is then a :class:`~sketchlab.attention.MemoryState`.
    params : FarParams or None
        The learnable tensors the options call for (see :func:`~sketchlab.attention.functional.llops_attention`).
    causal, normalize, non_negative, eps, chunk_size
        As :class:`~sketchlab.attention.AttentionOptions` (``causal``: ``T == S``; ``normalize="sum"``
        is safe for non-negative maps only, see :mod:`sketchlab.attention.reference`); ``non_negative``
        self-tensors the given features (``φ ⊗ φ``, ``M²`` of them); ``C = chunk_size``.
    block_chunks : int >= 1
        Chunks vectorised together per step of the block loop.
    max_bytes : int
        Memory budget for one block's per-chunk states, or the parallel form's ``B·H·T·S`` scores
        (:func:`sketchlab._validation.check_memory`).
    window, sinks, local, local_scale, degree, gate, key_padding_mask, initial_state, output_final_state
        As :func:`~sketchlab.attention.ops.additive.naive.feature_attention_naive` (which states the formula); the local
        part costs ``O(T·(w + C + sinks)·D)``.
    denominator_check
        As :class:`~sketchlab.attention.AttentionOptions` (counted chunk by chunk, one
        synchronisation per call).

    Returns
    -------
    Tensor ``[B, T, H, Dv]`` in the dtype of the inputs, or ``(o, AttentionState)``; equals
    :func:`~sketchlab.attention.ops.additive.naive.feature_attention_naive` to round-off.
    """
    o = call_options("feature_attention", options, params,
                     dict(causal=causal, normalize=normalize, non_negative=non_negative, eps=eps, chunk_size=chunk_size,
                          window=window, sinks=sinks, local=local, local_scale=local_scale,
                          denominator_check=denominator_check), _FEATURE_DEFAULTS)
    causal, normalize, eps, chunk_size, mode = o.causal, o.normalize or "sum", o.eps, o.chunk_size, o.denominator_check
    non_negative = bool(o.non_negative)
    window, sinks, local, local_scale = o.window, o.sinks, o.local, o.local_scale
    block_chunks = check_positive_int(block_chunks, "block_chunks")
    check_flag(output_final_state, "output_final_state")
    if o.backend == "triton":
        raise ValueError("feature_attention: backend='triton' fuses only LLoPS maps; given features run with "
                         "backend='torch' (or 'auto') or 'reference'")
    if o.memory:
        return memory_call(phi_q, phi_k, v, q, k, where="feature_attention", qkv_checked=False, options=o,
                           params=params, gate=gate, degree=degree, non_negative=non_negative, key_padding_mask=key_padding_mask,
                           initial_state=initial_state, output_final_state=output_final_state)
    gate = far_gate("feature_attention", gate, params)
    if o.backend == "reference":
        return feature_attention_naive(phi_q, phi_k, v, q=q, k=k, causal=causal, normalize=normalize, eps=eps,
                                       non_negative=non_negative, window=window, sinks=sinks, local=local,
                                       local_scale=local_scale, degree=degree, gate=gate,
                                       key_padding_mask=key_padding_mask, initial_state=initial_state,
                                       output_final_state=output_final_state, denominator_check=mode)
    phi_q, phi_k, v = check_qkv(phi_q, phi_k, v, causal=causal, names=("phi_q", "phi_k", "v"))
    B, T, H, M = phi_q.shape
    dim = q.shape[-1] if isinstance(q, torch.Tensor) and q.ndim == 4 else 1
    window, sinks, local, scale, gate = check_hybrid(window, sinks, local, local_scale, gate, normalize=normalize,
                                                     heads=H, dim=dim, like=phi_q)
    qt = kt = None
    if window:
        if q is None or k is None:
            raise ValueError(f"window={window} > 0 needs the raw q and k (q=, k=) for the exact local part")
        q, k, _ = check_qkv(q, k, v, causal=causal)
        if q.shape[:3] != phi_q.shape[:3] or k.shape[:3] != phi_k.shape[:3]:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must match phi_q {tuple(phi_q.shape)} and "
                             f"phi_k {tuple(phi_k.shape)} in [B, T, H]")
        check_window_lengths(causal, window, q.shape[1], k.shape[1])
        if local == "poly":
            degree = check_degree(degree)
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T|S, D]
    mask = check_key_padding_mask(key_padding_mask, B, phi_k.shape[1], phi_q.device)
    fq, fk = phi_q.transpose(1, 2), phi_k.transpose(1, 2)  # [B, H, T|S, M]
    out = chunk_attention(TokenRanges(fq), TokenRanges(fk), qt, kt, v.transpose(1, 2),
                  num_features=M, causal=causal, normalize=normalize, non_negative=non_negative, eps=eps,
                  chunk_size=chunk_size, block_chunks=block_chunks, max_bytes=max_bytes, window=window, sinks=sinks,
                  local=local, scale=scale, degree=degree, gate=gate, mask=mask, initial_state=initial_state,
                  output_final_state=output_final_state, denominator_check=mode, where="feature_attention")
    if output_final_state:
        return out[0].transpose(1, 2), out[1]  # [B, T, H, Dv]
    return out.transpose(1, 2)  # [B, T, H, Dv]


#: feature_attention's option keywords' defaults (options= must leave them so).
_FEATURE_DEFAULTS = keyword_defaults(feature_attention)


def llops_attention_chunked(q, k, v, theta_q, theta_k, *, causal: bool = True, normalize: str = "sum",
                            non_negative: bool = False, eps: float = 1e-6, chunk_size: int = DEFAULT_CHUNK_SIZE,
                            block_chunks: int = DEFAULT_BLOCK_CHUNKS, max_bytes: int = DEFAULT_MAX_BYTES,
                            validate: bool = True, window: int = 0, sinks: int = 0, local: str = "softmax",
                            local_scale=None, gate=None, key_padding_mask=None, initial_state=None,
                            output_final_state: bool = False, denominator_check: str = "warn"):
    r"""LLoPS attention, chunked, with the feature map computed block by block.

    Parameters
    ----------
    q : Tensor ``[B, T, H, D]``
    k : Tensor ``[B, S, H, D]``
    v : Tensor ``[B, S, H, Dv]``
    theta_q, theta_k : Tensor ``[H, t, p, D, M]``
        :math:`\phi(x)_i = \sum_r \prod_j \langle\theta_{r,j,:,i}, x\rangle` per head.
    causal, normalize, non_negative, eps, chunk_size, block_chunks, max_bytes, window, sinks, local,
    local_scale, gate, key_padding_mask, initial_state, output_final_state, denominator_check
        As in :func:`feature_attention` (``local="poly"`` uses Θ's degree ``p``).
    validate : bool
        Check the arguments (``False`` only from :func:`sketchlab.attention.functional.llops_attention`,
        which has checked them already).

    Returns
    -------
    Tensor ``[B, T, H, Dv]`` (or ``(o, AttentionState)``); gradients reach ``q, k, v, theta_q,
    theta_k`` and ``gate``.
    """
    mode, mask, scale = denominator_check, key_padding_mask, local_scale
    if validate:  # else llops_attention built the options and checked every argument once (DESIGN §7)
        normalize, eps, chunk_size, block_chunks = _check_engine_args(causal, normalize, non_negative, eps,
                                                                      chunk_size, block_chunks)
        check_flag(output_final_state, "output_final_state")
        mode = check_denominator_check(denominator_check)
        q, k, v = check_qkv(q, k, v, causal=causal)
        theta_q, theta_k = check_theta(theta_q, theta_k, heads=q.shape[2], dim=q.shape[3], like=q)
        window, sinks, local, scale, gate = check_hybrid(window, sinks, local, local_scale, gate,
                                                         normalize=normalize, heads=q.shape[2], dim=q.shape[3], like=q)
        mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[1], q.device)
    elif scale is None:
        scale = q.shape[3] ** -0.5
    check_window_lengths(causal, window, q.shape[1], k.shape[1])
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T|S, D]
    phi_q, phi_k = llops_feature_fn(theta_q), llops_feature_fn(theta_k)
    out = chunk_attention(TokenRanges(qt, phi_q), TokenRanges(kt, phi_k),  # features [B, H, n, M] of token ranges
                  qt, kt, v.transpose(1, 2), num_features=theta_q.shape[-1], causal=causal, normalize=normalize,
                  non_negative=non_negative, eps=eps, chunk_size=chunk_size, block_chunks=block_chunks,
                  max_bytes=max_bytes, window=window, sinks=sinks, local=local, scale=scale, degree=theta_q.shape[2],
                  gate=gate, mask=mask, initial_state=initial_state, output_final_state=output_final_state,
                  denominator_check=mode, where="llops_attention")
    if output_final_state:
        return out[0].transpose(1, 2), out[1]  # [B, T, H, Dv]
    return out.transpose(1, 2)  # [B, T, H, Dv]

