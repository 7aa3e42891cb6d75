r"""The additive state's chunked path (training and prefill; layout ``[B, H, ·, ·]``): the causal block core with a
hand-written backward and the driver over it.

One call handles one block of ``n`` queries against ``off + n`` keys (the ``off`` keys before
the queries, then one key per query: query ``t`` is key ``off + t``; ``off`` a multiple of the
chunk size ``C``) and a carried state ``S_in [B, H, M2, Dv]``, ``z_in [B, H, M2]`` of every key
before those. Query ``t`` sees key ``e`` through the features when it lies at least ``lag``
positions back (``lag = 0``: plain causal linear attention; ``lag = w``: the far part of the
sliding-window hybrid, the keys that left the window):

.. math:: \text{num}_t = \phi(q_t)^\top S_{in} + \sum_{e \le \text{off} + t - \text{lag}} (\phi(q_t)\cdot\phi(k_e))\, v_e,
          \qquad \text{den}_t = \phi(q_t)\cdot z_{in} + \sum_{e \le \text{off} + t - \text{lag}} \phi(q_t)\cdot\phi(k_e),

and returns the state of every key at least ``lag`` positions before the block's end,
``S_out = S_in + Σ_{e ≤ off + n − 1 − lag} φ(k_e)ᵀ v_e`` (``z_out`` alike; a caller that reads none skips it, and
``S_in = None`` is a zero state). Padded keys, sinks
and any key the caller wants out of the far sums carry zero features. ``non_negative``: the
kernel is ``(φ(q)·φ(k))²``, the state holds ``φ ⊗ φ`` (``M2 = M²``).

The far state (the prefix GEMM of the wholly far key chunks, recomputed in the backward) is the part both
cores share (:mod:`.far`: :func:`~.far.far_forward`, :func:`~.far.far_backward`); :func:`chunk_core` adds the partly-far key
chunks (``C × C`` scores with a fixed mask, kept for the backward). Its float64 twin is
:func:`sketchlab.attention.ops.additive.naive.feature_attention_naive`; the gradients are tested with ``gradcheck``.

*The driver*, :func:`chunk_attention` (decoding one token of the hybrid is :mod:`.recurrent`'s). The
sequence is cut into chunks of ``C`` tokens. Within a chunk the masked ``C × C`` score product is formed directly; across chunks the running state
:math:`S = \sum_{s} \phi(k_s)^\top v_s \in \mathbb R^{M\times D_v}` and normaliser
:math:`z = \sum_s \phi(k_s)` carry everything earlier chunks contribute:

.. math:: o_t = \phi(q_t)^\top S_{<c} + \sum_{s \in c,\, s\le t} (\phi(q_t)\cdot\phi(k_s))\, v_s,
          \qquad \text{den}_t = \phi(q_t)\cdot z_{<c} + \sum_{s\in c,\, s\le t}\phi(q_t)\cdot\phi(k_s).

Chunks are processed a *block* of ``block_chunks`` chunks at a time, fully vectorised inside the
block (batched matmuls over ``B·H·chunks``, the per-chunk prefix states by one 0/1 matmul), with
the state carried from block to block by a short Python loop. The causal block is one
``torch.autograd.Function`` (:func:`chunk_core`, below; the hybrid's:
``hybrid_core``) whose backward recomputes the block's per-chunk states from its saved inputs.
The features come block by block (:class:`TokenRanges`; the LLoPS path computes its map there).
Memory in the forward pass: ``O(T·(D + Dv))`` for inputs and output plus, per block,
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
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...._validation import DEFAULT_MAX_BYTES, check_memory
from ....polynomial import self_tensor
from ..._checks import DenominatorCounter
from .far import chunk_geometry, far_backward, far_forward, from_chunks, normalized_grads, to_chunks
from .hybrid_driver import HybridSettings, hybrid_causal_block, hybrid_noncausal
from .parallel import parallel_core, use_parallel
from .recurrent import hybrid_decode_one

__all__ = ["TokenRanges", "chunk_attention", "chunk_core"]


class _Core(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fq, fk, v, S_in, z_in, off, lag, C, non_negative, normalize, eps, final_state):
        B, H, n, _ = fq.shape
        N, Wc, Ne, lags, R, last, reach = chunk_geometry(n, off, lag, C, fq.device, fq.dtype)
        fqc, fkc, vc = to_chunks(fq, N, C), to_chunks(fk, Ne, C), to_chunks(v, Ne, C)
        # S_out, z_out: one more row of the far states' GEMM (not formed when the caller reads no final state)
        num, den, S_out, z_out = far_forward(R, N, last, reach, fqc, fkc, vc, S_in, z_in, non_negative=non_negative,
                                              final_state=final_state)  # [N, B, H, C, Dv], [N, B, H, C]
        Dv = v.shape[-1]
        kept = []  # the masked scores, for the backward
        for L, c0, mask in lags:  # partly-far key chunks: masked C × C scores
            kk = slice(Wc + c0 - L, Wc + N - L)
            s = fqc[c0:] @ fkc[kk].mT  # [N', B, H, C, C]
            a = (s.square_() if non_negative else s).mul_(mask)
            kept.append(a)
            num[c0:].view(-1, C, Dv).baddbmm_(a.view(-1, C, C), vc[kk].view(-1, C, Dv))
            den[c0:] += a.sum(-1)
        num, den = from_chunks(num, n), from_chunks(den, n)  # [B, H, n, Dv], [B, H, n]
        ctx.geo = (off, lag, C, non_negative, normalize, eps)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (skipped below)
        if normalize:
            out = num / (den[..., None] + eps)
            ctx.save_for_backward(fq, fk, v, S_in, z_in, out, den, *kept)
            ctx.mark_non_differentiable(den)
            return out, den, S_out, z_out
        ctx.save_for_backward(fq, fk, v, S_in, z_in, *kept)
        return num, den, S_out, z_out

    @staticmethod
    @once_differentiable  # in-place work on its own buffers: no double backward
    def backward(ctx, g_num, g_den, g_S, g_z):
        off, lag, C, non_negative, normalize, eps = ctx.geo
        if normalize:
            fq, fk, v, S_in, z_in, out, den, *kept = ctx.saved_tensors
        else:
            fq, fk, v, S_in, z_in, *kept = ctx.saved_tensors
        n = fq.shape[2]
        N, Wc, Ne, lags, R, last, reach = chunk_geometry(n, off, lag, C, fq.device, fq.dtype)
        fqc, fkc, vc = to_chunks(fq, N, C), to_chunks(fk, Ne, C), to_chunks(v, Ne, C)
        if normalize:  # out = num / (den + eps)
            dnum, dden = normalized_grads(g_num, out, den, eps, N, C)  # [N, B, H, C, Dv], [N, B, H, C]
        else:
            dnum = to_chunks(fq.new_zeros(*fq.shape[:3], v.shape[-1]) if g_num is None else g_num, N, C)
            dden = to_chunks((fq.new_zeros(fq.shape[:3]) if g_den is None else g_den)[..., None], N, C)[..., 0]
        # the incoming state's gradient only when it has one (S_in None: a zero state, not a tensor)
        need_in = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        dfq, dfk, dvc, dS_in, dz_in, _ = far_backward(R, N, last, reach, fqc, fkc, vc, S_in, z_in, dnum, dden, g_S,
                                                       g_z, non_negative=non_negative, need_in=need_in)
        for (L, c0, mask), a in zip(lags, kept):
            kk = slice(Wc + c0 - L, Wc + N - L)
            da = (dnum[c0:] @ vc[kk].mT).add_(dden[c0:, ..., None]).mul_(mask)  # [N', B, H, C, C]
            ds = da.mul_(fqc[c0:] @ fkc[kk].mT).mul_(2.0) if non_negative else da  # d(s²) = 2s
            dfq[c0:] += ds @ fkc[kk]
            dfk[kk] += ds.mT @ fqc[c0:]
            dvc[kk] += a.mT @ dnum[c0:]
        L_k = fk.shape[2]
        return (from_chunks(dfq, n), from_chunks(dfk, L_k), from_chunks(dvc, L_k), dS_in, dz_in,
                None, None, None, None, None, None, None)


def _check_core_args(fq, fk, v, S_in, z_in, *, off, lag, chunk_size, non_negative, final_state) -> None:
    """``chunk_core``'s arguments: ranks, the shared ``B, H``, the feature and value widths, the state's shapes (or both
    ``None``), one dtype and device, the offsets and the flag (shape arithmetic only: nothing is read from the
    tensors)."""
    if (S_in is None) != (z_in is None):
        raise ValueError(f"S_in and z_in must both be tensors or both None (a zero state), got S_in "
                         f"{type(S_in).__name__} and z_in {type(z_in).__name__}")
    if not isinstance(final_state, bool):
        raise ValueError(f"final_state must be a bool, got {final_state!r}")
    state = (("S_in", S_in, 4), ("z_in", z_in, 3)) if S_in is not None else ()
    for name, x, rank in (("fq", fq, 4), ("fk", fk, 4), ("v", v, 4), *state):
        if not isinstance(x, torch.Tensor) or x.ndim != rank:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a {rank}-D tensor, got {got}")
        if not x.is_floating_point() or x.dtype != fq.dtype or x.device != fq.device:
            raise ValueError(f"{name} must be a floating tensor of fq's dtype and device ({fq.dtype}, {fq.device}), "
                             f"got {x.dtype} on {x.device}")
    for name, value, low in (("chunk_size", chunk_size, 1), ("off", off, 0), ("lag", lag, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if off % chunk_size:
        raise ValueError(f"off={off} must be a multiple of chunk_size={chunk_size}")
    B, H, n, M = fq.shape
    Dv = v.shape[-1]
    M2 = M * M if non_negative else M
    want = {"fk": (B, H, off + n, M), "v": (B, H, off + n, Dv), "S_in": (B, H, M2, Dv), "z_in": (B, H, M2)}
    for name, x in (("fk", fk), ("v", v), *((("S_in", S_in), ("z_in", z_in)) if S_in is not None else ())):
        if tuple(x.shape) != want[name]:
            raise ValueError(f"{name} must be {list(want[name])} (fq [B, H, n, M] = {list(fq.shape)}, off={off}, "
                             f"Dv={Dv}, M2={M2}{' = M²' if non_negative else ''}), got {list(x.shape)}")


def chunk_core(fq, fk, v, S_in, z_in, *, off: int, lag: int, chunk_size: int, non_negative: bool,
               normalize: bool, eps: float, final_state: bool = True):
    r"""The causal chunked core of one block (see the module docstring for the formula).

    Parameters
    ----------
    fq : Tensor ``[B, H, n, M]``
        Query features.
    fk : Tensor ``[B, H, off + n, M]``
        Key features (zero for keys outside the far sums); key ``off + t`` is query ``t``'s token.
    v : Tensor ``[B, H, off + n, Dv]``
    S_in, z_in : Tensor ``[B, H, M2, Dv]``, ``[B, H, M2]``, or both None
        The far state of every key before ``fk``'s first (``None``: zero, neither allocated nor added).
    off : int
        Keys before the first query, a multiple of ``chunk_size``.
    lag : int >= 0
        Query ``t`` reads key ``e`` when ``e <= off + t - lag``.
    chunk_size : int
    non_negative : bool
        Kernel ``(φ(q)·φ(k))²`` (state of ``φ ⊗ φ``).
    normalize : bool
        Return ``num / (den + eps)`` in place of ``num``.
    eps : float
    final_state : bool
        Form ``S_out, z_out`` (``False``: a caller that reads no final state; they are ``None`` and the key chunks
        only ``S_out`` would read get no per-chunk update).

    Returns
    -------
    ``(num or out [B, H, n, Dv], den [B, H, n], S_out [B, H, M2, Dv], z_out [B, H, M2])``; ``den`` is
    not differentiable when ``normalize``; ``S_out, z_out`` are ``None`` unless ``final_state``.

    Raises
    ------
    ValueError
        A tensor of the wrong rank, dtype or device, shapes that disagree (``fk``, ``v`` must hold ``off + n``
        keys; ``S_in [B, H, M2, Dv]``, ``z_in [B, H, M2]`` with ``M2 = M²`` when ``non_negative``; one of them
        ``None`` without the other), ``off`` not a multiple of ``chunk_size``, a negative ``off`` / ``lag`` /
        non-positive ``chunk_size``, or a ``final_state`` that is not a bool.
    """
    _check_core_args(fq, fk, v, S_in, z_in, off=off, lag=lag, chunk_size=chunk_size, non_negative=non_negative,
                     final_state=final_state)
    return _Core.apply(fq, fk, v, S_in, z_in, off, lag, chunk_size, non_negative, normalize, eps, final_state)


class TokenRanges:
    """The features (or any function) of token ranges: ``fn(x[:, :, a:b])`` for ``a:b`` of ``x [B, H, L, ·]``.

    After :meth:`blocks`, block-aligned ranges are pieces of one ``x.split``: under autograd their
    gradients are joined once, where a slice per block would zero-fill a full-size gradient each
    (quadratic in ``L`` over the blocks).

    Parameters
    ----------
    x : Tensor ``[B, H, L, ·]``
    fn : callable or None
        Applied to each range (None: the slice itself).
    """

    def __init__(self, x: torch.Tensor, fn=None):
        self.x, self.fn, self.pieces, self.size = x, fn, None, 0

    def then(self, g) -> TokenRanges:
        """``g`` applied after ``fn``."""
        fn = self.fn
        return TokenRanges(self.x, g if fn is None else (lambda x: g(fn(x))))

    def blocks(self, size: int) -> TokenRanges:
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
    vs = TokenRanges(v).blocks(block)
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


def chunk_attention(feat_q, feat_k, qt, kt, vt, o, *, num_features: int, degree, gate, mask, initial_state,
                    output_final_state: bool, where: str, max_bytes: int = DEFAULT_MAX_BYTES):
    """The one driver of the additive state's chunked path on internal layout ``[B, H, ·, ·]`` (arguments validated).

    ``window=0``: the pure engine (:func:`_engine`), the state being its ``S, z``; a stateless call
    within one chunk (``T, S <= chunk_size``) runs the parallel form instead
    (:func:`sketchlab.attention.ops.additive.parallel.use_parallel`); one token after a state, the recurrence itself.
    ``window > 0``: the hybrid, causal block by block carrying an :class:`~sketchlab.attention.AttentionState`
    (``block_chunks`` chunks per block; one token: :func:`~.recurrent.hybrid_decode_one`), or non-causal on the
    whole sequence. fp16/bf16 inputs are computed in float32 (the state is float32:
    :func:`~sketchlab.attention.state.state_dtype`) and the output cast back.

    Parameters
    ----------
    feat_q, feat_k : TokenRanges
        The features ``[B, H, n, M]`` of token ranges of the queries and keys.
    qt, kt : Tensor ``[B, H, T|S, D]`` or None
        The raw queries and keys (the hybrid's exact part; None without a window).
    vt : Tensor ``[B, H, S, Dv]``
    o : AttentionOptions
        Built and resolved by the caller (``normalize`` and ``non_negative`` decided:
        :meth:`~sketchlab.attention.AttentionOptions.resolve`) and read as given: ``causal``, ``normalize``,
        ``non_negative`` (the state then holds ``M²``), ``eps``, ``chunk_size`` (``C``), ``block_chunks`` (chunks
        vectorised together per step of the block loop), the hybrid's
        ``window``, ``sinks``, ``local`` and ``local_scale`` (None: ``1/√D``), ``denominator_check``.
    num_features : int
        ``M``.
    degree : int or None
        ``p`` of ``local="poly"``.
    gate : Tensor ``[H]`` or None
        Checked logits.
    mask : Tensor ``[B, S]`` bool or None
        Real keys.
    initial_state : AttentionState or None
        Checked by the op (causal, fits the call); read in the working dtype.
    output_final_state : bool
    where : str
        The caller's name in the denominator warning.
    max_bytes : int
        Memory budget for one block's per-chunk states or bands, or the parallel form's ``B·H·T·S`` scores
        (:func:`sketchlab._validation.check_memory`).

    Returns
    -------
    Tensor ``[B, H, T, Dv]``, or ``(Tensor [B, H, T, Dv], AttentionState)`` with ``output_final_state``.
    """
    from ...state import AttentionState, empty_state, state_dtype, state_in

    work = state_dtype(vt.dtype)
    if work != vt.dtype:  # half inputs: every sum, and the state, in float32; the output back in the input dtype
        out_dtype = vt.dtype
        qt, kt, vt = (None if x is None else x.to(work) for x in (qt, kt, vt))
        gate = None if gate is None else gate.to(work)
        feat_q, feat_k = feat_q.then(lambda f: f.to(work)), feat_k.then(lambda f: f.to(work))
        res = chunk_attention(feat_q, feat_k, qt, kt, vt, o, num_features=num_features, degree=degree, gate=gate,
                              mask=mask, initial_state=initial_state, output_final_state=output_final_state,
                              where=where, max_bytes=max_bytes)
        return (res[0].to(out_dtype), res[1]) if output_final_state else res.to(out_dtype)
    causal, normalize, non_negative, eps = o.causal, o.normalize, o.non_negative, o.eps
    window, sinks, local, denominator_check = o.window, o.sinks, o.local, o.denominator_check
    block_chunks = o.block_chunks
    B, H, S_len, Dv = vt.shape
    T = feat_q.x.shape[2]  # the queries (qt is None without a window)
    M = num_features
    M2 = M * M if non_negative else M
    D = kt.shape[-1] if kt is not None else 0
    stateful = initial_state is not None or output_final_state
    if initial_state is not None:  # checked by the op (causal, shapes): here only read in the working dtype
        state = state_in(initial_state, work)
    elif stateful or (window and causal):  # the hybrid's blocks carry a state even when the call returns none
        state = empty_state(B, H, M2, D, Dv, M, like=vt)
    else:
        state = None
    chunk_size = min(o.chunk_size, max(T, S_len))  # a short call (decoding: one token) pads to no more than itself
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
    scale = D ** -0.5 if o.local_scale is None else o.local_scale
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
    qs, ks, vs = (TokenRanges(x).blocks(block) for x in (qt, kt, vt))
    for a in range(0, T, block):
        b = min(a + block, T)
        out, state = hybrid_causal_block(h, state, qs(a, b), ks(a, b), vs(a, b), feat_q(a, b),
                                          feat_k(a, b), None if mask is None else mask[:, a:b], C, counter)
        outs.append(out)
    if counter is not None:
        counter.report(where, denominator_check)
    out = torch.cat(outs, 2)
    return (out, state) if output_final_state else out
