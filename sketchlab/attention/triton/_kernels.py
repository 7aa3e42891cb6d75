"""Triton kernels of fused LLoPS linear attention (forward and backward), layout ``[B, T, H, D]``.

Queries ``q [B, T, H, D]``, keys ``k [B, NK, H, D]`` and values ``v [B, NK, H, Dv]`` (``NK == T``
when causal). Each program owns one (batch, head) pair (the forward also splits the value dimension into
blocks). It walks the sequence chunk by chunk (``BLOCK_T`` tokens), computes the LLoPS features of
the chunk in registers,

    φ(X) = Σ_{r<R} ∏_{j<P} (X Θ_{r,j}),        X [BLOCK_T, D], Θ_{r,j} [D, M],

and runs the chunked linear-attention recurrence with the state ``S = Σ_s φ(k_s)ᵀ v_s`` [M, Dv]
and normaliser ``z = Σ_s φ(k_s)`` [M] held in fp32. Causal: ``out_t = φ(q_t) S_{<c} +
Σ_{s∈c, s≤t} (φ(q_t)·φ(k_s)) v_s`` for the chunk ``c`` holding ``t``; non-causal: a first pass
builds the full ``S, z``. ``NORMALIZE``: ``out_t = num_t / (den_t + eps)`` with
``den_t = φ(q_t)·z_{<c} + Σ_{s∈c, s≤t} φ(q_t)·φ(k_s)``.

Self-tensor (``SELF``, for ``non_negative=True``): the features are ``ψ = φ ⊗ φ`` (scores
``(φ(q)·φ(k))² ≥ 0``), formed per chunk in registers as ``[BLOCK_T, BLOCK_M²]``; the state becomes
``[BLOCK_M², Dv]`` and the backward maps ``dψ`` back to ``dφ`` before the chain rule below. Nothing
of size ``T·M²`` is ever stored.

Padding: every block dimension is a power of two ≥ 16 (``tl.dot``'s minimum); loads of rows
``≥ T``, features ``≥ M``, head dims ``≥ D`` and value columns ``≥ Dv`` are masked to 0. A zero
token row has zero features (every term of φ is a product of ``P ≥ 1`` linear forms), and a zero
column of Θ gives a zero feature, so padding never leaks into the sums; stores are masked.

Backward (derivation, with ``a_ts = φ(q_t)·φ(k_s)`` on the mask):
for ``NORMALIZE`` the launcher passes ``g_t = dO_t / (den_t + eps)`` and
``c_t = -(g_t · O_t)``, so that ``∂L/∂a_ts = g_t·v_s + c_t``; without it ``g = dO`` and ``c = 0``.
Then ``dφ(q_t) = Σ_{s≤t} (g_t·v_s + c_t) φ(k_s)`` (forward over chunks with the running ``S, z``),
``dφ(k_s) = Σ_{t≥s} (g_t·v_s + c_t) φ(q_t)`` and ``dv_s = Σ_{t≥s} a_ts g_t`` (reverse over chunks
with ``dS = Σ_t φ(q_t)ᵀ g_t`` [M, Dv], ``dz = Σ_t c_t φ(q_t)`` [M]). Through the map, with
``P_{r,l} = X Θ_{r,l}`` recomputed: ``G_{r,j} = dφ ⊙ ∏_{l≠j} P_{r,l}``,
``dX = Σ_{r,j} G_{r,j} Θ_{r,j}ᵀ``, ``dΘ_{r,j} = Xᵀ G_{r,j}``; ``dΘ`` is accumulated per
(batch, head) program in its own slice of a ``[B, H, R, P, D, M]`` fp32 buffer (read-add-write,
no atomics; the program zeroes its slice first) and summed over ``B`` by the launcher.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sketchlab.attention.triton.features import chunk_features, chunk_features_bwd, feature_slots, zero_theta_grad


@triton.jit
def _llops_fwd_kernel(
    Q, K, V, TQ, TK, O, DEN, S0, Z0,
    s_qb, s_qt, s_qh, s_qd,
    s_kb, s_kt, s_kh, s_kd,
    s_vb, s_vt, s_vh, s_vd,
    s_ob, s_ot, s_oh, s_od,
    s_nb, s_nt, s_nh,
    s_sb, s_sh, s_sf, s_sv,
    s_zb, s_zh, s_zf,
    s_qth, s_qtr, s_qtj, s_qtd, s_qtm,
    s_kth, s_ktr, s_ktj, s_ktd, s_ktm,
    H, T, NK, R, P, D, M, DV, eps,
    CAUSAL: tl.constexpr, NORMALIZE: tl.constexpr, SELF: tl.constexpr, HAS_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_DV: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (batch·head, value block): writes ``O[b, :, h, block]`` (and ``DEN[b, :, h]``
    = den + eps from the first value block when ``NORMALIZE``). ``HAS_STATE`` (causal): ``S, z`` start
    from the carried state ``S0 [B, H, F, Dv]``, ``Z0 [B, H, F]`` instead of 0."""
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
    o_base = O + b * s_ob + h * s_oh
    tq = TQ + h * s_qth
    tk = TK + h * s_kth

    if HAS_STATE:
        f_idx, f_ok = feature_slots(BLOCK_M, BLOCK_F, M, SELF)
        S = tl.load(S0 + b * s_sb + h * s_sh + f_idx[:, None] * s_sf + offs_v[None, :] * s_sv,
                    mask=f_ok[:, None] & (offs_v[None, :] < DV), other=0.0).to(tl.float32)
        z = tl.load(Z0 + b * s_zb + h * s_zh + f_idx * s_zf, mask=f_ok, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)  # Σ φ(k_s)ᵀ v_s over past chunks
        z = tl.zeros([BLOCK_F], dtype=tl.float32)  # Σ φ(k_s)
    if not CAUSAL:
        for c0 in range(0, NK, BLOCK_T):
            rows = c0 + offs_t
            rmask = rows < NK
            k = tl.load(k_base + rows[:, None] * s_kt + offs_d[None, :] * s_kd,
                        mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
            v = tl.load(v_base + rows[:, None] * s_vt + offs_v[None, :] * s_vd,
                        mask=rmask[:, None] & (offs_v[None, :] < DV), other=0.0).to(tl.float32)
            phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            S += tl.dot(tl.trans(phk), v, input_precision=PREC)
            z += tl.sum(phk, axis=0)

    for c0 in range(0, T, BLOCK_T):
        rows = c0 + offs_t
        rmask = rows < T
        q = tl.load(q_base + rows[:, None] * s_qt + offs_d[None, :] * s_qd,
                    mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        phq = chunk_features(q, tq, s_qtr, s_qtj, s_qtd, s_qtm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
        num = tl.dot(phq, S, input_precision=PREC)  # [BLOCK_T, BLOCK_DV]
        den = tl.sum(phq * z[None, :], axis=1)  # [BLOCK_T]
        if CAUSAL:
            k = tl.load(k_base + rows[:, None] * s_kt + offs_d[None, :] * s_kd,
                        mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
            v = tl.load(v_base + rows[:, None] * s_vt + offs_v[None, :] * s_vd,
                        mask=rmask[:, None] & (offs_v[None, :] < DV), other=0.0).to(tl.float32)
            phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            a = tl.dot(phq, tl.trans(phk), input_precision=PREC)  # [BLOCK_T (t), BLOCK_T (s)]
            a = tl.where((rows[:, None] >= rows[None, :]) & rmask[None, :], a, 0.0)
            num += tl.dot(a, v, input_precision=PREC)
            den += tl.sum(a, axis=1)
            S += tl.dot(tl.trans(phk), v, input_precision=PREC)
            z += tl.sum(phk, axis=0)
        if NORMALIZE:
            den = den + eps
            out = num / den[:, None]
            tl.store(DEN + b * s_nb + h * s_nh + rows * s_nt, den, mask=rmask & (pid_v == 0))
        else:
            out = num
        tl.store(o_base + rows[:, None] * s_ot + offs_v[None, :] * s_od, out,
                 mask=rmask[:, None] & (offs_v[None, :] < DV))


@triton.jit
def _llops_bwd_kernel(
    Q, K, V, TQ, TK, G, C, DQ, DK, DVV, DTQ, DTK, S0, Z0, DS0, DZ0,
    s_qb, s_qt, s_qh, s_qd,
    s_kb, s_kt, s_kh, s_kd,
    s_vb, s_vt, s_vh, s_vd,
    s_gb, s_gt, s_gh, s_gd,
    s_cb, s_ct, s_ch,
    s_dqb, s_dqt, s_dqh, s_dqd,
    s_dkb, s_dkt, s_dkh, s_dkd,
    s_dvb, s_dvt, s_dvh, s_dvd,
    s_qth, s_qtr, s_qtj, s_qtd, s_qtm,
    s_kth, s_ktr, s_ktj, s_ktd, s_ktm,
    s_gtb, s_gth, s_gtr, s_gtj, s_gtd, s_gtm,
    s_sb, s_sh, s_sf, s_sv,
    s_zb, s_zh, s_zf,
    H, T, NK, R, P, D, M, DV,
    CAUSAL: tl.constexpr, NORMALIZE: tl.constexpr, SELF: tl.constexpr, HAS_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_DV: tl.constexpr, PREC: tl.constexpr,
):
    """One program per (batch·head), all of Dv: writes dq, dk, dv rows of (b, h) and the (b, h)
    slices of the dΘ_Q, dΘ_K buffers ``[B, H, R, P, D, M]`` (shared strides ``s_gt*``). ``HAS_STATE``
    (causal): the dq pass starts from ``S0, Z0`` and ``DS0 = Σ_t φ(q_t)ᵀ g_t``, ``DZ0 = Σ_t c_t φ(q_t)``
    (the final ``dS, dz`` of the dk pass) are written with the strides of ``S0, Z0``."""
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    dmask = offs_d[None, :] < D
    vmask = offs_v[None, :] < DV
    q_base = Q + b * s_qb + h * s_qh
    k_base = K + b * s_kb + h * s_kh
    v_base = V + b * s_vb + h * s_vh
    g_base = G + b * s_gb + h * s_gh
    c_base = C + b * s_cb + h * s_ch
    tq = TQ + h * s_qth
    tk = TK + h * s_kth
    dtq = DTQ + b * s_gtb + h * s_gth
    dtk = DTK + b * s_gtb + h * s_gth
    zero_theta_grad(dtq, s_gtr, s_gtj, s_gtd, s_gtm, R, P, D, M, BLOCK_D, BLOCK_M)
    zero_theta_grad(dtk, s_gtr, s_gtj, s_gtd, s_gtm, R, P, D, M, BLOCK_D, BLOCK_M)

    # ---- dq: forward over chunks with the running S = Σ φ(k)ᵀ v, z = Σ φ(k) ----------------
    if HAS_STATE:
        f_idx, f_ok = feature_slots(BLOCK_M, BLOCK_F, M, SELF)
        S = tl.load(S0 + b * s_sb + h * s_sh + f_idx[:, None] * s_sf + offs_v[None, :] * s_sv,
                    mask=f_ok[:, None] & vmask, other=0.0).to(tl.float32)
        z = tl.load(Z0 + b * s_zb + h * s_zh + f_idx * s_zf, mask=f_ok, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)
        z = tl.zeros([BLOCK_F], dtype=tl.float32)
    if not CAUSAL:
        for c0 in range(0, NK, BLOCK_T):
            rows = c0 + offs_t
            rmask = rows[:, None] < NK
            k = tl.load(k_base + rows[:, None] * s_kt + offs_d[None, :] * s_kd, mask=rmask & dmask, other=0.0).to(tl.float32)
            v = tl.load(v_base + rows[:, None] * s_vt + offs_v[None, :] * s_vd, mask=rmask & vmask, other=0.0).to(tl.float32)
            phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            S += tl.dot(tl.trans(phk), v, input_precision=PREC)
            z += tl.sum(phk, axis=0)
    for c0 in range(0, T, BLOCK_T):
        rows = c0 + offs_t
        rmask = rows[:, None] < T
        q = tl.load(q_base + rows[:, None] * s_qt + offs_d[None, :] * s_qd, mask=rmask & dmask, other=0.0).to(tl.float32)
        g = tl.load(g_base + rows[:, None] * s_gt + offs_v[None, :] * s_gd, mask=rmask & vmask, other=0.0)
        dphq = tl.dot(g, tl.trans(S), input_precision=PREC)  # [BLOCK_T, BLOCK_F]
        if NORMALIZE:
            c = tl.load(c_base + rows * s_ct, mask=rows < T, other=0.0)
            dphq += c[:, None] * z[None, :]
        if CAUSAL:
            k = tl.load(k_base + rows[:, None] * s_kt + offs_d[None, :] * s_kd, mask=rmask & dmask, other=0.0).to(tl.float32)
            v = tl.load(v_base + rows[:, None] * s_vt + offs_v[None, :] * s_vd, mask=rmask & vmask, other=0.0).to(tl.float32)
            phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            da = tl.dot(g, tl.trans(v), input_precision=PREC)  # [BLOCK_T (t), BLOCK_T (s)]
            if NORMALIZE:
                da += c[:, None]
            da = tl.where((rows[:, None] >= rows[None, :]) & (rows[None, :] < T), da, 0.0)
            dphq += tl.dot(da, phk, input_precision=PREC)
            S += tl.dot(tl.trans(phk), v, input_precision=PREC)
            z += tl.sum(phk, axis=0)
        dq = chunk_features_bwd(q, dphq, tq, s_qtr, s_qtj, s_qtd, s_qtm, dtq, s_gtr, s_gtj, s_gtd, s_gtm,
                           R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
        tl.store(DQ + b * s_dqb + h * s_dqh + rows[:, None] * s_dqt + offs_d[None, :] * s_dqd, dq, mask=rmask & dmask)

    # ---- dk, dv: reverse over chunks with dS = Σ φ(q)ᵀ g, dz = Σ c φ(q) -----------------
    dS = tl.zeros([BLOCK_F, BLOCK_DV], dtype=tl.float32)
    dz = tl.zeros([BLOCK_F], dtype=tl.float32)
    if not CAUSAL:
        for c0 in range(0, T, BLOCK_T):
            rows = c0 + offs_t
            rmask = rows[:, None] < T
            q = tl.load(q_base + rows[:, None] * s_qt + offs_d[None, :] * s_qd, mask=rmask & dmask, other=0.0).to(tl.float32)
            g = tl.load(g_base + rows[:, None] * s_gt + offs_v[None, :] * s_gd, mask=rmask & vmask, other=0.0)
            phq = chunk_features(q, tq, s_qtr, s_qtj, s_qtd, s_qtm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            dS += tl.dot(tl.trans(phq), g, input_precision=PREC)
            if NORMALIZE:
                c = tl.load(c_base + rows * s_ct, mask=rows < T, other=0.0)
                dz += tl.sum(phq * c[:, None], axis=0)
    n_chunks = tl.cdiv(NK, BLOCK_T)
    for i in range(0, n_chunks):
        c0 = (n_chunks - 1 - i) * BLOCK_T
        rows = c0 + offs_t
        rmask = rows[:, None] < NK
        k = tl.load(k_base + rows[:, None] * s_kt + offs_d[None, :] * s_kd, mask=rmask & dmask, other=0.0).to(tl.float32)
        v = tl.load(v_base + rows[:, None] * s_vt + offs_v[None, :] * s_vd, mask=rmask & vmask, other=0.0).to(tl.float32)
        phk = chunk_features(k, tk, s_ktr, s_ktj, s_ktd, s_ktm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
        dphk = tl.dot(v, tl.trans(dS), input_precision=PREC)  # [BLOCK_T, BLOCK_F]
        if NORMALIZE:
            dphk += dz[None, :]
        dv = tl.dot(phk, dS, input_precision=PREC)  # [BLOCK_T, BLOCK_DV]
        if CAUSAL:
            q = tl.load(q_base + rows[:, None] * s_qt + offs_d[None, :] * s_qd, mask=rmask & dmask, other=0.0).to(tl.float32)
            g = tl.load(g_base + rows[:, None] * s_gt + offs_v[None, :] * s_gd, mask=rmask & vmask, other=0.0)
            phq = chunk_features(q, tq, s_qtr, s_qtj, s_qtd, s_qtm, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
            keep = (rows[None, :] >= rows[:, None]) & (rows[None, :] < T)  # [s, t]: t ≥ s
            at = tl.dot(phk, tl.trans(phq), input_precision=PREC)  # [BLOCK_T (s), BLOCK_T (t)]
            at = tl.where(keep, at, 0.0)
            dat = tl.dot(v, tl.trans(g), input_precision=PREC)
            if NORMALIZE:
                c = tl.load(c_base + rows * s_ct, mask=rows < T, other=0.0)
                dat += c[None, :]
            dat = tl.where(keep, dat, 0.0)
            dphk += tl.dot(dat, phq, input_precision=PREC)
            dv += tl.dot(at, g, input_precision=PREC)
            dS += tl.dot(tl.trans(phq), g, input_precision=PREC)
            if NORMALIZE:
                dz += tl.sum(phq * c[:, None], axis=0)
        # rows ≥ T of dphk may hold dz, but their k rows are 0 (no dΘ) and their dk is not stored
        dk = chunk_features_bwd(k, dphk, tk, s_ktr, s_ktj, s_ktd, s_ktm, dtk, s_gtr, s_gtj, s_gtd, s_gtm,
                           R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, SELF, PREC)
        tl.store(DK + b * s_dkb + h * s_dkh + rows[:, None] * s_dkt + offs_d[None, :] * s_dkd, dk, mask=rmask & dmask)
        tl.store(DVV + b * s_dvb + h * s_dvh + rows[:, None] * s_dvt + offs_v[None, :] * s_dvd, dv, mask=rmask & vmask)
    if HAS_STATE:
        tl.store(DS0 + b * s_sb + h * s_sh + f_idx[:, None] * s_sf + offs_v[None, :] * s_sv, dS, mask=f_ok[:, None] & vmask)
        if NORMALIZE:
            tl.store(DZ0 + b * s_zb + h * s_zh + f_idx * s_zf, dz, mask=f_ok)
        else:
            tl.store(DZ0 + b * s_zb + h * s_zh + f_idx * s_zf, tl.zeros([BLOCK_F], dtype=tl.float32), mask=f_ok)


#: Autotuning space on CUDA: (BLOCK_T, BLOCK_DV, num_warps) for the forward, (BLOCK_T, num_warps)
#: for the backward (which holds all of Dv). Kept short: every distinct shape compiles each one, and
#: an sm_90 compile of the backward takes tens of seconds (measured ahead of time, without a GPU).
FWD_CONFIGS = [(32, 64, 4), (64, 64, 4), (64, 128, 8)]
BWD_CONFIGS = [(16, 4), (32, 8)]
#: The fixed CUDA config when autotuning is off (``SKETCHLAB_TRITON_AUTOTUNE=0``).
FWD_FIXED = (32, 64, 4)
BWD_FIXED = (16, 4)


def _fwd_configs():
    return [triton.Config({"BLOCK_T": t, "BLOCK_DV": dv}, num_warps=w, num_stages=2) for t, dv, w in FWD_CONFIGS]


def _bwd_configs():
    return [triton.Config({"BLOCK_T": t}, num_warps=w, num_stages=2) for t, w in BWD_CONFIGS]


def _prune_value_blocks(configs, named_args, **kwargs):
    """Drop forward configs whose value block exceeds the padded Dv (they only repeat a smaller one)."""
    padded = max(16, triton.next_power_of_2(named_args["DV"]))
    kept = [c for c in configs if c.kwargs["BLOCK_DV"] <= padded]
    return kept or configs


_KEY = ["D", "M", "DV", "R", "P", "CAUSAL", "NORMALIZE", "SELF", "HAS_STATE", "BLOCK_D", "BLOCK_M", "PREC"]
llops_fwd_kernel_tuned = triton.autotune(
    configs=_fwd_configs(), key=_KEY, prune_configs_by={"early_config_prune": _prune_value_blocks}
)(_llops_fwd_kernel)
llops_bwd_kernel_tuned = triton.autotune(configs=_bwd_configs(), key=_KEY + ["BLOCK_DV"])(_llops_bwd_kernel)
llops_fwd_kernel = _llops_fwd_kernel
llops_bwd_kernel = _llops_bwd_kernel
