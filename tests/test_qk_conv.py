"""The short causal convolution on q and k (``AttentionOptions.qk_conv``, issue 40's proof that a mechanism
is one module and one options line): the convolution against its float64 twin, the identity start, and the
op, the block, the toy model and a converted transformers model with it — split states, decoding steps,
padding, gradients, save and load.

Tolerances (float64): 1e-12 where one computation is compared with its written-out sum (a few terms of
O(1) values), 1e-10 where a chunked path meets a token-by-token one (as ``test_memory.py``).
"""

import dataclasses

import pytest
import torch

import sketchlab as sl
from sketchlab.attention import AttentionOptions, FarParams, linear_attention
from sketchlab.attention.qk_conv import ConvStep, causal_conv, causal_conv_naive, identity_conv_weight
from sketchlab.featuremaps import HedgehogMap, LLoPSMap

B, T, H, D, K = 2, 13, 2, 4, 4
TOL64 = 1e-10


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def test_causal_conv_is_the_written_out_sum_and_carries_its_tail():
    x, w, tail = _rand(B, T, H, D, seed=1), _rand(H, D, K, seed=2), _rand(B, K - 1, H, D, seed=3)
    for given in (None, tail):
        y, new = causal_conv(x, w, given)
        y_ref, new_ref = causal_conv_naive(x, w, given)
        assert (y - y_ref).abs().max() < 1e-12 and torch.equal(new, x[:, -(K - 1):]) and torch.equal(new_ref, new)
    whole, _ = causal_conv(x, w)
    a, t = causal_conv(x[:, :5], w)
    b, _ = causal_conv(x[:, 5:], w, t)
    assert torch.equal(torch.cat([a, b], 1), whole)  # a split anywhere equals the whole
    short, t1 = causal_conv(x[:, :1], w)  # fewer tokens than the tail: zeros before them
    assert torch.equal(t1[:, :-1], torch.zeros_like(t1[:, :-1])) and torch.equal(t1[:, -1], x[:, 0])


def test_identity_start_is_the_identity_bit_for_bit():
    x = _rand(B, T, H, D, seed=4)
    y, _ = causal_conv(x, identity_conv_weight(H, D, K, dtype=torch.float64))
    assert torch.equal(y, x)


def _maps():
    return {"hedgehog": HedgehogMap(H, D, m=4, seed=0, dtype=torch.float64),
            "llops": LLoPSMap(H, D, m=5, seed=0, dtype=torch.float64)}


LAYOUTS = {"pure": dict(), "hybrid": dict(window=3, sinks=1), "decay": dict(window=3, decay="input"),
           "delta": dict(window=3, state="delta")}


def _params(options, seed=0):
    p = FarParams(options, H, D, dim=D, gate=False).double()  # the gate passed as gate=
    with torch.no_grad():
        for i, (_, x) in enumerate(sorted(p.named_parameters())):
            x.copy_(_rand(*x.shape, seed=100 + seed + i, scale=0.5))
    return p


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["hedgehog", "llops"])
def test_the_op_with_a_qk_conv_splits_decodes_and_matches_its_twin(name, layout):
    fmap = _maps()[name]
    options = AttentionOptions(qk_conv=K, chunk_size=4, normalize="sum", **LAYOUTS[layout])
    params = _params(options)
    q, k, v = _rand(B, T, H, D, seed=5, scale=0.7), _rand(B, T, H, D, seed=6, scale=0.7), _rand(B, T, H, D, seed=7)
    gate = _rand(H, seed=8) if options.window else None
    run = dict(params=params, gate=gate)
    whole, final = linear_attention(q, k, v, fmap, options=options, output_final_state=True, **run)
    twin, _ = linear_attention(q, k, v, fmap, options=options.replace(backend="reference"), **run)
    assert (whole - twin).abs().max() < TOL64
    a, state = linear_attention(q[:, :6], k[:, :6], v[:, :6], fmap, options=options, output_final_state=True, **run)
    b, _ = linear_attention(q[:, 6:], k[:, 6:], v[:, 6:], fmap, options=options, initial_state=state, **run)
    assert (torch.cat([a, b], 1) - whole).abs().max() < TOL64
    steps, state = [], None
    for t in range(T):
        o, state = linear_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], fmap, options=options,
                                    initial_state=state, output_final_state=True, **run)
        steps.append(o)
    assert (torch.cat(steps, 1) - whole).abs().max() < TOL64
    assert torch.equal(state.conv_q, final.conv_q) and torch.equal(final.conv_k, k[:, -(K - 1):])
    without, _ = linear_attention(q, k, v, fmap, options=options.replace(qk_conv=0), **run)
    assert (whole - without).abs().max() > 1e-3  # the convolution is applied


