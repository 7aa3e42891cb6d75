"""``fit_sketch``: the one entry point that fits any registered sketch and reports its error.

Each sketch module registers a *fitter* with :func:`register_sketch`::

    @register_sketch("name")
    def _fit(q, k, *, p, m, seed=0, **options) -> Sketch: ...

A fitter receives validated float tensors ``q[..., n_q, d]``, ``k[..., n_k, d]`` (the fitting
tokens only) and returns a :class:`~sketchlab.sketch.Sketch`; it may set ``sketch.fit_info``, a
dict with ``steps`` (int), ``converged`` (bool) and any method-specific entries. ``fit_sketch``
splits off held-out tokens, times the fit and measures every error against the Theorem 3.1
optimum in float64.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ._validation import check_degree, check_fraction, check_pair, check_positive_int
from .sketch import Sketch

__all__ = ["Fit", "FitReport", "available_sketches", "fit_sketch", "holdout_split", "register_sketch", "sketch_fitter"]

_FITTERS: dict[str, Callable[..., Sketch]] = {}


def register_sketch(name: str) -> Callable[[Callable[..., Sketch]], Callable[..., Sketch]]:
    """Decorator registering ``fitter`` under ``name`` for :func:`fit_sketch`."""

    def decorate(fitter: Callable[..., Sketch]) -> Callable[..., Sketch]:
        if name in _FITTERS and _FITTERS[name] is not fitter:
            raise ValueError(f"a sketch named {name!r} is already registered")
        _FITTERS[name] = fitter
        return fitter

    return decorate


def available_sketches() -> list[str]:
    """Names accepted by :func:`fit_sketch`, sorted."""
    return sorted(_FITTERS)


def sketch_fitter(name: str) -> Callable[..., Sketch]:
    """The fitter registered under ``name`` (raw: no hold-out, no report; see :func:`fit_sketch`)."""
    if name not in _FITTERS:
        raise ValueError(f"unknown sketch method {name!r}; available: {', '.join(available_sketches())}")
    return _FITTERS[name]


@dataclass
class FitReport:
    """Errors of one fit, each a float64 tensor with the batch shape (``[]`` or ``[L, H]``).

    ``holdout_*`` are measured on the held-out tokens (``None`` when ``holdout == 0``); ``tail``
    and ``holdout_tail`` are the Theorem 3.1 floors on the fitting and held-out tokens, so each
    ``optimality_ratio`` is the error divided by the best any size-``m`` sketch achieves there.
    """

    method: str
    p: int
    m: int
    rel_fro: torch.Tensor
    rel_mae: torch.Tensor
    optimality_ratio: torch.Tensor
    tail: torch.Tensor
    seconds: float
    steps: int
    converged: bool
    num_features: int
    num_parameters: int
    holdout_rel_fro: torch.Tensor | None = None
    holdout_rel_mae: torch.Tensor | None = None
    holdout_optimality_ratio: torch.Tensor | None = None
    holdout_tail: torch.Tensor | None = None
    info: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """JSON-ready dict (tensors become nested lists)."""
        out = {}
        for key, value in self.__dict__.items():
            out[key] = value.tolist() if isinstance(value, torch.Tensor) else value
        out["info"] = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in self.info.items()}
        return out


@dataclass
class Fit:
    """A fitted sketch and its :class:`FitReport`."""

    sketch: Sketch
    report: FitReport

    def save_theta(self, path, *, dump, scale=None):
        """Export Θ with every metadata field filled in: :func:`sketchlab.export.export_theta`."""
        from .export import export_theta

        return export_theta(self, path, dump=dump, scale=scale)


def holdout_split(n: int, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``range(n)`` into sorted fit and held-out token indices (``ceil(holdout·n)`` held out).

    The same ``(n, holdout, seed)`` always gives the same split.
    """
    n = check_positive_int(n, "n")
    holdout = check_fraction(holdout, "holdout")
    n_held = math.ceil(holdout * n)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)
    return perm[n_held:].sort().values, perm[:n_held].sort().values


def _errors(sketch: Sketch, q: torch.Tensor, k: torch.Tensor, p: int, m: int):
    from .metrics import optimality_ratio, rel_fro, rel_mae
    from .optimal import tail_bound
    from .polynomial import poly_kernel

    exact = poly_kernel(q.to(torch.float64), k.to(torch.float64), p)
    with torch.no_grad():
        approx = sketch.kernel(q, k).to(torch.float64)
    tail = tail_bound(q, k, p, m)
    return rel_fro(approx, exact), rel_mae(approx, exact), optimality_ratio(approx, exact, tail), tail


