"""Converted models with long-context memory (DESIGN §7): each mechanism through convert_attention,
generate(), the state cache, save and load."""

import pytest
import torch

from sketchlab.attention.memory import MemoryState
from sketchlab.convert import convert_attention, converted_modules, load_linearized, save_linearized
from tests.test_convert import TOL64, _greedy_by_full_forward, _inputs, _llama, _out, _state_after

MECHANISMS = [dict(cache=3), dict(decay="input"), dict(decay=0.9), dict(state="delta"),
              dict(state="delta", beta="input", decay="head", cache=2)]


def _perturb(model) -> None:
    """Move every new parameter off its initial value (a round trip must carry trained values)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for s in converted_modules(model):
            for p in s.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


@pytest.mark.parametrize("memory", MECHANISMS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_memory_generate_equals_greedy_full_forward_and_state_is_flat(memory):
    model = _llama()
    convert_attention(model, attention="hedgehog", m=8, window=3, sinks=1, **memory)
    _perturb(model)
    ids, _ = _inputs(False, B=2, T=5)
    out = model.generate(ids, max_new_tokens=9, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.cache.layers[0].state, MemoryState)
    assert torch.equal(out.sequences, _greedy_by_full_forward(model, ids, 9))
    sizes = [_state_after(model, n).state_bytes() for n in (15, 40)]
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("memory", MECHANISMS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_memory_save_load_identical_logits(memory, tmp_path):
    model = _llama()
    convert_attention(model, attention="hedgehog", m=8, window=3, sinks=1, **memory)
    _perturb(model)
    ids, mask = _inputs(True)
    want = _out(model, ids, mask)
    save_linearized(model, tmp_path / "lin")
    fresh = load_linearized(tmp_path / "lin", _llama())
    torch.testing.assert_close(_out(fresh, ids, mask), want, rtol=0, atol=0)
    assert fresh.config.sketchlab["cache"] == memory.get("cache", 0)
    other = _llama()  # converted afresh: the trained decay / β / gates are what the round trip restored
    convert_attention(other, attention="hedgehog", m=8, window=3, sinks=1, **memory)
    assert float((_out(other, ids, mask) - want).abs().max()) > 1e-6


def test_cache_covering_the_sequence_reproduces_teacher():
    """cache ≥ T with the softmax window is softmax attention: the converted model is the teacher."""
    teacher = _llama()
    ids, mask = _inputs(False)
    want = _out(teacher, ids, mask)
    model = _llama()
    convert_attention(model, attention="hedgehog", m=8, window=2, sinks=1, cache=ids.shape[1], eps=0.0)
    torch.testing.assert_close(_out(model, ids, mask), want, **TOL64)
    small = _llama()
    convert_attention(small, attention="hedgehog", m=8, window=2, sinks=1, cache=1, eps=0.0)
    assert float((_out(small, ids, mask) - want).abs().max()) > 1e-3


def test_memory_params_train_in_transfer_and_are_new_parameters():
    """The decay and β parameters are registered on the converted layer (so stage 1 and the optimiser
    see them) and receive gradients through the model's loss."""
    model = _llama()
    convert_attention(model, attention="hedgehog", m=8, window=3, sinks=1, state="delta", decay="input", beta="input")
    s = converted_modules(model)[0]
    names = {n for n, _ in s.named_parameters()}
    assert {"far.decay_bias", "far.decay_weight", "far.beta_bias", "far.beta_weight", "gate"} <= names
    ids, _ = _inputs(False, T=12)
    model(ids, labels=ids).loss.backward()
    for n in ("decay_bias", "decay_weight", "beta_bias", "beta_weight"):
        g = getattr(s.far, n).grad
        assert g is not None and float(g.abs().max()) > 0, n


@pytest.mark.parametrize("kwargs,match", [
    (dict(cache=-1), "cache must be an integer >= 0"), (dict(cache=4, window=0), "cache=4 needs window >= 1"),
    (dict(decay=1.5), r"decay \(a fixed decay per step\) must be a finite number > 0.0 and <= 1.0"), (dict(decay="gla"), "decay must be one of"),
    (dict(state="gated"), "state must be one of"), (dict(beta="x", state="delta"), "beta must be one of")])
def test_bad_memory_options_refused_before_the_model_is_touched(kwargs, match):
    model = _llama()
    opts = dict(attention="hedgehog", m=8, window=3, sinks=0)
    opts.update(kwargs)
    with pytest.raises(ValueError, match=match):
        convert_attention(model, **opts)
    assert not converted_modules(model, required=False)


def test_memory_refused_for_an_encoder():
    from tests.test_convert import _bert

    model = _bert()
    with pytest.raises(ValueError, match="need causal=True"):
        convert_attention(model, attention="hedgehog", m=8, window=3, cache=2)
    assert not converted_modules(model, required=False)


def test_linearize_with_memory_and_exact_layers_trains_the_new_parameters():
    """linearize converts with the memory options and exact layers, stage 1 moves the decay and β
    parameters (trained with the gate) and leaves the exact layer exact; the settings record both."""
    from sketchlab import linearize
    from sketchlab.convert.exact import ExactAttention

    model = _llama()
    ids = torch.randint(1, 50, (6, 16), generator=torch.Generator().manual_seed(2))
    model, report = linearize(model, ids, attention="hedgehog", m=8, window=3, sinks=1, state="delta", decay="head",
                              beta="input", exact_layers=[1], transfer_steps=5, seq_len=16, batch_size=2,
                              gate_init=0.0, evaluate=False)
    (s,) = converted_modules(model)
    assert isinstance(model.model.layers[1].self_attn.sketch, ExactAttention)
    assert report.settings["state"] == "delta" and report.settings["exact_layers"] == [1]
    assert float(s.far.decay_bias.detach().sub(torch.logit(torch.tensor(0.99, dtype=torch.float64))).abs().max()) > 1e-4
    assert float(s.far.beta_weight.detach().abs().max()) > 0


def test_linearize_refuses_bad_memory_options_before_the_teacher_pass(monkeypatch):
    import importlib

    from sketchlab import linearize

    lin = importlib.import_module("sketchlab.convert.linearize")
    monkeypatch.setattr(lin, "teacher_attention", lambda *a, **k: pytest.fail("the teacher ran"))
    ids = torch.randint(1, 50, (4, 16))
    with pytest.raises(ValueError, match="cache=2 needs window >= 1"):
        linearize(_llama(), ids, attention="hedgehog", m=8, window=0, sinks=0, cache=2, seq_len=16)
    with pytest.raises(ValueError, match="not a layer index"):
        linearize(_llama(), ids, attention="hedgehog", m=8, window=3, exact_layers=[5], seq_len=16)
