"""Layers kept exact in a converted model (DESIGN §7): ExactAttention, its growing KV state, ranking."""

import pytest
import torch

from sketchlab.convert import convert_attention, converted_modules, load_linearized, save_linearized
from sketchlab.convert.exact import ExactAttention, KVState
from sketchlab.convert.ranking import rank_exact_layers
from tests.test_convert import TOL64, _greedy_by_full_forward, _inputs, _llama, _out, _state_after, perturb_maps


def _exact_sites(model):
    return [m for m in model.modules() if isinstance(getattr(m, "sketch", None), ExactAttention)]


def test_exact_layer_is_the_teachers_attention():
    """With every other layer's window covering the sequence, a model with an exact layer is the
    teacher (float64 round-off), left and right padding alike; the exact layer alone (a short window
    elsewhere) differs from the fully converted model, so the exact layer is what made layer 0 exact."""
    teacher = _llama()
    ids, mask = _inputs(True)
    mask[0, :2] = 0  # left padding in row 0 too
    want = _out(teacher, ids, mask)
    model = _llama()
    sketches = convert_attention(model, attention="hedgehog", m=8, window=ids.shape[1], sinks=1, eps=0.0,
                                 exact_layers=[0])
    assert len(sketches) == 1 and len(_exact_sites(model)) == 1
    assert model.config.sketchlab["exact_layers"] == [0]
    valid = mask.bool()
    torch.testing.assert_close(_out(model, ids, mask)[valid], want[valid], **TOL64)
    short_exact, short = _llama(), _llama()
    convert_attention(short_exact, attention="hedgehog", m=8, window=2, sinks=1, exact_layers=[0])
    convert_attention(short, attention="hedgehog", m=8, window=2, sinks=1)
    assert float((_out(short_exact, ids, mask) - _out(short, ids, mask))[valid].abs().max()) > 1e-3


def test_exact_layer_decodes_with_a_growing_kv_cache():
    """generate() with an exact layer equals greedy decoding by full forward passes; the exact
    layer's state is a KV cache that grows with the context while the converted layer's stays flat."""
    model = _llama()
    convert_attention(model, attention="hedgehog", m=8, window=3, sinks=1, exact_layers=[1])
    ids, _ = _inputs(False, B=2, T=5)
    out = model.generate(ids, max_new_tokens=7, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _greedy_by_full_forward(model, ids, 7))
    sizes = []
    for n in (12, 30):
        cache = _state_after(model, n)
        assert isinstance(cache.layers[1].state, KVState) and cache.layers[1].state.k.shape[2] == n
        sizes.append((cache.layers[0].state.nbytes, cache.layers[1].state.nbytes))
    assert sizes[0][0] == sizes[1][0]  # the converted layer: flat
    assert sizes[1][1] == sizes[0][1] * 30 // 12  # the exact layer: keys and values of every token


def test_exact_layer_state_holds_the_teachers_kv_heads_and_bytes():
    """GQA (4 query heads, 2 key/value heads): the exact layer's KVState holds the model's 2 key/value
    heads, so after n tokens its bytes are the teacher's DynamicCache layer's (keys + values), not twice
    them; decoding from it step by step equals the full forward."""
    from transformers import DynamicCache

    from sketchlab.convert.cache import SketchStateCache

    teacher, model = _llama(), _llama()
    assert teacher.config.num_key_value_heads < teacher.config.num_attention_heads
    convert_attention(model, attention="hedgehog", m=8, window=3, sinks=1, exact_layers=[1])
    ids = torch.randint(1, 50, (2, 11), generator=torch.Generator().manual_seed(4))
    for n in (5, 11):
        kv, cache = DynamicCache(), SketchStateCache(2)
        with torch.no_grad():
            teacher(ids[:, :n], cache=kv, use_cache=True)
            model(ids[:, :n], cache=cache, use_cache=True)
        state, want = cache.layers[1].state, kv.layers[1]
        assert state.nbytes == want.keys.nbytes + want.values.nbytes
        assert state.k.shape == want.keys.shape and state.v.shape == want.values.shape
    cache, steps = SketchStateCache(2), []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), _out(model, ids, torch.ones_like(ids)), **TOL64)


