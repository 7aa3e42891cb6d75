"""Every fit method's result is the family's pair of feature maps, and that pair runs wherever a map runs: the
attention op, ``convert_attention`` and ``linearize`` (issue 40's "what fit_sketch returns is a feature map").

Tolerance: 1e-10 on float64 features and outputs (the same products in another order).
"""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import sketchlab as sl  # noqa: E402
from sketchlab.attention import AttentionOptions, linear_attention  # noqa: E402
from sketchlab.attention.ops.additive.naive import feature_attention_naive  # noqa: E402
from sketchlab.convert import converted_modules, linearize  # noqa: E402
from sketchlab.featuremaps import FeatureMap  # noqa: E402

L, H, D = 2, 4, 8
_QUICK = {"mlp": {"steps": 3}, "elementwise": {"steps": 3}, "llops": {"steps": 2, "lm_steps": 2}}


def _opt():
    cfg = transformers.OPTConfig(vocab_size=50, hidden_size=H * D, num_hidden_layers=L, ffn_dim=48,
                                 num_attention_heads=H, max_position_embeddings=64, word_embed_proj_dim=H * D,
                                 attn_implementation="sdpa")
    torch.manual_seed(3)
    return transformers.OPTForCausalLM(cfg).double().eval()


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture(scope="module", params=sorted(sl.available_sketches()))
def fit(request):
    q, k = _rand(L, H, 30, D, seed=1) * D**-0.25, _rand(L, H, 30, D, seed=2) * D**-0.25
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # undefined ratios are not the point here
        return sl.fit_sketch(request.param, q, k, p=2, m=6, reference=False, **_QUICK.get(request.param, {}))


def _same_features(got: FeatureMap, want: FeatureMap, x):
    with torch.no_grad():
        torch.testing.assert_close(got.features(x).double(), want.features(x).double(), rtol=1e-10, atol=1e-10)


def test_a_fit_is_a_pair_of_feature_maps_and_runs_through_the_op(fit):
    assert isinstance(fit.map_q, FeatureMap) and isinstance(fit.map_k, FeatureMap)
    assert (fit.map_q.heads, fit.map_q.head_dim) == (L * H, D) and fit.report.num_features == fit.map_q.num_features
    map_q, map_k = fit.layer(1)
    q, k, v = _rand(1, 9, H, D, seed=3) * D**-0.25, _rand(1, 9, H, D, seed=4) * D**-0.25, _rand(1, 9, H, 3, seed=5)
    out, _ = linear_attention(q, k, v, map_q, map_k, options=AttentionOptions(normalize="none", chunk_size=4))
    with torch.no_grad():
        fq, fk = map_q.features(q).double(), map_k.features(k).double()
    want = feature_attention_naive(fq, fk, v, normalize="none")
    torch.testing.assert_close(out.double(), want, rtol=1e-10, atol=1e-10 * float(want.abs().max()))


@pytest.mark.filterwarnings("ignore:.*denominator")  # signed maps (optimal, TensorSketch) in the hybrid may warn
def test_a_fit_converts_a_model_and_linearizes_it(fit):
    ids = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(6))
    x = _rand(1, 5, H, D, seed=7)
    model = _opt()
    layers = sl.convert_attention(model, feature_map=fit, window=4)
    for layer in range(L):  # layer l runs the fit's heads l·H … l·H + H − 1
        want_q, want_k = fit.layer(layer)
        got_q, got_k = layers[layer].map_q, layers[layer].map_k
        _same_features(got_q, want_q, x)
        assert (got_k is None) == fit.tied  # None: the key map is the query map (saved once)
        _same_features(got_q if got_k is None else got_k, want_k, x)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    model, report = linearize(_opt(), ids, feature_map=fit, window=4, sinks=1, seq_len=12,
                              holdout=0.5, evaluate=False, transfer_steps=0, gate_sequences=1, batch_size=2)
    assert report.settings["attention"] == "custom"
    for layer, module in enumerate(converted_modules(model)):
        want_q, _ = fit.layer(layer)
        _same_features(module.map_q, want_q, x)