def fit_sketch(method: str, q, k, /, *, p: int, m: int, seed: int = 0, holdout: float = 0.0, **options) -> Fit:
    """Fit the sketch ``method`` to ``(q, k)`` and measure it against the Theorem 3.1 optimum.

    Parameters
    ----------
    method : str
        A name from :func:`available_sketches`.
    q : Tensor ``[..., n_q, d]``
    k : Tensor ``[..., n_k, d]``
        Leading axes (e.g. ``[L, H]``) are independent problems, fitted together.
    p, m : int
        Degree and sketch size.
    seed : int
        Seeds the held-out split and the method's own randomness.
    holdout : float in ``[0, 1)``
        Fraction of tokens (of ``q`` and of ``k`` separately) held out of the fit; errors on
        them are reported as ``holdout_*``. With ``n_q == n_k`` both use one split, so the
        held-out tokens are the same positions on both sides.
    **options
        Passed to the method's fitter.

    Returns
    -------
    Fit
        ``fit.sketch`` and ``fit.report`` (in-sample and held-out ``rel_fro``, ``rel_mae``,
        ``optimality_ratio``, the tails, wall seconds, steps, convergence).
    """
    fitter = sketch_fitter(method)
    q, k = check_pair(q, k)
    p = check_degree(p)
    m = check_positive_int(m, "m (the sketch size)")
    holdout = check_fraction(holdout, "holdout")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    fit_q, held_q = holdout_split(q.shape[-2], holdout, seed)
    fit_k, held_k = (fit_q, held_q) if q.shape[-2] == k.shape[-2] else holdout_split(k.shape[-2], holdout, seed)
    if holdout > 0 and (len(fit_q) == 0 or len(fit_k) == 0):
        raise ValueError(f"holdout={holdout} leaves no fitting tokens out of n_q={q.shape[-2]}, n_k={k.shape[-2]}")
    q_fit, k_fit = q[..., fit_q, :], k[..., fit_k, :]
    from .optimal import max_sketch_size  # optimal registers itself here: import late

    limit = max_sketch_size(q_fit.shape[-2], k_fit.shape[-2], q.shape[-1], p)
    if m > limit:  # checked before fitting: the report's Theorem 3.1 floor needs m <= rank bound
        raise ValueError(
            f"m (the sketch size) must be at most min(fitting tokens, D) = {limit} for d={q.shape[-1]}, p={p} "
            f"({q_fit.shape[-2]} query and {k_fit.shape[-2]} key tokens left after holdout={holdout}); got m={m}"
        )
    known = _option_names(fitter)
    unknown = [] if known is None else sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for sketch method {method!r}; "
            f"it takes: {', '.join(sorted(known)) or 'no options'}"
        )

    start = time.perf_counter()
    sketch = fitter(q_fit, k_fit, p=p, m=m, seed=seed, **options)
    seconds = time.perf_counter() - start

    info = dict(getattr(sketch, "fit_info", {}) or {})
    rel_f, rel_m, ratio, tail = _errors(sketch, q_fit, k_fit, p, m)
    report = FitReport(
        method=method, p=p, m=m, rel_fro=rel_f, rel_mae=rel_m, optimality_ratio=ratio, tail=tail,
        seconds=seconds, steps=int(info.pop("steps", 0)), converged=bool(info.pop("converged", True)),
        num_features=sketch.num_features, num_parameters=sketch.num_parameters, info=info,
    )
    if holdout > 0:
        q_held, k_held = q[..., held_q, :], k[..., held_k, :]
        # The held-out floor uses the same m, clamped to the largest rank the held-out A can
        # have (its tail is 0 there, and the ratio inf: a sketch that size could be exact).
        m_held = min(m, max_sketch_size(q_held.shape[-2], k_held.shape[-2], q.shape[-1], p))
        h_f, h_m, h_r, h_t = _errors(sketch, q_held, k_held, p, m_held)
        report.holdout_rel_fro, report.holdout_rel_mae = h_f, h_m
        report.holdout_optimality_ratio, report.holdout_tail = h_r, h_t
    return Fit(sketch=sketch, report=report)


def _option_names(fitter: Callable[..., Sketch]) -> set[str] | None:
    """Keyword options a fitter takes beyond ``p, m, seed``; ``None`` when it takes ``**options``."""
    params = inspect.signature(fitter).parameters
    if any(par.kind is inspect.Parameter.VAR_KEYWORD for par in params.values()):
        return None
    return {name for name, par in params.items()
            if par.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("p", "m", "seed")}
