"""Review fixes of the conversion glue: the short-prompt refusal's advice, a feature map shared by
q and k saved and loaded, refusals before any work (``linearize`` with ``local="poly"``,
``load_linearized`` with another family, options or a corrupt options file, a mask of the wrong
length). Tiny random float64 models."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from sketchlab.convert import convert_attention
from tests.test_convert import _llama

GEN = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)


def _converted(sinks, model=None):
    """A converted tiny LLaMA (window 3) with random gates, so the window and far parts both weigh."""
    from sketchlab.convert import converted_modules

    model = _llama() if model is None else model
    convert_attention(model, attention="llops", p=2, m=8, window=3, sinks=sinks)
    torch.manual_seed(5)
    with torch.no_grad():
        for s in converted_modules(model):
            s.gate.normal_()
    return model


def test_short_left_padded_prompt_refusal_advises_what_works():
    """A left-padded prompt with fewer real tokens (2) than the sinks (4) in generate() is refused, and
    the message names remedies that hold: converting with at most 2 sinks makes the batch give each
    prompt its own new tokens, and the short prompt generated alone (unpadded) is not refused. It does
    not advise right padding, which gives the short prompt other tokens than its own (checked here)."""
    g = torch.Generator().manual_seed(7)
    long, short = torch.randint(1, 50, (6,), generator=g), torch.randint(1, 50, (2,), generator=g)
    ids = torch.stack([long, torch.cat([torch.zeros(4, dtype=torch.long), short])])
    mask = (ids != 0).long()
    mask[0] = 1
    model = _converted(4)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"row 1 of the batch \(4 of its 6 tokens pads\).*convert with at most 2 "
                                             r"sinks, or generate the short prompt alone") as err:
            model.generate(ids, attention_mask=mask, **GEN)
        assert "padding_side" not in str(err.value)
        alone = model.generate(short[None], **GEN)[0, 2:]  # the advised "alone": runs
        right = torch.stack([long, torch.cat([short, torch.zeros(4, dtype=torch.long)])])
        bad = model.generate(right, attention_mask=(right != 0).long(), **GEN)[1, 6:]
        assert not torch.equal(bad, alone)  # right padding: not the prompt's own tokens
        fewer = _converted(2)  # the advised sink count
        batch = fewer.generate(ids, attention_mask=mask, **GEN)[:, 6:]
        assert torch.equal(batch[1], fewer.generate(short[None], **GEN)[0, 2:])
        assert torch.equal(batch[0], fewer.generate(long[None], **GEN)[0, 6:])


def _shared_hedgehog(layer, heads, head_dim):
    """A ``feature_map`` returning ONE module: shared by q and k."""
    from sketchlab.featuremaps import make_feature_map

    return make_feature_map("hedgehog", heads=heads, head_dim=head_dim, p=2, m=8)


def _toy():
    from sketchlab.tasks.model import TransformerConfig, TransformerLM

    torch.manual_seed(4)
    return TransformerLM(TransformerConfig(vocab_size=50, d_model=32, n_heads=2, n_layers=2)).double().eval()


@pytest.mark.parametrize("make", [_llama, _toy], ids=["llama", "toy"])
def test_map_shared_by_q_and_k_saves_and_loads(make, tmp_path):
    """A ``feature_map`` returning one module (shared by q and k) is registered once: the model saves
    (``save_pretrained`` refused shared tensors before; the toy model's safetensors file too), and a
    model converted with the same ``feature_map`` loads it back with identical logits (float64, atol 0)
    and q and k still one map, moved off its initial values before saving (so the load restored it)."""
    from sketchlab.convert import converted_modules, load_linearized, save_linearized

    model = make()
    convert_attention(model, window=3, sinks=1, feature_map=_shared_hedgehog)
    torch.manual_seed(9)
    with torch.no_grad():
        for s in converted_modules(model):
            assert s.key_map is s.map_q
            for p in s.parameters():
                p.add_(0.1 * torch.randn_like(p))
    save_linearized(model, tmp_path)
    fresh = make()
    convert_attention(fresh, window=3, sinks=1, feature_map=_shared_hedgehog)
    load_linearized(tmp_path, fresh)
    ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = model(ids), fresh(ids)
    want, got = (getattr(x, "logits", x) for x in (want, got))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for s in converted_modules(fresh):
        assert s.key_map is s.map_q


POLY_RULE = r"local='poly' needs a polynomial degree \(its exact window scores are \(s·qᵀk\)\^p\), and HedgehogMap"


@pytest.mark.parametrize("maps", ["named", "custom"])
def test_linearize_refuses_poly_window_without_degree_before_the_teacher(maps):
    """``linearize(local="poly")`` with a map that has no polynomial degree (Hedgehog, by name or from a
    ``feature_map``) is refused by the layer's own rule (``check_local_degree``'s message) before the
    model runs once (no teacher pass, no metric) and leaves it unconverted."""
    from sketchlab.convert import converted_modules
    from sketchlab.convert.linearize import linearize

    model = _llama()
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    ids = torch.randint(1, 50, (8, 16), generator=torch.Generator().manual_seed(0))
    kw = dict(attention="hedgehog") if maps == "named" else dict(feature_map=_shared_hedgehog)
    with pytest.raises(ValueError, match=POLY_RULE):
        linearize(model, ids, m=8, window=4, local="poly", seq_len=16, transfer_steps=1, **kw)
    assert calls == [] and converted_modules(model, required=False) == []


def test_cli_linearize_refuses_poly_window_without_degree_before_the_teacher(tmp_path, capsys, monkeypatch):
    """``sketchlab linearize --attention hedgehog --local poly``: exit 2 with the rule's message, no
    output directory, and the teacher never recorded (its recording raises here if reached)."""
    import importlib

    from sketchlab.cli import main
    from tests.test_cli_linearize_lm import _model_dir, _text_file

    _model_dir(tmp_path / "m")
    _text_file(tmp_path / "t.txt", 200)
    capsys.readouterr()

    def reached(*args, **kwargs):
        raise AssertionError("the teacher ran")

    lin = importlib.import_module("sketchlab.convert.linearize")  # the module (the package exports the function)
    monkeypatch.setattr(lin, "teacher_attention", reached)
    monkeypatch.setattr(lin, "perplexity", reached)
    rc = main(["linearize", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--attention",
               "hedgehog", "--m", "8", "--window", "4", "--local", "poly", "--seq-len", "32", "--out",
               str(tmp_path / "lin"), "--no-progress"])
    assert rc == 2
    assert "needs a polynomial degree" in capsys.readouterr().err
    assert not (tmp_path / "lin").exists()


def test_far_mass_gate_refuses_poly_without_degree_by_the_one_rule():
    """``far_mass_gate`` on a ``local="poly"`` layer whose map has no degree (a Hedgehog map put in after
    construction) raises ``check_local_degree``'s message, before reading any recorded input."""
    from sketchlab.convert.scale import far_mass_gate
    from sketchlab.convert.sketched import SketchedAttention
    from sketchlab.featuremaps import HedgehogMap, make_feature_map

    maps = [make_feature_map("llops", heads=2, head_dim=4, p=2, m=8) for _ in range(2)]
    sketch = SketchedAttention(*maps, heads=2, head_dim=4, window=2, sinks=1, local="poly")
    sketch.map_q = HedgehogMap(2, 4, m=8)
    with pytest.raises(ValueError, match=POLY_RULE):
        far_mass_gate(sketch, None, torch.ones(1, 6, dtype=torch.long), [0])


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  attn_implementation="sdpa")
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def test_load_linearized_refuses_before_converting(tmp_path):
    """``load_linearized`` refuses, with the model left as it was: a LLaMA save onto a GPT-2 (naming both
    families; the GPT-2 stays unconverted), a model converted with other options (naming each that
    differs and both values), a corrupt options file (naming its path)."""
    from sketchlab.convert import converted_modules, load_linearized, save_linearized

    model = _llama()
    convert_attention(model, attention="llops", p=2, m=8, window=4)
    save_linearized(model, tmp_path)
    gpt2 = _gpt2()
    with pytest.raises(ValueError, match=r"saved from a model of the 'llama' family, and GPT2LMHeadModel is of the "
                                         r"'gpt2' family"):
        load_linearized(tmp_path, gpt2)
    assert converted_modules(gpt2, required=False) == []
    other = _llama()
    convert_attention(other, attention="llops", p=2, m=16, window=8)
    with pytest.raises(ValueError, match=r"already converted with other options than the saved ones: m=16 \(saved "
                                         r"8\), window=8 \(saved 4\)$"):
        load_linearized(tmp_path, other)
    (tmp_path / "sketchlab_conversion.json").write_text("{bad")
    fresh = _llama()
    with pytest.raises(ValueError, match="^" + re.escape(f"{tmp_path / 'sketchlab_conversion.json'}: not valid JSON")):
        load_linearized(tmp_path, fresh)
    assert converted_modules(fresh, required=False) == []


def test_attention_mask_of_the_wrong_length_is_refused_by_name():
    """A padding ``attention_mask`` whose length is not the number of keys (7 columns for 10 tokens; in a
    call continuing a 10-token state, 3 columns for 3 new tokens, the 10 earlier ones missing) is refused
    naming attention_mask, its shape and the expected ``[B, past + T]``, not with a bare shape error."""
    from sketchlab.convert.cache import SketchStateCache

    model = _converted(2)
    ids = torch.randint(1, 50, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 7\), expected \[2, 10\]: .*\(0 earlier "
                                             r"token\(s\) in the state and the 10 of this call\)"):
            model(input_ids=ids, attention_mask=mask)
        cache = SketchStateCache(2)
        model(input_ids=ids, cache=cache, use_cache=True)
        mask = torch.ones(2, 3, dtype=torch.long)
        mask[0, -1] = 0  # a pad after the real tokens: the one layout a continuing call may have
        with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 3\), expected \[2, 13\]: .*\(10 earlier "
                                             r"token\(s\) in the state and the 3 of this call\)"):
            model(input_ids=ids[:, :3], attention_mask=mask, cache=cache, use_cache=True)
