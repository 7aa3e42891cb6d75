"""``fit_sketch``: the one entry point that fits any registered sketch and reports its error.

**Methods are names of the one registry** (:mod:`sketchlab.featuremaps.registry`: one vocabulary for
maps and methods, each name with a builder slot and a fitter slot). A name's *fitter* (its fitter slot,
:func:`~sketchlab.featuremaps.registry.own_fitter`; the built-in ones imported on first use) has the
form::

    def _fit(q, k, *, p, m, seed=0, **options) -> FittedMaps | FeatureMap | tuple[FeatureMap, FeatureMap]: ...

It receives validated float tensors ``q[..., n_q, d]``, ``k[..., n_k, d]`` (the fitting tokens
only) and returns the fitted pair of :class:`~sketchlab.featuremaps.FeatureMap` s ``(map_q, map_k)`` (the
same map twice when they are tied) of ``H = prod(batch)`` heads of ``d``, the batch flattened row-major
(:func:`~sketchlab.featuremaps.batch_features`), as :class:`~sketchlab.featuremaps.FittedMaps`: the pair and
``info``, the one home of what the fit says of itself (a dict with ``steps`` (int), ``converged`` (bool), any
method-specific entries, and ``kernel_core``: a float64 ``[..., N_q, N_k]`` matrix with the singular values
of ``A`` on the tokens it was given, e.g. ``R_Q R_Kᵀ`` of the Gram roots it fitted on, which ``fit_sketch``
reuses for the report's Theorem 3.1 floor instead of recomputing it; the rest becomes the report's
``steps``, ``converged`` and ``info``). A fitter with nothing to say may return the map or the bare pair. Fitters trust their inputs: validation happens once, here.
Users add their own with :func:`register_sketch` (it fills the name's fitter
slot). A map whose fitter slot is empty is fitted by Adam on the kernel loss
(:func:`sketchlab.featuremaps.fitting.feature_map_fitter`), so a map registered there is a method
with no line here. ``fit_sketch`` splits off held-out tokens, optionally subsamples the
fitting tokens, times the fit and measures every error against the Theorem 3.1 optimum in
float64, in row blocks (never an ``n × n`` matrix; see :class:`FitReport` for large ``n``).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._validation import DEFAULT_MAX_BYTES, check_degree, check_fraction, check_pair, check_positive_int, check_seed
from .featuremaps.base import FeatureMap
from .featuremaps.registry import (
    DEPRECATED_METHODS,
    FittedMaps,
    feature_map_names,
    fitter_names,
    own_fitter,
    register_fitter,
)
from .numerics import UNDEFINED_REASONS, check_poly_kernel_range, is_roundoff, warn_undefined

#: What a fitter returns: :class:`FittedMaps` (the pair and the fit's ``info``), one map for both sides, or the
#: bare pair ``(map_q, map_k)``.
Fitted = FittedMaps | FeatureMap | tuple[FeatureMap, FeatureMap]

__all__ = [
    "Fit",
    "accepted_methods",
    "FitReport",
    "available_sketches",
    "fit_sketch",
    "holdout_split",
    "register_sketch",
    "sketch_fitter",
]


def register_sketch(name: str) -> Callable[[Callable[..., Fitted]], Callable[..., Fitted]]:
    """Decorator filling the fitter slot of ``name`` with ``fitter`` for :func:`fit_sketch`
    (:func:`~sketchlab.featuremaps.registry.register_fitter`: a new method, or the own fitter of the map
    ``name``; a name that has another fitter is refused)."""

    def decorate(fitter: Callable[..., Fitted]) -> Callable[..., Fitted]:
        register_fitter(name, fitter)
        return fitter

    return decorate


def available_sketches() -> list[str]:
    """The names with their own fitter (:func:`~sketchlab.featuremaps.registry.fitter_names`), sorted
    (deprecated names left out). :func:`fit_sketch` also fits every other name of
    :func:`sketchlab.featuremaps.feature_map_names` (Adam on the kernel loss)."""
    return fitter_names()


def accepted_methods() -> set[str]:
    """Every name :func:`fit_sketch` takes: :func:`available_sketches`, the deprecated names and the
    registered feature maps."""
    return set(fitter_names()) | set(DEPRECATED_METHODS) | set(feature_map_names())


def sketch_fitter(name: str) -> Callable[..., Fitted]:
    """The fitter of ``name`` (raw: no hold-out, no report; see :func:`fit_sketch`): its fitter slot
    (:func:`~sketchlab.featuremaps.registry.own_fitter`), else, for a map without one, Adam on the map
    (:func:`~sketchlab.featuremaps.fitting.feature_map_fitter`). A deprecated name warns and keeps its fitter.

    A fitter trusts ``q, k, p, m, seed`` as :func:`fit_sketch` checks them (finite real floating
    ``q[..., n_q, d]``, ``k[..., n_k, d]``, ints ``p >= 1``, ``1 <= m < min(n_q, n_k, D)``, an int
    seed) and checks only its own options: call it directly only with inputs checked that way.
    """
    if isinstance(name, str) and name in DEPRECATED_METHODS:
        import warnings

        new, note = DEPRECATED_METHODS[name]
        warnings.warn(f"fit_sketch: the method name {name!r} is deprecated, use {new!r}{note}", DeprecationWarning,
                      stacklevel=3)
    fitter = own_fitter(name)
    if fitter is not None:
        return fitter
    if isinstance(name, str) and name in feature_map_names():  # a map without its own fitter: Adam
        from .featuremaps.fitting import feature_map_fitter

        return feature_map_fitter(name)
    raise ValueError(f"unknown sketch method {name!r}; available: {', '.join(available_sketches())}, or a "
                     f"feature map: {', '.join(feature_map_names())}")


#: The ratios of a fit report and the denominator each is undefined by (a cause of
#: :data:`sketchlab.numerics.UNDEFINED_REASONS`): the JSON of every dump tool marks them by this table.
RATIO_CAUSES = {"optimality_ratio": "tail", "holdout_optimality_ratio": "tail", "holdout_vs_reference": "reference"}


@dataclass
class FitReport:
    """Errors of one fit, each a float64 tensor with the batch shape (``[]`` or ``[L, H]``).

    In-sample errors are measured on *all* non-held-out tokens, also when the fit used only a
    subsample of them (``fit_tokens``). ``holdout_*`` are measured on the held-out tokens
    (``None`` when ``holdout == 0``); ``tail`` and ``holdout_tail`` are the Theorem 3.1 floors on
    those tokens, so each ``optimality_ratio`` is the error divided by the best any size-``m``
    sketch achieves there. **A ratio is NaN when undefined**: its denominator is round-off by the one
    rule of :mod:`sketchlab.numerics` (:data:`RATIO_CAUSES`): the tail (see
    :func:`sketchlab.metrics.ratio_to_tail`; e.g. ``m`` at least the rank of the held-out kernel), or
    the reference's error. ``holdout_reference_rel_fro`` is the documented held-out reference: the
    held-out error of the in-sample optimum with the *minimum-norm* ``W*``
    (:func:`sketchlab.optimal.min_norm_sketch`), and ``holdout_vs_reference`` the sketch's
    held-out ``rel_fro`` divided by it (``None`` without hold-out; NaN where the reference's
    ``rel_fro`` is round-off, at most ``ROUNDOFF · n · eps`` with ``n`` the held-out tokens).
    ``holdout_rank`` is the largest rank the held-out kernel can have: at ``m >= holdout_rank`` the
    held-out optimality ratio is undefined by construction.

    Every error is exact up to :data:`EXACT_REPORT_ENTRIES` (``n_q · n_k``, i.e. 8192² tokens) per
    head. Beyond, ``rel_fro`` and the ratios stay exact (from Gram matrices) and ``rel_mae`` is
    estimated on a seeded random sample of query rows against every key, ``info["rel_mae_rows"]``
    rows of them, with its standard error per head in ``info["rel_mae_se"]`` (``holdout_``-prefixed
    for the held-out errors): the report then costs a fraction of the fit instead of
    ``n_q · n_k · (d + m)`` multiply-adds.
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
    holdout_reference_rel_fro: torch.Tensor | None = None
    holdout_vs_reference: torch.Tensor | None = None
    fit_tokens: int | None = None
    holdout_rank: int | None = None
    info: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """JSON-ready dict (tensors become nested lists; NaN stays: the writer stores ``null``), with
        ``undefined`` naming the reason of each ratio that is NaN for some head (absent when none is)."""
        out = {}
        for key, value in self.__dict__.items():
            out[key] = value.tolist() if isinstance(value, torch.Tensor) else value
        out["info"] = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in self.info.items()}
        reasons = {key: UNDEFINED_REASONS[cause] for key, cause, n, _ in self.undefined_counts(expected=True) if n}
        if reasons:
            out["undefined"] = reasons
        return out

    def undefined_counts(self, expected: bool = False) -> list[tuple[str, str, int, int]]:
        """``(field, cause, undefined heads, heads)`` for each ratio this report holds (:data:`RATIO_CAUSES`).

        ``expected=False`` leaves out the held-out optimality ratio when it is undefined by construction
        (``m >= holdout_rank``, documented: what a warning need not repeat)."""
        by_construction = self.holdout_rank is not None and self.m >= self.holdout_rank
        ratios = [(key, cause, getattr(self, key)) for key, cause in RATIO_CAUSES.items()
                  if expected or not (key == "holdout_optimality_ratio" and by_construction)]
        return [(key, cause, int(r.isnan().sum()), r.numel()) for key, cause, r in ratios if r is not None]


