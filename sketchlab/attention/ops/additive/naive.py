r"""The additive state's float64 twin (the sliding-window hybrid over it included): the formula written out,
every query against every key (layout ``[B, T, H, D]``), what the chunked path, the parallel form, the decoding
steps and the Triton kernel are tested against. Memory grows with ``T·S``: for tests and small problems.
Normalisation semantics: see :mod:`sketchlab.attention.reference`.
"""

from __future__ import annotations

import torch

from ...._validation import check_degree
from ....polynomial import self_tensor
from ..._checks import (
    check_denominator_check,
    check_eps,
    check_flag,
    check_hybrid,
    check_key_padding_mask,
    check_normalize,
    check_qkv,
    check_segments,
    check_window_lengths,
    denominator_counts,
    report_denominators,
)
from ..hybrid import local_far_masks

__all__ = ["feature_attention_naive"]


def feature_attention_naive(phi_q, phi_k, v, *, q=None, k=None, causal: bool = True, normalize: str = "sum",
                            eps: float = 1e-6, non_negative: bool = False, segments=None, window: int = 0,
                            sinks: int = 0, local: str = "softmax", local_scale=None, degree: int | None = None,
                            gate=None, key_padding_mask=None, initial_state=None, output_final_state: bool = False,
                            denominator_check: str = "warn"):
    r"""Linear attention through feature maps, optionally hybrid and stateful, dense and in float64.

    The literal formula with explicit masks over every (query, key) pair: the twin every other
    path is tested against.

    Parameters
    ----------
    phi_q : Tensor ``[B, T, H, M]``
        Query features :math:`\phi_Q(q_t)`.
    phi_k : Tensor ``[B, S, H, M]``
        Key features :math:`\phi_K(k_s)`.
    v : Tensor ``[B, S, H, Dv]``
    q, k : Tensor ``[B, T, H, D]``, ``[B, S, H, D]`` or None
        The raw queries and keys, for the exact local part (needed when ``window > 0``).
    causal, normalize, eps, segments
        As in :func:`sketchlab.attention.reference.kernel_attention_naive`.
    non_negative, window, sinks, local, local_scale, denominator_check
        As :class:`~sketchlab.attention.AttentionOptions` (``φ ⊗ φ`` built explicitly here; the sinks
        are the first ``sinks`` tokens of each sequence; the local scores are in Notes).
    degree : int or None
        ``p`` of ``local="poly"``.
    gate : Tensor ``[H]`` or None
        Per-head logits; ``g = sigmoid(gate)``, ``None``: ``g = 1/2``.
    key_padding_mask : bool Tensor ``[B, S]`` or None
        ``True`` for real tokens; padded keys are never attended to.
    initial_state : AttentionState or None
        The state after earlier tokens (causal only); positions continue from its ``offset``.
    output_final_state : bool
        Return ``(o, state)``.

    Returns
    -------
    Tensor ``[B, T, H, Dv]`` float64, or ``(o, AttentionState)``.

    Notes
    -----
    For a causal query ``i`` the local keys are ``i−w < j ≤ i`` plus the sinks ``j < sinks``
    (non-causal: ``|i−j| < w`` plus the sinks), the far keys every other allowed ``j``:

    .. math:: o_i = \frac{\sum_{local} g\,a_{ij} v_j + \sum_{far} (1-g)\,\phi(q_i)\cdot\phi(k_j)\, v_j}
                         {\sum_{local} g\,a_{ij} + \sum_{far} (1-g)\,\phi(q_i)\cdot\phi(k_j) + \varepsilon}

    with :math:`a_{ij} = \exp(s\,q_i^\top k_j - c_i)`, :math:`c_i = \max_{local} s\,q_i^\top k_j`
    (``"softmax"``; ``c_i`` is part of the definition and differentiated through, as in LoLCATs)
    or :math:`a_{ij} = (s\,q_i^\top k_j)^p` (``"poly"``). With ``window=0`` every allowed key is
    far and no gate applies (pure linear attention). The state adds
    :math:`\phi(q_i)^\top S_0` and :math:`\phi(q_i)\cdot z_0` to the far sums. The unfused fast paths share one
    copy of this combine (:mod:`sketchlab.attention.ops.hybrid`); it is written out here again, as the
    definition they are tested against.
    """
    from ...state import AttentionState, check_state

    check_flag(causal, "causal")
    check_flag(non_negative, "non_negative")
    check_flag(output_final_state, "output_final_state")
    normalize, eps = check_normalize(normalize), check_eps(eps)
    mode = check_denominator_check(denominator_check)
    phi_q, phi_k, v = check_qkv(phi_q, phi_k, v, causal=causal, names=("phi_q", "phi_k", "v"))
    B, T, H, M = phi_q.shape
    S_len, Dv = v.shape[1], v.shape[-1]
    dim = q.shape[-1] if q is not None else 1
    window, sinks, local, scale, gate = check_hybrid(window, sinks, local, local_scale, gate, normalize=normalize,
                                                     heads=H, dim=dim, like=phi_q)
    if window:
        if q is None or k is None:
            raise ValueError(f"window={window} > 0 needs the raw q and k (q=, k=) for the exact local part")
        q, k, _ = check_qkv(q, k, v, causal=causal)
        if q.shape[:3] != phi_q.shape[:3]:
            raise ValueError(f"q {tuple(q.shape)} must match phi_q {tuple(phi_q.shape)} in [B, T, H]")
        check_window_lengths(causal, window, T, S_len)
        if local == "poly":
            degree = check_degree(degree)
    mask = check_key_padding_mask(key_padding_mask, B, S_len, phi_q.device)
    stateful = initial_state is not None or output_final_state
    if stateful and not causal:
        raise ValueError("initial_state/output_final_state need causal=True (a state summarises a prefix)")
    if stateful and segments is not None:
        raise ValueError("segments cannot be combined with initial_state/output_final_state (one sequence per row)")
    f64 = torch.float64
    lift = self_tensor if non_negative else (lambda x: x)
    M2 = M * M if non_negative else M
    D = q.shape[-1] if q is not None else 0
    fq, fk, vv = (x.to(f64).transpose(1, 2) for x in (phi_q, phi_k, v))  # [B, H, T|S, ·]
    qq = q.to(f64).transpose(1, 2) if window else None  # [B, H, T, D]
    kk = k.to(f64).transpose(1, 2) if window else None  # [B, H, S, D]
    dev = fq.device  # every tensor made here follows the inputs' device
    valid = torch.ones(B, S_len, dtype=torch.bool, device=dev) if mask is None else mask
    if initial_state is not None:
        st = check_state(initial_state, batch=B, heads=H, num_features=M2, dim=D if window else None,
                         dim_v=Dv, feature_dim=M, window=window, sinks=sinks, like=phi_q)
        P0, S0, z0 = st.offset, st.S.to(f64), st.z.to(f64)
        Ls, Lw = st.k_sink.shape[2], st.k_window.shape[2]
        sink_valid = torch.ones(B, Ls, dtype=torch.bool, device=dev) if st.mask_sink is None else st.mask_sink
        win_valid = torch.ones(B, Lw, dtype=torch.bool, device=dev) if st.mask_window is None else st.mask_window
        # the window's sink positions are held once, as sinks
        keep = torch.arange(P0 - Lw, P0, device=dev) >= Ls  # [Lw]
        ext_k = torch.cat([st.k_sink.to(f64), st.k_window.to(f64)[:, :, keep], kk], 2) if window else None
        ext_v = torch.cat([st.v_sink.to(f64), st.v_window.to(f64)[:, :, keep], vv], 2)
        ext_f = torch.cat([torch.zeros(B, H, Ls, M, dtype=f64, device=dev), st.phi_window.to(f64)[:, :, keep], fk], 2)
        ext_pos = torch.cat([torch.arange(Ls, device=dev), torch.arange(P0 - Lw, P0, device=dev)[keep],
                             torch.arange(P0, P0 + S_len, device=dev)])
        ext_valid = torch.cat([sink_valid, win_valid[:, keep], valid], 1)  # [B, X]
        ext_seg = torch.zeros_like(ext_pos)
        ext_rel = ext_pos
    else:
        P0, S0, z0 = 0, torch.zeros(B, H, M2, Dv, dtype=f64, device=dev), torch.zeros(B, H, M2, dtype=f64, device=dev)
        ext_k, ext_v, ext_f, ext_valid = kk, vv, fk, valid
        ext_pos = torch.arange(S_len, device=dev)
        segs = check_segments(segments, S_len)
        if segs is not None and T != S_len:
            raise ValueError(f"segments need T == S, got T={T}, S={S_len}")
        lengths = torch.tensor(segs if segs is not None else [S_len], device=dev)
        ext_seg = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths)  # [S]
        starts = torch.cumsum(lengths, 0) - lengths
        ext_rel = ext_pos - starts[ext_seg]  # position inside its own sequence
    q_pos = torch.arange(P0, P0 + T, device=dev)
    q_seg = ext_seg[-T:] if (segments is not None and initial_state is None) else torch.zeros(T, dtype=torch.long, device=dev)
    # explicit masks [B, 1, T, X]
    allowed = ext_valid[:, None, None, :] & (q_seg[:, None] == ext_seg[None, :])[None, None]
    near, far = local_far_masks(q_pos, ext_pos, ext_rel, window=window, sinks=sinks, causal=causal)  # [T, X]
    is_local, is_far = allowed & near, allowed & far
    zero = torch.zeros((), dtype=f64, device=dev)
    fscores = fq @ ext_f.mT  # [B, H, T, X]
    if non_negative:
        fscores = fscores.square()  # = lift(φq)·lift(φk)
    fscores = torch.where(is_far, fscores, zero)
    lq = lift(fq)  # [B, H, T, M2]
    far_num = fscores @ ext_v + lq @ S0  # [B, H, T, Dv]
    far_den = fscores.sum(-1) + (lq @ z0[..., None]).squeeze(-1)  # [B, H, T]
    if window:
        logits = scale * (qq @ ext_k.mT)  # [B, H, T, X]
        if local == "softmax":
            c = torch.where(is_local, logits, torch.full((), float("-inf"), dtype=f64, device=dev)).amax(-1, keepdim=True)
            c = torch.where(torch.isfinite(c), c, zero)  # a row without local keys: c = 0
            a = torch.where(is_local, torch.exp(logits - c), zero)
        else:
            a = torch.where(is_local, logits**degree, zero)
        g = (torch.full((H,), 0.5, dtype=f64, device=dev) if gate is None else torch.sigmoid(gate.to(f64)))[None, :, None]  # [1, H, 1]
        num = g[..., None] * (a @ ext_v) + (1 - g[..., None]) * far_num
        den = g * a.sum(-1) + (1 - g) * far_den
    else:
        num, den = far_num, far_den
    if normalize == "sum":
        rows = valid[:, -T:] if (mask is not None and T == S_len) else torch.ones(B, T, dtype=torch.bool, device=dev)
        report_denominators(denominator_counts(den, rows[:, None]), B * H * T, "feature_attention_naive", mode)
        out = num / (den + eps)[..., None]
    else:
        out = num
    out = out.transpose(1, 2)  # [B, T, H, Dv]
    if not output_final_state:
        return out
    end = P0 + S_len
    # every key not yet in S0: the held window and the new tokens, positions P0 - Lw ... end - 1
    held = initial_state.k_window.shape[2] if initial_state is not None else 0
    r_pos = torch.arange(P0 - held, end, device=dev)
    if initial_state is not None:
        r_k = torch.cat([initial_state.k_window.to(f64), kk], 2) if window else None
        r_v = torch.cat([initial_state.v_window.to(f64), vv], 2)
        r_f = torch.cat([initial_state.phi_window.to(f64), fk], 2)
        r_valid = torch.cat([win_valid, valid], 1)
    else:
        r_k, r_v, r_f, r_valid = kk, vv, fk, valid
    enters = r_valid & ((r_pos >= sinks) & (r_pos < end - window))[None, :]  # [B, R]
    lf = lift(r_f) * enters[:, None, :, None]  # [B, H, R, M2]
    S_new, z_new = S0 + lf.mT @ r_v, z0 + lf.sum(2)
    keep_w = r_pos >= end - window
    old_s = initial_state.k_sink.shape[2] if initial_state is not None else 0
    take = (r_pos < sinks) & (r_pos >= old_s)
    if window:
        k_sink = torch.cat([initial_state.k_sink.to(f64), r_k[:, :, take]], 2) if initial_state is not None else r_k[:, :, take]
    else:
        k_sink = torch.zeros(B, H, 0, D, dtype=f64, device=dev)
    v_sink = torch.cat([initial_state.v_sink.to(f64), r_v[:, :, take]], 2) if initial_state is not None else r_v[:, :, take]
    m_sink = torch.cat([sink_valid, r_valid[:, take]], 1) if initial_state is not None else r_valid[:, take]
    state = AttentionState(
        S=S_new, z=z_new,
        k_window=r_k[:, :, keep_w] if window else torch.zeros(B, H, 0, D, dtype=f64, device=dev),
        v_window=r_v[:, :, keep_w], phi_window=r_f[:, :, keep_w], k_sink=k_sink, v_sink=v_sink, offset=end,
        mask_window=None if mask is None and (initial_state is None or initial_state.mask_window is None)
        else r_valid[:, keep_w],
        mask_sink=None if mask is None and (initial_state is None or initial_state.mask_sink is None) else m_sink)
    return out, state
