r"""Chunked linear attention in PyTorch (layout ``[B, T, H, D]``): the CPU path.

The sequence is cut into chunks of ``C`` tokens. Within a chunk the masked ``C × C`` score
product is formed directly; across chunks the running state
:math:`S = \sum_{s} \phi(k_s)^\top v_s \in \mathbb R^{M\times D_v}` and normaliser
:math:`z = \sum_s \phi(k_s)` carry everything earlier chunks contribute:

.. math:: o_t = \phi(q_t)^\top S_{<c} + \sum_{s \in c,\, s\le t} (\phi(q_t)\cdot\phi(k_s))\, v_s,
          \qquad \text{den}_t = \phi(q_t)\cdot z_{<c} + \sum_{s\in c,\, s\le t}\phi(q_t)\cdot\phi(k_s).

Chunks are processed a *block* of ``block_chunks`` chunks at a time, fully vectorised inside the
block (batched matmuls over ``B·H·chunks``, the per-chunk prefix states by one 0/1 matmul), with
the state carried from block to block by a short Python loop. The causal block is one
``torch.autograd.Function`` (:func:`sketchlab.attention.ops.additive.chunk.chunk_core`; the hybrid's:
``hybrid_core``) whose backward recomputes the block's per-chunk states from its saved inputs.
The LLoPS map is computed block by block from ``q``/``k`` (:func:`llops_attention_chunked`), so
the whole ``[B, T, H, M]`` feature tensor is never held in the forward pass. Memory in the
forward pass: ``O(T·(D + Dv))`` for inputs and output plus, per block,
``O(block·(M + C) + chunks·M·Dv)``: never ``T²``. Under autograd each block keeps its features,
its ``C × C`` near scores (the hybrid: its local weights, ``O(block·(w + C))``, and chunk-major
copies of its ``q, k, v``) and its incoming state for the backward pass,
``O(T·(M + C) + (T/block)·M·Dv)``: linear in ``T``.

``non_negative=True`` (self-tensored features ``φ ⊗ φ``, kernel :math:`(\phi(q)\cdot\phi(k))^2`):
the intra-chunk scores are squared and never touch ``M²``; the inter-chunk state is
``(φ⊗φ)ᵀ v``, of size ``M²·Dv``, and the block's features ``φ ⊗ φ`` (``block·M²``) are
materialised to build and read it. That part is ``M²`` by nature (the map has ``M²`` features).

Gradients reach every input (features, values, and Θ in the LLoPS path): by the cores' backward
inside a block, by autograd around them.
Normalisation semantics: see :mod:`sketchlab.attention.reference`.
"""

from __future__ import annotations

import torch

