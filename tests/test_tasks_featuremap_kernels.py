"""The toy model's learned feature-map kernels ``"hedgehog"`` and ``"psf-learned"`` are wired to
:mod:`sketchlab.featuremaps` (HedgehogMap, psf_learned_map): the model's attention equals the
dense float64 attention of those maps on the scaled inputs, their weights are the documented
draws, trained with the model, and decoding with a state equals the full forward."""

import pytest
import torch

from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.featuremaps import HedgehogMap, InputNormed, MLPMap, SelfTensored, psf_learned_map
from sketchlab.tasks import TransformerConfig, TransformerLM, attention_registry, kernel_modules
from sketchlab.tasks.attention import input_scale

H, D = 2, 8


def tiny(attention, options, layers=2):
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=21, d_model=H * D, n_heads=H, n_layers=layers, mlp_ratio=2, short_conv=2,
                            attention=attention, attention_options=options)
    return TransformerLM(cfg).double()


def _qkv(B=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, D, generator=g, dtype=torch.float64) for _ in range(3)]


def _perturb(module, seed):
    """Move every parameter of ``module`` by N(0, 0.3²): the two sides' maps then differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _want(kernel, q, k, v, **hybrid):
    """Dense float64 attention of the kernel's own maps (their naive twins) on q, k scaled by D^{-1/4}."""
    s = input_scale(D)
    map_k = kernel.map_q if kernel.map_k is None else kernel.map_k
    fq, fk = kernel.map_q.features_naive(q * s), map_k.features_naive(k * s)  # [B, T, H, M]
    if hybrid:
        hybrid = dict(q=q * s, k=k * s, local_scale=1.0, gate=kernel.gate, degree=kernel.map_q.degree, **hybrid)
    return feature_attention_naive(fq, fk, v, causal=True, normalize=kernel.config_options["normalize"], eps=kernel.config_options["eps"],
                                   **hybrid)


# float64 throughout: the chunked path and the dense twin differ by summation order (~1e-15
# relative); 1e-10 leaves room for the T = 9 sums and the softmax / GELU features.
F64 = dict(rtol=1e-10, atol=1e-10)


def test_both_kernels_are_registered():
    names = attention_registry()
    assert "hedgehog" in names and "psf-learned" in names


@pytest.mark.parametrize("m, identity", [(None, True), (6, False)])
def test_hedgehog_kernel_is_hedgehogmap_attention(m, identity):
    opts = {"seed": 4} if m is None else {"m": m, "seed": 4}
    model = tiny("hedgehog", opts)
    kernel = kernel_modules(model)[1]
    assert isinstance(kernel.map_q, HedgehogMap) and kernel.config_options["m"] == (2 * D if m is None else m)
    # the documented draw: layer 1 from seed + 1; m = 2D starts at the identity; both sides equal
    ref = HedgehogMap(H, D, m=kernel.config_options["m"], seed=5).double()  # built in float32, like the model
    torch.testing.assert_close(kernel.map_q.weight, ref.weight, rtol=0, atol=0)
    torch.testing.assert_close(kernel.map_k.weight, ref.weight, rtol=0, atol=0)
    assert torch.equal(ref.weight[0], torch.eye(D, dtype=torch.float64)) == identity
    _perturb(kernel.map_k, 1)  # a swapped or shared key map now gives another attention
    q, k, v = _qkv()
    torch.testing.assert_close(kernel(q, k, v), _want(kernel, q, k, v), **F64)
    # q and k read by the wrong maps (or unscaled) would differ by far more than the tolerance
    s = input_scale(D)
    wrong = feature_attention_naive(kernel.map_k.features_naive(q * s), kernel.map_q.features_naive(k * s), v)
    assert (kernel(q, k, v) - wrong).abs().max() > 1e-3
    wrong = feature_attention_naive(kernel.map_q.features_naive(q), kernel.map_k.features_naive(k), v)
    assert (kernel(q, k, v) - wrong).abs().max() > 1e-3


def test_hedgehog_tied_and_hybrid():
    model = tiny("hedgehog", {"tie": True, "window": 3, "sinks": 1})
    kernel = kernel_modules(model)[0]
    assert kernel.map_k is None and "blocks.0.attention.attn.map_k.weight" not in model.state_dict()
    with torch.no_grad():
        kernel.gate.copy_(torch.tensor([0.7, -1.2]))
    q, k, v = _qkv(seed=2)
    torch.testing.assert_close(kernel(q, k, v), _want(kernel, q, k, v, window=3, sinks=1, local="softmax"), **F64)


