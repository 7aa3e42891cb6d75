r"""The direct LLoPS fit: exact block alternating least squares, then Levenberg–Marquardt.

:func:`fit_llops_direct` minimises :math:`\|\Phi_Q\Phi_K^\top - A\|_F^2`,
:math:`A = (QK^\top)^{\circ p}`, over Θ in two stages per head (batched over heads): ALS sweeps
(:func:`_als_side`, exact least squares in one column's factor at a time) and then
Levenberg–Marquardt steps on the whole parameter vector (:func:`~sketchlab.llops.fit_lm.lm_step`),
interleaved with further ALS sweeps.
:func:`_als_side_naive` is the float64 twin of one side's update.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
from tqdm import tqdm

from .._validation import DEFAULT_MAX_BYTES, check_nonnegative_int, check_positive_int, check_real
from ..featuremaps.base import FittedMaps
from ..objective import check_finite_loss
from ._fitting import balance, prepare
from .fit_lm import lm_step
from .inits import llops_init
from .maps import llops_features
from .pair import llops_maps
from .target import ROUTES, fit_problem, iteration_flops

__all__ = ["QUALITY", "Preset", "fit_llops_direct"]

class Preset(NamedTuple):
    """A budget of :func:`fit_llops_direct`."""

    steps: int  #: ALS sweeps of the first stage
    lm_steps: int  #: Levenberg–Marquardt steps
    cg_iters: int  #: conjugate-gradient iterations per LM step
    interleave: int  #: ALS sweeps before every block of that many LM steps (0: ALS, then LM only)
    work: float  #: cap on the iterations' estimated multiply-adds per head


#: Presets of :func:`fit_llops_direct`. The work caps bind only on large heads: the shipped dump's
#: (d = 32, n = 512, m = 64) take about 1e8 multiply-adds per iteration, a head of d = 128,
#: n = 4096, m = 128 about 2.2e10.
QUALITY = {"default": Preset(6, 16, 10, 2, 1.5e11), "high": Preset(6, 180, 10, 2, 1.5e12)}

#: Columns whose targets are formed by one matrix product in :func:`_als_side`.
_BLOCK = 8


def _lu(normal: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LU factors and pivots of normal matrices ``[..., k, k]`` plus a relative ridge
    (``ridge · mean diag``, which keeps rank-deficient blocks solvable)."""
    eye = torch.eye(normal.shape[-1], dtype=normal.dtype, device=normal.device)
    lam = ridge * normal.diagonal(dim1=-2, dim2=-1).mean(-1) + torch.finfo(normal.dtype).tiny
    return torch.linalg.lu_factor(normal + lam[..., None, None] * eye)  # LU: robust to round-off when singular


def _als_side(side, theta, f_self, f_other, cross, ridge):
    r"""Update factor ``j`` of every column in turn, for ``j = 1..p``, the other side fixed (in place).

    With :math:`\Phi_K` fixed the loss is :math:`\mathrm{tr}(\Phi_Q G\Phi_Q^\top) - 2\,\mathrm{tr}(\Phi_Q^\top T)`
    + const, :math:`G = \Phi_K^\top\Phi_K`, :math:`T = A\Phi_K` (``cross``). For column ``i`` with the
    other columns fixed it is :math:`G_{ii}\|\phi_i - t_i\|^2` + const with
    :math:`t_i = (T_i - \sum_{l\ne i}\phi_l G_{li}) / G_{ii}`, and :math:`\phi_i = Z_i\,\mathrm{vec}(\theta_{:,j,:,i})`
    is linear in factor ``j``: each block step is the exact least-squares solve
    :math:`Z_i^\top Z_i\,\theta = Z_i^\top t_i`. The normal matrices depend only on the column's
    *other* factors, so for one ``j`` they are formed for all columns at once
    (``side.factor(theta, j).normal()``); the right-hand sides follow the columns in turn (Gauss–Seidel).
    ``side`` (:mod:`~sketchlab.llops.sides`, ``N`` rows), ``theta[B, t, p, d, m]``, ``f_self[B, N, m]``,
    ``f_other[B, N', m]``, ``cross[B, N, m]``.
    """
    B, t, p, d, m = theta.shape
    tiny = torch.finfo(theta.dtype).tiny
    gram = f_other.mT @ f_other  # [B, m, m]
    g_diag = gram.diagonal(dim1=-2, dim2=-1).clamp_min(tiny)  # [B, m]
    # column-major working copies: column i is a contiguous slice
    feats = f_self.mT.contiguous()  # [B, m, N]
    cross_t = cross.mT  # [B, m, N]
    for j in range(p):
        factor = side.factor(theta, j)
        lu, pivots = _lu(factor.normal(), ridge)  # [B, m, t·d, t·d], [B, m, t·d]
        for lo in range(0, m, _BLOCK):  # T_i − Σ_l φ_l G_li for a block of columns: one matrix product
            hi = min(lo + _BLOCK, m)
            resid = cross_t[:, lo:hi] - gram[:, :, lo:hi].mT @ feats  # [B, c, N]
            start = feats[:, lo:hi].clone()  # [B, c, N]; the block's own changes are added back below
            for i in range(lo, hi):
                moved = gram[:, None, lo:hi, i] @ (feats[:, lo:hi] - start)  # [B, 1, N]
                target = (resid[:, i - lo] - moved[:, 0]) / g_diag[:, i, None] + feats[:, i]  # [B, N]
                rhs = factor.rhs(i, target)  # [B, t, d]
                sol = torch.linalg.lu_solve(lu[:, i], pivots[:, i], rhs.reshape(B, t * d, 1)).reshape(B, t, d)
                theta[:, :, j, :, i] = sol
                feats[:, i] = factor.column(i, sol)
    f_self.copy_(feats.mT)


