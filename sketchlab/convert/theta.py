"""Stage 0 of :func:`sketchlab.linearize`: LLoPS Θ ``[L, H, t, p, D, m]`` fitted to the teacher's post-RoPE
kernel, layer by layer, from the teacher recording (:func:`sketchlab.convert.teacher.teacher_attention`),
its effort capped per head (:data:`DEFAULT_FIT_WORK`)."""

from __future__ import annotations

import numbers

import torch

from .._validation import check_nonnegative_int
from .evaluate import progress_bar
from .teacher import LayerIO, teacher_attention

__all__ = ["DEFAULT_FIT_WORK", "fit_theta"]

#: Default cap of the stage-0 Θ fit's effort: estimated multiply-adds per head (``fit_llops_direct(work=)``,
#: :func:`sketchlab.llops.target.iteration_flops` per iteration). On a SmolLM2 head (d = 64, 1024 fitting
#: tokens, p = 2, m = 64: 6.8e8 per iteration) it allows 5 of the default preset's 38 iterations: one layer's
#: 9 heads took 13.4 CPU s against 88 uncapped (~4 min for SmolLM2's 30 layers against ~27), the in-sample
#: error 0.755 against 0.737. ``fit_work=math.inf``: the preset's full schedule.
DEFAULT_FIT_WORK = 3.5e9


