"""DPFP (Schlag et al. 2021), added as one module + one registry line: its features against a hand-computed
case and its float64 twin, non-negativity, and the map working unchanged in every place that takes a
registered name: ``fit_sketch`` and ``compare``, ``linear_attention``, the toy model and ``sketchlab
train``, ``convert_attention(attention=...)``.

Tolerances: float64 1e-12 (a product of two numbers per feature, in one order or the other).
"""

import json

import pytest
import torch

import sketchlab as sl
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.featuremaps import make_feature_map
from sketchlab.featuremaps.dpfp import DPFPMap

TOL64 = 1e-12


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_features_of_a_hand_computed_case():
    # x = [1, 2, −3]: r = [relu(x), relu(−x)] = [1, 2, 0, 0, 0, 3]
    # ν = 1: r_i·r_{i+1} = [1·2, 2·0, 0·0, 0·0, 0·3, 3·1] = [2, 0, 0, 0, 0, 3]
    # ν = 2: r_i·r_{i+2} = [1·0, 2·0, 0·0, 0·3, 0·1, 3·2] = [0, 0, 0, 0, 0, 6]
    fmap = DPFPMap(1, 3, nu=2)
    x = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float64).reshape(1, 1, 1, 3)
    want = torch.tensor([2, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 6], dtype=torch.float64)
    assert torch.equal(fmap.features(x).flatten(), want)
    assert torch.equal(fmap.features_naive(x).flatten(), want)
    assert fmap.num_features == 12 and fmap.degree == 2 and fmap.non_negative


@pytest.mark.parametrize("nu", [1, 3])
def test_fast_equals_the_twin_and_is_non_negative_and_homogeneous(nu):
    fmap = make_feature_map("dpfp", heads=2, head_dim=5, nu=nu)
    x = _rand(2, 7, 2, 5, seed=nu)
    fast = fmap.features(x)
    assert fast.shape == (2, 7, 2, 2 * 5 * nu)
    assert (fast - fmap.features_naive(x)).abs().max() < TOL64
    assert (fast >= 0).all()
    assert (fmap.features(2.5 * x) - 2.5**2 * fast).abs().max() < TOL64  # positively homogeneous of degree 2
    assert make_feature_map("dpfp", heads=2, head_dim=5, m=40).num_features == 40  # nu from the budget: ⌊40 / 10⌋ = 4
    with pytest.raises(ValueError, match="feature map 'dpfp': nu must be an integer >= 1, got 0"):
        make_feature_map("dpfp", heads=2, head_dim=5, nu=0)


def test_in_fit_sketch_and_compare():
    q, k = _rand(2, 40, 4, seed=1) * 0.6, _rand(2, 40, 4, seed=2) * 0.6
    fit = sl.fit_sketch("dpfp", q, k, p=2, m=8, nu=1, holdout=0.25)
    assert fit.report.num_features == 8 and fit.report.steps == 0  # no parameters: nothing to train
    assert bool((fit.report.optimality_ratio >= 1 - 1e-9).all())  # no sketch of 8 features beats the optimum
    table = sl.compare((q[None], k[None]), p=2, m=8, methods=["optimal", "dpfp"], options={"dpfp": {"nu": 1}},
                       progress=False)
    assert len(table.values("dpfp", "rel_fro")) == 2


def test_in_the_op():
    fmap = make_feature_map("dpfp", heads=2, head_dim=4, nu=2)
    q, k, v = _rand(1, 10, 2, 4, seed=3), _rand(1, 10, 2, 4, seed=4), _rand(1, 10, 2, 3, seed=5)
    out, _ = sl.linear_attention(q, k, v, fmap, options=sl.AttentionOptions(window=3, sinks=1, backend="torch",
                                                                            chunk_size=4))
    literal = feature_attention_naive(fmap.features_naive(q), fmap.features_naive(k), v, q=q, k=k,
                                                   degree=2, window=3, sinks=1)
    assert (out - literal).abs().max() < 1e-10


def test_in_the_toy_model_and_sketchlab_train(tmp_path):
    from sketchlab.cli import main
    from sketchlab.tasks import TransformerConfig, TransformerLM

    cfg = TransformerConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1, attention="dpfp",
                            attention_options={"nu": 2, "window": 2})
    assert TransformerLM(cfg)(torch.randint(0, 11, (2, 6))).shape == (2, 6, 11)
    out = tmp_path / "run"
    assert main(["train", "--attention", "dpfp", "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--seq-len",
                 "16", "--num-pairs", "2", "--batch-size", "4", "--eval-sequences", "4", "--eval-every", "0",
                 "--no-progress", "--steps", "2", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["config"]["attention"] == "dpfp"


def test_in_convert_attention():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        teacher = model(ids).logits
    sketches = sl.convert_attention(model, attention="dpfp", m=16, window=0)
    assert type(sketches[0].map_q).__name__ == "DPFPMap" and sketches[0].map_q.num_features == 16
    with torch.no_grad():
        linear = model(ids).logits
    assert torch.isfinite(linear).all() and not torch.allclose(linear, teacher)