def _als_side_naive(x, theta, f_self, f_other, cross):
    """Float64 twin of :func:`_als_side` (ridge 0): one explicit least-squares problem per block,
    with ``Z_i`` formed column by column; same arguments, updated in place."""
    _, t, p, d, m = theta.shape
    gram = f_other.mT @ f_other  # [B, m, m]
    for j in range(p):
        for i in range(m):
            for b in range(x.shape[0]):
                others = torch.stack([
                    math.prod(x[b] @ theta[b, r, l, :, i] for l in range(p) if l != j) for r in range(t)
                ])  # [t, n]
                z = torch.cat([others[r, :, None] * x[b] for r in range(t)], 1)  # [n, t·d]
                coupling = sum(f_self[b, :, l] * gram[b, l, i] for l in range(m) if l != i)
                target = (cross[b, :, i] - coupling) / gram[b, i, i]
                theta[b, :, j, :, i] = torch.linalg.lstsq(z, target[:, None]).solution.reshape(t, d)
                f_self[b, :, i] = llops_features(x[b], theta[b, ..., i : i + 1])[:, 0]


def _als_sweep(side_q, side_k, target, theta_q, theta_k, fq, fk, cross_q, ridge):
    r"""One sweep of exact block coordinate descent (in place): every query column (with
    ``cross_q`` :math:`= A\Phi_K`), then every key column (:math:`A^\top\Phi_Q`), then :func:`balance`."""
    _als_side(side_q, theta_q, fq, fk, cross_q, ridge)
    _als_side(side_k, theta_k, fk, fq, target.cross_t(fq), ridge)
    balance(theta_q, theta_k, fq, fk)


