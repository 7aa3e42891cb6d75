"""analysis/exact_layers.py: a layer made exact is the teacher's attention, the others keep their
hybrid, layers are ranked by the loss they remove, and the selection sequences are the transfer's own
held-back ones (the script's SmolLM2 run is not repeated here)."""

import argparse
import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sketchlab.convert import convert_attention  # noqa: E402

_PATH = Path(__file__).resolve().parent.parent / "analysis" / "exact_layers.py"
sys.path.insert(0, str(_PATH.parent))  # the script imports its siblings linearize_lm and position_loss
_spec = importlib.util.spec_from_file_location("exact_layers", _PATH)
el = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(el)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def _layer_outputs(model, ids):
    """Each decoder layer's output (the residual stream after it): ``[L]`` tensors ``[1, T, d]``."""
    out = model(input_ids=ids, output_hidden_states=True)
    return out.hidden_states[1:], out.logits


def test_set_exact_makes_exactly_those_layers_softmax_and_restores_the_others():
    teacher = _llama()
    ids = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(1))
    t_hidden, t_logits = _layer_outputs(teacher, ids)
    model = copy.deepcopy(teacher)
    sketches = convert_attention(model, attention="hedgehog", m=8, window=4, sinks=1)
    for s in sketches:  # the far part's weight well away from 0, so a hybrid layer differs from softmax
        s.gate.data.fill_(-1.0)
    h_hidden, h_logits = _layer_outputs(model, ids)
    assert (h_logits - t_logits).abs().max() > 1e-3  # the hybrid is not the teacher

    # layer 0 exact: its output is the teacher's (float64 round-off; the residual stream before it is the
    # embedding, shared), layer 1 reads the same input as in the teacher but keeps its hybrid, so it differs
    el.set_exact(sketches, {0})
    e_hidden, _ = _layer_outputs(model, ids)
    torch.testing.assert_close(e_hidden[0], t_hidden[0], rtol=0, atol=1e-10)
    assert (e_hidden[1] - t_hidden[1]).abs().max() > 1e-3

    # every layer exact: the teacher's logits
    el.set_exact(sketches, {0, 1, 2})
    torch.testing.assert_close(model(input_ids=ids).logits, t_logits, rtol=0, atol=1e-10)

    # none: back to the hybrid as converted
    el.set_exact(sketches, set())
    torch.testing.assert_close(model(input_ids=ids).logits, h_logits, rtol=0, atol=0)


def test_softmax_forward_is_the_teachers_with_padding_and_refuses_a_state():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 9, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, 6:] = False  # right padding of the second row
    for causal in (True, False):
        s = q.transpose(1, 2) @ k.transpose(1, 2).mT * 0.5  # [B, H, T, T], scale 0.5
        allowed = pad[:, None, None, :] & (torch.ones(9, 9).tril().bool() if causal else True)
        expected = (s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.transpose(1, 2)).transpose(1, 2)
        got = el.softmax_forward(q, k, v, causal=causal, scaling=0.5, key_padding_mask=pad)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="no recurrent state"):
        el.softmax_forward(q, k, v, causal=True, output_final_state=True)


def test_rank_layers_orders_by_the_loss_removed_and_keeps_layer_order_on_ties():
    assert el.rank_layers(3.0, [2.9, 2.5, 3.1, 2.9]) == [1, 0, 3, 2]
    assert el.rank_layers(1.0, [1.0, 1.0]) == [0, 1]


def test_transfer_data_reads_the_cached_runs_training_sequences_and_refuses_a_name_without_them():
    stem = "psf_w64_s4_m64_gatesearch_len2048x16_steps400_lr0.01_maplrNone_batch1_gs4_perlayer"
    assert el.transfer_data(Path(f"/c/{stem}.safetensors")) == (2048, 16)
    with pytest.raises(ValueError, match=r"x\.safetensors: the name records no training data"):
        el.transfer_data(Path("/c/x.safetensors"))


@pytest.mark.parametrize("text, expected", [("0,1,2", [0, 1, 2]), ("3", [3])])
def test_k_list_accepts_increasing_counts(text, expected):
    assert el.k_list(text) == expected


@pytest.mark.parametrize("text", ["2,1", "1,1", "-1,2", "a"])
def test_k_list_refuses_others(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--k must be"):
        el.k_list(text)