@pytest.mark.parametrize("tie", [True, False])
def test_psf_learned_kernel_is_selftensored_psf_learned_map_attention(tie):
    model = tiny("psf-learned", {"p": 4, "m": 10, "hidden": 5, "seed": 2, "tie": tie})
    kernel = kernel_modules(model)[1]
    assert isinstance(kernel.map_q, SelfTensored) and isinstance(kernel.map_q.inner, InputNormed)
    assert isinstance(kernel.map_q.inner.inner, MLPMap)
    # ⌊√10⌋ = 3 inner features, 9 after φ ⊗ φ, standing for degree p = 4; layer 1 from seed + 1
    assert kernel.map_q.num_features == 9 and kernel.map_q.degree == 4
    ref = psf_learned_map(H, D, m=3, hidden=5, degree=2, seed=3).double()  # built in float32, like the model
    for name, value in ref.named_parameters():
        torch.testing.assert_close(kernel.map_q.inner.get_parameter(name), value, rtol=0, atol=0)
    assert (kernel.map_k is None) == tie
    if not tie:
        _perturb(kernel.map_k, 3)
    q, k, v = _qkv(seed=1)
    torch.testing.assert_close(kernel(q, k, v), _want(kernel, q, k, v), **F64)


def test_psf_learned_hybrid_with_the_poly_local_part():
    model = tiny("psf-learned", {"p": 2, "m": 9, "window": 4, "local": "poly"})
    kernel = kernel_modules(model)[0]
    q, k, v = _qkv(seed=3)
    torch.testing.assert_close(kernel(q, k, v), _want(kernel, q, k, v, window=4, local="poly"), **F64)


@pytest.mark.parametrize("attention, options", [("hedgehog", {"m": 6}), ("psf-learned", {"m": 9, "tie": False})])
def test_maps_train_with_the_model_and_decode_with_a_state(attention, options):
    model = tiny(attention, options, layers=1)
    kernel = kernel_modules(model)[0]
    x = torch.randint(0, 21, (2, 11), generator=torch.Generator().manual_seed(0))
    model(x).logsumexp(-1).sum().backward()
    named = dict(model.named_parameters())
    for side in ("map_q", "map_k"):
        params = [p for n, p in named.items() if n.startswith(f"blocks.0.attention.attn.{side}.")]
        assert params and all(p.grad is not None and p.grad.abs().max() > 0 for p in params), side
    # decoding: 5 tokens, then 6 more against the state, equals the full forward
    q, k, v = _qkv(T=11, seed=4)
    with torch.no_grad():
        full = kernel(q, k, v)
        a, state = kernel.step(q[:, :5], k[:, :5], v[:, :5], None)
        b, _ = kernel.step(q[:, 5:], k[:, 5:], v[:, 5:], state)
    torch.testing.assert_close(torch.cat([a, b], 1), full, **F64)


@pytest.mark.parametrize("attention, options, msg", [
    ("hedgehog", {"m": 7}, r"m must be even for Hedgehog .* got 7"),
    ("hedgehog", {"window": 2, "local": "poly"},
     r"local='poly' needs a polynomial degree .*, and HedgehogMap \(attention 'hedgehog'\) has none .*use local='softmax'"),
    ("hedgehog", {"p": 2}, r"unknown attention option\(s\) \['p'\] for attention 'hedgehog'"),
    ("hedgehog", {"tie": 1}, r"attention 'hedgehog': tie must be a bool, got 1"),
    ("psf-learned", {"p": 3}, r"PolySketchFormer's map is self-tensored .*: p must be even, got 3"),
    ("psf-learned", {"hidden": 0}, r"attention 'psf-learned': hidden must be an integer >= 1, got 0"),
    ("psf-learned", {"sinks": 2}, r"sinks=2 needs window >= 1"),
])
def test_options_are_checked(attention, options, msg):
    with pytest.raises(ValueError, match=msg):
        tiny(attention, options)


@torch.no_grad()
def test_psf_learned_scores_are_non_negative_so_sum_normalisation_is_safe():
    kernel = kernel_modules(tiny("psf-learned", {"m": 16}))[0]
    f = kernel.map_q.features(_qkv(seed=5)[0] * input_scale(D))  # [B, T, H, 16]: φ ⊗ φ of 4 features
    fk = kernel.map_q.features(_qkv(seed=6)[0] * input_scale(D))
    scores = torch.einsum("bthm,bshm->bhts", f, fk)  # = (φ(q)·φ(k))² exactly, up to round-off
    inner = torch.einsum("bthm,bshm->bhts", kernel.map_q.inner.features(_qkv(seed=5)[0] * input_scale(D)),
                         kernel.map_q.inner.features(_qkv(seed=6)[0] * input_scale(D)))
    torch.testing.assert_close(scores, inner**2, **F64)
    assert float(scores.min()) >= 0
