r"""The additive state's float64 twin (the sliding-window hybrid over it included): the formula written out,
every query against every key (layout ``[B, T, H, D]``), what the chunked path, the parallel form, the decoding
steps and the Triton kernel are tested against. Memory grows with ``T·S``: for tests and small problems.
Normalisation semantics: see :mod:`sketchlab.attention.reference`. The arguments are trusted: checked by the
op (:func:`sketchlab.attention.linear_attention`, ``backend="reference"``) or by the test that calls it directly.
"""

from __future__ import annotations

import torch

from ....polynomial import self_tensor
from ..._checks import denominator_counts, report_denominators
from ..hybrid import local_far_masks

__all__ = ["feature_attention_naive"]


def feature_attention_naive(phi_q, phi_k, v, *, q=None, k=None, causal: bool = True, normalize: str = "sum",
                            eps: float = 1e-6, non_negative: bool = False, segments=None, window: int = 0,
                            sinks: int = 0, local: str = "softmax", local_scale=None, degree: int | None = None,
                            gate=None, key_padding_mask=None, initial_state=None, output_final_state: bool = False,
                            denominator_check: str = "warn"):
    r"""Linear attention through feature maps, optionally hybrid and stateful, dense and in float64.

    The literal formula with explicit masks over every (query, key) pair: the twin every other
    path is tested against. Nothing is checked here (the op checks once); the denominators are reported.

    Parameters
    ----------
    phi_q : Tensor ``[B, T, H, M]``
        Query features :math:`\phi_Q(q_t)`.
    phi_k : Tensor ``[B, S, H, M]``
        Key features :math:`\phi_K(k_s)`.
    v : Tensor ``[B, S, H, Dv]``
    q, k : Tensor ``[B, T, H, D]``, ``[B, S, H, D]`` or None
        The raw queries and keys, for the exact local part (needed when ``window > 0``).
    causal : bool
        Keep only ``s ≤ t`` (``T == S``).
    normalize : ``"none"`` or ``"sum"``; eps : float >= 0
        As in :func:`sketchlab.attention.reference.kernel_attention_naive`.
    segments : sequence of int or None
        Lengths of sequences joined along the token axis (``T == S``, stateless): no query attends across
        them; positions (window, sinks) restart in each.
    non_negative, window, sinks, local, local_scale, denominator_check
        As :class:`~sketchlab.attention.AttentionOptions` (``φ ⊗ φ`` built explicitly here; the sinks
        are the first ``sinks`` tokens of each sequence; ``local_scale`` None is ``1/√D``; the local
        scores are in Notes). ``denominator_check``: ``"warn"``, ``"raise"`` or ``"off"``.
    degree : int or None
        ``p`` of ``local="poly"``.
    gate : Tensor ``[H]`` or None
        Per-head logits; ``g = sigmoid(gate)``, ``None``: ``g = 1/2``.
    key_padding_mask : bool Tensor ``[B, S]`` or None
        ``True`` for real tokens; padded keys are never attended to.
    initial_state : AttentionState or None
        The state after earlier tokens (causal only); positions continue from its ``offset``.
    output_final_state : bool
        Return ``(o, state)`` (causal only).

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
    from ...state import AttentionState

    f64 = torch.float64
    B, T, H, M = phi_q.shape
    S_len, Dv = v.shape[1], v.shape[-1]
    D = q.shape[-1] if q is not None else 0
    lift = self_tensor if non_negative else (lambda x: x)
    M2 = M * M if non_negative else M
    fq, fk, vv = (x.to(f64).transpose(1, 2) for x in (phi_q, phi_k, v))  # [B, H, T|S, ·]
    qq = q.to(f64).transpose(1, 2) if window else None  # [B, H, T, D]
    kk = k.to(f64).transpose(1, 2) if window else None  # [B, H, S, D]
    dev = fq.device  # every tensor made here follows the inputs' device
    mask = key_padding_mask
    valid = torch.ones(B, S_len, dtype=torch.bool, device=dev) if mask is None else mask
    st = initial_state
    # the keys every query may see, with their positions: the state's held sinks and window, then the new tokens
    if st is not None:
        P0, S0, z0 = st.offset, st.S.to(f64), st.z.to(f64)
        Ls, Lw = st.k_sink.shape[2], st.k_window.shape[2]
        sink_valid = torch.ones(B, Ls, dtype=torch.bool, device=dev) if st.mask_sink is None else st.mask_sink
        win_valid = torch.ones(B, Lw, dtype=torch.bool, device=dev) if st.mask_window is None else st.mask_window
        keep = torch.arange(P0 - Lw, P0, device=dev) >= Ls  # [Lw]: the window's sink positions are held once, as sinks
        ext_k = torch.cat([st.k_sink.to(f64), st.k_window.to(f64)[:, :, keep], kk], 2) if window else None
        ext_v = torch.cat([st.v_sink.to(f64), st.v_window.to(f64)[:, :, keep], vv], 2)
        ext_f = torch.cat([torch.zeros(B, H, Ls, M, dtype=f64, device=dev), st.phi_window.to(f64)[:, :, keep], fk], 2)
        ext_pos = torch.cat([torch.arange(Ls, device=dev), torch.arange(P0 - Lw, P0, device=dev)[keep],
                             torch.arange(P0, P0 + S_len, device=dev)])
        ext_valid = torch.cat([sink_valid, win_valid[:, keep], valid], 1)  # [B, X]
        ext_seg, ext_rel = torch.zeros_like(ext_pos), ext_pos
    else:
        P0, S0, z0 = 0, torch.zeros(B, H, M2, Dv, dtype=f64, device=dev), torch.zeros(B, H, M2, dtype=f64, device=dev)
        ext_k, ext_v, ext_f, ext_valid = kk, vv, fk, valid
        ext_pos = torch.arange(S_len, device=dev)
        lengths = torch.tensor(list(segments) if segments is not None else [S_len], device=dev)
        ext_seg = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths)  # [S]: each key's sequence
        ext_rel = ext_pos - (torch.cumsum(lengths, 0) - lengths)[ext_seg]  # position inside its own sequence
    q_pos = torch.arange(P0, P0 + T, device=dev)
    q_seg = ext_seg[-T:] if segments is not None else torch.zeros(T, dtype=torch.long, device=dev)
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
        scale = D ** -0.5 if local_scale is None else local_scale
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
        report_denominators(denominator_counts(den, rows[:, None]), B * H * T, "feature_attention_naive",
                            denominator_check)
        out = num / (den + eps)[..., None]
    else:
        out = num
    out = out.transpose(1, 2)  # [B, T, H, Dv]
    if not output_final_state:
        return out
    # the final state: every key not yet in S0 (the held window and the new tokens, positions P0 − Lw ... end − 1)
    # enters S, z once it leaves the window; the last `window` stay held, the first `sinks` are kept as sinks
    end = P0 + S_len
    if st is not None:
        r_k = torch.cat([st.k_window.to(f64), kk], 2) if window else None
        r_v, r_f = torch.cat([st.v_window.to(f64), vv], 2), torch.cat([st.phi_window.to(f64), fk], 2)
        r_valid = torch.cat([win_valid, valid], 1)
    else:
        Ls, Lw, r_k, r_v, r_f, r_valid = 0, 0, kk, vv, fk, valid
    r_pos = torch.arange(P0 - Lw, end, device=dev)
    enters = r_valid & ((r_pos >= sinks) & (r_pos < end - window))[None, :]  # [B, R]
    lf = lift(r_f) * enters[:, None, :, None]  # [B, H, R, M2]
    keep_w, take = r_pos >= end - window, (r_pos < sinks) & (r_pos >= Ls)
    no_keys = torch.zeros(B, H, 0, D, dtype=f64, device=dev)
    k_sink, v_sink, m_sink = (r_k[:, :, take] if window else no_keys), r_v[:, :, take], r_valid[:, take]
    if st is not None:
        k_sink = torch.cat([st.k_sink.to(f64), k_sink], 2) if window else no_keys
        v_sink, m_sink = torch.cat([st.v_sink.to(f64), v_sink], 2), torch.cat([sink_valid, m_sink], 1)
    masked = mask is not None or (st is not None and st.mask_window is not None)
    return out, AttentionState(
        S=S0 + lf.mT @ r_v, z=z0 + lf.sum(2), k_window=r_k[:, :, keep_w] if window else no_keys,
        v_window=r_v[:, :, keep_w], phi_window=r_f[:, :, keep_w], k_sink=k_sink, v_sink=v_sink, offset=end,
        mask_window=r_valid[:, keep_w] if masked else None,
        mask_sink=m_sink if mask is not None or (st is not None and st.mask_sink is not None) else None)
