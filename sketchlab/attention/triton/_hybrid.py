r"""Triton kernels of the sliding-window hybrid (exact local attention + LLoPS far), ``[B, T, H, D]``.

The formula (docs/DESIGN.md §6). For a causal query ``i`` the local keys are ``i−w < j ≤ i`` and the
sinks ``j < sinks`` (``j ≤ i``), the far keys every other ``j ≤ i`` (``CAUSAL=False``: local
``|i−j| < w`` and the sinks, far every other key); with ``γ = sigmoid(gate[h])``,

    o_i = (γ Σ_L a_ij v_j + (1−γ) Σ_F f_ij v_j) / (γ Σ_L a_ij + (1−γ) Σ_F f_ij + ε),

``f_ij = φ(q_i)·φ(k_j)`` (LLoPS features, or their self-tensor with ``SELF``), ``u_ij = s·q_iᵀk_j``
and ``a_ij = exp(u_ij − c_i)``, ``c_i = max_L u_ij`` (``SOFTMAX``), or ``a_ij = u_ij^p`` (poly, the
Θ's degree ``p``).

Index space. The key tensor ``K [B, NK, H, D]`` is what the launcher built: the sink tokens of a
carried state, then its window tokens, then the ``T`` new keys (``NK = QOFF + T``); query ``t``
sits at key index ``qi = QOFF + t``. A key index ``r < SINKS`` is a sink; every other key index
differs from its true position by one constant (the tokens folded into the carried state ``S0, z0``),
so the window test ``r > qi − W`` holds in index space. ``S0, z0`` (``HAS_STATE``) are far for every
query. ``HAS_MASK``: ``KVALID [B, NK]`` (int8, 0 = a padded key) removes keys from the local sums;
the launcher's caller zeroes those keys, whose features are then 0 (φ(0) = 0), which removes them
from the far sums and the state and stops their gradients.

Forward, per (batch·head, value block), query block ``c0`` (rows ``qi ∈ [QOFF+c0, QOFF+c0+BT)``):
non-sink keys ``r < F = BT·⌊(QOFF+c0−W+1)/BT⌋`` are far for every row and live in the running state
``S = Σ φ(k)ᵀv``, ``z = Σ φ(k)`` (folded block by block as ``F`` advances, sink rows zeroed); the key
blocks ``[F, qi_max]`` are visited explicitly with both masks, and the sink blocks below ``F`` with
the sink mask only. The local softmax runs online (running max ``m``, rescaled ``Σ a v`` and
``Σ a``), the far sums unshifted, so the cost is ``O(T·(W + BT + M)·(D + Dv))``, plus the sinks.
Saved per row: ``den + ε``, ``c_i`` and the key index of the arg-max (softmax). Not ``CAUSAL``
(``QOFF = 0``, no state): keys at or above ``G = BT·⌈(c0+BT−1+W)/BT⌉`` are far for every row too
and enter as ``φ(q)(S_all − S_{<G})`` (``S_all`` from a first pass, ``S_{<G}`` folded as ``G``
advances); the explicit blocks are ``[F, G)`` plus the sink blocks outside them.

Backward (``Gᵢ = dOᵢ/denᵢ``, ``Cᵢ = −Gᵢ·oᵢ``, ``δ_ij = Gᵢ·v_j + Cᵢ`` = ∂L/∂(γa_ij) = ∂L/∂((1−γ)f_ij)):

    ∂L/∂u_ij = γ δ_ij ∂a_ij/∂u_ij − [j = j*_i] γ ρ_i           (softmax: ∂a/∂u = a; poly: p u^{p−1}, no 2nd term)
    ρ_i = Σ_L a_ij δ_ij,   ζ_i = Σ_F f_ij δ_ij,   ∂L/∂γ = Σ_i (ρ_i − ζ_i)
    dφ(q_i) = (1−γ) Σ_F δ_ij φ(k_j),  dφ(k_j) = (1−γ) Σ_F δ_ij φ(q_i),
    dv_j = γ Σ_L a_ij G_i + (1−γ) Σ_F f_ij G_i,
    dS0 = (1−γ) Σ_i φ(q_i)ᵀ G_i,  dz0 = (1−γ) Σ_i C_i φ(q_i).

The second term of ∂L/∂u is the gradient through ``c_i = u_{i j*}`` (the far terms are not shifted, so
``c_i`` changes the output): the kernel writes ``ρ, ζ`` per row and the launcher adds the
``O(T·D)`` arg-max terms ``dq_i += s e_i k_{j*}``, ``dk_{j*} += s e_i q_i`` (``e_i = −γ ρ_i``) with a
gather/scatter. The dq program walks query blocks forward with the same state and block partition
as the forward; the dk/dv program walks key blocks backward with ``dS = Σ φ(q)ᵀG``, ``dz = Σ Cφ(q)``
over the query blocks that are far for the whole key block (``QOFF + c0 − W ≥ k0 + BT − 1``) and
visits the rest explicitly; a key block that holds a sink is visited against every query block.
Not ``CAUSAL``, the query blocks below ``fq = BT·⌊(k0−W+1)/BT⌋`` are far too and enter as
``dS_all − dS_{≥fq}`` (the latter folded as ``fq`` falls), and the explicit range is ``[fq, gf)``.
Through the features, ``chunk_features_bwd`` (shared with the pure kernel) gives dq, dk and dΘ.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sketchlab.attention.triton.features import chunk_features, chunk_features_bwd, feature_slots, zero_theta_grad

NEG = tl.constexpr(-1.0e30)  # the running max before any local key (finite: exp(NEG - NEG) = 1, never NaN)


@triton.jit
def _rows(base, rows, n, s_t, cols, ncols, s_c):
    """Load ``base[rows, cols]`` as fp32 ``[len(rows), len(cols)]``, zero outside ``rows < n``, ``cols < ncols``."""
    return tl.load(base + rows[:, None] * s_t + cols[None, :] * s_c,
                   mask=(rows[:, None] < n) & (cols[None, :] < ncols), other=0.0).to(tl.float32)


@triton.jit
def _key_ok(kv_base, krows, NK, s_mt, HAS_MASK: tl.constexpr):
    """Whether each key row is a real token (``KVALID != 0``); all True without a mask."""
    if HAS_MASK:
        return tl.load(kv_base + krows * s_mt, mask=krows < NK, other=0) != 0
    else:
        return krows >= 0


@triton.jit
def _local_far(qi2, r2, ok, W, SINKS, CAUSAL: tl.constexpr):
    """The local and far masks for query indices ``qi2`` and key indices ``r2`` (broadcast to one
    shape) where ``ok``: local ``|qi − r| < W`` or ``r < SINKS``; far the other non-sink keys;
    ``CAUSAL`` keeps ``r ≤ qi`` only."""
    if CAUSAL:
        ok = ok & (r2 <= qi2)
    near = (r2 > qi2 - W) & (r2 < qi2 + W)
    loc = ok & (near | (r2 < SINKS))
    far = ok & ((r2 <= qi2 - W) | (r2 >= qi2 + W)) & (r2 >= SINKS)
    return loc, far


@triton.jit
def _power(u, n):
    """``u ** n`` for an int ``n ≥ 0`` (``u ** 0 = 1``)."""
    a = tl.full(u.shape, 1.0, dtype=tl.float32)
    for _ in range(0, n):
        a = a * u
    return a


@triton.jit
def _online_update(u, loc, v, k0, m, l, acc, arg, P, SOFTMAX: tl.constexpr, PREC: tl.constexpr):
    """Fold one key block's local scores ``u [BT, BT]`` (mask ``loc``) into the running local sums."""
    if SOFTMAX:
        su = tl.where(loc, u, NEG)
        bmax = tl.max(su, axis=1)
        barg = tl.argmax(su, axis=1, tie_break_left=True) + k0
        m_new = tl.maximum(m, bmax)
        alpha = tl.exp(m - m_new)
        a = tl.where(loc, tl.exp(su - m_new[:, None]), 0.0)  # su, not u: no overflow off the mask
        acc = acc * alpha[:, None] + tl.dot(a, v, input_precision=PREC)
        l = l * alpha + tl.sum(a, axis=1)
        arg = tl.where(bmax > m, barg, arg)
        m = m_new
    else:
        a = tl.where(loc, _power(u, P), 0.0)
        acc += tl.dot(a, v, input_precision=PREC)
        l += tl.sum(a, axis=1)
    return m, l, acc, arg