def test_the_convolved_q_k_are_what_the_attention_sees():
    """With the convolution written out by hand before a call without it, the op gives the same output."""
    fmap = _maps()["hedgehog"]
    options = AttentionOptions(qk_conv=K, window=3, sinks=1, chunk_size=4)
    params = _params(options, seed=3)
    q, k, v = _rand(B, T, H, D, seed=9, scale=0.7), _rand(B, T, H, D, seed=10, scale=0.7), _rand(B, T, H, D, seed=11)
    out, _ = linear_attention(q, k, v, fmap, options=options, params=params)
    qc, kc = causal_conv_naive(q, params.conv_q)[0], causal_conv_naive(k, params.conv_k)[0]
    ref, _ = linear_attention(qc, kc, v, fmap, options=options.replace(qk_conv=0), params=params)
    assert (out - ref).abs().max() < TOL64


def test_segments_and_padding_start_the_convolution_afresh():
    fmap = _maps()["hedgehog"]
    options = AttentionOptions(qk_conv=K, chunk_size=4)
    params = _params(options, seed=5)
    q, k, v = _rand(1, T, H, D, seed=12, scale=0.7), _rand(1, T, H, D, seed=13, scale=0.7), _rand(1, T, H, D, seed=14)
    joined, _ = linear_attention(q, k, v, fmap, options=options, params=params, segments=[5, 8])
    first, _ = linear_attention(q[:, :5], k[:, :5], v[:, :5], fmap, options=options, params=params)
    second, _ = linear_attention(q[:, 5:], k[:, 5:], v[:, 5:], fmap, options=options, params=params)
    assert (joined - torch.cat([first, second], 1)).abs().max() < TOL64
    pad = torch.zeros(1, 3, H, D, dtype=torch.float64)  # left padding: the pads enter as the zeros before a sequence
    mask = torch.tensor([[False] * 3 + [True] * T])
    padded, _ = linear_attention(*(torch.cat([pad, x], 1) + 5.0 * (~mask)[..., None, None] for x in (q, k, v)), fmap,
                                 options=options, params=params, key_padding_mask=mask)
    alone, _ = linear_attention(q, k, v, fmap, options=options, params=params)
    assert (padded[:, 3:] - alone).abs().max() < TOL64


def test_gradients_reach_the_convolution():
    fmap = _maps()["hedgehog"]
    options = AttentionOptions(qk_conv=3, window=2, chunk_size=4)
    params = _params(options, seed=7)
    q, k, v = _rand(1, 6, H, D, seed=15, scale=0.7), _rand(1, 6, H, D, seed=16, scale=0.7), _rand(1, 6, H, D, seed=17)

    def f(wq, wk):  # the weights as plain tensors in a FarParams, so the graph reaches gradcheck's inputs
        p = FarParams(options, H, D, dim=D, gate=False).double()
        del p.conv_q, p.conv_k
        p.conv_q, p.conv_k = wq, wk
        return linear_attention(q, k, v, fmap, options=options, params=p)[0]

    weights = (params.conv_q.detach().clone().requires_grad_(), params.conv_k.detach().clone().requires_grad_())
    assert torch.autograd.gradcheck(lambda wq, wk: f(wq, wk), weights)


def test_refusals_name_the_rule():
    fmap = _maps()["hedgehog"]
    q = _rand(1, 5, H, D)
    with pytest.raises(ValueError, match="qk_conv=4 needs causal=True"):
        AttentionOptions(qk_conv=4, causal=False)
    with pytest.raises(ValueError, match="qk_conv must be an integer >= 0"):
        AttentionOptions(qk_conv=-1)
    options = AttentionOptions(qk_conv=K)
    with pytest.raises(ValueError, match=r"needs its weights params.conv_q .* FarParams\(options, heads, dim_v, dim=D\)"):
        linear_attention(q, q, q, fmap, options=options)
    with pytest.raises(ValueError, match="needs dim="):
        FarParams(options, H, D)
    plain, state = linear_attention(q, q, q, fmap, options=AttentionOptions(), output_final_state=True)
    with pytest.raises(ValueError, match=r"initial_state.conv_q must be the short convolution's tail \[1, 3, 2, 4\]"):
        linear_attention(q, q, q, fmap, options=options, params=FarParams(options, H, D, dim=D).double(),
                         initial_state=state)


