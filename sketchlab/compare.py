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
import numbers
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ._validation import check_degree, check_fraction, check_positive_int
from .fit import available_sketches, fit_sketch
from .io import load_qk, select_indices, validate_qk
from .optimal import max_sketch_size

__all__ = ["DEFAULT_METHODS", "ComparisonRow", "ComparisonTable", "compare", "resolve_scale"]

#: Methods compared by default, in table order.
DEFAULT_METHODS = ("optimal", "llops", "mlp", "psf", "tensorsketch", "based")

_METRICS = ("rel_mae", "rel_fro", "optimality_ratio", "holdout_rel_mae", "holdout_rel_fro",
            "holdout_optimality_ratio")


def resolve_scale(scale, d: int) -> tuple[str, float]:
    """``(label, factor)`` for a ``scale`` argument: ``"none"`` → 1, ``"sqrt-d"`` → ``d^{-1/4}``
    (so that ``qᵀk`` becomes ``qᵀk/√d``), or a positive finite number used as the factor."""
    if isinstance(scale, str):
        if scale == "none":
            return "none", 1.0
        if scale == "sqrt-d":
            return "sqrt-d", float(d) ** -0.25
        raise ValueError(f"scale must be 'none', 'sqrt-d' or a positive number, got {scale!r}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be 'none', 'sqrt-d' or a positive finite number, got {scale!r}")
    return repr(float(scale)), float(scale)


