"""KernelSpectrum's derived quantities against hand-computed values on a known spectrum."""

import math

import pytest
import torch

from sketchlab.spectrum import KernelSpectrum


def _spectrum(s):
    s = torch.tensor(s, dtype=torch.float64)
    return KernelSpectrum(singular_values=s, p=2, layers=[0], heads=list(range(s.shape[1])), scale="none",
                          scale_factor=1.0, scale_description="scale = none", source="test", n_tokens=s.shape[-1],
                          d=2, holdout=0.0, seed=0)


# one layer, two heads; energies σ²: head 0 = [16, 9, 4, 1, 0] (sum 30), head 1 = [1, 1, 1, 1, 1] (sum 5)
S = [[[4.0, 3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]]]


@pytest.mark.parametrize("m,tails", [(0, [30, 5]), (1, [14, 4]), (2, [5, 3]), (3, [1, 2]), (4, [0, 1]), (5, [0, 0])])
def test_tail_is_the_energy_beyond_m(m, tails):
    assert _spectrum(S).tail(m).tolist() == [[float(t) for t in tails]]


@pytest.mark.parametrize("m", [-1, 6, 1.0, True])
def test_tail_rejects_m_outside_0_to_max_m(m):
    with pytest.raises(ValueError, match=r"m must be an integer in 0..5"):
        _spectrum(S).tail(m)


def test_floor_curve_and_floor_m():
    spec = _spectrum(S)
    curve = spec.floor_curve()
    expect0 = [math.sqrt(t / 30) for t in (30, 14, 5, 1, 0, 0)]
    expect1 = [math.sqrt(t / 5) for t in (5, 4, 3, 2, 1, 0)]
    torch.testing.assert_close(curve, torch.tensor([[expect0, expect1]], dtype=torch.float64), rtol=1e-15, atol=0)
    # target 0.5: head 0 needs √(5/30) = 0.408 → m = 2; head 1 needs √(1/5) = 0.447 → m = 4
    assert spec.floor_m(0.5).tolist() == [[2, 4]]


@pytest.mark.parametrize("fraction,ranks", [
    (0.5, [[1, 3]]),    # head 0: 16/30 = 0.53 ≥ 0.5 at m = 1; head 1: 3/5 at m = 3 (2/5 < 0.5)
    (0.8, [[2, 4]]),    # head 0: 25/30 = 0.83; head 1: 4/5
    (0.99, [[4, 5]]),   # head 0: 30/30 at m = 4 (29/30 = 0.967 < 0.99); head 1: all five
])
def test_energy_rank_is_the_smallest_m_holding_the_fraction(fraction, ranks):
    assert _spectrum(S).energy_rank(fraction).tolist() == ranks


@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.1, True, "0.9"])
def test_energy_rank_rejects_fractions_outside_0_1(fraction):
    with pytest.raises(ValueError, match=r"fraction \(of ‖A‖_F²\) must lie in \(0, 1\)"):
        _spectrum(S).energy_rank(fraction)
