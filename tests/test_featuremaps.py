"""The feature-map family: each fast map against its float64 twin, the kernels they promise, and
linear_attention (pure, hybrid, state) against the dense twin.

Tolerances: float64 1e-10 (the fast and naive forms differ only in summation order); kernels that
are identities (ψ_p, Taylor, self-tensoring) to 1e-10 on O(1) inputs for the same reason.
"""

import pytest
import torch
from attention_calls import run_llops

from sketchlab import (
    AttentionOptions,
    ExactPolyMap,
    FeatureMap,
    HedgehogMap,
    LLoPSMap,
    MLPMap,
    SelfTensored,
    TaylorMap,
    linear_attention,
    make_feature_map,
    psf_learned_map,
)
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.featuremaps import InputNormed

TOL64 = 1e-10
H, D = 2, 4


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _maps():
    return {
        "llops": LLoPSMap(H, D, p=2, m=6, rank=2, seed=1, dtype=torch.float64),
        "exact": ExactPolyMap(H, D, p=2),
        "taylor": TaylorMap(H, D, proj=_rand(H, D, 3, seed=9)),
        "psf": psf_learned_map(H, D, m=5, hidden=7, seed=2, dtype=torch.float64),
        "hedgehog": HedgehogMap(H, D, m=6, seed=3, dtype=torch.float64),
        "self": SelfTensored(LLoPSMap(H, D, p=2, m=3, rank=2, seed=4, dtype=torch.float64)),
    }


@pytest.mark.parametrize("name", list(_maps()))
def test_fast_features_match_the_naive_twin(name):
    fmap = _maps()[name]
    x = _rand(2, 7, H, D, seed=5)
    fast, naive = fmap.features(x), fmap.features_naive(x)
    assert fast.shape == (2, 7, H, fmap.num_features) == naive.shape
    assert (fast - naive).abs().max() < TOL64
    # each head has its own parameters where the map has any: the heads' features differ
    if name not in ("exact",):
        assert not torch.allclose(fast[:, :, 0], fmap.features(x[:, :, [1, 0]])[:, :, 1])


def test_kernels_the_maps_promise():
    x, y = _rand(1, 5, H, D, seed=6), _rand(1, 5, H, D, seed=7)
    dot = (x * y).sum(-1)  # [1, 5, H]
    maps = _maps()

    def kern(m):
        return (m.features(x) * m.features(y)).sum(-1)

    assert (kern(maps["exact"]) - dot**2).abs().max() < TOL64
    taylor = TaylorMap(H, D, dim=3, dtype=torch.float64)  # P = [I_3; 0]
    s = (x[..., :3] * y[..., :3]).sum(-1) / 3**0.5
    assert (kern(taylor) - (1 + s + s**2 / 2)).abs().max() < TOL64
    inner = maps["self"].inner
    assert (kern(maps["self"]) - kern(inner) ** 2).abs().max() < TOL64
    hh = maps["hedgehog"].features(x)
    assert (hh >= 0).all() and (hh[..., :3].sum(-1) - 1).abs().max() < TOL64  # two softmaxes of m/2 each
    # the learned map starts with a LayerNorm: invariant to a shift of x (up to the LN's eps)
    assert (maps["psf"].features(x + 3.0) - maps["psf"].features(x)).abs().max() < 1e-6


def test_psf_learned_map_is_the_mlp_on_normed_input_in_the_promoted_dtype():
    """PolySketchFormer's learned sketch is ``InputNormed(MLPMap)``: GELU(LN(x) W1 + b1) W2 + b2 written out here,
    and a float32 map on float64 input computes in float64 (the FeatureMap contract), as PSFLearnedMap did."""
    fmap = psf_learned_map(H, D, m=5, hidden=7, seed=2)  # float32 weights
    assert isinstance(fmap, InputNormed) and isinstance(fmap.inner, MLPMap) and fmap.degree == 1
    with torch.no_grad():
        fmap.weight.uniform_(0.5, 1.5), fmap.bias.uniform_(-0.5, 0.5)  # off the identity affine
    x = _rand(2, 7, H, D, seed=6)
    w1, b1, w2, b2 = (getattr(fmap.inner, n).double() for n in ("w1", "b1", "w2", "b2"))
    y = torch.nn.functional.layer_norm(x, (D,), eps=1e-5) * fmap.weight.double() + fmap.bias.double()
    want = torch.einsum("bthe,hem->bthm", torch.nn.functional.gelu(torch.einsum("bthd,hde->bthe", y, w1) + b1), w2) + b2
    out = fmap.features(x)
    assert out.dtype == torch.float64 and (out - want).abs().max() < TOL64
    assert (fmap.features_naive(x) - want).abs().max() < TOL64


