"""The one set of scalar rules (sketchlab._validation: check_int, check_real, check_flag, check_choice): the attention
options' checks are these rules, and a wrong type raises InvalidParameterError, a TypeError that is a ValueError too
(what each side raised before they were one set, so every caller's except clause keeps catching it)."""

import math

import pytest

from sketchlab import _validation
from sketchlab._validation import InvalidParameterError, check_choice, check_flag, check_int, check_real
from sketchlab.attention import _checks, options
from sketchlab.attention.options import AttentionOptions


def test_the_attention_checks_are_the_validation_rules():
    for name in ("check_real", "check_flag", "check_choice"):
        assert getattr(_checks, name) is getattr(_validation, name), name
    for name in ("check_int", "check_real", "check_flag", "check_choice"):
        assert getattr(options, name) is getattr(_validation, name), name
    assert _checks.check_eps(0) == 0.0


@pytest.mark.parametrize("call, match", [
    (lambda: AttentionOptions(window="3"), r"^window must be an integer >= 0, got '3' \(str\)$"),
    (lambda: AttentionOptions(window=True), r"^window must be an integer >= 0, got True \(bool\)$"),
    (lambda: AttentionOptions(eps="nan"), r"^eps must be a finite number >= 0\.0, got 'nan' \(str\)$"),
    (lambda: AttentionOptions(causal=1), r"^causal must be True or False, got 1 \(int\)$"),
    (lambda: AttentionOptions(state=None), r"^state must be one of \['additive', 'delta'\], got None$"),
    (lambda: _validation.check_positive_int(2.5, "steps"), r"^steps must be an integer >= 1, got 2\.5 \(float\)$"),
    (lambda: check_real("x", "lr", positive=True), r"^lr must be a finite number > 0, got 'x' \(str\)$"),
])
def test_a_wrong_type_is_a_type_error_and_a_value_error(call, match):
    for kind in (TypeError, ValueError):
        with pytest.raises(kind, match=match) as info:
            call()
        assert type(info.value) is InvalidParameterError


@pytest.mark.parametrize("call, match", [
    (lambda: AttentionOptions(window=-1), r"^window must be an integer >= 0, got -1$"),
    (lambda: AttentionOptions(decay=1.5), r"^decay \(a fixed decay per step\) must be a finite number > 0\.0 and <= 1\.0, "
                                          r"got 1\.5$"),
    (lambda: AttentionOptions(local="x"), r"^local must be one of \['softmax', 'poly'\], got 'x'$"),
    (lambda: _validation.check_nonnegative_int(-2, "warmup"), r"^warmup must be an integer >= 0, got -2$"),
    (lambda: check_real(math.inf, "shift", positive=False), r"^shift must be a finite number >= 0, got inf$"),
    (lambda: check_real(0.0, "clip", positive=True), r"^clip must be a finite number > 0, got 0\.0$"),
])
def test_a_wrong_value_is_a_plain_value_error(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert type(info.value) is ValueError


def test_the_rules_return_the_checked_value():
    assert check_int(3, "n", 1) == 3 and type(check_int(True + 2, "n", 0)) is int
    assert check_real(2, "x", lo=-math.inf) == 2.0 and check_real(1, "d", lo=0.0, lo_open=True, hi=1.0) == 1.0
    assert check_flag(False, "f") is False and check_choice("sum", "normalize", ("none", "sum")) == "sum"
    with pytest.raises(ValueError, match=r"^d must be a finite number > 0 and <= 1, got 1\.5$"):
        check_real(1.5, "d", lo=0, lo_open=True, hi=1)
