"""``fit_sketch("llops", ...)``: one entry point over the LLoPS fits, with their options checked."""

from __future__ import annotations

import inspect

from ..featuremaps.base import FittedMaps
from .fit_adam import fit_llops_adam
from .fit_als import fit_llops_direct
from .fit_cp import fit_llops_cp

__all__ = ["METHODS", "fit_llops"]

METHODS = ("direct", "cp", "adam")

_FUNCTIONS = {"direct": fit_llops_direct, "cp": fit_llops_cp, "adam": fit_llops_adam}


def _check_options(method: str, options: dict) -> None:
    params = inspect.signature(_FUNCTIONS[method]).parameters
    known = {name for name, par in params.items()
             if par.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("p", "m", "seed", "rank", "init")}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for sketch method 'llops' with method={method!r}; "
            f"it takes: {', '.join(sorted(known | {'rank', 'method'} | ({'init'} if method != 'cp' else set())))}"
        )


def fit_llops(q, k, *, p: int, m: int, seed: int = 0, rank: int = 1, method: str = "direct", init=None,
              **options) -> FittedMaps:
    """``fit_sketch("llops", q, k, p=, m=, rank=1, method="direct"|"cp"|"adam", init=..., **options)``.

    ``method="direct"`` → :func:`~sketchlab.llops.fit_llops_direct` (``init`` default ``"svd"``;
    options ``quality``, ``steps``, ``lm_steps``, ``cg_iters``, ``interleave``, ``tol``, ``ridge``, ``route``, ...);
    ``"cp"`` → :func:`~sketchlab.llops.fit_llops_cp` (``init`` must be ``None``); ``"adam"`` →
    :func:`~sketchlab.llops.fit_llops_adam` (``init`` default ``"random"``). An option the chosen
    function does not take is rejected with ``ValueError`` listing the ones it does. Returns the untied pair
    ``(map_q, map_k)`` of :class:`~sketchlab.featuremaps.LLoPSMap` as :class:`~sketchlab.featuremaps.FittedMaps`
    (with the fit's ``info``).
    """
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _check_options(method, options)
    if method == "direct":
        return fit_llops_direct(q, k, p=p, m=m, rank=rank, init="svd" if init is None else init, seed=seed, **options)
    if method == "adam":
        return fit_llops_adam(q, k, p=p, m=m, rank=rank, init="random" if init is None else init, seed=seed, **options)
    if init is not None:
        raise ValueError(f"method='cp' takes no init (it decomposes the optimal projector), got init={init!r}")
    return fit_llops_cp(q, k, p=p, m=m, rank=rank, seed=seed, **options)