def fit_llops_direct(
    q,
    k,
    *,
    p: int,
    m: int,
    rank: int = 1,
    init="svd",
    quality: str = "default",
    steps: int | None = None,
    lm_steps: int | None = None,
    cg_iters: int | None = None,
    interleave: int | None = None,
    work: float | None = None,
    tol: float = 1e-4,
    ridge: float = 1e-12,
    extrapolate: bool = True,
    route: str = "auto",
    seed: int = 0,
    progress: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    cp_options: dict | None = None,
) -> FittedMaps:
    r"""Fit LLoPS to :math:`A = (QK^\top)^{\circ p}` by minimising :math:`\|\Phi_Q\Phi_K^\top - A\|_F^2` directly.

    Parameters
    ----------
    q : Tensor ``[..., n_q, d]``
    k : Tensor ``[..., n_k, d]``
        Leading axes (e.g. ``[L, H]``) are independent problems, fitted together (batched), on
        the device of ``q``. Inputs are used as given (no rescaling); all arithmetic is float64.
    p, m, rank : int
        Degree, sketch size, CP rank ``t``.
    init : see :func:`~sketchlab.llops.llops_init` (default ``"svd"``).
    quality : {"default", "high"}
        Preset budgets :class:`Preset` ``(steps, lm_steps, cg_iters, interleave, work)`` from
        :data:`QUALITY`: ``"default"`` (6 ALS sweeps, then 16 LM steps of 10 CG iterations with 2
        ALS sweeps before every 2 LM steps; at most ``1.5e11`` multiply-adds per head) fits the 16
        heads of the shipped dump (p = 2, t = 1, m = 64) in under a minute on one thread;
        ``"high"`` (6, 180, 10, 2, 1.5e12) takes about seven minutes there and is closer to the
        optimum (numbers in ``analysis/results/fit.md``).
    steps, lm_steps, cg_iters : int, optional
        Override the preset: ALS sweeps (``>= 1``), Levenberg–Marquardt steps (``>= 0``), CG
        iterations per LM step (``>= 1``).
    interleave : int, optional
        Override the preset: in the LM stage, run this many ALS sweeps (with extrapolation)
        before every block of ``interleave`` LM steps (``>= 0``; ``0``: the LM steps only, after
        the ALS stage). The exact block solves and the joint Gauss–Newton steps fix different
        things (within-block scaling and the coupling between columns), so alternating them
        lowers the loss faster per second than either alone.
    work : float, optional
        Override the preset's cap on the iterations' multiply-adds per head (``> 0``; ``inf``: no
        cap). The schedule above is cut after ``max(1, ⌊work / c⌋)`` iterations (ALS sweeps and
        LM steps alike), ``c`` being the route's estimate of one iteration
        (:func:`~sketchlab.llops.target.iteration_flops`: ``2p`` normal-matrix products and two
        products with ``A``). The cap keeps a large head's fit to seconds, where an iteration costs
        ~1e10 (d = 128, n = 4096, m = 128: six ALS sweeps in the default) and leaves small heads
        untouched; ``info["capped"]`` says whether it cut the schedule.
    tol : float
        A stage stops early when one iteration lowers every head's loss by less than this fraction.
    ridge : float
        Relative Tikhonov term of each ALS block solve (``ridge · mean diag`` of its normal
        matrix): ``1e-12`` only keeps rank-deficient blocks solvable; larger values shrink Θ
        towards 0 in the ALS sweeps (a regulariser for few fitting tokens; the LM stage
        minimises the plain loss).
    extrapolate : bool
        After each sweep try :math:`\Theta + \beta(\Theta - \Theta_{\text{prev}})` and keep it, per
        head, only where it lowers the loss (``β`` ×1.5 on success, ÷2 on failure, in ``[1/8, 8]``).
    route : {"auto", "kernel", "features", "compressed"}
        How the data enter (:func:`~sketchlab.llops.target.fit_problem`): the tokens with the
        ``n × n`` kernel, or with symmetric features in token blocks; or, ``"compressed"``, at most
        ``D = C(d+p-1, p)`` rows per side with the tokens' Gram matrix (same loss and iterates;
        per sweep the cost no longer grows with ``n``: the route for ``p = 2`` and many tokens).
        ``"auto"`` picks by estimated cost within ``max_bytes``.
    seed : int
        Seeds the initialisation; the stages are deterministic.
    progress : bool
        Show a tqdm bar over sweeps and steps.
    max_bytes : int
        Memory budget of the big allocations (``A``, cached features, the init's candidates).
    cp_options : dict, optional
        Passed to :func:`~sketchlab.llops.fit_llops_cp` when ``init="cp"``.

    Returns
    -------
    FittedMaps
        The untied pair ``(map_q, map_k)`` of :class:`~sketchlab.featuremaps.LLoPSMap`
        (:func:`~sketchlab.llops.llops_maps`): Θ ``[B, rank, p, d, m]`` of the ``B = prod(...)`` problems
        flattened row-major into heads, in the input dtype (float32 at least), with
        ``info = {"steps", "als_steps", "lm_steps", "converged", "capped", "init",
        "init_rel_fro", "rel_fro_history", "route"}``, and on the compressed route
        ``"kernel_core"`` (``R_Q R_Kᵀ``, ``[..., N_q, N_k]``: its singular values are ``A``'s;
        :func:`sketchlab.fit_sketch` takes it out for the report's floor).

    Notes
    -----
    1. *Initialisation* (default ``"svd"``: the leading ``m`` terms of the multinomial expansion of
       the kernel in the singular directions of :math:`QK^\top`).
    2. *ALS sweeps.* The loss is linear least squares in any one factor :math:`\Theta_{r,j}` with
       the others fixed; a block is one column ``i``, one side and one factor ``j`` (``t·d``
       unknowns). The ``m`` normal matrices of one factor are formed together (on tokens one
       ``(t²m) × n × d(d+1)/2`` product per head; on ``N`` compressed rows ``N·m·(td)²``), and
       LU-factored in one batch; the right-hand
       sides follow the columns in turn (Gauss–Seidel). Per sweep: two products with ``A`` and
       ``2p`` normal-matrix products. Each block step is the exact minimiser (up to the ridge).
       Extrapolation as above.
    3. *Levenberg–Marquardt* (:func:`~sketchlab.llops.fit_lm.lm_step`): Gauss–Newton steps on all
       of a head's parameters at once, solved by CG preconditioned with the ALS blocks. ALS
       moves one block at a time and crawls along the narrow valleys ("swamps") of CP problems;
       the joint step does not. With ``interleave > 0`` every ``interleave`` LM steps are preceded
       by ``interleave`` ALS sweeps (``info["als_steps"]`` counts them).

    The best Θ seen (initialisation included) is returned per head, so the result never has a
    higher loss than its start. *Stopping rule* (``converged``): the last stage run stopped early
    because one of its iterations lowered every head's loss by less than ``tol`` (relative); an
    LM step that is rejected counts as no decrease only once ``λ`` has reached its ceiling. In the
    LM stage the test compares each LM step with the loss just before it (after any interleaved
    ALS sweeps): what the sweeps gained does not count. A non-finite loss raises ``FloatingPointError`` naming the heads.
    """
    q, k, p, m, rank, out_dtype, batch, q64, k64 = prepare(q, k, p, m, rank)
    if quality not in QUALITY:
        raise ValueError(f"quality must be one of {tuple(QUALITY)}, got {quality!r}")
    preset = QUALITY[quality]
    steps = preset.steps if steps is None else check_positive_int(steps, "steps")
    lm_steps = preset.lm_steps if lm_steps is None else check_nonnegative_int(lm_steps, "lm_steps")
    cg_iters = preset.cg_iters if cg_iters is None else check_positive_int(cg_iters, "cg_iters")
    interleave = preset.interleave if interleave is None else check_nonnegative_int(interleave, "interleave")
    if work is None:
        work = preset.work
    elif isinstance(work, bool) or not isinstance(work, numbers.Real):
        raise TypeError(f"work must be a number > 0 (inf: no cap), got {work!r} ({type(work).__name__})")
    elif not work > 0:  # NaN fails too
        raise ValueError(f"work must be a number > 0 (inf: no cap), got {work!r}")
    tol = check_real(tol, "tol", positive=False)
    ridge = check_real(ridge, "ridge", positive=False)
    if not isinstance(extrapolate, bool):
        raise TypeError(f"extrapolate must be a bool, got {extrapolate!r}")
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    if cp_options is not None and not isinstance(cp_options, dict):
        raise TypeError(f"cp_options must be a dict or None, got {type(cp_options).__name__}")
    extra = interleave * -(-lm_steps // interleave) if interleave else 0  # ALS sweeps inside the LM stage
    planned = steps + lm_steps + extra
    side_q, side_k, target = fit_problem(q64, k64, p, m, rank, route=route, iterations=planned, max_bytes=max_bytes)
    per = iteration_flops(target.route, q64.shape[-2], k64.shape[-2], q64.shape[-1], p, m, rank)
    allowed = planned if work >= planned * per else max(1, int(work // per))  # work may be inf or a huge int
    check_finite_loss(target.sq_norm, 0, "LLoPS direct", batch)
    theta_q, theta_k = llops_init(q, k, p=p, m=m, rank=rank, init=init, seed=seed, max_bytes=max_bytes,
                                  **(cp_options or {}))
    d = q.shape[-1]
    theta_q = theta_q.reshape(-1, rank, p, d, m).to(q64.device).clone()  # [B, t, p, d, m]
    theta_k = theta_k.reshape(-1, rank, p, d, m).to(q64.device).clone()
    norm_a = target.sq_norm.clamp_min(torch.finfo(torch.float64).tiny)
    fq, fk = side_q.features(theta_q), side_k.features(theta_k)
    cross_q = target.cross(fk)
    loss = target.loss(fq, fk, cross_q)
    check_finite_loss(loss, 0, "LLoPS direct", batch)
    init_rel = (loss / norm_a).sqrt()
    best_loss, best_q, best_k = loss.clone(), theta_q.clone(), theta_k.clone()
    history = [float(init_rel.median())]
    bar = tqdm(total=allowed, desc="LLoPS fit", disable=not progress, leave=False)

    def keep_best(new):
        nonlocal best_loss
        better = new < best_loss
        best_loss = torch.where(better, new, best_loss)
        keep = better[:, None, None, None, None]
        best_q.copy_(torch.where(keep, theta_q, best_q))
        best_k.copy_(torch.where(keep, theta_k, best_k))
        history.append(float((best_loss / norm_a).sqrt().median()))
        bar.set_postfix(rel_fro=history[-1])
        bar.update()

    beta = torch.full_like(loss, 0.5)  # per-head extrapolation step

    def als_step(theta_q, theta_k, fq, fk, cross_q, beta, count):
        """One ALS sweep plus the extrapolation trial; returns the new state and loss."""
        prev_q, prev_k = theta_q.clone(), theta_k.clone()
        _als_sweep(side_q, side_k, target, theta_q, theta_k, fq, fk, cross_q, ridge)
        fq, fk = side_q.features(theta_q), side_k.features(theta_k)  # recompute: no drift
        cross_q = target.cross(fk)
        new = target.loss(fq, fk, cross_q)
        check_finite_loss(new, count, "LLoPS direct", batch)
        if extrapolate:
            b = beta[:, None, None, None, None]
            cand_q, cand_k = theta_q + b * (theta_q - prev_q), theta_k + b * (theta_k - prev_k)
            cand_fq, cand_fk = side_q.features(cand_q), side_k.features(cand_k)
            cand_cross = target.cross(cand_fk)
            cand = target.loss(cand_fq, cand_fk, cand_cross)
            take = torch.isfinite(cand) & (cand < new)
            keep, keep3 = take[:, None, None, None, None], take[:, None, None]
            theta_q, theta_k = torch.where(keep, cand_q, theta_q), torch.where(keep, cand_k, theta_k)
            fq, fk, cross_q = torch.where(keep3, cand_fq, fq), torch.where(keep3, cand_fk, fk), torch.where(keep3, cand_cross, cross_q)
            new = torch.where(take, cand, new)
            beta = torch.where(take, (beta * 1.5).clamp(max=8.0), (beta * 0.5).clamp(min=0.125))
        return theta_q, theta_k, fq, fk, cross_q, beta, new

    als_done, converged = 0, False
    for step in range(min(steps, allowed)):
        theta_q, theta_k, fq, fk, cross_q, beta, new = als_step(theta_q, theta_k, fq, fk, cross_q, beta, step + 1)
        als_done = step + 1
        keep_best(new)
        converged = bool(((loss - new) <= tol * loss).all())
        loss = new
        if converged:
            break
    theta_q, theta_k, loss = best_q.clone(), best_k.clone(), best_loss.clone()
    damping = torch.full_like(loss, 1e-3)
    lm_done = 0
    for step in range(lm_steps if als_done < allowed else 0):
        if interleave and step % interleave == 0:  # ALS sweeps before every block of LM steps
            fq, fk = side_q.features(theta_q), side_k.features(theta_k)
            cross_q = target.cross(fk)
            for _ in range(min(interleave, allowed - als_done - lm_done)):
                theta_q, theta_k, fq, fk, cross_q, beta, loss = als_step(
                    theta_q, theta_k, fq, fk, cross_q, beta, als_done + lm_done + 1)
                als_done += 1
                keep_best(loss)
        if als_done + lm_done >= allowed:
            break
        new, damping = lm_step(side_q, side_k, target, theta_q, theta_k, loss, damping, cg_iters=cg_iters)
        check_finite_loss(new, als_done + lm_done + 1, "LLoPS direct (LM)", batch)
        lm_done = step + 1
        keep_best(new)
        stalled = ((loss - new) <= tol * loss) & ((new < loss) | (damping >= 1e6))
        converged = bool(stalled.all())
        loss = new
        if converged:
            break
    bar.close()
    map_q, map_k = llops_maps(best_q.reshape(*batch, rank, p, d, m).to(out_dtype),
                              best_k.reshape(*batch, rank, p, d, m).to(out_dtype))
    info = {
        "steps": als_done + lm_done,
        "als_steps": als_done,
        "lm_steps": lm_done,
        "converged": converged,
        "capped": allowed < planned and not converged and als_done + lm_done == allowed,
        "init": init if isinstance(init, str) else type(init).__name__,
        "init_rel_fro": init_rel.reshape(batch),
        "rel_fro_history": history,
        "route": target.route,
    }
    if target.route == "compressed":  # R_Q R_Kᵀ: A's singular values, which the report's floor reuses
        info["kernel_core"] = target.a.reshape(*batch, *target.a.shape[-2:])
    return FittedMaps(map_q, map_k, info)
