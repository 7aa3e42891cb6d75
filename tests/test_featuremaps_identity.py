"""The identity map (DeltaNet's φ(x) = x), added as one module + one registry line: its features and float64
twin, its properties, and the map in ``linear_attention`` and the toy model (with the delta rule: the
memory tests, tests/test_tasks_memory.py).

Tolerances: exact (a copy), float64 1e-12 for attention sums.
"""

import torch

import sketchlab as sl
from sketchlab.featuremaps import feature_map_names, make_feature_map
from sketchlab.featuremaps.identity import IdentityMap


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_features_are_the_input_and_the_twin_agrees():
    fmap = make_feature_map("identity", heads=2, head_dim=5, m=99, p=3)  # m, p: ignored (M = D)
    assert isinstance(fmap, IdentityMap) and "identity" in feature_map_names()
    x = _rand(2, 7, 2, 5)
    fast = fmap.features(x)
    assert torch.equal(fast, x) and fast.data_ptr() != x.data_ptr()  # a copy, not the caller's tensor
    assert torch.equal(fmap.features_naive(x), x)
    assert fmap.num_features == 5 and fmap.degree == 1 and not fmap.non_negative and fmap.num_parameters == 0


def test_in_the_op_it_is_linear_attention_on_q_k():
    fmap = make_feature_map("identity", heads=2, head_dim=4)
    q, k, v = _rand(1, 9, 2, 4, seed=1), _rand(1, 9, 2, 4, seed=2), _rand(1, 9, 2, 3, seed=3)
    out, _ = sl.linear_attention(q, k, v, fmap, options=sl.AttentionOptions(normalize="none", backend="torch",
                                                                            chunk_size=4))
    scores = torch.einsum("bthd,bshd->bhts", q, k).tril()  # causal qᵀk, unnormalised
    assert (out - torch.einsum("bhts,bshd->bthd", scores, v)).abs().max() < 1e-12


def test_under_the_delta_rule_a_signed_map_enters_as_it_is():
    """``non_negative=None`` self-tensors a signed map only under a denominator: the delta state has none,
    so the default equals ``non_negative=False`` there (D features, not D²) and differs from ``True``."""
    fmap = make_feature_map("identity", heads=2, head_dim=4)
    q, k, v = _rand(1, 9, 2, 4, seed=1), _rand(1, 9, 2, 4, seed=2), _rand(1, 9, 2, 3, seed=3)

    def run(non_negative):
        options = sl.AttentionOptions(state="delta", non_negative=non_negative, backend="reference")
        params = sl.FarParams(options, heads=2, dim_v=3).double()
        out, state = sl.linear_attention(q, k, v, fmap, options=options, params=params, output_final_state=True)
        return out, state.S.shape[-2]  # the state's feature axis: M

    (default, m_default), (signed, m_signed), (tensored, m_tensored) = run(None), run(False), run(True)
    assert torch.equal(default, signed) and m_default == m_signed == 4 and m_tensored == 16
    assert (default - tensored).abs().max() > 1e-3
