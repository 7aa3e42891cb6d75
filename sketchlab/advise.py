r"""How large must ``m`` be? The Theorem 3.1 floor and a method's practical sketch size, per head.

For a target relative error ``target`` (``rel_fro = ‖Â − A‖_F / ‖A‖_F``) and each selected
(layer, head):

**floor m** — the smallest ``m`` whose Theorem 3.1 floor meets the target,
:math:`\sqrt{\sum_{i>m}\sigma_i(A)^2}/\|A\|_F \le \text{target}`. Every ``m`` at once from one
factorisation (:func:`sketchlab.kernel_spectrum`). No size-``m`` sketch of any kind meets the target
below it (on the fitting tokens).

**practical m** — the smallest ``m`` at which ``method`` (through :func:`sketchlab.fit_sketch`, the
same fit :func:`sketchlab.compare` runs) meets the target, found by fitting that head alone:

1. start at ``c = floor m`` (every ``m`` below fails by the theorem, so no fit is needed there);
2. *bracket*: fit at ``c``; if it fails, let ``r`` be its measured ×optimum (rel_fro ÷ floor) and
   take the next ``c`` as the larger of the smallest ``m`` with ``r·floor(m) ≤ target`` (the
   prediction if the ratio stayed ``r``) and ``⌈1.05·c⌉`` (geometric growth, since the ratio of
   LLoPS grows with ``m``), capped at ``max_m``; repeat until a fit meets the target;
3. *bisect* between the last failing ``m`` and the first passing one.

The result is a measured boundary: the fit at ``practical m`` meets the target and the fit at
``practical m − 1`` does not (measured, or below the floor). Fits need not be monotone in ``m``,
so a larger failing ``m`` may exist; every fit made is kept (``HeadAdvice.fits``) and plotted.
When no ``m ≤ max_m`` meets the target, ``practical_m`` is ``None``.

The floors and fits use the fitting tokens of ``holdout_split(n, holdout, seed)`` — the same
tokens and seed as :func:`sketchlab.compare` with the same arguments, so ``compare`` at
``practical m`` reports the same ``rel_fro`` for that head.
"""

from __future__ import annotations

import json
import math
import numbers
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ._dumpsel import select_and_scale
from ._validation import check_degree, check_fraction, check_symmetric_features
from .fit import _fit_sketch, accepted_methods, available_sketches
from .numerics import check_poly_kernel_range, json_ratios, ratio_text, warn_undefined
from .optimal import max_sketch_size
from .scaling import DEFAULT_SCALE
from .spectrum import KernelSpectrum, spectrum_of_selection

__all__ = ["Advice", "HeadAdvice", "advise"]


@dataclass
class HeadAdvice:
    """Advice for one (layer, head).

    ``fits`` maps each fitted ``m`` to ``{"rel_fro", "optimality_ratio", "floor", "passed", "seconds"}``.
    ``practical_rel_fro`` / ``practical_ratio`` are the fit's rel_fro and ×optimum at ``practical_m``.
    """

    layer: int
    head: int
    floor_m: int
    practical_m: int | None
    practical_rel_fro: float | None
    practical_ratio: float | None
    fits: dict = field(default_factory=dict)