from .._validation import DEFAULT_MAX_BYTES, check_degree, check_memory, check_positive_int
from ..llops.maps import llops_feature_fn
from ..polynomial import self_tensor
from ._checks import (
    DenominatorCounter,
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
from .ops.additive.chunk import chunk_core
from .ops.additive.hybrid_driver import HybridSettings, hybrid_causal_block, hybrid_noncausal
from .ops.additive.naive import feature_attention_naive
from .ops.additive.parallel import parallel_core, use_parallel
from .ops.additive.recurrent import hybrid_decode_one
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




class _Tokens:
    """``fn(x[:, :, a:b])`` for token ranges ``a:b`` of ``x [B, H, L, ·]`` (``fn=None``: the slice itself).

    After :meth:`blocks`, block-aligned ranges are pieces of one ``x.split``: under autograd their
    gradients are joined once, where a slice per block would zero-fill a full-size gradient each
    (quadratic in ``L`` over the blocks).
    """

    def __init__(self, x: torch.Tensor, fn=None):
        self.x, self.fn, self.pieces, self.size = x, fn, None, 0

    def then(self, g) -> _Tokens:
        """``g`` applied after ``fn``."""
        fn = self.fn
        return _Tokens(self.x, g if fn is None else (lambda x: g(fn(x))))

    def blocks(self, size: int) -> _Tokens:
        self.pieces, self.size = self.x.split(size, 2), size
        return self

    def __call__(self, a: int, b: int) -> torch.Tensor:
        if self.pieces is not None and a % self.size == 0 and b == min(a + self.size, self.x.shape[2]):
            x = self.pieces[a // self.size]
        else:
            x = self.x[:, :, a:b]
        return x if self.fn is None else self.fn(x)


def _engine(feat_q, feat_k, v: torch.Tensor, length_q: int, *, causal: bool, normalize: str, non_negative: bool,
            eps: float, chunk_size: int, block_chunks: int, num_features: int, max_bytes: int, S0=None, z0=None,
            rows=None, counter=None, final_state: bool = True):
    """Chunked (pure) linear attention on internal layout ``[B, H, ·, ·]``.

    ``feat_q(a, b)`` / ``feat_k(a, b)`` return the features ``[B, H, b - a, M]`` of tokens
    ``a:b`` (padded keys already zeroed); ``v`` is ``[B, H, S, Dv]``. ``S0 [B, H, M2, Dv]``,
    ``z0 [B, H, M2]``: the state of earlier tokens (causal; ``None``: none, and no zero state is
    made). ``rows [B, T]``: real queries, for ``counter`` (a :class:`~sketchlab.attention._checks.DenominatorCounter`).
    ``final_state=False`` (causal): the caller reads no final state, the last block forms none.
    Returns ``([B, H, T, Dv], S, z)`` (``S, z`` None when causal and not ``final_state``).
    """
    B, H, S, Dv = v.shape
    C = chunk_size
    M2 = num_features**2 if non_negative else num_features
    block = C * block_chunks
    itemsize = v.element_size()
    check_memory(B * H * (block_chunks * M2 * Dv + (2 * block * M2 if non_negative else 0)) * itemsize,
                 what=f"the per-chunk states of one block ([B={B}, H={H}, {block_chunks} chunks, {M2}, {Dv}])"
                      + (f" and its self-tensored features (2 × [B, H, {block}, {M2}])" if non_negative else ""),
                 way_out="lower block_chunks or the number of features (non_negative squares it)", max_bytes=max_bytes)
    lift = self_tensor if non_negative else (lambda f: f)
    state, zsum = S0, z0  # Σ φ(k)ᵀ v, Σ φ(k) over finished blocks (None: zero)
    outs = []
    vs = _Tokens(v).blocks(block)
    if not causal:  # one pass for the state, one for the queries
        state, zsum = v.new_zeros(B, H, M2, Dv), v.new_zeros(B, H, M2)
        for a in range(0, S, block):
            fk = lift(feat_k(a, min(a + block, S)))  # [B, H, n, M2]
            state = state + fk.mT @ vs(a, min(a + block, S))  # [B, H, M2, Dv]
            zsum = zsum + fk.sum(2)
        # the denominators φ(q)·Σφ(k) as one more column of the state's GEMM (a GEMV, or [1, M]·[M, n], is slower)
        read = torch.cat([state, zsum[..., None]], -1) if normalize == "sum" else state  # [B, H, M2, Dv (+ 1)]
        for a in range(0, length_q, block):
            fq = lift(feat_q(a, min(a + block, length_q)))  # [B, H, n, M2]
            out = fq @ read  # [B, H, n, Dv (+ 1)]
            if normalize == "sum":
                out, den = out[..., :Dv], out[..., Dv]  # [B, H, n, Dv], [B, H, n]
                if counter is not None:
                    counter.add(den, None if rows is None else rows[:, a:a + block])
                out = out / (den[..., None] + eps)
            outs.append(out)
        return torch.cat(outs, 2), state, zsum

    for a in range(0, S, block):  # causal: the core block by block, the state carried
        b = min(a + block, S)
        out, den, state, zsum = chunk_core(feat_q(a, b), feat_k(a, b), vs(a, b), state, zsum, off=0, lag=0,
                                           chunk_size=C, non_negative=non_negative, normalize=normalize == "sum",
                                           eps=eps, final_state=final_state or b < S)
        if counter is not None:
            counter.add(den, None if rows is None else rows[:, a:b])
        outs.append(out)  # [B, H, n, Dv]
    return torch.cat(outs, 2), state, zsum


def _check_engine_args(causal, normalize, non_negative, eps, chunk_size, block_chunks):
    check_flag(causal, "causal")
    check_flag(non_negative, "non_negative")
    return (check_normalize(normalize), check_eps(eps), check_chunk_size(chunk_size),
            check_positive_int(block_chunks, "block_chunks"))


def _attend(feat_q, feat_k, qt, kt, vt, *, num_features: int, causal: bool, normalize: str, non_negative: bool,
            eps: float, chunk_size: int, block_chunks: int, max_bytes: int, window: int, sinks: int, local: str,
            scale: float, degree, gate, mask, initial_state, output_final_state: bool, denominator_check: str,
            where: str):
    """The one driver of the chunked path on internal layout ``[B, H, ·, ·]`` (arguments validated).

    ``window=0``: the pure engine (:func:`_engine`), the state being its ``S, z``; a stateless call
    within one chunk (``T, S <= chunk_size``) runs the parallel form instead
    (:func:`sketchlab.attention.ops.additive.parallel.use_parallel`).
    ``window > 0``: the hybrid, causal block by block carrying an :class:`AttentionState`
    (``block_chunks`` chunks per block), or non-causal on the whole sequence. fp16/bf16 inputs
    are computed in float32 (the state is float32: :func:`~sketchlab.attention.state.state_dtype`)
    and the output cast back.
    Returns ``[B, H, T, Dv]`` or ``([B, H, T, Dv], AttentionState)``.
    """
    from .state import AttentionState, check_state, empty_state, state_dtype

    work = state_dtype(vt.dtype)
    if work != vt.dtype:  # half inputs: every sum, and the state, in float32; the output back in the input dtype
        out_dtype = vt.dtype
        qt, kt, vt = (None if x is None else x.to(work) for x in (qt, kt, vt))
        gate = None if gate is None else gate.to(work)
        feat_q, feat_k = feat_q.then(lambda f: f.to(work)), feat_k.then(lambda f: f.to(work))
        res = _attend(feat_q, feat_k, qt, kt, vt, num_features=num_features, causal=causal, normalize=normalize,
                      non_negative=non_negative, eps=eps, chunk_size=chunk_size, block_chunks=block_chunks,
                      max_bytes=max_bytes, window=window, sinks=sinks, local=local, scale=scale, degree=degree,
                      gate=gate, mask=mask, initial_state=initial_state, output_final_state=output_final_state,
                      denominator_check=denominator_check, where=where)
        return (res[0].to(out_dtype), res[1]) if output_final_state else res.to(out_dtype)
    B, H, S_len, Dv = vt.shape
    T = feat_q.x.shape[2]  # the queries (qt is None without a window)
    M = num_features
    M2 = M * M if non_negative else M
    D = kt.shape[-1] if kt is not None else 0
    stateful = initial_state is not None or output_final_state
    if stateful and not causal:
        raise ValueError("initial_state/output_final_state need causal=True (a state summarises a prefix)")
    if initial_state is not None:
        state = check_state(initial_state, batch=B, heads=H, num_features=M2,
                            dim=D if window else None, dim_v=Dv, feature_dim=M,
                            window=window, sinks=sinks, like=vt, dtype=work)
    elif stateful or (window and causal):  # the hybrid's blocks carry a state even when the call returns none
        state = empty_state(B, H, M2, D, Dv, M, like=vt)
    else:
        state = None
    chunk_size = min(chunk_size, max(T, S_len))  # a short call (decoding: one token) pads to no more than itself
    counter = DenominatorCounter() if normalize == "sum" and denominator_check != "off" else None
    rows = mask if (mask is not None and T == S_len) else None
    block = chunk_size * block_chunks
    feat_q, feat_k = feat_q.blocks(block), feat_k.blocks(block)
    if mask is not None:
        keep = mask[:, None, :, None]  # [B, 1, S, 1]
        feat_k_raw = feat_k

        def feat_k(a, b):  # padded keys have zero features: they add nothing to any far sum
            return feat_k_raw(a, b) * keep[:, :, a:b].to(vt.dtype)
    if not window and causal and stateful and T == 1:  # decoding one token: the recurrence itself
        lift = self_tensor if non_negative else (lambda f: f)
        fq, fk = lift(feat_q(0, 1)), lift(feat_k(0, 1))  # [B, H, 1, M2]
        S, z = state.S + fk.mT @ vt, state.z + fk[:, :, 0]  # S_t = S_{t-1} + φ(k_t)ᵀv_t, z_t = z_{t-1} + φ(k_t)
        out = fq @ S  # [B, H, 1, Dv]
        if normalize == "sum":
            den = fq @ z[..., None]  # [B, H, 1, 1]
            if counter is not None:
                counter.add(den[..., 0], rows)
                counter.report(where, denominator_check)
            out = out / (den + eps)
        if not output_final_state:
            return out
        return out, AttentionState(S=S, z=z, k_window=state.k_window, v_window=state.v_window,
                                   phi_window=state.phi_window, k_sink=state.k_sink, v_sink=state.v_sink,
                                   offset=state.offset + 1)
    if use_parallel(T, S_len, chunk_size=chunk_size, window=window, stateful=stateful):  # one chunk: no state
        check_memory(B * H * T * S_len * vt.element_size(), what=f"the scores of the parallel form ([B={B}, H={H}, "
                     f"{T}, {S_len}])", way_out="lower chunk_size (the parallel form runs when T, S <= chunk_size)",
                     max_bytes=max_bytes)
        out, den = parallel_core(feat_q(0, T), feat_k(0, S_len), vt, causal=causal, non_negative=non_negative,
                                 normalize=normalize == "sum", eps=eps)
        if counter is not None:
            counter.add(den, rows)
            counter.report(where, denominator_check)
        return out
    if not window:
        out, S, z = _engine(feat_q, feat_k, vt, T, causal=causal, normalize=normalize, non_negative=non_negative,
                            eps=eps, chunk_size=chunk_size, block_chunks=block_chunks, num_features=M,
                            max_bytes=max_bytes, S0=state.S if stateful else None,
                            z0=state.z if stateful else None, rows=rows, counter=counter,
                            final_state=output_final_state)
        if counter is not None:
            counter.report(where, denominator_check)
        if not output_final_state:
            return out
        return out, AttentionState(S=S, z=z, k_window=state.k_window, v_window=state.v_window,
                                   phi_window=state.phi_window, k_sink=state.k_sink, v_sink=state.v_sink,
                                   offset=state.offset + T)
    h = HybridSettings(window=window, sinks=sinks, local=local, scale=scale, degree=degree, gate=gate, eps=eps,
                non_negative=non_negative, heads=H, like=vt)
    C = chunk_size
    if not causal:
        out = hybrid_noncausal(h, qt, kt, vt, feat_q(0, T), feat_k(0, S_len), mask, C, counter)
        if counter is not None:
            counter.report(where, denominator_check)
        return out
    if T == 1 and stateful:  # decoding one token: the window slides by one, one key may enter S
        out, state = hybrid_decode_one(h, state, qt, kt, vt, feat_q(0, 1), feat_k(0, 1), mask, counter)
        if counter is not None:
            counter.report(where, denominator_check)
        return (out, state) if output_final_state else out
    queries = min(block, -(-T // C) * C)  # a block holds at most the call's chunks
    held = min(window, state.offset + T)  # window keys a block can see: no more than the sequence has
    check_memory(B * H * queries * (held + C) * (D + M + Dv + 2) * vt.element_size(),
                 what=f"the bands of one block ([B={B}, H={H}, {queries} queries, window {held} + chunk {C} keys])",
                 way_out="lower block_chunks or chunk_size (the band is inherent to the window)", max_bytes=max_bytes)
    outs = []
    qs, ks, vs = (_Tokens(x).blocks(block) for x in (qt, kt, vt))
    for a in range(0, T, block):
        b = min(a + block, T)
        out, state = hybrid_causal_block(h, state, qs(a, b), ks(a, b), vs(a, b), feat_q(a, b),
                                          feat_k(a, b), None if mask is None else mask[:, a:b], C, counter)
        outs.append(out)
    if counter is not None:
        counter.report(where, denominator_check)
    out = torch.cat(outs, 2)
    return (out, state) if output_final_state else out


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
    out = _attend(_Tokens(fq), _Tokens(fk), qt, kt, v.transpose(1, 2),
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
    out = _attend(_Tokens(qt, phi_q), _Tokens(kt, phi_k),  # features [B, H, n, M] of token ranges
                  qt, kt, v.transpose(1, 2), num_features=theta_q.shape[-1], causal=causal, normalize=normalize,
                  non_negative=non_negative, eps=eps, chunk_size=chunk_size, block_chunks=block_chunks,
                  max_bytes=max_bytes, window=window, sinks=sinks, local=local, scale=scale, degree=theta_q.shape[2],
                  gate=gate, mask=mask, initial_state=initial_state, output_final_state=output_final_state,
                  denominator_check=mode, where="llops_attention")
    if output_final_state:
        return out[0].transpose(1, 2), out[1]  # [B, T, H, Dv]
    return out.transpose(1, 2)  # [B, T, H, Dv]


# ----------------------------------------------------------------------------------------------
# sliding-window hybrid (local exact + far sketched), causal with a carried state, or non-causal
