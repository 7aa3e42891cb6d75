r"""Fit several sketches to the same Q/K tensors and tabulate them against the Theorem 3.1 optimum.

This reproduces (and extends) Table 3 of the LLoPS paper: for each layer, head and method, the
relative mean absolute error (our definition, see :func:`sketchlab.rel_mae`), the relative
Frobenius error, the optimality ratio :math:`\|\hat A - A\|_F/\sqrt{\mathrm{tail}}` (1 = the best
any size-``m`` sketch can do on that data), their held-out versions (tokens not used to fit), the
feature and parameter counts, and the fit time. Every method goes through
:func:`sketchlab.fit_sketch`, so the held-out split and the metrics are the same for all of them.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field

from ._dumpsel import select_and_scale
from ._validation import (
    DEFAULT_MAX_BYTES,
    check_degree,
    check_fraction,
    check_positive_int,
    check_seed,
    check_symmetric_features,
)
from .fit import RATIO_CAUSES, _fit_checked, accepted_methods, available_sketches, sketch_fitter
from .numerics import UNDEFINED, check_poly_kernel_range, json_ratios, warn_undefined
from .optimal import max_sketch_size
from .scaling import DEFAULT_SCALE, describe_scale

__all__ = ["DEFAULT_METHODS", "ComparisonRow", "ComparisonTable", "compare"]

#: Methods compared by default, in table order.
DEFAULT_METHODS = ("optimal", "llops", "mlp", "psf-random", "tensorsketch", "based-expand")

_METRICS = ("rel_mae", "rel_fro", "optimality_ratio", "holdout_rel_mae", "holdout_rel_fro",
            "holdout_optimality_ratio", "holdout_vs_reference")


@dataclass
class ComparisonRow:
    """One (layer, head, method) result. ``fit_seconds`` is the wall time of the method's batched
    fit on the layer divided by the number of heads fitted together (amortised per head)."""

    layer: int
    head: int
    method: str
    rel_mae: float
    rel_fro: float
    optimality_ratio: float
    holdout_rel_mae: float | None
    holdout_rel_fro: float | None
    holdout_optimality_ratio: float | None
    num_features: int
    num_parameters: int
    fit_seconds: float
    steps: int
    converged: bool
    holdout_vs_reference: float | None = None


@dataclass
class ComparisonTable:
    """Result of :func:`compare`: the rows and the configuration that produced them."""

    rows: list[ComparisonRow]
    p: int
    m: int
    methods: list[str]
    layers: list[int]
    heads: list[int]
    scale: str
    scale_factor: float
    seed: int
    holdout: float
    source: str
    n_tokens: int
    d: int
    options: dict = field(default_factory=dict)

    # ---- access -------------------------------------------------------------------------------
    def values(self, method: str, metric: str = "rel_mae", layer: int | None = None) -> list[float]:
        """The ``metric`` of ``method`` for every head (of ``layer``, or of all layers)."""
        if metric not in _METRICS and metric not in ("num_features", "num_parameters", "fit_seconds"):
            raise ValueError(f"metric must be one of {_METRICS}, got {metric!r}")
        if method not in self.methods:
            raise ValueError(f"method {method!r} is not in this table ({self.methods})")
        return [getattr(r, metric) for r in self.rows
                if r.method == method and (layer is None or r.layer == layer)]

    def cell(self, method: str, metric: str, layer: int | None = None, stat: str = "mean") -> float:
        """Mean (or median) over heads of ``metric``; NaN (printed "undefined") when any value is undefined or
        missing (a held-out metric without hold-out, which the tables leave out)."""
        vals = self.values(method, metric, layer)
        if any(v is None for v in vals):
            return math.nan
        return statistics.fmean(vals) if stat == "mean" else statistics.median(vals)

    def roundoff_references(self) -> set[tuple[int, int]]:
        """The ``(layer, head)`` pairs whose held-out reference error is round-off (``holdout_vs_reference``
        undefined, NaN, in any row: :class:`sketchlab.FitReport`): no yardstick there."""
        return {(r.layer, r.head) for r in self.rows
                if r.holdout_vs_reference is not None and math.isnan(r.holdout_vs_reference)}

    def _reference_cell(self, method: str) -> float:
        """Median ``holdout_vs_reference`` of ``method`` over the heads whose reference is not round-off
        (NaN, printed "undefined", when none is left or a value is missing)."""
        skip = self.roundoff_references()
        vals = [r.holdout_vs_reference for r in self.rows if r.method == method and (r.layer, r.head) not in skip]
        if not vals or any(v is None for v in vals):
            return math.nan
        return statistics.median(vals)

    def ratio(self, numerator: str, denominator: str, metric: str = "rel_mae") -> float:
        """Median over (layer, head) of the per-head ratio ``metric[numerator] / metric[denominator]``."""
        a = {(r.layer, r.head): getattr(r, metric) for r in self.rows if r.method == numerator}
        b = {(r.layer, r.head): getattr(r, metric) for r in self.rows if r.method == denominator}
        if not a or not b:
            raise ValueError(f"both {numerator!r} and {denominator!r} must be in the table ({self.methods})")
        if any(v is None for v in (*a.values(), *b.values())):
            raise ValueError(f"{metric} is missing for some rows (held-out metrics need holdout > 0)")
        return statistics.median(a[key] / b[key] for key in a)

    # ---- output -------------------------------------------------------------------------------
    def to_dicts(self) -> list[dict]:
        """Rows as plain dicts: an undefined ratio becomes ``None`` with its reason under ``"undefined"``
        (:func:`sketchlab.numerics.json_ratios`), any other non-finite float ``None``."""
        return [{k: _finite_or_none(v) for k, v in json_ratios(asdict(r), RATIO_CAUSES).items()} for r in self.rows]

    def config(self) -> dict:
        return {
            "p": self.p, "m": self.m, "methods": self.methods, "layers": self.layers, "heads": self.heads,
            "scale": self.scale, "scale_factor": self.scale_factor, "scale_description": self.scale_description(),
            "seed": self.seed, "holdout": self.holdout,
            "source": self.source, "n_tokens": self.n_tokens, "d": self.d, "options": self.options,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """``{"config": {...}, "rows": [...]}`` as a JSON string (``null`` for non-finite values)."""
        return json.dumps({"config": self.config(), "rows": self.to_dicts()}, indent=indent)

    def scale_description(self) -> str:
        """The header line of :func:`sketchlab.scaling.describe_scale` for this table's scale."""
        return describe_scale(self.scale if self.scale in ("none", "sqrt-d") else float(self.scale), self.d)

    def has_holdout_reference(self) -> bool:
        """Whether the fits reported ``holdout_vs_reference`` (a documented held-out reference)."""
        return self.holdout > 0 and any(r.holdout_vs_reference is not None for r in self.rows)

    def summary_markdown(self) -> str:
        r"""One row per method: errors, ``×optimum`` and held-out rel_mae (medians over all heads).

        ``×optimum`` is the optimality ratio :math:`\|\hat A - A\|_F/\sqrt{\mathrm{tail}}` on the
        fitting tokens (1 = the Theorem 3.1 floor, which no size-``m`` sketch beats there). The
        held-out column is the plain relative mean absolute error on the tokens no fit saw. The
        held-out optimality ratio is not shown: the held-out floor of Theorem 3.1 is that of a
        sketch fitted *on* the held-out tokens, far below what any sketch fitted elsewhere
        reaches, so the ratio reads ≫ 1 even for the optimum itself. When the fits report a
        documented held-out reference (``FitReport.holdout_vs_reference``: held-out rel_fro ÷
        that of the minimum-norm in-sample optimum), a column "held-out ÷ reference" shows it.
        """
        with_ref = self.has_holdout_reference()
        header = ["Method", "rel_mae", "rel_fro", "×optimum", "held-out rel_mae"] + (["held-out ÷ reference"] if with_ref else []) + [
            "features", "parameters", "fit s/head"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for method in self.methods:
            rows = [r for r in self.rows if r.method == method]
            held = "–" if self.holdout == 0 else _fmt(self.cell(method, "holdout_rel_mae", stat="median"))
            lines.append("| " + " | ".join([
                method, _fmt(self.cell(method, "rel_mae", stat="median")), _fmt(self.cell(method, "rel_fro", stat="median")),
                _fmt(self.cell(method, "optimality_ratio", stat="median")), held,
                *([_fmt(self._reference_cell(method))] if with_ref else []), str(rows[0].num_features),
                str(rows[0].num_parameters), f"{statistics.fmean(r.fit_seconds for r in rows):.3g}",
            ]) + " |")
        return "\n".join(lines) + "\n"

    def to_markdown(self, stat: str = "mean") -> str:
        """A summary per method (:meth:`summary_markdown`), then the paper's Table 3 layout
        (methods × layers, plus Avg) for each metric, then sizes.

        Each layer cell is the ``stat`` ("mean" or "median") over the selected heads; ``Avg`` is the
        same statistic over all (layer, head) pairs. The header names the scale applied to q and k.
        """
        if stat not in ("mean", "median"):
            raise ValueError(f"stat must be 'mean' or 'median', got {stat!r}")
        lines = [
            f"p = {self.p}, m = {self.m}, {self.scale_description()}, held out = {self.holdout:g} of "
            f"{self.n_tokens} tokens, d = {self.d}, layers {self.layers}, heads {self.heads}, seed {self.seed}. "
            f"Source: {self.source}",
            "",
            "**Summary** (medians over all heads; ×optimum = ‖Â−A‖_F/√tail on the fitting tokens, 1 = Theorem 3.1 "
            "optimum)",
            "",
            self.summary_markdown(),
        ]
        if self.holdout > 0 and self.has_holdout_reference():
            lines += ["held-out ÷ reference = held-out rel_fro ÷ that of the Theorem 3.1 optimum fitted on the fitting "
                      "tokens with the minimum-norm W* (the fits' documented held-out reference; 1 = as good as it on "
                      "new tokens). No held-out optimality ratio is shown: the floor of a sketch fitted on the held-out "
                      "tokens themselves is not reachable by any sketch fitted elsewhere.", ""]
            skip = self.roundoff_references()
            if skip:
                heads = len({(r.layer, r.head) for r in self.rows})
                lines += [f"held-out ÷ reference leaves out {len(skip)} of {heads} head(s) ({UNDEFINED} when none is "
                          "left): there the reference's own held-out rel_fro is round-off (at most 64·n·eps; it "
                          "reproduces the held-out kernel exactly, e.g. a constant q or a kernel of rank <= m), so a "
                          "ratio to it is undefined (JSON null, with the reason).", ""]
        elif self.holdout > 0:
            lines += ["Held-out tokens are scored by rel_mae only: no held-out reference sketch is defined, so no "
                      "held-out optimality ratio is shown (the JSON keeps `holdout_optimality_ratio`, the ratio to "
                      "the floor of a sketch fitted on the held-out tokens themselves).", ""]
        titles = {
            "rel_mae": "Relative mean absolute error Σ|Â−A|/Σ|A| (fitting tokens)",
            "optimality_ratio": "×optimum: ‖Â−A‖_F / √tail (1 = Theorem 3.1 optimum; fitting tokens)",
            "holdout_rel_mae": "Relative mean absolute error on held-out tokens",
        }
        for metric, title in titles.items():
            if metric.startswith("holdout") and self.holdout == 0:
                continue
            lines += [f"**{title}** ({stat} over heads)", ""]
            header = ["Method"] + [f"Layer {l}" for l in self.layers] + ["Avg"]
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            for method in self.methods:
                cells = [_fmt(self.cell(method, metric, layer, stat)) for layer in self.layers]
                cells.append(_fmt(self.cell(method, metric, None, stat)))
                lines.append("| " + " | ".join([method] + cells) + " |")
            lines.append("")
        lines += ["**Sizes and fit time** (per head; parameters count both sides)", "",
                  "| Method | features | parameters | fit s/head | steps | converged |", "|---|---|---|---|---|---|"]
        for method in self.methods:
            rows = [r for r in self.rows if r.method == method]
            conv = sum(r.converged for r in rows)
            lines.append(
                f"| {method} | {rows[0].num_features} | {rows[0].num_parameters} | "
                f"{statistics.fmean(r.fit_seconds for r in rows):.3g} | {rows[0].steps} | {conv}/{len(rows)} |"
            )
        return "\n".join(lines) + "\n"


def _finite_or_none(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _fmt(v: float | None) -> str:
    """A table cell: "–" for a missing value, "undefined" for an undefined ratio (NaN)."""
    if v is None:
        return "–"
    if math.isnan(v):
        return UNDEFINED
    if math.isinf(v):
        return "inf"
    return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"


def _check_heads(sel, p: int) -> None:
    """Reject selected heads whose q or k is all zeros: their kernel is 0 and every relative error undefined."""
    for name, t in (("q", sel.q), ("k", sel.k)):
        zero = t.abs().amax((-2, -1)) == 0  # [L', H']
        if bool(zero.any()):
            i, j = (int(v) for v in zero.nonzero()[0])
            raise ValueError(
                f"{sel.source}: tensor {name} of layer {sel.layers[i]}, head {sel.heads[j]} is all zeros: the kernel "
                f"(qᵀk)^{p} is 0 there and every relative error is undefined; leave it out (heads=/layers=, "
                f"--heads/--layers on the command line)"
            )


def _check_tokens(sel, holdout: float) -> None:
    """At least 2 fitting tokens: on ``n_fit <= 1`` every sketch size reaches the kernel's rank."""
    n = sel.q.shape[2]
    n_fit = n - math.ceil(holdout * n)
    if n_fit <= 1:
        raise ValueError(
            f"{sel.source}: n={n} token(s), and holdout {holdout:g} leaves {n_fit} to fit: a kernel on at most one "
            "token has rank <= 1, so every sketch size m reaches it and the Theorem 3.1 floor is 0 (no yardstick); "
            "use a dump with more tokens or a smaller holdout (--holdout on the command line)"
        )


def compare(dump_or_qk, *, p: int, m: int, methods=DEFAULT_METHODS, layers=None, heads=None, seed: int = 0,
            holdout: float = 0.25, scale=DEFAULT_SCALE, options: dict | None = None, progress: bool = True) -> ComparisonTable:
    r"""Fit every method in ``methods`` to each selected layer and compare them head by head.

    Parameters
    ----------
    dump_or_qk : str or PathLike, QKDump, or tuple ``(q, k)``
        A dump file (read with :func:`sketchlab.io.load_qk`), a loaded dump, or tensors of shape
        ``[L, H, n, d]`` (also ``[H, n, d]`` or ``[n, d]``).
    p, m : int
        Degree and sketch size; ``m`` must not exceed
        :func:`sketchlab.optimal.max_sketch_size` ``(n_fit, n_fit, d, p) = min(n_fit, C(d+p−1, p), d^p)``,
        the largest rank of the fitting kernel (``n_fit`` = tokens left after the held-out split).
    methods : sequence of str
        Registered sketch names (:func:`sketchlab.available_sketches`); unknown names raise.
    layers, heads : int, sequence of int or None
        Positions in the dump (``None``: all); negative indices count from the end, duplicates
        are rejected (:func:`sketchlab.io.select_indices`). The table records them non-negative.
    seed : int
        Held-out split and every method's randomness.
    holdout : float in ``[0, 1)``
        Fraction of tokens held out of every fit.
    scale : "sqrt-d" (default), "none" or float
        Factor applied to ``q`` and ``k`` before fitting, by the one rule of every dump-level entry
        point (:mod:`sketchlab.scaling`): ``"sqrt-d"`` multiplies by ``d^{-1/4}``, so the kernel is
        :math:`(q^\top k/\sqrt d)^p` as in softmax attention; ``"none"`` uses the tensors as given.
        Recorded in the table header and the JSON config.
    options : dict or None
        Per-method keyword options for the fitters, e.g. ``{"mlp": {"steps": 500}}``.
    progress : bool
        Show a tqdm progress bar (on stderr) while fitting.

    Returns
    -------
    ComparisonTable
        One :class:`ComparisonRow` per (layer, head, method).

    Warns
    -----
    RuntimeWarning
        Once, when some ratio of some fit is undefined (:func:`sketchlab.numerics.warn_undefined`).

    Notes
    -----
    All heads of a layer are fitted together (the fitters are batched over heads); the reported
    ``fit_seconds`` is that wall time divided by the number of heads.
    """
    if isinstance(methods, str):
        methods = [m_.strip() for m_ in methods.split(",") if m_.strip()]
    methods = list(methods)
    if not methods:
        raise ValueError("methods must name at least one sketch method")
    known = available_sketches()
    unknown = [name for name in methods if name not in accepted_methods()]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(map(repr, unknown))}; available: {', '.join(known)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods contain duplicates: {methods}")
    options = dict(options or {})
    stray = [name for name in options if name not in methods]
    if stray:
        raise ValueError(f"options given for method(s) not compared: {stray}")
    for name, value in options.items():
        if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
            raise TypeError(f"options[{name!r}] must be a dict of keyword options for that method, got {value!r}")
    p = check_degree(p)
    m = check_positive_int(m, "m (the sketch size)")
    holdout = check_fraction(holdout, "holdout")
    seed = check_seed(seed)

    sel = select_and_scale(dump_or_qk, layers=layers, heads=heads, scale=scale)  # [L', H', n, d], scaled
    layers, heads, source = sel.layers, sel.heads, sel.source
    _check_heads(sel, p)  # the checks before any fit: each names the file, layer and head
    _check_tokens(sel, holdout)
    check_poly_kernel_range(sel.q, sel.k, p, where=sel.label)
    _, _, n, d = sel.q.shape
    n_fit = n - math.ceil(holdout * n)
    limit = max_sketch_size(n_fit, n_fit, d, p)
    if m > limit:
        raise ValueError(
            f"m={m} exceeds {limit} = sketchlab.optimal.max_sketch_size(n_fit={n_fit}, n_fit, d={d}, p={p}) "
            f"(min of the fitting tokens and the exact feature dimension): the kernel on the fitting tokens has "
            f"rank at most {limit}, so the Theorem 3.1 floor is 0 and undefined as a yardstick"
        )
    # every fit's report measures it against the Theorem 3.1 optimum, on the exact symmetric features of one
    # layer's fitting tokens: their enumeration and size, estimated before the first fit
    check_symmetric_features(d, p, len(heads) * n_fit, where=f"{source}: compare at p={p}, d={d}",
                             lower_p="lower p (--p on the command line)",
                             fewer_rows="compare fewer heads at once (heads=, --heads)")

    from tqdm.auto import tqdm

    rows: list[ComparisonRow] = []
    undefined = []  # every fit's undefined ratios: one warning at the end
    with tqdm(total=len(layers) * len(methods), desc="compare", disable=not progress, leave=False) as bar:
        for i_layer, layer in enumerate(layers):
            q_l, k_l = sel.q[i_layer], sel.k[i_layer]  # [H', n, d] each
            for method in methods:
                bar.set_description(f"layer {layer}: {method}")
                # checked once above (the dump by select_and_scale): straight to the fit
                fit = _fit_checked(method, sketch_fitter(method), q_l, k_l, p, m, seed, holdout, None, True,
                                   DEFAULT_MAX_BYTES, options.get(method, {}))
                rep = fit.report
                undefined += rep.undefined_counts()
                per_head = rep.seconds / len(heads)
                for i, head in enumerate(heads):
                    def get(t):
                        return None if t is None else float(t.reshape(-1)[i])

                    rows.append(ComparisonRow(
                        layer=layer, head=head, method=method, rel_mae=get(rep.rel_mae), rel_fro=get(rep.rel_fro),
                        optimality_ratio=get(rep.optimality_ratio), holdout_rel_mae=get(rep.holdout_rel_mae),
                        holdout_rel_fro=get(rep.holdout_rel_fro),
                        holdout_optimality_ratio=get(rep.holdout_optimality_ratio),
                        num_features=rep.num_features, num_parameters=rep.num_parameters,
                        fit_seconds=per_head, steps=rep.steps, converged=rep.converged,
                        holdout_vs_reference=get(getattr(rep, "holdout_vs_reference", None)),
                    ))
                bar.update(1)
    warn_undefined(f"compare {source}", undefined)
    return ComparisonTable(
        rows=rows, p=p, m=m, methods=methods, layers=layers, heads=heads, scale=sel.scale, scale_factor=sel.scale_factor,
        seed=int(seed), holdout=holdout, source=source, n_tokens=n, d=d, options=options,
    )
