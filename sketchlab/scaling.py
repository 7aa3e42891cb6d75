r"""The one input-scale convention of every dump-level entry point.

Rule. The math functions that take tensors (:func:`sketchlab.poly_features`,
:func:`sketchlab.optimal_sketch`, :func:`sketchlab.fit_sketch`, ...) never rescale their inputs.
Every entry point that takes a *dump* (:func:`sketchlab.compare`, :func:`sketchlab.verify`,
:func:`sketchlab.advise`, :func:`sketchlab.kernel_spectrum` and the matching ``sketchlab`` commands)
takes ``scale`` with one default, ``"sqrt-d"``, multiplies ``q`` and ``k`` by the factor below
before anything else, and prints the scale it used in every table header and JSON output.

Accepted values:

``"sqrt-d"`` (the default)
    factor :math:`d^{-1/4}` on ``q`` and ``k``, so that :math:`q^\top k` becomes
    :math:`q^\top k/\sqrt d`, the logit of softmax attention (dumps are captured before the
    :math:`1/\sqrt d` scaling, see ``data/README.md``);
``"none"``
    factor 1 (use it for dumps already scaled);
a positive finite number
    that factor on ``q`` and ``k``.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["DEFAULT_SCALE", "describe_scale", "resolve_scale", "scale_label"]

#: The default of every dump-level entry point.
DEFAULT_SCALE = "sqrt-d"


def _check(scale):
    if isinstance(scale, str):
        if scale in ("none", "sqrt-d"):
            return scale
        try:  # a number written as text, as a Θ export's metadata stores it
            scale = float(scale)
        except ValueError:
            raise ValueError(f"scale must be 'sqrt-d', 'none' or a positive finite number, got {scale!r}") from None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be 'sqrt-d', 'none' or a positive finite number, got {scale!r}")
    return float(scale)


def resolve_scale(scale, d: int) -> float:
    """The factor applied to ``q`` and ``k``: ``"sqrt-d"`` → ``d**-0.25``, ``"none"`` → 1, a number → itself.

    Raises ``ValueError`` naming the value for anything else (and ``d`` that is not a positive int).
    """
    scale = _check(scale)
    if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1:
        raise ValueError(f"d (the head dimension) must be an integer >= 1, got {d!r}")
    if scale == "sqrt-d":
        return float(d) ** -0.25
    if scale == "none":
        return 1.0
    return scale


def scale_label(scale) -> str:
    """The short label recorded in tables and JSON: ``"sqrt-d"``, ``"none"`` or ``repr(float(scale))``."""
    scale = _check(scale)
    return scale if isinstance(scale, str) else repr(scale)


def describe_scale(scale, d: int) -> str:
    """One line for table headers, e.g. ``"scale = sqrt-d (q, k × 0.4204 = d^-1/4, d = 32: qᵀk → qᵀk/√d)"``."""
    factor = resolve_scale(scale, d)
    label = scale_label(scale)
    if label == "sqrt-d":
        return f"scale = sqrt-d (q, k × {factor:.4g} = d^-1/4, d = {d}: qᵀk → qᵀk/√d)"
    if label == "none":
        return "scale = none (q, k used as stored)"
    return f"scale = {label} (q, k × {factor:.6g}: qᵀk → {factor * factor:.6g}·qᵀk)"