@dataclass
class Fit:
    """A fit: its pair of feature maps and its :class:`FitReport`.

    ``map_q``, ``map_k`` (the same object when the method ties the two sides) are
    :class:`~sketchlab.featuremaps.FeatureMap` s of ``H = prod(batch_shape)`` heads of ``head_dim = d``, the fitted
    batch flattened row-major (layer ``l``, head ``j`` of an ``[L, H]`` fit is head ``l·H + j``, as
    :func:`sketchlab.featuremaps.batch_features` maps it): they run as attention
    (:func:`sketchlab.attention.linear_attention`), in a model (``convert_attention``) and through the metrics
    (:func:`sketchlab.featuremaps.pair_features`) like any map of the family.
    """

    map_q: FeatureMap
    map_k: FeatureMap
    report: FitReport
    batch_shape: tuple = ()

    @property
    def maps(self) -> tuple[FeatureMap, FeatureMap]:
        """``(map_q, map_k)``."""
        return self.map_q, self.map_k

    @property
    def tied(self) -> bool:
        """Whether the key map is the query map."""
        return self.map_k is self.map_q

    @property
    def head_dim(self) -> int:
        return self.map_q.head_dim

    def layer(self, index) -> tuple[FeatureMap, FeatureMap]:
        """``(map_q, map_k)`` of the problems at ``index`` of the batch shape (e.g. layer ``l`` of an ``[L, H]``
        fit: maps of ``H`` heads), copies holding those heads only (:meth:`FeatureMap.select_heads`)."""
        if not self.batch_shape:
            raise ValueError("this fit has batch shape [] (one problem): there is no layer to select")
        if isinstance(index, int) and not -self.batch_shape[0] <= index < self.batch_shape[0]:
            raise IndexError(f"layer {index} is out of range for this fit of batch shape {list(self.batch_shape)} "
                             f"({self.batch_shape[0]} layers)")
        heads = torch.arange(math.prod(self.batch_shape)).reshape(self.batch_shape)[index].flatten().tolist()
        map_q = self.map_q.select_heads(heads)
        return map_q, (map_q if self.tied else self.map_k.select_heads(heads))

    def save_theta(self, path, *, dump, scale=None):
        """Export Θ with every metadata field filled in: :func:`sketchlab.export.export_theta`."""
        from .export import export_theta

        return export_theta(self, path, dump=dump, scale=scale)