@triton.jit
def _local_grad(u, loc, cm, da, P, SOFTMAX: tl.constexpr):
    """Local scores ``a`` and ``δ·∂a/∂u`` (both masked), for ``u`` laid out like ``loc``; ``cm``
    broadcasts as the row max ``c`` of the matching query."""
    if SOFTMAX:
        a = tl.where(loc, tl.exp(tl.where(loc, u, NEG) - cm), 0.0)
        return a, a * da
    else:
        a = tl.where(loc, _power(u, P), 0.0)
        return a, tl.where(loc, P * _power(u, P - 1) * da, 0.0)


@triton.jit
def _hybrid_fwd_kernel(
    Q, K, V, TQ, TK, GATE, S0, Z0, KVALID, O, DEN, CMAX, ARG,
    s_qb, s_qt, s_qh, s_qd,
    s_kb, s_kt, s_kh, s_kd,
    s_vb, s_vt, s_vh, s_vd,
    s_ob, s_ot, s_oh, s_od,
    s_nb, s_nt, s_nh,
    s_sb, s_sh, s_sf, s_sv,
    s_zb, s_zh, s_zf,
    s_mb, s_mt,
    s_qth, s_qtr, s_qtj, s_qtd, s_qtm,
    s_kth, s_ktr, s_ktj, s_ktd, s_ktm,
    H, T, NK, QOFF, W, SINKS, R, P, D, M, DV, scale, eps,
    CAUSAL: tl.constexpr, SOFTMAX: tl.constexpr, HAS_STATE: tl.constexpr, HAS_MASK: tl.constexpr, SELF: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_DV: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (batch·head, value block): ``O[b, :, h, block]``; the first value block
    also writes ``DEN`` (den + ε), ``CMAX`` (c_i) and ``ARG`` (key index of the local arg-max)."""
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    q_base = Q + b * s_qb + h * s_qh
    k_base = K + b * s_kb + h * s_kh
    v_base = V + b * s_vb + h * s_vh
    tq = TQ + h * s_qth
    tk = TK + h * s_kth
    gam = tl.load(GATE + h).to(tl.float32)

    if HAS_STATE:
        f_idx, f_ok = feature_slots(BLOCK_M, BLOCK_F, M, SELF)
        S = tl.load(S0 + b * s_sb + h * s_sh + f_idx[:, None] * s_sf + offs_v[None, :] * s_sv,
                    mask=f_ok[:, None] & (offs_v[None, :] < DV), other=0.0).to(tl.float32)
        z = tl.load(Z0 + b * s_zb + h * s_zh + f_idx * s_zf, mask=f_ok, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)
        z = tl.zeros([BLOCK_F], dtype=tl.float32)
    St = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)  # not CAUSAL: every non-sink key
    zt = tl.zeros([BLOCK_F], dtype=tl.float32)
    Su = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)  # not CAUSAL: the non-sink keys below gk
    zu = tl.zeros([BLOCK_F], dtype=tl.float32)
    if not CAUSAL:
        for k0 in range(0, NK, BLOCK_T):
            krows = k0 + offs_t
            k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
            v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
            phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            phk = tl.where(krows[:, None] >= SINKS, phk, 0.0)
            St += tl.dot(tl.trans(phk), v, input_precision=PREC)
            zt += tl.sum(phk, axis=0)
    kf = 0  # key blocks below kf are folded into S, z
    gk = 0  # not CAUSAL: key blocks below gk are folded into Su, zu
    for c0 in range(0, T, BLOCK_T):
        rows = c0 + offs_t
        qi = QOFF + rows
        q = _rows(q_base, rows, T, s_qt, offs_d, D, s_qd)
        phq = chunk_features(q, tq, s_qtr, s_qtj, s_qtd, s_qtm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
        F = (tl.maximum(QOFF + c0 - W + 1, 0) // BLOCK_T) * BLOCK_T
        for k0 in range(kf, F, BLOCK_T):
            krows = k0 + offs_t
            k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
            v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
            phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            phk = tl.where(krows[:, None] >= SINKS, phk, 0.0)
            S += tl.dot(tl.trans(phk), v, input_precision=PREC)
            z += tl.sum(phk, axis=0)
        kf = tl.maximum(kf, F)
        facc = tl.dot(phq, S, input_precision=PREC)  # [BLOCK_T, BLOCK_DV]
        fl = tl.sum(phq * z[None, :], axis=1)
        m = tl.full([BLOCK_T], NEG, dtype=tl.float32)
        l = tl.zeros([BLOCK_T], dtype=tl.float32)
        acc = tl.zeros([BLOCK_T, BLOCK_DV], dtype=tl.float32)
        arg = tl.zeros([BLOCK_T], dtype=tl.int32)
        for k0 in range(0, tl.minimum(SINKS, F), BLOCK_T):  # sink blocks below F: sinks only
            krows = k0 + offs_t
            k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
            v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
            u = scale * tl.dot(q, tl.trans(k), input_precision=PREC)
            loc = (rows[:, None] < T) & (krows[None, :] < SINKS) & _key_ok(KVALID + b * s_mb, krows, NK, s_mt, HAS_MASK)[None, :]
            m, l, acc, arg = _online_update(u, loc, v, k0, m, l, acc, arg, P, SOFTMAX, PREC)
        if CAUSAL:
            hi = QOFF + tl.minimum(c0 + BLOCK_T, T)  # explicit key blocks end after the last query
        else:  # keys at or above G are far for every row: S_total − S_{<G}
            hi = tl.minimum(tl.cdiv(c0 + BLOCK_T - 1 + W, BLOCK_T), tl.cdiv(NK, BLOCK_T)) * BLOCK_T
            for k0 in range(gk, hi, BLOCK_T):
                krows = k0 + offs_t
                k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
                v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
                phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M,
                                     BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
                phk = tl.where(krows[:, None] >= SINKS, phk, 0.0)
                Su += tl.dot(tl.trans(phk), v, input_precision=PREC)
                zu += tl.sum(phk, axis=0)
            gk = tl.maximum(gk, hi)
            facc += tl.dot(phq, St - Su, input_precision=PREC)
            fl += tl.sum(phq * (zt - zu)[None, :], axis=1)
            for k0 in range(hi, SINKS, BLOCK_T):  # sink blocks at or above G: sinks only
                krows = k0 + offs_t
                k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
                v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
                u = scale * tl.dot(q, tl.trans(k), input_precision=PREC)
                loc = (rows[:, None] < T) & (krows[None, :] < SINKS) & _key_ok(KVALID + b * s_mb, krows, NK, s_mt, HAS_MASK)[None, :]
                m, l, acc, arg = _online_update(u, loc, v, k0, m, l, acc, arg, P, SOFTMAX, PREC)
        for k0 in range(F, hi, BLOCK_T):  # the rest: window, sinks in [F, hi), far keys not in a state
            krows = k0 + offs_t
            k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
            v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
            ok = (rows[:, None] < T) & (krows[None, :] < NK) & _key_ok(KVALID + b * s_mb, krows, NK, s_mt, HAS_MASK)[None, :]
            loc, far = _local_far(qi[:, None], krows[None, :], ok, W, SINKS, CAUSAL)
            u = scale * tl.dot(q, tl.trans(k), input_precision=PREC)
            m, l, acc, arg = _online_update(u, loc, v, k0, m, l, acc, arg, P, SOFTMAX, PREC)
            phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            f = tl.where(far, tl.dot(phq, tl.trans(phk), input_precision=PREC), 0.0)
            facc += tl.dot(f, v, input_precision=PREC)
            fl += tl.sum(f, axis=1)
        den = gam * l + (1.0 - gam) * fl + eps
        out = (gam * acc + (1.0 - gam) * facc) / den[:, None]
        tl.store(O + b * s_ob + h * s_oh + rows[:, None] * s_ot + offs_v[None, :] * s_od, out,
                 mask=(rows[:, None] < T) & (offs_v[None, :] < DV))
        nmask = (rows < T) & (pid_v == 0)
        n_off = b * s_nb + h * s_nh + rows * s_nt
        tl.store(DEN + n_off, den, mask=nmask)
        tl.store(CMAX + n_off, m, mask=nmask)
        tl.store(ARG + n_off, arg, mask=nmask)


@triton.jit
def _hybrid_bwd_kernel(
    Q, K, V, TQ, TK, GATE, S0, Z0, KVALID, G, C, CMAX, DQ, DK, DVV, DTQ, DTK, RHO, ZETA, DS0, DZ0,
    s_qb, s_qt, s_qh, s_qd,
    s_kb, s_kt, s_kh, s_kd,
    s_vb, s_vt, s_vh, s_vd,
    s_gb, s_gt, s_gh, s_gd,
    s_nb, s_nt, s_nh,
    s_dqb, s_dqt, s_dqh, s_dqd,
    s_dkb, s_dkt, s_dkh, s_dkd,
    s_dvb, s_dvt, s_dvh, s_dvd,
    s_sb, s_sh, s_sf, s_sv,
    s_zb, s_zh, s_zf,
    s_mb, s_mt,
    s_qth, s_qtr, s_qtj, s_qtd, s_qtm,
    s_kth, s_ktr, s_ktj, s_ktd, s_ktm,
    s_gtb, s_gth, s_gtr, s_gtj, s_gtd, s_gtm,
    H, T, NK, QOFF, W, SINKS, R, P, D, M, DV, scale,
    CAUSAL: tl.constexpr, SOFTMAX: tl.constexpr, HAS_STATE: tl.constexpr, HAS_MASK: tl.constexpr, SELF: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_DV: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (batch·head), all of Dv: dq, dk, dv rows, the (b, h) dΘ slices, ρ and ζ per
    query (``C, CMAX, RHO, ZETA`` share the ``[B, T, H]`` strides ``s_n*``) and, with ``HAS_STATE``,
    dS0, dz0 (strides of ``S0, Z0``)."""
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    q_base = Q + b * s_qb + h * s_qh
    k_base = K + b * s_kb + h * s_kh
    v_base = V + b * s_vb + h * s_vh
    g_base = G + b * s_gb + h * s_gh
    n_base = b * s_nb + h * s_nh
    tq = TQ + h * s_qth
    tk = TK + h * s_kth
    dtq = DTQ + b * s_gtb + h * s_gth
    dtk = DTK + b * s_gtb + h * s_gth
    zero_theta_grad(dtq, s_gtr, s_gtj, s_gtd, s_gtm, R, P, D, M, BLOCK_D, BLOCK_M)
    zero_theta_grad(dtk, s_gtr, s_gtj, s_gtd, s_gtm, R, P, D, M, BLOCK_D, BLOCK_M)
    gam = tl.load(GATE + h).to(tl.float32)
    f_idx, f_ok = feature_slots(BLOCK_M, BLOCK_F, M, SELF)

    # ---- dq, ρ, ζ (and dS0, dz0): query blocks forward, the forward's partition -------------------
    if HAS_STATE:
        S = tl.load(S0 + b * s_sb + h * s_sh + f_idx[:, None] * s_sf + offs_v[None, :] * s_sv,
                    mask=f_ok[:, None] & (offs_v[None, :] < DV), other=0.0).to(tl.float32)
        z = tl.load(Z0 + b * s_zb + h * s_zh + f_idx * s_zf, mask=f_ok, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)
        z = tl.zeros([BLOCK_F], dtype=tl.float32)
    dS0 = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)
    dz0 = tl.zeros([BLOCK_F], dtype=tl.float32)
    St = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)  # not CAUSAL: every non-sink key
    zt = tl.zeros([BLOCK_F], dtype=tl.float32)
    Su = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)  # not CAUSAL: the non-sink keys below gk
    zu = tl.zeros([BLOCK_F], dtype=tl.float32)
    if not CAUSAL:
        for k0 in range(0, NK, BLOCK_T):
            krows = k0 + offs_t
            k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
            v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
            phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            phk = tl.where(krows[:, None] >= SINKS, phk, 0.0)
            St += tl.dot(tl.trans(phk), v, input_precision=PREC)
            zt += tl.sum(phk, axis=0)
    kf = 0
    gk = 0
    for c0 in range(0, T, BLOCK_T):
        rows = c0 + offs_t
        qi = QOFF + rows
        rmask = rows < T
        q = _rows(q_base, rows, T, s_qt, offs_d, D, s_qd)
        g = _rows(g_base, rows, T, s_gt, offs_v, DV, s_gd)
        c = tl.load(C + n_base + rows * s_nt, mask=rmask, other=0.0)
        cm = tl.load(CMAX + n_base + rows * s_nt, mask=rmask, other=0.0)
        phq = chunk_features(q, tq, s_qtr, s_qtj, s_qtd, s_qtm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
        F = (tl.maximum(QOFF + c0 - W + 1, 0) // BLOCK_T) * BLOCK_T
        for k0 in range(kf, F, BLOCK_T):
            krows = k0 + offs_t
            k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
            v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
            phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            phk = tl.where(krows[:, None] >= SINKS, phk, 0.0)
            S += tl.dot(tl.trans(phk), v, input_precision=PREC)
            z += tl.sum(phk, axis=0)
        kf = tl.maximum(kf, F)
        dphq = tl.dot(g, tl.trans(S), input_precision=PREC) + c[:, None] * z[None, :]  # Σ_F δ φ(k), unweighted
        dql = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)  # Σ_L (δ ∂a/∂u) k
        rho = tl.zeros([BLOCK_T], dtype=tl.float32)
        for k0 in range(0, tl.minimum(SINKS, F), BLOCK_T):
            krows = k0 + offs_t
            k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
            v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
            loc = rmask[:, None] & (krows[None, :] < SINKS) & _key_ok(KVALID + b * s_mb, krows, NK, s_mt, HAS_MASK)[None, :]
            u = scale * tl.dot(q, tl.trans(k), input_precision=PREC)
            da = tl.dot(g, tl.trans(v), input_precision=PREC) + c[:, None]
            a, du = _local_grad(u, loc, cm[:, None], da, P, SOFTMAX)
            rho += tl.sum(a * da, axis=1)
            dql += tl.dot(du, k, input_precision=PREC)
        if CAUSAL:
            hi = QOFF + tl.minimum(c0 + BLOCK_T, T)
        else:
            hi = tl.minimum(tl.cdiv(c0 + BLOCK_T - 1 + W, BLOCK_T), tl.cdiv(NK, BLOCK_T)) * BLOCK_T
            for k0 in range(gk, hi, BLOCK_T):
                krows = k0 + offs_t
                k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
                v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
                phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M,
                                     BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
                phk = tl.where(krows[:, None] >= SINKS, phk, 0.0)
                Su += tl.dot(tl.trans(phk), v, input_precision=PREC)
                zu += tl.sum(phk, axis=0)
            gk = tl.maximum(gk, hi)
            dphq += tl.dot(g, tl.trans(St - Su), input_precision=PREC) + c[:, None] * (zt - zu)[None, :]
            for k0 in range(hi, SINKS, BLOCK_T):
                krows = k0 + offs_t
                k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
                v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
                loc = rmask[:, None] & (krows[None, :] < SINKS) & _key_ok(KVALID + b * s_mb, krows, NK, s_mt, HAS_MASK)[None, :]
                u = scale * tl.dot(q, tl.trans(k), input_precision=PREC)
                da = tl.dot(g, tl.trans(v), input_precision=PREC) + c[:, None]
                a, du = _local_grad(u, loc, cm[:, None], da, P, SOFTMAX)
                rho += tl.sum(a * da, axis=1)
                dql += tl.dot(du, k, input_precision=PREC)
        for k0 in range(F, hi, BLOCK_T):
            krows = k0 + offs_t
            k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
            v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
            ok = rmask[:, None] & (krows[None, :] < NK) & _key_ok(KVALID + b * s_mb, krows, NK, s_mt, HAS_MASK)[None, :]
            loc, far = _local_far(qi[:, None], krows[None, :], ok, W, SINKS, CAUSAL)
            u = scale * tl.dot(q, tl.trans(k), input_precision=PREC)
            da = tl.dot(g, tl.trans(v), input_precision=PREC) + c[:, None]
            a, du = _local_grad(u, loc, cm[:, None], da, P, SOFTMAX)
            rho += tl.sum(a * da, axis=1)
            dql += tl.dot(du, k, input_precision=PREC)
            phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            dphq += tl.dot(tl.where(far, da, 0.0), phk, input_precision=PREC)
        zeta = tl.sum(phq * dphq, axis=1)
        dq = chunk_features_bwd(q, (1.0 - gam) * dphq, tq, s_qtr, s_qtj, s_qtd, s_qtm, dtq, s_gtr, s_gtj, s_gtd, s_gtm,
                           R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
        dq += (scale * gam) * dql
        tl.store(DQ + b * s_dqb + h * s_dqh + rows[:, None] * s_dqt + offs_d[None, :] * s_dqd, dq,
                 mask=rmask[:, None] & (offs_d[None, :] < D))
        tl.store(RHO + n_base + rows * s_nt, rho, mask=rmask)
        tl.store(ZETA + n_base + rows * s_nt, zeta, mask=rmask)
        if HAS_STATE:
            dS0 += tl.dot(tl.trans(phq), g, input_precision=PREC)
            dz0 += tl.sum(phq * c[:, None], axis=0)
    if HAS_STATE:
        tl.store(DS0 + b * s_sb + h * s_sh + f_idx[:, None] * s_sf + offs_v[None, :] * s_sv, (1.0 - gam) * dS0,
                 mask=f_ok[:, None] & (offs_v[None, :] < DV))
        tl.store(DZ0 + b * s_zb + h * s_zh + f_idx * s_zf, (1.0 - gam) * dz0, mask=f_ok)

    # ---- dk, dv: key blocks backward; dS, dz hold the query blocks far for the whole key block -------
    dS = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)
    dz = tl.zeros([BLOCK_F], dtype=tl.float32)
    cf = tl.cdiv(T, BLOCK_T) * BLOCK_T  # query blocks at or above cf are in dS, dz
    # not CAUSAL, the queries far below the key block: Σ_all − Σ_{≥ cl} (cl falls with k0)
    dSt = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)
    dzt = tl.zeros([BLOCK_F], dtype=tl.float32)
    dSg = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)
    dzg = tl.zeros([BLOCK_F], dtype=tl.float32)
    cl = tl.cdiv(T, BLOCK_T) * BLOCK_T
    if not CAUSAL:
        for c0 in range(0, T, BLOCK_T):
            rows = c0 + offs_t
            q = _rows(q_base, rows, T, s_qt, offs_d, D, s_qd)
            g = _rows(g_base, rows, T, s_gt, offs_v, DV, s_gd)
            c = tl.load(C + n_base + rows * s_nt, mask=rows < T, other=0.0)
            phq = chunk_features(q, tq, s_qtr, s_qtj, s_qtd, s_qtm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            dSt += tl.dot(tl.trans(phq), g, input_precision=PREC)
            dzt += tl.sum(phq * c[:, None], axis=0)
    n_kb = tl.cdiv(NK, BLOCK_T)
    for i in range(0, n_kb):
        k0 = (n_kb - 1 - i) * BLOCK_T
        krows = k0 + offs_t
        kmask = krows < NK
        k = _rows(k_base, krows, NK, s_kt, offs_d, D, s_kd)
        v = _rows(v_base, krows, NK, s_vt, offs_v, DV, s_vd)
        phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
        no_sink = k0 >= SINKS
        # the first query block far for every key of this block (only for blocks without sinks)
        gf = tl.cdiv(tl.maximum(k0 + BLOCK_T - 1 + W - QOFF, 0), BLOCK_T) * BLOCK_T
        gf = tl.where(no_sink, tl.minimum(gf, cf), cf)
        for c0 in range(gf, cf, BLOCK_T):
            rows = c0 + offs_t
            q = _rows(q_base, rows, T, s_qt, offs_d, D, s_qd)
            g = _rows(g_base, rows, T, s_gt, offs_v, DV, s_gd)
            c = tl.load(C + n_base + rows * s_nt, mask=rows < T, other=0.0)
            phq = chunk_features(q, tq, s_qtr, s_qtj, s_qtd, s_qtm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            dS += tl.dot(tl.trans(phq), g, input_precision=PREC)
            dz += tl.sum(phq * c[:, None], axis=0)
        cf = gf
        if CAUSAL:
            lo = (tl.maximum(k0 - QOFF, 0) // BLOCK_T) * BLOCK_T
            dSf = dS
            dzf = dz
        else:  # query blocks below fq are far for the whole key block
            fq = (tl.maximum(k0 - W + 1, 0) // BLOCK_T) * BLOCK_T
            fq = tl.where(no_sink, tl.minimum(fq, cl), cl)
            for c0 in range(fq, cl, BLOCK_T):
                rows = c0 + offs_t
                q = _rows(q_base, rows, T, s_qt, offs_d, D, s_qd)
                g = _rows(g_base, rows, T, s_gt, offs_v, DV, s_gd)
                c = tl.load(C + n_base + rows * s_nt, mask=rows < T, other=0.0)
                phq = chunk_features(q, tq, s_qtr, s_qtj, s_qtd, s_qtm, R, P, D, M,
                                     BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
                dSg += tl.dot(tl.trans(phq), g, input_precision=PREC)
                dzg += tl.sum(phq * c[:, None], axis=0)
            cl = fq
            lo = tl.where(no_sink, fq, 0)
            dSf = dS + (dSt - dSg)
            dzf = dz + (dzt - dzg)
        use = tl.where(no_sink, 1.0, 0.0)  # a block with sinks is visited against every query block
        dphk = use * (tl.dot(v, tl.trans(dSf), input_precision=PREC) + dzf[None, :])  # Σ_F δ φ(q), unweighted
        dvf = use * tl.dot(phk, dSf, input_precision=PREC)  # Σ_F f G
        dkl = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        dvl = tl.zeros([BLOCK_T, BLOCK_DV], dtype=tl.float32)
        hi = tl.where(no_sink, cf, tl.cdiv(T, BLOCK_T) * BLOCK_T)
        for c0 in range(lo, hi, BLOCK_T):
            rows = c0 + offs_t
            qi = QOFF + rows
            q = _rows(q_base, rows, T, s_qt, offs_d, D, s_qd)
            g = _rows(g_base, rows, T, s_gt, offs_v, DV, s_gd)
            c = tl.load(C + n_base + rows * s_nt, mask=rows < T, other=0.0)
            cm = tl.load(CMAX + n_base + rows * s_nt, mask=rows < T, other=0.0)
            phq = chunk_features(q, tq, s_qtr, s_qtj, s_qtd, s_qtm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            ok = kmask[:, None] & (rows[None, :] < T) & _key_ok(KVALID + b * s_mb, krows, NK, s_mt, HAS_MASK)[:, None]
            loc, far = _local_far(qi[None, :], krows[:, None], ok, W, SINKS, CAUSAL)  # [s, t]
            ut = scale * tl.dot(k, tl.trans(q), input_precision=PREC)  # [BLOCK_T (s), BLOCK_T (t)]
            dat = tl.dot(v, tl.trans(g), input_precision=PREC) + c[None, :]
            at, dut = _local_grad(ut, loc, cm[None, :], dat, P, SOFTMAX)
            dkl += tl.dot(dut, q, input_precision=PREC)
            dvl += tl.dot(at, g, input_precision=PREC)
            ft = tl.where(far, tl.dot(phk, tl.trans(phq), input_precision=PREC), 0.0)
            dphk += tl.dot(tl.where(far, dat, 0.0), phq, input_precision=PREC)
            dvf += tl.dot(ft, g, input_precision=PREC)
        # rows ≥ NK of dphk may be nonzero, but their k rows are 0 (no dΘ) and their dk is not stored
        dk = chunk_features_bwd(k, (1.0 - gam) * dphk, tk, s_ktr, s_ktj, s_ktd, s_ktm, dtk, s_gtr, s_gtj, s_gtd, s_gtm,
                           R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
        dk += (scale * gam) * dkl
        dv = gam * dvl + (1.0 - gam) * dvf
        tl.store(DK + b * s_dkb + h * s_dkh + krows[:, None] * s_dkt + offs_d[None, :] * s_dkd, dk,
                 mask=kmask[:, None] & (offs_d[None, :] < D))
        tl.store(DVV + b * s_dvb + h * s_dvh + krows[:, None] * s_dvt + offs_v[None, :] * s_dvd, dv,
                 mask=kmask[:, None] & (offs_v[None, :] < DV))


#: The fixed CUDA configs of the hybrid (no autotuning: its compile is the longest of the package):
#: (BLOCK_T, BLOCK_DV, num_warps) forward, (BLOCK_T, num_warps) backward.
HYBRID_FWD_FIXED = (32, 64, 4)
HYBRID_BWD_FIXED = (16, 4)
hybrid_fwd_kernel = _hybrid_fwd_kernel
hybrid_bwd_kernel = _hybrid_bwd_kernel