def _load(dump_or_qk):
    """Return ``(q, k, source)`` with ``q, k`` of shape ``[L, H, n, d]``."""
    if isinstance(dump_or_qk, (str, os.PathLike)):
        path = Path(dump_or_qk)
        if not path.exists():
            raise FileNotFoundError(f"Q/K dump {str(path)!r} does not exist")
        dump = load_qk(path)
        return dump.q, dump.k, str(path)
    if isinstance(dump_or_qk, tuple) and len(dump_or_qk) == 2:
        q, k = dump_or_qk
        return q, k, "in-memory (q, k)"
    if hasattr(dump_or_qk, "q") and hasattr(dump_or_qk, "k"):
        return dump_or_qk.q, dump_or_qk.k, str(getattr(dump_or_qk, "path", None) or "in-memory dump")
    raise TypeError(
        "dump_or_qk must be a path to a Q/K dump, a QKDump (with .q and .k) or a tuple (q, k), "
        f"got {type(dump_or_qk).__name__}"
    )


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
        """Mean (or median) over heads of ``metric``; ``nan`` when any value is missing."""
        vals = self.values(method, metric, layer)
        if any(v is None for v in vals):
            return math.nan
        return statistics.fmean(vals) if stat == "mean" else statistics.median(vals)

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
        """Rows as plain dicts (non-finite floats become ``None``)."""
        return [{k: _finite_or_none(v) for k, v in asdict(r).items()} for r in self.rows]

    def config(self) -> dict:
        return {
            "p": self.p, "m": self.m, "methods": self.methods, "layers": self.layers, "heads": self.heads,
            "scale": self.scale, "scale_factor": self.scale_factor, "seed": self.seed, "holdout": self.holdout,
            "source": self.source, "n_tokens": self.n_tokens, "d": self.d, "options": self.options,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """``{"config": {...}, "rows": [...]}`` as a JSON string (``null`` for non-finite values)."""
        return json.dumps({"config": self.config(), "rows": self.to_dicts()}, indent=indent)

    def to_markdown(self, stat: str = "mean") -> str:
        """The paper's Table 3 layout (methods × layers, plus Avg) for each metric, then sizes.

        Each cell is the ``stat`` ("mean" or "median") over the selected heads; ``Avg`` is the same
        statistic over all (layer, head) pairs.
        """
        if stat not in ("mean", "median"):
            raise ValueError(f"stat must be 'mean' or 'median', got {stat!r}")
        lines = [
            f"p = {self.p}, m = {self.m}, scale = {self.scale} (factor {self.scale_factor:.6g} on q and k), "
            f"held out = {self.holdout:g} of {self.n_tokens} tokens, d = {self.d}, layers {self.layers}, "
            f"heads {self.heads}, seed {self.seed}; cells: {stat} over heads. Source: {self.source}",
            "",
        ]
        titles = {
            "rel_mae": "Relative mean absolute error Σ|Â−A|/Σ|A| (fitting tokens)",
            "optimality_ratio": "Optimality ratio ‖Â−A‖_F / √tail (1 = Theorem 3.1 optimum; fitting tokens)",
            "holdout_rel_mae": "Relative mean absolute error on held-out tokens",
            "holdout_optimality_ratio": "Optimality ratio on held-out tokens (against the held-out optimum)",
        }
        for metric, title in titles.items():
            if metric.startswith("holdout") and self.holdout == 0:
                continue
            if metric == "holdout_optimality_ratio" and all(
                v is None or not math.isfinite(v) for v in (getattr(r, metric) for r in self.rows)
            ):
                lines += [f"**{title}**: undefined here — the held-out kernel has rank ≤ m (too few held-out "
                          "tokens), so its Theorem 3.1 floor is 0 and every ratio is undefined (NaN).", ""]
                continue
            lines += [f"**{title}**", ""]
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


def _fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if math.isinf(v):
        return "inf"
    return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"


def compare(dump_or_qk, *, p: int, m: int, methods=DEFAULT_METHODS, layers=None, heads=None, seed: int = 0,
            holdout: float = 0.25, scale="none", options: dict | None = None, progress: bool = True) -> ComparisonTable:
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
    scale : "none", "sqrt-d" or float
        Factor applied to ``q`` and ``k`` before fitting (``"sqrt-d"``: ``d^{-1/4}``, so the kernel
        is :math:`(q^\top k/\sqrt d)^p`). Recorded in the table. Explicit: the default applies none.
    options : dict or None
        Per-method keyword options for the fitters, e.g. ``{"mlp": {"steps": 500}}``.
    progress : bool
        Show a tqdm progress bar (on stderr) while fitting.

    Returns
    -------
    ComparisonTable
        One :class:`ComparisonRow` per (layer, head, method).

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
    unknown = [name for name in methods if name not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(map(repr, unknown))}; available: {', '.join(known)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods contain duplicates: {methods}")
    options = dict(options or {})
    stray = [name for name in options if name not in methods]
    if stray:
        raise ValueError(f"options given for method(s) not compared: {stray}")
    p = check_degree(p)
    m = check_positive_int(m, "m (the sketch size)")
    holdout = check_fraction(holdout, "holdout")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {seed!r}")

    q, k, source = _load(dump_or_qk)
    q, k, _ = validate_qk(q, k, where=source)  # [L, H, n, d] each, finite floats, same shape
    n_layers, n_heads, n, d = q.shape
    layers = select_indices(layers, n_layers, "layer", source)
    heads = select_indices(heads, n_heads, "head", source)
    n_fit = n - math.ceil(holdout * n)
    limit = max_sketch_size(n_fit, n_fit, d, p)
    if m > limit:
        raise ValueError(
            f"m={m} exceeds {limit} = sketchlab.optimal.max_sketch_size(n_fit={n_fit}, n_fit, d={d}, p={p}) "
            f"(min of the fitting tokens and the exact feature dimension): the kernel on the fitting tokens has "
            f"rank at most {limit}, so the Theorem 3.1 floor is 0 and undefined as a yardstick"
        )
    label, factor = resolve_scale(scale, d)

    from tqdm.auto import tqdm

    rows: list[ComparisonRow] = []
    head_index = torch.tensor(heads)
    with tqdm(total=len(layers) * len(methods), desc="compare", disable=not progress, leave=False) as bar:
        for layer in layers:
            q_l = q[layer, head_index] * factor  # [H', n, d]
            k_l = k[layer, head_index] * factor  # [H', n, d]
            for method in methods:
                bar.set_description(f"layer {layer}: {method}")
                fit = fit_sketch(method, q_l, k_l, p=p, m=m, seed=int(seed), holdout=holdout, **options.get(method, {}))
                rep = fit.report
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
                    ))
                bar.update(1)
    return ComparisonTable(
        rows=rows, p=p, m=m, methods=methods, layers=layers, heads=heads, scale=label, scale_factor=factor,
        seed=int(seed), holdout=holdout, source=source, n_tokens=n, d=d, options=options,
    )