def test_properties_and_factory():
    assert LLoPSMap(H, D, m=4).non_negative and not LLoPSMap(H, D, m=4, rank=2, theta=_rand(H, 2, 2, D, 4)).non_negative
    assert ExactPolyMap(H, D, p=2).non_negative and not ExactPolyMap(H, D, p=3).non_negative
    psf = make_feature_map("psf", heads=H, head_dim=D, p=4, m=16)
    assert isinstance(psf, SelfTensored) and psf.num_features == 16 and psf.degree == 4 and psf.non_negative
    taylor = make_feature_map("taylor", heads=H, head_dim=D, m=21)
    assert taylor.num_features <= 21 and taylor.proj.shape[-1] == 4  # d' = 4: 1 + 4 + 16 = 21
    assert make_feature_map("llops", heads=H, head_dim=D, m=8, rank=2).theta.shape == (H, 2, 2, D, 8)
    assert make_feature_map("hedgehog", heads=H, head_dim=D, m=8, self_tensored=True).num_features == 64
    assert make_feature_map("exact", heads=H, head_dim=D, p=2).num_features == 10
    with pytest.raises(ValueError, match="must be one of"):
        make_feature_map("cosformer", heads=H, head_dim=D)
    with pytest.raises(ValueError, match="even"):
        make_feature_map("hedgehog", heads=H, head_dim=D, m=7)
    with pytest.raises(ValueError, match=r"layout \[B, T, H=2, D=4\]"):
        LLoPSMap(H, D).features(torch.zeros(1, 3, 3, 4))
    with pytest.raises(TypeError, match="FeatureMap"):
        SelfTensored(object())
    learnable = sum(p.numel() for p in make_feature_map("psf", heads=H, head_dim=D, m=9).parameters())
    assert learnable > 0 and isinstance(make_feature_map("psf", heads=H, head_dim=D), FeatureMap)


@pytest.mark.parametrize("name", list(_maps()))
@pytest.mark.parametrize("window", [0, 3])
def test_linear_attention_matches_the_dense_twin(name, window):
    fmap = _maps()[name]
    q, k, v = _rand(2, 13, H, D, seed=8), _rand(2, 13, H, D, seed=9), _rand(2, 13, H, 3, seed=10)
    gate = _rand(H, seed=11) if window else None
    kw = dict(window=window, sinks=1 if window else 0, normalize="sum", non_negative=False, denominator_check="off")
    out, _ = linear_attention(q, k, v, fmap, gate=gate, options=AttentionOptions(backend="torch", chunk_size=4, **kw))
    ref, _ = linear_attention(q, k, v, fmap, gate=gate, options=AttentionOptions(backend="reference", **kw))
    assert (out - ref).abs().max() < TOL64
    literal = feature_attention_naive(fmap.features_naive(q), fmap.features_naive(k), v, q=q, k=k, degree=fmap.degree,
                                      gate=gate, **kw)
    assert (ref - literal).abs().max() < TOL64


def test_linear_attention_defaults_never_divide_by_a_signed_sum():
    q, k, v = _rand(1, 16, H, D, seed=12), _rand(1, 16, H, D, seed=13), _rand(1, 16, H, 3, seed=14)
    signed = ExactPolyMap(H, D, p=3)  # kernel (qᵀk)³: row 0's only score is (q_0·k_0)³, negative half the time
    with pytest.warns(RuntimeWarning, match="denominator <= 0"):
        linear_attention(q, k, v, signed, options=AttentionOptions(normalize="sum", non_negative=False))
    out, _ = linear_attention(q, k, v, signed)  # the default self-tensors a signed map
    assert out.abs().max() <= v.abs().max() * (1 + 1e-9)
    ref, _ = linear_attention(q, k, v, SelfTensored(signed), options=AttentionOptions(non_negative=False))
    assert (out - ref).abs().max() < TOL64


def test_featuremap_state_split_and_keys_map():
    fq, fk = HedgehogMap(H, D, m=6, seed=1, dtype=torch.float64), HedgehogMap(H, D, m=6, seed=2, dtype=torch.float64)
    q, k, v = _rand(1, 12, H, D, seed=15), _rand(1, 12, H, D, seed=16), _rand(1, 12, H, 3, seed=17)
    opts = AttentionOptions(window=3, sinks=1, backend="torch", chunk_size=4)
    whole, none = linear_attention(q, k, v, fq, fk, options=opts)
    a, state = linear_attention(q[:, :5], k[:, :5], v[:, :5], fq, fk, options=opts, output_final_state=True)
    b, _ = linear_attention(q[:, 5:], k[:, 5:], v[:, 5:], fq, fk, options=opts, initial_state=state,
                            output_final_state=True)
    assert none is None and (torch.cat([a, b], 1) - whole).abs().max() < TOL64
    assert not torch.allclose(whole, linear_attention(q, k, v, fq, options=opts)[0])  # the key map is used
    with pytest.raises(ValueError, match="one kind"):
        linear_attention(q, k, v, fq, TaylorMap(H, D))
    with pytest.raises(ValueError, match="needs a polynomial degree"):
        linear_attention(q, k, v, fq, options=AttentionOptions(window=2, local="poly"))


def test_llops_map_goes_to_llops_attention_with_gradients():
    fmap = LLoPSMap(H, D, m=5, dtype=torch.float64)
    q, k, v = _rand(1, 9, H, D, seed=18), _rand(1, 9, H, D, seed=19), _rand(1, 9, H, 3, seed=20)
    out, _ = linear_attention(q, k, v, fmap, options=AttentionOptions(window=2, backend="torch", chunk_size=4))
    ref = run_llops(q, k, v, fmap.theta, fmap.theta, window=2, backend="reference")
    assert (out - ref).abs().max() < TOL64
    out.sum().backward()
    assert fmap.theta.grad is not None and fmap.theta.grad.abs().sum() > 0


def test_llops_map_random_start_is_the_seeds():
    """A random Θ start is drawn from ``seed`` alone: the same seed gives the same Θ whatever the global RNG
    did in between, another seed another Θ."""
    from sketchlab.featuremaps import LLoPSMap

    torch.manual_seed(0)
    a = LLoPSMap(2, 4, p=2, m=6, seed=3).theta.detach().clone()
    torch.manual_seed(123)
    b = LLoPSMap(2, 4, p=2, m=6, seed=3).theta.detach()
    c = LLoPSMap(2, 4, p=2, m=6, seed=4).theta.detach()
    assert torch.equal(a, b) and not torch.equal(a, c)
