"""sketchlab.convert.scale: the tied non-negative LLoPS map, tie_theta, the far-mass gate, and the
transfer's separate map learning rate."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from sketchlab.convert import convert_attention
from sketchlab.convert.linearize import attention_transfer, teacher_attention
from sketchlab.convert.scale import TiedLLoPSMap, far_mass_gate, search_gate, tie_theta


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().double()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
    return model


def test_tie_theta_is_best_psd_rank1_of_symmetric_part():
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(2, 2, 2, 5, 3, generator=gen, dtype=torch.float64)  # [H, t, p=2, D, M]
    theta[0, 0, 1, :, 0] = theta[0, 0, 0, :, 0]  # equal factors: tied already
    theta[0, 0, 1, :, 1] = -theta[0, 0, 0, :, 1]  # opposite factors: sym(abᵀ) = −aaᵀ <= 0
    tied = tie_theta(theta)
    assert tied.shape == (2, 2, 5, 3)
    for h in range(2):
        for r in range(2):
            for i in range(3):
                a, b = theta[h, r, 0, :, i], theta[h, r, 1, :, i]
                sym = (torch.outer(a, b) + torch.outer(b, a)) / 2
                lam, vec = torch.linalg.eigh(sym)  # ascending
                best = lam[-1].clamp_min(0) * torch.outer(vec[:, -1], vec[:, -1])
                got = torch.outer(tied[h, r, :, i], tied[h, r, :, i])
                # closed form vs eigendecomposition of a 5×5 matrix in float64: round-off ~1e-15·‖Θ‖²
                torch.testing.assert_close(got, best, atol=1e-12, rtol=0)
    torch.testing.assert_close(tied[0, 0, :, 0], theta[0, 0, 0, :, 0], atol=1e-14, rtol=0)
    assert float(tied[0, 0, :, 1].abs().max()) == 0.0
    with pytest.raises(ValueError, match="p=2"):
        tie_theta(torch.randn(1, 1, 3, 4, 2))


def test_tied_map_matches_naive_and_is_non_negative():
    gen = torch.Generator().manual_seed(1)
    fmap = TiedLLoPSMap(2, 4, torch.randn(2, 2, 4, 3, generator=gen, dtype=torch.float64))
    x = torch.randn(1, 5, 2, 4, generator=gen, dtype=torch.float64)
    f = fmap.features(x)
    assert f.shape == (1, 5, 2, 3) and fmap.non_negative and fmap.degree == 2 and fmap.num_features == 3
    torch.testing.assert_close(f, fmap.features_naive(x), atol=1e-12, rtol=0)  # float64 sums of 2 squares
    f = f.detach()
    assert bool((f >= 0).all()) and float(f.min()) > 0  # generic inputs: strictly positive
    # trained, it stays non-negative: one parameter per feature, squared
    fmap.theta.data.mul_(-3.0)
    assert bool((fmap.features(x) >= 0).all())
    with pytest.raises(ValueError, match="even degree"):
        TiedLLoPSMap(2, 4, torch.randn(2, 1, 4, 3), p=3)
    with pytest.raises(ValueError, match="theta must have shape"):
        TiedLLoPSMap(2, 4, torch.randn(2, 1, 5, 3))


def test_far_mass_gate_matches_dense_definition():
    model = _llama()
    ids = torch.randint(1, 60, (3, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[2, 15:] = 0  # padding: the gate only sees valid tokens
    layers = teacher_attention(model, ids, mask)
    gen = torch.Generator().manual_seed(3)
    maps = lambda layer, heads, dim: TiedLLoPSMap(heads, dim, torch.randn(heads, 1, dim, 6, generator=gen) / 3)  # noqa: E731
    sketches = convert_attention(model, feature_map=maps, window=4, sinks=1)
    sketch, io = sketches[1], layers[1]
    gate = far_mass_gate(sketch, io, mask, [0, 2])
    # naive twin: per head, query by query, key by key
    c = sketch.input_scale
    want = []
    for h in range(4):
        vals = []
        for n in (0, 2):
            q, k, _ = io.inputs(torch.tensor([n]))
            T = int(mask[n].sum())
            fq = sketch.map_q.features_naive(q[:, :T] * c)[0, :, h]  # [T, M]
            fk = sketch.key_map.features_naive(k[:, :T] * c)[0, :, h]
            for i in range(T):
                logits = [io.scaling * float(q[0, i, h] @ k[0, j, h]) for j in range(i + 1)]
                near = [logits[j] for j in range(i + 1) if j < 1 or i - j < 4]
                far = [j for j in range(1, i + 1) if i - j >= 4]
                if not far:
                    continue
                cmax = max(near)
                F = sum(float(fq[i] @ fk[j]) for j in far)
                S = sum(math.exp(logits[j] - cmax) for j in far)
                vals.append(math.log(F) - math.log(S))
        want.append(torch.tensor(vals, dtype=torch.float64).median())
    # float64 throughout; the fast path sums in a different order: round-off ~1e-13 on logs of O(1e2)
    torch.testing.assert_close(gate, torch.stack(want), atol=1e-10, rtol=0)
    assert float(gate.abs().max()) > 0.1  # not the fallback zero
    with pytest.raises(ValueError, match="no window"):
        far_mass_gate(convert_attention(_llama(), attention="hedgehog", m=4, window=0, sinks=0)[0], io, mask, [0])


def test_transfer_map_lr_separate_from_gate():
    model = _llama()
    ids = torch.randint(1, 60, (4, 16), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    layers = teacher_attention(model, ids, mask)
    for map_lr, maps_move in ((0.0, False), (None, True)):
        sketches = convert_attention(_llama(), attention="llops", p=2, m=4, window=4, sinks=1)
        theta0 = sketches[0].map_q.theta.detach().clone()
        gate0 = sketches[0].gate.detach().clone()
        attention_transfer(sketches, layers, mask, torch.arange(3), steps=3, lr=1e-2, map_lr=map_lr, batch_size=2)
        assert not torch.equal(sketches[0].gate.detach(), gate0)  # the gate trains at lr either way
        assert torch.equal(sketches[0].map_q.theta.detach(), theta0) != maps_move
    with pytest.raises(ValueError, match="map_lr"):
        attention_transfer(sketches, layers, mask, torch.arange(3), steps=1, map_lr=-1.0)


def test_search_gate_picks_least_error_per_head():
    from sketchlab.convert.linearize import attention_errors

    model = _llama()
    ids = torch.randint(1, 60, (2, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    layers = teacher_attention(model, ids, mask)
    sketch = convert_attention(model, attention="hedgehog", m=4, window=4, sinks=1)[0]
    cands = torch.tensor([[-3.0, 0.0, 3.0, 6.0], [0.0, 3.0, 6.0, -3.0], [3.0, 6.0, -3.0, 0.0]], dtype=torch.float64)
    gate = search_gate(sketch, layers[0], mask, [0, 1], cands)
    # naive twin: every combination of per-head choices (3⁴ = 81), the whole-output error of each
    best, best_err = None, math.inf
    for choice in torch.cartesian_prod(*[torch.arange(3)] * 4):
        g = cands[choice, torch.arange(4)]
        sketch.gate.data.copy_(g)
        err = attention_errors([sketch], layers[:1], mask, [0, 1])[0]
        if err < best_err:
            best, best_err = g, err
    # heads are separable, so the per-head argmin is the joint argmin (ties: none on random data)
    torch.testing.assert_close(gate, best, atol=0, rtol=0)
    sketch.gate.data.zero_()
    search_gate(sketch, layers[0], mask, [0, 1], cands)
    torch.testing.assert_close(sketch.gate.detach().double(), best, atol=0, rtol=0)  # left at the result
    assert not any(torch.equal(best, row) for row in cands)  # a per-head mix, not one whole candidate row
    with pytest.raises(ValueError, match="candidates must have shape"):
        search_gate(sketch, layers[0], mask, [0], torch.zeros(2, 3))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("non_negative", [False, True])
@pytest.mark.parametrize("local", ["softmax", "poly"])
def test_far_mass_gate_gives_the_attention_the_teachers_far_share(non_negative, local, causal):
    """Checked against the attention itself, not a restated kernel: one query has far keys, so the
    median is that query's logit; at it, the sketch's output on values marking the far key (its far
    share of the denominator, eps=0) is the teacher's softmax share of it — for the self-tensored
    kernel (φq·φk)², the poly window and an encoder's two-sided window alike."""
    from sketchlab.convert.linearize import LayerIO
    from sketchlab.convert.sketched import SketchedAttention

    H, D, w, ns = 2, 4, 3, 1
    if causal:  # valid tokens 0 … T-2 (the last is padding): only query T-2 has a far key, key ns
        T, query, key, valid = ns + w + 2, ns + w, ns, ns + w + 1
    else:  # tokens 0 … T-1: only query 0 has a far key (|0 − j| >= w, j >= ns), key T-1; the others' lie in the sinks
        T, query, key, valid = ns + w, 0, ns + w - 1, ns + w
    gen = torch.Generator().manual_seed(7)
    q, k = (2 * torch.randn(1, T, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.zeros(1, T, H, 1, dtype=torch.float64)
    mask = torch.zeros(1, T, dtype=torch.long)
    mask[0, :valid] = 1
    io = LayerIO(q, k, v, torch.zeros(1, T, H, 1, dtype=torch.float64), 0.7 / math.sqrt(D))
    maps = [TiedLLoPSMap(H, D, torch.randn(H, 1, D, 3, generator=gen, dtype=torch.float64) / 2) for _ in range(2)]
    sketch = SketchedAttention(*maps, heads=H, head_dim=D, window=w, sinks=ns, local=local,
                               non_negative=non_negative, eps=0.0, causal=causal).double()
    gate = far_mass_gate(sketch, io, mask, [0])
    assert float(gate.abs().min()) > 0.1  # every head found its query (not the fallback zero)
    far = torch.zeros(1, valid, H, 1, dtype=torch.float64)
    far[0, key] = 1.0  # the one far key of that query
    with torch.no_grad():
        sketch.gate.copy_(gate)
        share = sketch(q[:, :valid], k[:, :valid], far, scaling=io.scaling)[0, query, :, 0]  # [H]
    seen = valid if not causal else query + 1
    logits = io.scaling * torch.einsum("hd,jhd->hj", q[0, query], k[0, :seen])  # [H, seen]
    want = torch.softmax(logits, -1)[:, key]
    # float64: logs and exps of O(10) values, round-off ~1e-14
    torch.testing.assert_close(share, want, atol=1e-12, rtol=0)