def _fit_plan(p, m, rank, D, n, fit_work, fit_options) -> dict:
    """The fit's iterations per head and multiply-adds: ``{"per_iteration", "iterations", "planned",
    "work"}`` (what the cap allows of the preset's schedule; the kernel route's estimate)."""
    from ..llops.fit_als import QUALITY
    from ..llops.target import iteration_flops

    options = dict(fit_options or {})
    preset = QUALITY.get(options.get("quality", "default"), QUALITY["default"])
    steps = options.get("steps", preset.steps)
    lm_steps = options.get("lm_steps", preset.lm_steps)
    interleave = options.get("interleave", preset.interleave)
    planned = steps + lm_steps + (interleave * -(-lm_steps // interleave) if interleave else 0)
    per = iteration_flops("kernel", n, n, D, p, m, rank)
    work = options.get("work", fit_work)
    iterations = planned if work >= planned * per else max(1, int(work // per))
    return {"per_iteration": per, "iterations": iterations, "planned": planned, "work": iterations * per}


def _check_fit_work(fit_work, fit_options) -> float:
    """``fit_work``: a number > 0 (``math.inf``: no cap) or ``None`` (:data:`DEFAULT_FIT_WORK`); not
    given together with ``fit_options["work"]`` (one cap, one place)."""
    if fit_options is not None and not isinstance(fit_options, dict):
        raise ValueError(f"fit_options must be a dict or None, got {type(fit_options).__name__}")
    if fit_work is None:
        return (fit_options or {}).get("work", DEFAULT_FIT_WORK)
    if isinstance(fit_work, bool) or not isinstance(fit_work, numbers.Real) or not fit_work > 0:
        raise ValueError(f"fit_work must be a number > 0 (multiply-adds per head; math.inf: no cap), got {fit_work!r}")
    if "work" in (fit_options or {}):
        raise ValueError(f"fit_work={fit_work!r} and fit_options['work']={fit_options['work']!r}: give the fit's cap "
                         "once")
    return float(fit_work)


def fit_theta(model, ids, mask, *, p, m, rank=1, fit_tokens=1024, seed=0, fit_options=None, fit_work=None,
              progress=False):
    """Stage 0: Θ ``[L, H, t, p, D, m]`` fitted to the teacher's post-RoPE kernel (``"sqrt-d"`` inputs)
    on the valid tokens of ``ids [N, T]``; returns ``((theta_q, theta_k), info)``.

    ``fit_tokens`` random tokens (the same positions for q and k) per head; one layer's heads are
    fitted together, layer by layer, so the fit report's dense ``H × n × n`` kernel (its
    Theorem 3.1 bound) never holds every layer at once (SmolLM2: 270 heads at 1024 tokens would
    ask 4.5 GB; one layer, 0.15 GB). ``fit_work``: the cap on each head's multiply-adds
    (:data:`DEFAULT_FIT_WORK`; ``fit_options["work"]`` alike); ``progress``: a bar over the layers.
    The teacher's recording of ``ids`` (:func:`teacher_attention`) and :func:`_fit_recorded` on it
    (:func:`sketchlab.linearize` fits from its own recording, without this second teacher pass)."""
    fit_tokens = None if fit_tokens is None else check_nonnegative_int(fit_tokens, "fit_tokens")
    fit_work = _check_fit_work(fit_work, fit_options)
    layers = teacher_attention(model, ids, mask, progress=progress)
    return _fit_recorded(layers, mask, slice(None), set(), p=p, m=m, rank=rank, fit_tokens=fit_tokens, seed=seed,
                        fit_work=fit_work, fit_options=fit_options, progress=progress)


def _subset(n: int, fit_tokens, seed: int):
    """The fitting tokens' positions among ``n`` (sorted; ``None``: all of them)."""
    if fit_tokens and n > fit_tokens:  # a random subset, the same for q and k: the fit and its report
        # (in-sample errors and the tail bound, O(n²) per head) both see only these
        return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:fit_tokens].sort().values
    return None


def _fit_recorded(layers: list[LayerIO], mask, index, skip, *, p, m, rank, fit_tokens, seed, fit_work, fit_options,
                 progress):
    """:func:`fit_theta` from the teacher recording: the post-RoPE q, k of the sequences ``index``' valid
    tokens (GQA keys repeated, float32 then float64 times ``D^{-1/4}``; only the fitting tokens copied);
    the layers in ``skip`` are not fitted and left zero (exact layers: never read)."""
    from ..fit import fit_sketch

    valid = mask[index].to(torch.bool)  # [n_seq, T]
    n = int(valid.sum())
    keep = _subset(n, fit_tokens, seed)
    options = {**dict(fit_options or {}), "work": fit_work}
    count = len(layers)
    thetas_q, thetas_k, rel_fro, seconds = [None] * count, [None] * count, [None] * count, 0.0
    with progress_bar(count - len(skip), "stage 0: Θ fit", progress, unit="layer", leave=True) as bar:
        for layer, io in enumerate(layers):
            if layer in skip:
                continue
            H, D = io.q.shape[2], io.q.shape[3]
            q, k = io.q[index][valid], io.k[index][valid]  # [n, H(_kv), D] in token order
            if keep is not None:
                q, k = q[keep], k[keep]
            k = k.repeat_interleave(H // k.shape[1], dim=1)
            c = D ** -0.25
            q, k = q.float().transpose(0, 1).double() * c, k.float().transpose(0, 1).double() * c  # [H, n, D]
            fit = fit_sketch("llops", q, k, p=p, m=m, rank=rank, seed=seed, reference=False, **options)
            thetas_q[layer] = fit.map_q.theta.detach()  # [H, t, p, D, m] (LLoPSMap)
            thetas_k[layer] = fit.map_k.theta.detach()
            report = fit.report.as_dict()
            rel = report.get("rel_fro")
            rel_fro[layer] = rel.tolist() if isinstance(rel, torch.Tensor) else rel
            seconds += float(report.get("seconds") or 0.0)
            bar.update()
    shape = next(t for t in thetas_q if t is not None)
    theta_q = torch.stack([torch.zeros_like(shape) if t is None else t for t in thetas_q])  # [L, H, t, p, D, m]
    theta_k = torch.stack([torch.zeros_like(shape) if t is None else t for t in thetas_k])
    info = {"tokens": n, "fit_tokens": n if keep is None else len(keep), "rel_fro": rel_fro, "seconds": seconds,
            "work": fit_work}
    return (theta_q, theta_k), info
