"""token_nll / perplexity on a tiny random LLaMA: each position's next-token loss against a
direct log-softmax, padding handled as NaN, perplexity its exp-mean."""

from __future__ import annotations

import math

import pytest
import torch

from sketchlab.convert import perplexity, token_nll
from tests.test_convert import _llama  # a tiny random LLaMA (GQA, rotary), float64


def test_token_nll_matches_log_softmax_and_marks_padding():
    model = _llama()
    ids = torch.randint(1, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding: targets 7.. of row 1 are not tokens
    nll = token_nll(model, ids, mask, batch_size=2)
    assert nll.shape == (3, 11) and nll.dtype == torch.float64
    for n in range(3):
        real = int(mask[n].sum())
        with torch.no_grad():  # the row on its own, unpadded: logits of positions 0..real-2 predict 1..real-1
            logits = model(input_ids=ids[n : n + 1, :real]).logits[0].double()
        direct = torch.logsumexp(logits[:-1], -1) - logits[:-1].gather(1, ids[n, 1:real, None])[:, 0]
        # float64 model: agreement to round-off (the padded batch runs the same ops on longer rows)
        torch.testing.assert_close(nll[n, : real - 1], direct, rtol=0, atol=1e-10)
        assert torch.isnan(nll[n, real - 1 :]).all()
    valid = ~torch.isnan(nll)
    assert int(valid.sum()) == 11 + 6 + 11
    assert perplexity(model, ids, mask, batch_size=3) == pytest.approx(math.exp(float(nll[valid].mean())), rel=1e-12)


def test_left_padding_drops_the_first_real_token_and_keeps_the_rest():
    model = _llama()
    ids = torch.randint(1, 50, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: row 0's real tokens are 3..9
    nll = token_nll(model, ids, mask)
    # targets 1..3 of row 0 are NaN (2 pads and the first real token, predicted from a pad's logits)
    assert torch.isnan(nll[0, :3]).all() and not torch.isnan(nll[0, 3:]).any() and not torch.isnan(nll[1]).any()


def test_no_valid_target_is_refused():
    model = _llama()
    ids = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros_like(ids)
    mask[:, 0] = 1  # one real token per row: nothing to predict
    with pytest.raises(ValueError, match="no valid next-token target"):
        perplexity(model, ids, mask)


def test_token_nll_rejects_bad_shapes():
    model = _llama()
    with pytest.raises(ValueError, match=r"\[N, T\] of one shape with T >= 2"):
        token_nll(model, torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="one shape"):
        token_nll(model, torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))


@pytest.mark.parametrize("training", [True, False])
def test_evaluation_runs_in_eval_mode_and_restores_the_models_mode(training):
    """token_nll and sentence_embeddings evaluate in eval mode (no dropout) and leave the model's mode as it was."""
    from sketchlab.convert.evaluate import sentence_embeddings

    model = _llama().train(training)
    seen = []
    model.model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    ids = torch.randint(1, 50, (2, 8), generator=torch.Generator().manual_seed(2))
    token_nll(model, ids, torch.ones_like(ids))
    assert model.training is training
    sentence_embeddings(model.model, ids, torch.ones_like(ids))
    assert model.model.training is training and seen == [False, False]