def holdout_split(n: int, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``range(n)`` into sorted fit and held-out token indices (``ceil(holdout·n)`` held out).

    The same ``(n, holdout, seed)`` always gives the same split.
    """
    return _holdout_split(check_positive_int(n, "n"), check_fraction(holdout, "holdout"), check_seed(seed))


def _holdout_split(n: int, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`holdout_split` for checked arguments (trusts them)."""
    n_held = math.ceil(holdout * n)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)
    return perm[n_held:].sort().values, perm[:n_held].sort().values


#: Reports take the Theorem 3.1 floor by the Gram route from this many tokens per feature on.
_GRAM_TOKENS = 4

#: Per head, a report forms every entry of ``Â − A`` (row blocks) up to this many entries
#: (n_q · n_k; 8192² tokens); beyond, ``rel_fro`` comes from Gram matrices (exact) and ``rel_mae``
#: from a random sample of query rows against all keys (with its standard error in the report).
EXACT_REPORT_ENTRIES = 2**26

#: Below this ``sq_err / ‖A‖²`` the Gram-matrix form of the error cancels too much (it keeps
#: ``~1e-13 ‖A‖²`` absolute accuracy): the report then takes the row blocks instead.
_GRAM_ERR_FLOOR = 1e-6


def _errors(maps: tuple, q: torch.Tensor, k: torch.Tensor, p: int, m: int, method: str, where: str,
            max_bytes: int, *, core: torch.Tensor | None = None, seed: int = 0):
    """rel_fro, rel_mae, optimality ratio, tail and ``info`` of the pair ``maps`` on ``(q, k)``; a non-finite
    error raises ``FloatingPointError`` naming the method, the heads and the likely cause.

    Trusts its inputs (checked by :func:`fit_sketch`). ``core``: a matrix with ``A``'s singular
    values that the fit already formed (``FittedMaps.info["kernel_core"]``); otherwise they are computed
    (the Gram route when tokens far outnumber the features). Up to :data:`EXACT_REPORT_ENTRIES`
    entries per head every error is exact (row blocks); beyond, ``sq_err`` comes from Gram matrices
    (:func:`sketchlab.metrics._gram_sq_err`) and ``rel_mae`` from ``EXACT_REPORT_ENTRIES / n_k``
    random query rows (seeded by ``seed``), ``info`` recording ``rel_mae_rows`` and ``rel_mae_se``.
    """
    from .featuremaps.heads import pair_features
    from .metrics import _gram_sq_err, _kernel_errors, _sampled_rel_mae, ratio_to_tail
    from .optimal import _kernel_singular_values, _pad
    from .polynomial import _num_features

    n_q, n_k = q.shape[-2], k.shape[-2]
    if core is not None:
        s = _pad(torch.linalg.svdvals(core), min(n_q, n_k))
    else:
        # Far more tokens than features: the floor from the Gram factors (5/8·n·D² multiply-adds per
        # side for G, against ~2·n·D² for Householder QR; the tail agrees to ~1e-12 relative unless it
        # is below ~1e-12 ‖A‖², where the ratio is undefined anyway)
        many = max(n_q, n_k) >= _GRAM_TOKENS * _num_features(q.shape[-1], p, True)
        s = _kernel_singular_values(q, k, p, m, "gram" if many else "auto", max_bytes)
    tail = (s[..., m:] ** 2).sum(-1)
    fq, fk = pair_features(maps, q, k)
    info: dict = {}
    if n_q * n_k <= EXACT_REPORT_ENTRIES:
        err = _kernel_errors(fq, fk, q, k, p, max_bytes)
    else:
        sq_norm = (s**2).sum(-1)  # ‖A‖_F² from the singular values the floor needed anyway
        sq_err = _gram_sq_err(fq, fk, q, k, p, sq_norm, max_bytes=max_bytes)
        if bool((sq_err < _GRAM_ERR_FLOOR * sq_norm).any()):  # near-exact sketch: the identity cancels, take the rows
            err = _kernel_errors(fq, fk, q, k, p, max_bytes)
        else:
            rows = _subsample(n_q, max(2, EXACT_REPORT_ENTRIES // n_k), seed + 0x3AE)
            rel_mae, se = _sampled_rel_mae(fq, fk, q, k, p, rows, max_bytes=max_bytes)
            err = {"sq_err": sq_err, "sq_norm": sq_norm, "rel_fro": (sq_err / sq_norm).sqrt(), "rel_mae": rel_mae}
            info = {"rel_mae_rows": int(rows.numel()), "rel_mae_se": se}
    bad = ~(torch.isfinite(err["sq_err"]) & torch.isfinite(err["sq_norm"]) & torch.isfinite(err["rel_mae"]))
    if bool(bad.any()):
        flat = bad.reshape(-1).nonzero().flatten().tolist()
        batch = tuple(bad.shape)
        heads = [(i // batch[1], i % batch[1]) for i in flat[:8]] if len(batch) == 2 else flat[:8]
        label = "(layer, head)" if len(batch) == 2 else "flattened batch index"
        cause = ("‖A‖_F² of the exact kernel (QKᵀ)^p overflows float64 (input scale too large: x · d^-1/4 is the "
                 "usual choice)" if not bool(torch.isfinite(err["sq_norm"]).all()) else
                 f"the {method} sketch's features overflow or are NaN (input scale too large for its map)")
        raise FloatingPointError(
            f"sketch method {method!r}: non-finite {where} error for {len(flat)} head(s), {label} {heads}; likely cause: {cause}"
        )
    ratio = ratio_to_tail(err["sq_err"], tail, err["sq_norm"], max(n_q, n_k))
    return err["rel_fro"], err["rel_mae"], ratio, tail, info


def _subsample(n: int, count: int, seed: int) -> torch.Tensor:
    """Sorted random ``count`` of ``range(n)`` (seeded; a different stream from the hold-out split)."""
    gen = torch.Generator().manual_seed(seed + 0x5EED)
    return torch.randperm(n, generator=gen)[:count].sort().values


def fit_sketch(method: str, q, k, /, *, p: int, m: int, seed: int = 0, holdout: float = 0.0,
               fit_tokens: int | None = None, reference: bool = True, max_bytes: int = DEFAULT_MAX_BYTES,
               **options) -> Fit:
    """Fit the sketch ``method`` to ``(q, k)`` and measure it against the Theorem 3.1 optimum.

    Parameters
    ----------
    method : str
        A name from :func:`available_sketches`.
    q : Tensor ``[..., n_q, d]``
    k : Tensor ``[..., n_k, d]``
        Leading axes (e.g. ``[L, H]``) are independent problems, fitted together, on the device of ``q``.
    p, m : int
        Degree and sketch size; ``m`` must be below ``min(fitting tokens, D)`` (at that size the
        exact features already have zero error and every ratio would be undefined).
    seed : int
        Seeds the held-out split, the token subsample and the method's own randomness.
    holdout : float in ``[0, 1)``
        Fraction of tokens (of ``q`` and of ``k`` separately) held out of the fit; errors on
        them are reported as ``holdout_*``. With ``n_q == n_k`` both use one split, so the
        held-out tokens are the same positions on both sides.
    fit_tokens : int, optional
        Fit on a random subset of this many of the non-held-out tokens (per side; same positions
        when ``n_q == n_k``); errors are still reported on all of them and on the held-out ones.
        Makes a 100k-token dump usable: the fit's cost grows with the subset, the report's
        (``O(n² (d + m))`` flops in row blocks, never ``n × n`` memory) with all tokens.
    reference : bool
        With a hold-out, also report the held-out error of the minimum-norm in-sample optimum
        (:class:`FitReport`); needs the exact features ``ψ_p`` of the fitting tokens.
    max_bytes : int
        Memory budget of the report's allocations (row blocks, exact features).
    **options
        Passed to the method's fitter; unknown ones are rejected.

    Returns
    -------
    Fit
        ``fit.maps`` (the fitted ``(map_q, map_k)``) and ``fit.report`` (in-sample and held-out ``rel_fro``, ``rel_mae``,
        ``optimality_ratio``, the tails, wall seconds, steps, convergence).

    Raises
    ------
    FloatingPointError
        When an error comes out non-finite (naming method, heads and the likely cause).

    Warns
    -----
    RuntimeWarning
        Once, when some ratio of the report is undefined (:func:`sketchlab.numerics.warn_undefined`).
    """
    fit = _fit_sketch(method, q, k, p=p, m=m, seed=seed, holdout=holdout, fit_tokens=fit_tokens, reference=reference,
                      max_bytes=max_bytes, **options)
    warn_undefined(f"sketch method {method!r}", fit.report.undefined_counts())
    return fit


def _fit_sketch(method: str, q, k, /, *, p: int, m: int, seed: int = 0, holdout: float = 0.0,
                fit_tokens: int | None = None, reference: bool = True, max_bytes: int = DEFAULT_MAX_BYTES,
                **options) -> Fit:
    """:func:`fit_sketch` without its warning: for a caller that fits many times and warns once."""
    fitter = sketch_fitter(method)
    q, k = check_pair(q, k)
    p = check_degree(p)
    check_poly_kernel_range(q, k, p, max_bytes=max_bytes)
    m = check_positive_int(m, "m (the sketch size)")
    holdout = check_fraction(holdout, "holdout")
    seed = check_seed(seed)
    if not isinstance(reference, bool):
        raise TypeError(f"reference must be a bool, got {reference!r}")
    if fit_tokens is not None:
        fit_tokens = check_positive_int(fit_tokens, "fit_tokens")
    return _fit_checked(method, fitter, q, k, p, m, seed, holdout, fit_tokens, reference, max_bytes, options)


def _fit_checked(method: str, fitter: Callable[..., Fitted], q: torch.Tensor, k: torch.Tensor, p: int, m: int,
                 seed: int, holdout: float, fit_tokens: int | None, reference: bool, max_bytes: int,
                 options: dict) -> Fit:
    """:func:`fit_sketch` after its argument checks (the dump-level entry points call it with the
    values they checked). Trusts ``q, k, p, m, seed, holdout, fit_tokens, reference``; checks what
    depends on the data (tokens left to fit, ``m`` against them, the fitter's options)."""
    fit_q, held_q = _holdout_split(q.shape[-2], holdout, seed)
    fit_k, held_k = (fit_q, held_q) if q.shape[-2] == k.shape[-2] else _holdout_split(k.shape[-2], holdout, seed)
    if holdout > 0 and (len(fit_q) == 0 or len(fit_k) == 0):
        raise ValueError(f"holdout={holdout} leaves no fitting tokens out of n_q={q.shape[-2]}, n_k={k.shape[-2]}")
    sub_q, sub_k = fit_q, fit_k
    if fit_tokens is not None:
        if fit_tokens < len(fit_q) or fit_tokens < len(fit_k):
            pick_q = _subsample(len(fit_q), min(fit_tokens, len(fit_q)), seed)
            pick_k = pick_q if len(fit_q) == len(fit_k) else _subsample(len(fit_k), min(fit_tokens, len(fit_k)), seed)
            sub_q, sub_k = fit_q[pick_q], fit_k[pick_k]
    from .optimal import max_sketch_size  # import late: sketchlab.optimal is only needed here

    limit = max_sketch_size(len(sub_q), len(sub_k), q.shape[-1], p)
    if m >= limit:  # at m = limit the tail is 0: the exact features are optimal and every ratio undefined
        raise ValueError(
            f"m (the sketch size) must be below min(fitting tokens, D) = {limit} for d={q.shape[-1]}, p={p} "
            f"({len(sub_q)} query and {len(sub_k)} key tokens fitted, holdout={holdout}, fit_tokens={fit_tokens}); "
            f"got m={m}. At m >= {limit} the tail is 0 (the exact features are already optimal, every ratio "
            "undefined): use a smaller m, or more fitting tokens"
        )
    known = _option_names(fitter)
    unknown = [] if known is None else sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for sketch method {method!r}; "
            f"it takes: {', '.join(sorted(known)) or 'no options'}"
        )
    q_fit, k_fit = q[..., fit_q, :], k[..., fit_k, :]

    from ._threads import hot_loop_threads
    from .polynomial import _num_features

    # the fit's and the report's loops: ~(n_q + n_k)·D·(D + m) multiply-adds per head, ~n_q·n_k·(d + m) on tokens
    dim = _num_features(q.shape[-1], p, True)
    heads = math.prod(q.shape[:-2])
    work = heads * min((q.shape[-2] + k.shape[-2]) * dim * (dim + m), q.shape[-2] * k.shape[-2] * (q.shape[-1] + m))
    with hot_loop_threads(work):
        start = time.perf_counter()
        result = fitter(q[..., sub_q, :], k[..., sub_k, :], p=p, m=m, seed=seed, **options)
        seconds = time.perf_counter() - start
        map_q, map_k, fit_info = _fitted_maps(method, result, tuple(q.shape[:-2]), q.shape[-1])
        core = fit_info.pop("kernel_core", None)  # the report keeps no copy
        if fit_tokens is not None and (len(sub_q) < len(fit_q) or len(sub_k) < len(fit_k)):
            core = None  # the fit saw a subset: its A is not the report's
        info = dict(fit_info)
        m_in = min(m, max_sketch_size(len(fit_q), len(fit_k), q.shape[-1], p))
        rel_f, rel_m, ratio, tail, extra = _errors((map_q, map_k), q_fit, k_fit, p, m_in, method, "in-sample", max_bytes,
                                                   core=core, seed=seed)
        info.update(extra)
        report = FitReport(
            method=method, p=p, m=m, rel_fro=rel_f, rel_mae=rel_m, optimality_ratio=ratio, tail=tail,
            seconds=seconds, steps=int(info.pop("steps", 0)), converged=bool(info.pop("converged", True)),
            num_features=map_q.num_features,
            num_parameters=_parameters_per_head(map_q, map_k),
            info=info,
            fit_tokens=None if fit_tokens is None else len(sub_q),
        )
        if holdout > 0:
            q_held, k_held = q[..., held_q, :], k[..., held_k, :]
            # The held-out floor uses the same m, clamped to the largest rank the held-out A can
            # have (its tail is 0 there and the ratio NaN: undefined, a sketch that size could be exact).
            report.holdout_rank = max_sketch_size(q_held.shape[-2], k_held.shape[-2], q.shape[-1], p)
            m_held = min(m, report.holdout_rank)
            h_f, h_m, h_r, h_t, extra = _errors((map_q, map_k), q_held, k_held, p, m_held, method, "held-out", max_bytes, seed=seed)
            report.info.update({f"holdout_{key}": value for key, value in extra.items()})
            report.holdout_rel_fro, report.holdout_rel_mae = h_f, h_m
            report.holdout_optimality_ratio, report.holdout_tail = h_r, h_t
            if reference:
                from .optimal import _min_norm_sketch, _plan

                ref = _min_norm_sketch(*_plan(q[..., sub_q, :], k[..., sub_k, :], p, m, "auto", max_bytes), max_bytes)
                ref_f = _errors(ref.maps, q_held, k_held, p, m_held, "optimal (min-norm reference)", "held-out", max_bytes,
                                seed=seed)[0]
                report.holdout_reference_rel_fro = ref_f
                n_held = max(q_held.shape[-2], k_held.shape[-2])
                report.holdout_vs_reference = torch.where(is_roundoff(ref_f, 1.0, n_held), math.nan, h_f / ref_f)
    return Fit(map_q, map_k, report, batch_shape=tuple(q.shape[:-2]))


def _fitted_maps(method: str, result, batch_shape: tuple, head_dim: int):
    """``(map_q, map_k, info)`` of a fitter's ``result``: :class:`FittedMaps`, a :class:`FeatureMap` (both sides)
    or a pair ``(map_q, map_k)`` of ``prod(batch_shape)`` heads of ``head_dim``; ``info`` a copy of the result's
    (empty where it has none)."""
    heads = math.prod(batch_shape)
    pair = (result, result) if isinstance(result, FeatureMap) else result
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(f, FeatureMap) for f in pair)):
        raise TypeError(f"the fitter of {method!r} must return a FeatureMap or a pair (map_q, map_k) of them, got "
                        f"{type(result).__name__}")
    for f in pair:
        if f.heads != heads or f.head_dim != head_dim:
            raise ValueError(f"the fitter of {method!r} returned a map of heads={f.heads}, head_dim={f.head_dim}; the "
                             f"fit needs heads={heads} (batch shape {list(batch_shape)}) of head_dim={head_dim}")
    if pair[0].num_features != pair[1].num_features:
        raise ValueError(f"the fitter of {method!r} returned maps of {pair[0].num_features} (query) and "
                         f"{pair[1].num_features} (key) features: a kernel's two maps need the same number")
    if any(hasattr(f, "fit_info") for f in pair):  # the contract before FittedMaps: refused, not lost
        raise TypeError(f"the fitter of {method!r} left fit_info on a map; a fitter returns its account as "
                        "FittedMaps(map_q, map_k, info) (sketchlab.featuremaps.FittedMaps), and the maps carry none")
    return pair[0], pair[1], dict(result.info) if isinstance(result, FittedMaps) else {}


def _parameters_per_head(map_q: FeatureMap, map_k: FeatureMap) -> int:
    """Stored numbers that define one head's pair of maps, both sides counted (once when tied): a per-head map's
    numbers divided by its heads, a shared one's whole."""
    def one(fmap):
        return fmap.num_parameters // fmap.heads if fmap.per_head_parameters else fmap.num_parameters

    return one(map_q) if map_k is map_q else one(map_q) + one(map_k)


def _option_names(fitter: Callable[..., Fitted]) -> set[str] | None:
    """Keyword options a fitter takes beyond ``p, m, seed``; ``None`` when it takes ``**options``
    (then the fitter checks them itself, as ``fit_llops`` does)."""
    params = inspect.signature(fitter).parameters
    if any(par.kind is inspect.Parameter.VAR_KEYWORD for par in params.values()):
        return None
    return {name for name, par in params.items()
            if par.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("p", "m", "seed")}
