"""The one input-scale rule (sketchlab.scaling): the factor, the label and the header line, exactly."""

import math

import pytest

from sketchlab.scaling import describe_scale, resolve_scale, scale_label


@pytest.mark.parametrize("scale,d,factor,label", [
    ("sqrt-d", 16, 0.5, "sqrt-d"),
    ("sqrt-d", 81, 1 / 3, "sqrt-d"),
    ("none", 32, 1.0, "none"),
    (0.25, 8, 0.25, "0.25"),
    ("0.125", 8, 0.125, "0.125"),  # as a Θ export's metadata stores a number
    (3, 8, 3.0, "3.0"),
])
def test_factor_and_label(scale, d, factor, label):
    assert resolve_scale(scale, d) == pytest.approx(factor, rel=1e-15)
    assert scale_label(scale) == label


@pytest.mark.parametrize("scale", [0, 0.0, -1, "0", "-2", float("nan"), float("inf"), "inf", "big", True, None, [1]])
def test_bad_scales_are_rejected_with_the_value(scale):
    with pytest.raises(ValueError, match=r"scale must be 'sqrt-d', 'none' or a positive finite number, got "):
        resolve_scale(scale, 4)
    with pytest.raises(ValueError, match=r"scale must be"):
        scale_label(scale)


@pytest.mark.parametrize("d", [0, -3, 2.0, True])
def test_bad_head_dimension(d):
    with pytest.raises(ValueError, match=r"d \(the head dimension\) must be an integer >= 1"):
        resolve_scale("sqrt-d", d)


def test_describe_scale_states_factor_and_effect():
    assert describe_scale("sqrt-d", 32) == f"scale = sqrt-d (q, k × {32 ** -0.25:.4g} = d^-1/4, d = 32: qᵀk → qᵀk/√d)"
    assert describe_scale("sqrt-d", 32) == "scale = sqrt-d (q, k × 0.4204 = d^-1/4, d = 32: qᵀk → qᵀk/√d)"
    assert describe_scale("none", 7) == "scale = none (q, k used as stored)"
    assert describe_scale(0.5, 7) == "scale = 0.5 (q, k × 0.5: qᵀk → 0.25·qᵀk)"
    assert describe_scale(2, 7) == "scale = 2.0 (q, k × 2: qᵀk → 4·qᵀk)"
    assert math.isclose(float(describe_scale(3, 1).split("→ ")[1].split("·")[0]), 9.0)