def test_the_block_starts_where_it_was_steps_and_round_trips():
    x = _rand(2, 11, 8, seed=18)
    plain = sl.LLoPSAttention(8, H, p=2, m=5, window=3, sinks=1, dtype=torch.float64)
    conv = sl.LLoPSAttention(8, H, p=2, m=5, window=3, sinks=1, dtype=torch.float64, qk_conv=K)
    assert torch.equal(plain(x), conv(x))  # the identity start: a converted or new block begins where it was
    with torch.no_grad():
        conv.far.conv_q.add_(_rand(H, D, K, seed=19, scale=0.3))
        conv.far.conv_k.add_(_rand(H, D, K, seed=20, scale=0.3))
    y = conv(x)
    steps, state = [], None
    for t in range(x.shape[1]):
        y_t, state = conv.step(x[:, t], state)
        steps.append(y_t)
    assert (torch.stack(steps, 1) - y).abs().max() < TOL64
    again = sl.LLoPSAttention(8, H, p=2, m=5, window=3, sinks=1, dtype=torch.float64, qk_conv=K)
    again.load_state_dict(conv.state_dict())
    assert torch.equal(again(x), y)


def test_the_toy_model_trains_and_generates_with_it():
    from sketchlab.tasks import TransformerConfig, TransformerLM, generate, kernel_modules

    cfg = TransformerConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=2, mlp_ratio=2, attention="hedgehog",
                            attention_options={"qk_conv": K, "window": 2})
    model = TransformerLM(cfg).double()
    kernel = kernel_modules(model)[0]
    assert kernel.options.qk_conv == K and kernel.far.conv_q.shape == (2, 4, K)
    with torch.no_grad():
        for kern in kernel_modules(model):
            kern.far.conv_q.add_(_rand(2, 4, K, seed=21, scale=0.3))
    tokens = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(0))
    model(tokens).sum().backward()
    assert float(kernel.far.conv_q.grad.abs().max()) > 0
    out = generate(model, tokens, 5)
    seq = tokens
    for _ in range(5):  # greedy by full forward passes
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_a_converted_model_generates_pads_and_round_trips(tmp_path):
    from sketchlab.convert import convert_attention, converted_modules, load_linearized, save_linearized
    from tests.test_convert import _greedy_by_full_forward, _inputs, _llama, _out

    ids, mask = _inputs(False, B=2, T=7)
    plain, model = _llama(), _llama()
    convert_attention(plain, attention="hedgehog", m=8, window=3, sinks=1)
    convert_attention(model, attention="hedgehog", m=8, window=3, sinks=1, qk_conv=K)
    torch.testing.assert_close(_out(model, ids, mask), _out(plain, ids, mask), rtol=0, atol=0)  # identity start
    with torch.no_grad():
        for s in converted_modules(model):
            s.far.conv_q.add_(_rand(*s.far.conv_q.shape, seed=22, scale=0.3).to(s.far.conv_q.dtype))
            s.far.conv_k.add_(_rand(*s.far.conv_k.shape, seed=23, scale=0.3).to(s.far.conv_k.dtype))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(out.sequences, _greedy_by_full_forward(model, ids, 6))
    with torch.no_grad():  # each decoding step's logits are the full forward's at that position, not just its argmax
        full = model(input_ids=out.sequences).logits[:, ids.shape[1] - 1:-1]  # [B, 6, V]
    # generate() keeps its logits in float32: float32 round-off of O(1) values, ~1e-7
    torch.testing.assert_close(torch.stack(out.logits, 1), full.float(), rtol=1e-6, atol=1e-6)
    # left padding: the attention reorders the row's pads out of the window; the convolution runs before, in the
    # row's own order, so the real tokens' outputs are the row's alone
    left = torch.cat([torch.zeros(1, 3, dtype=ids.dtype), ids[:1]], 1)
    batch = torch.cat([left, torch.cat([ids[1:2], ids[1:2, :3]], 1)], 0)  # row 1: ten real tokens
    batch_mask = torch.ones_like(batch)
    batch_mask[0, :3] = 0
    positions = (batch_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(input_ids=batch, attention_mask=batch_mask, position_ids=positions).logits
        alone = model(input_ids=ids[:1]).logits
    torch.testing.assert_close(padded[0, 3:], alone[0], rtol=1e-9, atol=1e-9)
    # decoding after that reordered prefill continues the row exactly: the state carries the tails of the q, k the
    # op convolves (q·c, k·c; raw tails were off by c = D^-1/4 on every later token, ~7e-4 in the logits)
    gen = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    both, one = model.generate(batch, attention_mask=batch_mask, **gen), model.generate(ids[:1], **gen)
    torch.testing.assert_close(torch.stack(both.logits, 1)[0], torch.stack(one.logits, 1)[0], rtol=1e-9, atol=1e-9)
    save_linearized(model, tmp_path / "lin")
    fresh = load_linearized(tmp_path / "lin", _llama())
    assert fresh.config.sketchlab["qk_conv"] == K
    torch.testing.assert_close(_out(fresh, ids, mask), _out(model, ids, mask), rtol=0, atol=0)


def test_linearize_trains_the_convolution():
    from sketchlab import linearize
    from sketchlab.convert import converted_modules
    from tests.test_convert import _llama

    ids = torch.randint(1, 50, (6, 16), generator=torch.Generator().manual_seed(2))
    model, report = linearize(_llama(), ids, attention="hedgehog", m=8, window=3, sinks=1, qk_conv=K,
                              transfer_steps=5, seq_len=16, batch_size=2, gate_init=0.0, evaluate=False)
    assert report.settings["qk_conv"] == K
    moved = [float((s.far.conv_q.detach() - identity_conv_weight(*s.far.conv_q.shape, dtype=s.far.conv_q.dtype)).abs().max())
             for s in converted_modules(model)]
    assert min(moved) > 0


def test_the_lean_step_convolves_one_token_as_the_call_does():
    """ConvStep (the decoding step's ring) continues a state's tails token by token as causal_conv_naive does
    over the whole sequence (float64 round-off), writes the tails out in position order, sees the weights
    changed in place (a training step) at the next token, and refuses a state without tails."""
    B, T, H, D = 2, 9, 3, 4
    options = AttentionOptions(qk_conv=K)
    params = FarParams(options, H, D, dim=D).double()
    with torch.no_grad():
        params.conv_q.add_(_rand(H, D, K, seed=1, scale=0.5))
        params.conv_k.add_(_rand(H, D, K, seed=2, scale=0.5))
    q, k = _rand(B, T, H, D, seed=3), _rand(B, T, H, D, seed=4)
    split = 2  # fewer tokens than K - 1 before the split: part of the first tail is the zeros before the sequence
    fmap = HedgehogMap(H, D, m=4, seed=0, dtype=torch.float64)
    _, state = linear_attention(q[:, :split], k[:, :split], q[:, :split], fmap, options=options, params=params,
                                output_final_state=True)  # the tails as the op carries them
    step = ConvStep.from_state(state, options=options, params=params)
    heads = lambda x: x.transpose(1, 2).reshape(B * H, 1, D)  # noqa: E731  [B, 1, H, D] -> [B·H, 1, D]
    want_q, _ = causal_conv_naive(q, params.conv_q)
    want_k, _ = causal_conv_naive(k, params.conv_k)
    for t in range(split, T - 1):
        yq, yk = step(heads(q[:, t:t + 1]), heads(k[:, t:t + 1]))
        torch.testing.assert_close(yq, heads(want_q[:, t:t + 1]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(yk, heads(want_k[:, t:t + 1]), rtol=1e-12, atol=1e-12)
    got_q, got_k = step.tails()
    torch.testing.assert_close(got_q, q[:, T - K:T - 1])
    torch.testing.assert_close(got_k, k[:, T - K:T - 1])
    with torch.no_grad():  # a training step in place: the next token reads the new taps
        params.conv_q.mul_(2.0)
    yq, _ = step(heads(q[:, T - 1:]), heads(k[:, T - 1:]))
    torch.testing.assert_close(yq, heads(2.0 * want_q[:, T - 1:]), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="conv_q must be the short convolution's tail"):
        ConvStep.from_state(dataclasses.replace(state, conv_q=None), options=options, params=params)


def test_the_lean_convolution_runs_on_inference_tensors():
    """Weights made under ``torch.inference_mode`` (a model loaded for serving) have no version counter: the
    step makes its rotated taps again every token instead of failing, and still equals the call."""
    B, H, D = 1, 2, 3
    options = AttentionOptions(qk_conv=K)
    with torch.inference_mode():
        params = FarParams(options, H, D, dim=D).double()
        params.conv_q.add_(_rand(H, D, K, seed=1, scale=0.5))
        params.conv_k.add_(_rand(H, D, K, seed=2, scale=0.5))
        q, k = _rand(B, 6, H, D, seed=3), _rand(B, 6, H, D, seed=4)
        fmap = HedgehogMap(H, D, m=4, seed=0, dtype=torch.float64)
        _, state = linear_attention(q[:, :3], k[:, :3], q[:, :3], fmap, options=options, params=params,
                                    output_final_state=True)
        step = ConvStep.from_state(state, options=options, params=params)
        want, _ = causal_conv_naive(q, params.conv_q)
        for t in range(3, 6):
            yq, _ = step(q[:, t].reshape(B * H, 1, D), k[:, t].reshape(B * H, 1, D))
            torch.testing.assert_close(yq, want[:, t].reshape(B * H, 1, D), rtol=1e-12, atol=1e-12)
