"""The LLoPS features of one chunk in registers, and their backward: the ``@triton.jit`` device functions the pure
kernel (:mod:`._kernels`) and the hybrid kernel (:mod:`._hybrid`) share, written once.

For a chunk ``x [BLOCK_T, BLOCK_D]`` (fp32, rows and columns past ``T``, ``D`` zero) and the factors
``Θ [R, P, D, M]`` of one head (strides ``s_r, s_j, s_d, s_m``):

    φ(x) = Σ_{r<R} ∏_{j<P} (x Θ_{r,j})        [BLOCK_T, BLOCK_M]   (:func:`chunk_llops_map`)
    ψ(x) = φ(x) ⊗ φ(x), slot a·BLOCK_M + b    [BLOCK_T, BLOCK_M²]  (``SELF``: :func:`chunk_features`)

and the chain rule back through them (:func:`chunk_features_bwd`): ``dφ_a = Σ_b (dψ_ab + dψ_ba) φ_b`` under
``SELF``, then ``G_{r,j} = dφ ⊙ ∏_{l≠j} x Θ_{r,l}``, ``dx = Σ_{r,j} G_{r,j} Θ_{r,j}ᵀ`` and
``dΘ_{r,j} += xᵀ G_{r,j}``
(read-add-write into the program's own fp32 slice, zeroed first by :func:`zero_theta_grad`).
:func:`feature_slots` maps a kernel's feature slot to the torch index of the same feature. The derivations of the
kernels around them are in :mod:`._kernels`' docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["chunk_features", "chunk_features_bwd", "chunk_llops_map", "feature_slots", "zero_theta_grad"]


@triton.jit
def chunk_llops_map(
    x, th_ptr, s_r, s_j, s_d, s_m, R, P, D, M,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, PREC: tl.constexpr,
):
    """φ(x) = Σ_r ∏_j x Θ_{r,j} for a chunk ``x`` [BLOCK_T, BLOCK_D] fp32 -> [BLOCK_T, BLOCK_M] fp32."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    th_off = offs_d[:, None] * s_d + offs_m[None, :] * s_m  # [BLOCK_D, BLOCK_M]
    th_mask = (offs_d[:, None] < D) & (offs_m[None, :] < M)
    phi = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    for r in range(0, R):
        prod = tl.full([BLOCK_T, BLOCK_M], 1.0, dtype=tl.float32)
        for j in range(0, P):
            th = tl.load(th_ptr + r * s_r + j * s_j + th_off, mask=th_mask, other=0.0).to(tl.float32)
            prod = prod * tl.dot(x, th, input_precision=PREC)
        phi += prod
    return phi


@triton.jit
def chunk_features(
    x, th_ptr, s_r, s_j, s_d, s_m, R, P, D, M,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, SELF: tl.constexpr, PREC: tl.constexpr,
):
    """The attention features of a chunk: φ(x) [BLOCK_T, BLOCK_M], or with ``SELF`` the self-tensor
    ``φ(x) ⊗ φ(x)`` [BLOCK_T, BLOCK_M²] (index ``a·BLOCK_M + b``), formed in registers."""
    phi = chunk_llops_map(x, th_ptr, s_r, s_j, s_d, s_m, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, PREC)
    if SELF:
        phi = tl.reshape(phi[:, :, None] * phi[:, None, :], [BLOCK_T, BLOCK_M * BLOCK_M])
    return phi


@triton.jit
def feature_slots(BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, M, SELF: tl.constexpr):
    """Kernel feature slot → the torch index of the same feature and whether it is real.

    φ: slot ``a`` ↔ ``a`` (``a < M``). Self-tensor: slot ``a·BLOCK_M + b`` ↔ ``a·M + b``."""
    offs_f = tl.arange(0, BLOCK_F)
    if SELF:
        fa = offs_f // BLOCK_M
        fb = offs_f % BLOCK_M
        return fa * M + fb, (fa < M) & (fb < M)
    else:
        return offs_f, offs_f < M


@triton.jit
def zero_theta_grad(
    dth_ptr, s_r, s_j, s_d, s_m, R, P, D, M, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Zero this program's ``[R, P, D, M]`` slice of a dΘ buffer."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    off = offs_d[:, None] * s_d + offs_m[None, :] * s_m
    mask = (offs_d[:, None] < D) & (offs_m[None, :] < M)
    for r in range(0, R):
        for j in range(0, P):
            tl.store(dth_ptr + r * s_r + j * s_j + off, tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32), mask=mask)
    tl.debug_barrier()


@triton.jit
def chunk_features_bwd(
    x, dfeat, th_ptr, s_r, s_j, s_d, s_m, dth_ptr, g_r, g_j, g_d, g_m, R, P, D, M,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, SELF: tl.constexpr, PREC: tl.constexpr,
):
    """Chain rule through the features of one chunk: return dx [BLOCK_T, BLOCK_D]; add xᵀ G_{r,j}
    to dΘ_{r,j}.

    ``dfeat`` is the gradient of :func:`chunk_features`' output. With ``SELF`` it is first taken back
    through ``ψ_{ab} = φ_a φ_b``: ``dφ_a = Σ_b (dψ_{ab} + dψ_{ba}) φ_b`` (φ recomputed). Then
    ``G_{r,j} = dφ ⊙ ∏_{l≠j} x Θ_{r,l}`` (products recomputed, O(P²) small matmuls per r).
    """
    if SELF:
        phi = chunk_llops_map(x, th_ptr, s_r, s_j, s_d, s_m, R, P, D, M, BLOCK_T, BLOCK_D, BLOCK_M, PREC)
        d3 = tl.reshape(dfeat, [BLOCK_T, BLOCK_M, BLOCK_M])  # [t, a, b]
        dphi = tl.sum(d3 * phi[:, None, :], axis=2) + tl.sum(d3 * phi[:, :, None], axis=1)
    else:
        dphi = dfeat
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    th_off = offs_d[:, None] * s_d + offs_m[None, :] * s_m  # [BLOCK_D, BLOCK_M]
    dth_off = offs_d[:, None] * g_d + offs_m[None, :] * g_m
    mask = (offs_d[:, None] < D) & (offs_m[None, :] < M)
    dx = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for r in range(0, R):
        for j in range(0, P):
            grad = dphi
            for l in range(0, P):
                if l != j:
                    th_l = tl.load(th_ptr + r * s_r + l * s_j + th_off, mask=mask, other=0.0).to(tl.float32)
                    grad = grad * tl.dot(x, th_l, input_precision=PREC)
            th_j = tl.load(th_ptr + r * s_r + j * s_j + th_off, mask=mask, other=0.0).to(tl.float32)
            dx += tl.dot(grad, tl.trans(th_j), input_precision=PREC)
            dth_ptrs = dth_ptr + r * g_r + j * g_j + dth_off
            acc = tl.load(dth_ptrs, mask=mask, other=0.0)
            acc += tl.dot(tl.trans(x), grad, input_precision=PREC)
            tl.store(dth_ptrs, acc, mask=mask)
            # the next read of this slice may come from other threads of the program
            tl.debug_barrier()
    return dx