@dataclass
class Advice:
    """Result of :func:`advise`: one :class:`HeadAdvice` per selected (layer, head), and the spectrum."""

    heads: list[HeadAdvice]
    spectrum: KernelSpectrum
    target: float
    method: str
    p: int
    max_m: int
    holdout: float
    seed: int
    seconds: float
    options: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One sentence: medians and ranges of floor m and practical m."""
        floors = [h.floor_m for h in self.heads]
        prac = [h.practical_m for h in self.heads if h.practical_m is not None]
        text = (f"target rel_fro ≤ {self.target:g} at p = {self.p}: floor m median {statistics.median(floors):g} "
                f"(range {min(floors)}–{max(floors)})")
        if prac:
            text += (f"; {self.method} needs m median {statistics.median(prac):g} (range {min(prac)}–{max(prac)}) "
                     f"on {len(prac)}/{len(self.heads)} heads")
        missing = len(self.heads) - len(prac)
        if missing:
            text += f"; {missing} head(s) not reached by {self.method} up to m = {self.max_m}"
        return text + "."

    def to_markdown(self) -> str:
        spec = self.spectrum
        lines = [
            f"Advice for target rel_fro = ‖Â−A‖_F/‖A‖_F ≤ {self.target:g}; p = {self.p}, method {self.method}, "
            f"{spec.scale_description}; {spec.n_tokens} fitting tokens (held out {self.holdout:g}, seed {self.seed}), "
            f"m ≤ {self.max_m}. Source: {spec.source}",
            "",
            "floor m: smallest m whose Theorem 3.1 floor √(Σ_{i>m}σ_i²)/‖A‖_F meets the target (no sketch does "
            f"better). practical m: smallest m at which {self.method} meets it (bisection on fitted m; the fit at "
            "m−1 fails). ×optimum = rel_fro ÷ floor at that m.",
            "",
            "| layer | head | floor m | practical m | practical ÷ floor | rel_fro at practical m | ×optimum | fits |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for h in self.heads:
            if h.practical_m is None:
                cells = [f"> {self.max_m}", "–", "–", "–"]
            else:
                cells = [str(h.practical_m), f"{h.practical_m / h.floor_m:.2f}", f"{h.practical_rel_fro:.4f}",
                         ratio_text(h.practical_ratio)]
            lines.append("| " + " | ".join([str(h.layer), str(h.head), str(h.floor_m), *cells, str(len(h.fits))]) + " |")
        lines += ["", self.summary(), f"Wall time {self.seconds:.1f} s.", ""]
        return "\n".join(lines)

    def to_json(self, indent: int | None = 2) -> str:
        spec = self.spectrum
        config = {"target": self.target, "method": self.method, "p": self.p, "max_m": self.max_m,
                  "holdout": self.holdout, "seed": self.seed, "scale": spec.scale, "scale_factor": spec.scale_factor,
                  "scale_description": spec.scale_description, "source": spec.source, "n_tokens": spec.n_tokens,
                  "d": spec.d, "layers": spec.layers, "heads": spec.heads, "options": self.options,
                  "seconds": self.seconds}
        heads = []
        for h in self.heads:  # an undefined ratio: null, with its reason (sketchlab.numerics.json_ratios)
            row = json_ratios(asdict(h), {"practical_ratio": "tail"})
            row["fits"] = {str(m): json_ratios(v, {"optimality_ratio": "tail"}) for m, v in sorted(h.fits.items())}
            heads.append(row)
        return json.dumps({"config": config, "summary": self.summary(), "heads": heads}, indent=indent)


def _check_target(target) -> float:
    if isinstance(target, bool) or not isinstance(target, numbers.Real) or not 0 < target < 1:
        raise ValueError(f"target (a relative Frobenius error ‖Â−A‖_F/‖A‖_F) must lie in (0, 1), got {target!r}")
    return float(target)


def _practical_m(fit_at, floor: torch.Tensor, floor_m: int, max_m: int, target: float) -> int | None:
    """Bracket then bisect (module docstring). ``fit_at(m) -> (rel_fro, passed)``; ``floor[m]`` relative floors."""
    lo, c, hi = floor_m, floor_m, None  # invariant: every m < lo fails (measured or below the floor)
    while hi is None:
        rel, passed = fit_at(c)
        if passed:
            hi = c
            break
        lo = c + 1
        if lo > max_m:
            return None
        ratio = rel / float(floor[c]) if float(floor[c]) > 0 else math.inf
        reachable = (floor[lo:max_m + 1] * ratio <= target).nonzero()
        predicted = lo + int(reachable[0]) if math.isfinite(ratio) and len(reachable) else max_m
        c = min(max_m, max(lo, predicted, math.ceil(1.05 * c)))
    while lo < hi:  # fit(hi) passes, every m < lo fails
        mid = (lo + hi) // 2
        if fit_at(mid)[1]:
            hi = mid
        else:
            lo = mid + 1
    return hi


def advise(dump_or_qk, *, p: int, target: float, method: str = "llops", layers=None, heads=None,
           scale=DEFAULT_SCALE, holdout: float = 0.25, seed: int = 0, max_m: int | None = None,
           options: dict | None = None, progress: bool = True) -> Advice:
    r"""Per layer/head: the smallest ``m`` the Theorem 3.1 floor allows, and the ``m`` ``method`` needs.

    Parameters
    ----------
    dump_or_qk, layers, heads, scale
        The dump (``[L, H, n, d]``, also ``[H, n, d]``, ``[n, d]``), the positions (``None``: all) and
        the input scale, as in :func:`sketchlab.compare`.
    p : int
        Degree.
    target : float in ``(0, 1)``
        Target relative Frobenius error ``‖Â − A‖_F / ‖A‖_F`` on the fitting tokens.
    method : str
        A registered sketch (:func:`sketchlab.available_sketches`), fitted by :func:`sketchlab.fit_sketch`.
    holdout, seed : float in ``[0, 1)``, int
        The held-out split and seed, as in :func:`sketchlab.compare` (the floors and fits use the
        fitting tokens only).
    max_m : int or None
        Largest ``m`` tried (default and upper limit: one below
        :func:`sketchlab.optimal.max_sketch_size` of the fitting tokens, the largest rank ``A`` can
        have; at that rank the tail is 0 and the exact features meet any target).
    options : dict or None
        Keyword options for the method's fitter (e.g. ``{"steps": 200}``).
    progress : bool
        tqdm progress bar over heads (stderr).

    Returns
    -------
    Advice
        See the module docstring for how ``floor_m`` and ``practical_m`` are found.
    """
    p = check_degree(p)
    target = _check_target(target)
    if method not in accepted_methods():  # the deprecated names too, as fit_sketch and compare take them
        raise ValueError(f"unknown method {method!r}; available: {', '.join(available_sketches())}")
    holdout = check_fraction(holdout, "holdout")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    options = dict(options or {})
    start = time.perf_counter()
    sel = select_and_scale(dump_or_qk, layers=layers, heads=heads, scale=scale)
    check_poly_kernel_range(sel.q, sel.k, p, where=sel.label)  # the fits need ‖A‖_F²
    # each head's fits are measured against the Theorem 3.1 optimum on the exact symmetric features of its
    # fitting tokens: their enumeration and size, estimated before the spectrum and the first fit
    n_fit = sel.q.shape[2] - math.ceil(holdout * sel.q.shape[2])
    check_symmetric_features(sel.q.shape[3], p, n_fit, where=f"{sel.source}: advise at p={p}, d={sel.q.shape[3]}",
                             lower_p="lower p (--p on the command line)",
                             fewer_rows="fewer tokens (a shorter dump, or a larger holdout=, --holdout)")
    spectrum = spectrum_of_selection(sel, p, holdout=holdout, seed=seed)
    # m = limit (the largest rank A can have) has a zero tail: the exact features meet any target
    # there, and fit_sketch's ratios are undefined; the sizes worth advising are below it.
    limit = max_sketch_size(spectrum.n_tokens, spectrum.n_tokens, spectrum.d, p) - 1
    if limit < 1:
        raise ValueError(f"the {spectrum.n_tokens} fitting tokens leave no sketch size below the rank bound of A")
    if max_m is None:
        max_m = limit
    elif isinstance(max_m, bool) or not isinstance(max_m, numbers.Integral) or not 1 <= max_m <= limit:
        raise ValueError(f"max_m must be an integer in 1..{limit} (below {limit + 1}, the largest rank of A on the "
                         f"{spectrum.n_tokens} fitting tokens, d={spectrum.d}, p={p}), got {max_m!r}")
    curve = spectrum.floor_curve()  # [L', H', max_m + 1]
    floor_ms = spectrum.floor_m(target)  # [L', H']
    from tqdm.auto import tqdm

    results, undefined = [], []  # undefined: every fit's undefined ratios, one warning at the end
    pairs = [(a, b) for a in range(len(sel.layers)) for b in range(len(sel.heads))]
    for a, b in tqdm(pairs, desc=f"advise ({method})", disable=not progress, leave=False):
        floor, floor_m = curve[a, b], int(floor_ms[a, b])
        fits: dict[int, dict] = {}

        def fit_at(m: int, a=a, b=b, floor=floor, fits=fits):
            if m not in fits:
                fit = _fit_sketch(method, sel.q[a, b], sel.k[a, b], p=p, m=m, seed=seed, holdout=holdout, **options)
                undefined.extend(c for c in fit.report.undefined_counts() if c[0] == "optimality_ratio")
                rel = float(fit.report.rel_fro)
                fits[m] = {"rel_fro": rel, "optimality_ratio": float(fit.report.optimality_ratio),
                           "floor": float(floor[m]), "passed": rel <= target, "seconds": fit.report.seconds}
            return fits[m]["rel_fro"], fits[m]["passed"]

        if floor_m > max_m:
            practical = None
        else:
            practical = _practical_m(fit_at, floor, floor_m, max_m, target)
        results.append(HeadAdvice(
            layer=sel.layers[a], head=sel.heads[b], floor_m=floor_m, practical_m=practical,
            practical_rel_fro=None if practical is None else fits[practical]["rel_fro"],
            practical_ratio=None if practical is None else fits[practical]["optimality_ratio"], fits=fits,
        ))
    warn_undefined(f"advise {sel.source}", undefined)
    return Advice(heads=results, spectrum=spectrum, target=target, method=method, p=p, max_m=int(max_m),
                  holdout=holdout, seed=seed, seconds=time.perf_counter() - start, options=options)
