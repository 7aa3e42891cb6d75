"""The one layer core (:class:`sketchlab.attention.layer.LinearAttentionCore`): ``LLoPSAttention``, the converted
layers' ``SketchedAttention`` and the toy model's ``ToyKernel`` are adapters over it; each calls the op once, through
the core, with the core's own maps, options, gate and far parameters; the defaults are decided in one place
(``resolved_options``), so the three agree for one map and one set of options; a tied map is saved once."""

import pytest
import torch

import sketchlab.attention.layer as attn_layer
from sketchlab.attention import AttentionOptions, LLoPSAttention
from sketchlab.attention.layer import LinearAttentionCore
from sketchlab.convert.sketched import SketchedAttention
from sketchlab.featuremaps import LLoPSMap, make_feature_map
from sketchlab.tasks import TransformerConfig, TransformerLM, kernel_modules
from sketchlab.tasks.attention import ToyKernel

H, D = 2, 4


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _signed():
    return _rand(H, 2, 2, D, 3, seed=1)  # rank 2, unequal factors: a kernel that can be signed


def _adapters(state="additive", window=0, qk_conv=0):
    """One map (the signed Θ) and one set of options in each adapter, ``non_negative`` left to the module adapters'
    default (``None``: decided by ``AttentionOptions.resolve``); the toy's ``llops`` fixes ``False`` by its own table
    (recorded in every checkpoint's config), so it is asked for ``None`` here."""
    theta = _signed()
    block = LLoPSAttention(H * D, H, theta_q=theta, theta_k=theta.flip(-1), dtype=torch.float64, state=state,
                           window=window, qk_conv=qk_conv)
    sketch = SketchedAttention(LLoPSMap(H, D, theta=theta), LLoPSMap(H, D, theta=theta.flip(-1)), heads=H,
                               head_dim=D, window=window, sinks=0, state=state, qk_conv=qk_conv).double()
    cfg = TransformerConfig(vocab_size=11, d_model=H * D, n_heads=H, n_layers=1, mlp_ratio=2, attention="llops",
                            rope_base=None, attention_options={"p": 2, "m": 3, "rank": 2, "non_negative": None,
                                                               "state": state, "window": window, "qk_conv": qk_conv})
    (toy,) = kernel_modules(TransformerLM(cfg).double())
    with torch.no_grad():
        toy.map_q.theta.copy_(theta)
        toy.map_k.theta.copy_(theta.flip(-1))
    return block, sketch, toy


@pytest.mark.parametrize("state", ["additive", "delta"])
def test_the_adapters_decide_the_defaults_in_one_place(state):
    # a signed Θ: self-tensored where a sum divides (additive), as it is under the delta state (no denominator)
    for module in _adapters(state):
        assert isinstance(module, LinearAttentionCore)
        o = module.resolved_options()
        assert o.normalize == "sum" and o.non_negative is (state == "additive") and module.non_negative is o.non_negative
        want = module.options.resolve(lambda: module.map_q.non_negative and module.key_map.non_negative)
        assert o == want  # the op's rule (AttentionOptions.resolve) on the core's own maps
    no_map = LinearAttentionCore(None, options=AttentionOptions(), heads=H, dim_v=D)
    assert no_map.resolved_options().non_negative is False and no_map.gate is None and no_map.far is None


def test_each_adapter_calls_the_op_once_through_the_core(monkeypatch):
    calls = []
    real = attn_layer.linear_attention

    def spy(q, k, v, map_q, map_k, **kw):
        calls.append((map_q, map_k, kw))
        return real(q, k, v, map_q, map_k, **kw)

    monkeypatch.setattr(attn_layer, "linear_attention", spy)
    block, sketch, toy = _adapters(state="delta", window=2, qk_conv=3)
    x, q, k, v = _rand(1, 6, H * D, seed=2), _rand(1, 6, H, D, seed=3), _rand(1, 6, H, D, seed=4), _rand(1, 6, H, D, seed=5)
    for module, run in ((block, lambda: block(x)), (sketch, lambda: sketch(q, k, v)), (toy, lambda: toy(q, k, v))):
        calls.clear()
        assert torch.isfinite(run()).all()
        ((map_q, map_k, kw),) = calls
        assert map_q is module.map_q and map_k is module.map_k and map_k is not None
        assert kw["params"] is module.far and kw["gate"] is module.gate and module.far.conv_q is not None
        assert kw["options"].replace(local_scale=1.0) == module.options.replace(local_scale=1.0)


def test_a_tied_map_is_held_and_saved_once():
    fmap = make_feature_map("hedgehog", heads=H, head_dim=D, m=6)
    core = LinearAttentionCore(fmap, fmap, options=AttentionOptions(window=2), heads=H, dim_v=D)
    assert core.map_k is None and core.key_map is fmap and core.gate.shape == (H,)
    assert not any(key.startswith("map_k.") for key in core.state_dict())
    assert isinstance(kernel_modules(TransformerLM(TransformerConfig(
        vocab_size=11, d_model=H * D, n_heads=H, n_layers=1, attention="poly")))[0], ToyKernel)


def test_the_defaults_are_decided_once_when_the_layer_is_built():
    """A layer over LLoPS maps of equal factors (unsigned: not self-tensored) keeps its feature count when training
    moves the factors apart (the map turns signed): decided at build, never again per call."""
    theta = _rand(H, 1, 1, D, 3, seed=5).expand(-1, -1, 2, -1, -1).contiguous()  # equal factors: (θ·x)² >= 0
    fmap = LLoPSMap(H, D, theta=theta)
    sketch = SketchedAttention(fmap, fmap, heads=H, head_dim=D, window=0, sinks=0).double()
    assert fmap.non_negative and sketch.options.non_negative is False
    q, k, v = _rand(1, 5, H, D, seed=6), _rand(1, 5, H, D, seed=7), _rand(1, 5, H, D, seed=8)
    _, before = sketch(q, k, v, output_final_state=True)
    with torch.no_grad():  # a training step that separates the two factors
        fmap.theta[:, :, 1].add_(_rand(H, 1, D, 3, seed=9))
    assert not fmap.non_negative
    _, after = sketch(q, k, v, output_final_state=True)
    assert sketch.non_negative is False and after.S.shape == before.S.shape == (1, H, 3, D)