def test_exact_attention_with_grouped_heads_is_it_with_repeated_heads():
    """ExactAttention on H_kv key/value heads equals it on them repeated to the H query heads (the
    repeat_kv layout; bit for bit), a continued state equals the whole call, and a head count that
    does not divide H is refused."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 7, 6, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 7, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, :2] = False
    att = ExactAttention(heads=6, head_dim=4)
    want = att(q, k.repeat_interleave(3, 2), v.repeat_interleave(3, 2), key_padding_mask=pad)
    out, state = att(q, k, v, key_padding_mask=pad, output_final_state=True)
    assert torch.equal(out, want) and state.k.shape == (2, 2, 7, 4) and state.offset == 7
    first, state = att(q[:, :4], k[:, :4], v[:, :4], key_padding_mask=pad[:, :4], output_final_state=True)
    rest, state = att(q[:, 4:], k[:, 4:], v[:, 4:], key_padding_mask=pad[:, 4:], initial_state=state,
                      output_final_state=True)
    torch.testing.assert_close(torch.cat([first, rest], 1), want, **TOL64)
    assert torch.equal(state.k, k.transpose(1, 2)) and torch.equal(state.mask, pad)
    with pytest.raises(ValueError, match=r"6 query heads .* not a multiple of 4 key/value heads"):
        att(q, q[:, :, :4], q[:, :, :4])


def test_kv_decoder_step_is_the_layer_on_one_token():
    """The lean decoding step of an exact layer (KVDecoder: softmax attention's core over its buffer, grouped
    heads read in place) equals ExactAttention on each new token with the state, under a padded prompt, a
    given scaling and H_kv < H, past a growth of its buffer; its state is the layer's."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 5 + 4, 6, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 5 + 4, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    pad = torch.ones(2, 5, dtype=torch.bool)
    pad[1, :2] = False
    att = ExactAttention(heads=6, head_dim=4)
    _, state = att(q[:, :5], k[:, :5], v[:, :5], scaling=0.3, key_padding_mask=pad, output_final_state=True)
    dec = att.decoder(state, 0.3)
    dec.k, dec.v = dec.k[:, :, :6], dec.v[:, :, :6]  # room for one token: the second step grows the buffer
    dec.mask = dec.mask[:, :6]
    for t in range(5, 9):
        step = (x[:, t:t + 1].transpose(1, 2) for x in (q, k, v))  # [B, H|H_kv, 1, D]
        got = dec.step(*step)
        want, state = att(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], scaling=0.3, initial_state=state,
                          output_final_state=True)
        torch.testing.assert_close(got, want, **TOL64)
    mine = dec.state()
    assert torch.equal(mine.k, state.k) and torch.equal(mine.v, state.v) and torch.equal(mine.mask, state.mask)


def test_save_load_round_trip_with_exact_layers(tmp_path):
    model = _llama()
    convert_attention(model, attention="llops", p=2, m=8, window=3, sinks=1, exact_layers=[0])
    perturb_maps(model)
    ids, mask = _inputs(True)
    want = _out(model, ids, mask)
    save_linearized(model, tmp_path / "lin")
    fresh = load_linearized(tmp_path / "lin", _llama())
    assert len(_exact_sites(fresh)) == 1 and len(converted_modules(fresh)) == 1
    torch.testing.assert_close(_out(fresh, ids, mask), want, rtol=0, atol=0)


def test_rank_exact_layers_by_hand():
    """The gain of layer l is the mean loss with all converted minus the loss with l exact: checked
    against losses computed here by swapping the layer by hand; the model is left as converted."""
    from sketchlab.convert import token_nll

    model = _llama()
    convert_attention(model, attention="hedgehog", m=8, window=2, sinks=1)
    ids = torch.randint(1, 50, (2, 12), generator=torch.Generator().manual_seed(5))
    ones = torch.ones_like(ids)
    before = _out(model, ids, ones)
    base = float(token_nll(model, ids, ones).nanmean())
    holders = [m for m in model.modules() if getattr(m, "sketch", None) is not None]
    want = []
    for layer, holder in enumerate(holders):
        sketch = holder.sketch
        holder.sketch = ExactAttention(heads=sketch.heads, head_dim=sketch.head_dim)
        want.append((layer, base - float(token_nll(model, ids, ones).nanmean())))
        holder.sketch = sketch
    got = rank_exact_layers(model, ids)
    assert [layer for layer, _ in got] == [layer for layer, _ in sorted(want, key=lambda x: (-x[1], x[0]))]
    for layer, gain in got:
        assert gain == pytest.approx(dict(want)[layer], abs=1e-12)
    assert all(abs(gain) > 1e-6 for _, gain in got)  # making a layer exact changes the loss
    torch.testing.assert_close(_out(model, ids, ones), before, rtol=0, atol=0)


@pytest.mark.parametrize("layers,match", [([2], r"not a layer index in \[0, 2\)"), ([0, 0], "twice"),
                                          ([0, 1], "nothing would be converted"), ("0", "sequence of layer"),
                                          ([True], "not a layer index")])
def test_bad_exact_layers_refused_before_the_model_is_touched(layers, match):
    model = _llama()
    with pytest.raises((ValueError, TypeError), match=match):
        convert_attention(model, attention="hedgehog", m=8, window=3, exact_layers=layers)
    assert not converted_modules(model, required=False) and not _exact_sites(model)
