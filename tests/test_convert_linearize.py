"""sketchlab.linearize on tiny random models: every stage runs, and attention transfer lowers every
layer's held-out attention-output error."""

from __future__ import annotations

import pytest
import torch
import transformers

from sketchlab.convert import converted_modules, linearize
from sketchlab.convert.linearize import attention_errors, teacher_attention, tokenize_texts


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper attention than the random init's near-uniform one
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
    return model


def _ids(n=10, T=24, seed=1):
    return torch.randint(1, 60, (n, T), generator=torch.Generator().manual_seed(seed))


# a fitted (signed) Θ in the hybrid: the attention may warn about rows whose shared denominator
# is <= 0 before transfer, as it should; the test measures the errors
@pytest.mark.filterwarnings("ignore:linear_attention. .* normalising denominator")
@pytest.mark.parametrize("attention,window,sinks", [("llops", 4, 1), ("hedgehog", 0, 0)])
def test_transfer_lowers_every_layer_error(attention, window, sinks):
    model = _llama()
    model, report = linearize(model, _ids(), attention=attention, p=2, m=8, window=window, sinks=sinks, seq_len=24,
                              holdout=0.3, fit_tokens=96, fit_options={"steps": 2, "lm_steps": 2}, gate_init=0.0,
                              transfer_steps=40, transfer_lr=2e-2, batch_size=4)
    names = [s["name"] for s in report.stages]
    assert names == (["fit", "transfer"] if attention == "llops" else ["init", "transfer"])
    if attention == "llops":
        assert report.stages[0]["fit"]["tokens"] == 7 * 24  # the training sequences' tokens
    before, after = report.stages[0]["layer_error"], report.stages[1]["layer_error"]
    assert len(before) == len(after) == 2
    # held-out errors: each layer's must fall (by at least 10%: far beyond the noise of 3 held-out
    # sequences, while 40 Adam steps at lr 2e-2 lower it several-fold on this model)
    assert all(a < 0.9 * b for a, b in zip(after, before)), (before, after)
    assert report.teacher_metric is not None and all(s["metric"] is not None for s in report.stages)
    assert report.settings["held_out"] == 3 and report.settings["sequences"] == 10


def test_attention_errors_are_zero_for_exact_window():
    """The error measure itself: a window covering the sequence (exact softmax) has error ~0."""
    from sketchlab.convert import convert_attention

    model = _llama().double()
    ids = _ids(4, 12)
    mask = torch.ones_like(ids)
    layers = teacher_attention(model, ids, mask)
    assert len(layers) == 2 and layers[0].q.shape == (4, 12, 4, 8) and layers[0].k.shape == (4, 12, 2, 8)
    sketches = convert_attention(model, attention="hedgehog", m=8, window=12, sinks=0, eps=0.0)
    errors = attention_errors(sketches, layers, mask, slice(0, 4))
    assert max(errors) < 1e-12
    short = attention_errors(convert_attention(_llama().double(), attention="hedgehog", m=8, window=2, sinks=0),
                             layers, mask, slice(0, 4))
    assert min(short) > 1e-3


def test_lora_stage_runs_and_merges():
    model = _llama()
    model, report = linearize(model, _ids(), attention="hedgehog", m=8, window=4, sinks=1, seq_len=24, holdout=0.3,
                              transfer_steps=5, lora_steps=4, lora_rank=2, lora_lr=1e-3, batch_size=4)
    assert [s["name"] for s in report.stages] == ["init", "transfer", "lora"]
    assert len(report.stages[2]["losses"]) == 4
    assert type(model).__name__ == "LlamaForCausalLM" and len(converted_modules(model)) == 2
    assert not any("lora" in name for name, _ in model.named_parameters())  # merged


def test_tokenize_texts_and_bad_input():
    ids, mask = tokenize_texts([[1, 2, 3, 4, 5], [6, 7]], seq_len=2)
    assert ids.tolist() == [[1, 2], [3, 4], [5, 0], [6, 7]] and mask.sum().item() == 7
    with pytest.raises(ValueError, match="texts are strings: pass the model's tokenizer"):
        tokenize_texts("some text")
    with pytest.raises(ValueError, match="holdout=0.5 of 1 sequence"):
        linearize(_llama(), _ids(1), attention="hedgehog", m=8, holdout=0.5, seq_len=24)


def test_toy_model_linearize_and_round_trip(tmp_path):
    """sketchlab's TransformerLM: the same stages through hooks on its kernels, and save/load."""
    from sketchlab.convert import load_linearized, save_linearized
    from sketchlab.tasks.model import TransformerConfig, TransformerLM

    def toy():
        torch.manual_seed(5)
        model = TransformerLM(TransformerConfig(vocab_size=60, d_model=32, n_heads=2, n_layers=2)).eval()
        with torch.no_grad():
            for block in model.blocks:
                block.attention.q_proj.weight.mul_(30.0)
        return model

    # gate 0: the transfer starts from an even split (the default gate search starts it nearer its end)
    model, report = linearize(toy(), _ids(), attention="hedgehog", m=8, window=3, sinks=1, seq_len=24, holdout=0.3,
                              gate_init=0.0, transfer_steps=30, transfer_lr=2e-2, batch_size=4)
    before, after = report.stages[0]["layer_error"], report.stages[1]["layer_error"]
    assert all(a < 0.9 * b for a, b in zip(after, before)), (before, after)
    ids = _ids(2, 16, seed=9)
    with torch.no_grad():
        want = model(ids)
    save_linearized(model, tmp_path / "toy")
    fresh = load_linearized(tmp_path / "toy", toy())
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), want, rtol=0, atol=0)


def test_transfer_progress_lines_are_flushed_as_each_layer_ends(monkeypatch):
    """Stage 1's one line per layer reaches a piped stderr (a log being watched; progress goes to stderr)
    when the layer ends, not when the buffer fills: each line is flushed (issue 35 mutation round)."""
    import importlib
    import io
    import sys

    transfer = importlib.import_module("sketchlab.convert.transfer")

    class Watched(io.StringIO):
        def __init__(self):
            super().__init__()
            self.seen_at_flush = []

        def flush(self):
            self.seen_at_flush.append(self.getvalue())
            super().flush()

    out = Watched()
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.setattr(transfer, "_transfer_layer", lambda *a, **k: [] if a[0] == "empty" else [2.0, 0.5])
    losses = transfer._train_own(["s0", "empty", "s2"], [None] * 3, None, None, 0, 1, steps=1, lr=0.1, map_lr=0.1,
                                 batch_size=1, seed=0, progress=True)
    assert losses == [[2.0, 0.5], [], [2.0, 0.5]]
    lines = ["transfer layer 0: mse 2 -> 0.5\n", "transfer layer 1: 0 steps\n", "transfer layer 2: mse 2 -> 0.5\n"]
    said = lambda text: [line[line.index("transfer layer"):] + "\n" for line in text.split("\n")  # noqa: E731
                         if "transfer layer" in line]
    assert said(out.getvalue()) == lines  # beside them, the progress bar's own lines
    # each layer's line was flushed out by itself, before the next layer's existed
    assert [lines[:i + 1] for i in range(3)] == [x for i, x in enumerate(map(said, out.seen_at_flush))
                                                  if x and (i == 0 or x != said(out.seen_at_flush[i - 1]))]


def test_linearize_with_a_custom_feature_map_records_it_as_custom_and_every_option_under_its_name():
    """A run with ``feature_map=`` says "custom" where the map's name goes (the name given in ``attention``
    did not make the maps), and the options keep their own names (``normalize``, the window...)."""
    from sketchlab.featuremaps import make_feature_map

    def _maps(layer, heads, head_dim):
        return tuple(make_feature_map("hedgehog", heads=heads, head_dim=head_dim, p=2, m=8, seed=layer + side)
                     for side in range(2))

    ids = torch.randint(1, 60, (4, 12), generator=torch.Generator().manual_seed(2))
    _, report = linearize(_llama(), ids, seq_len=12, holdout=0.5, evaluate=False, feature_map=_maps, window=4,
                          sinks=1, normalize=None, transfer_steps=0, gate_sequences=1, batch_size=2)
    settings = report.settings
    assert settings["attention"] == "custom"
    assert settings["normalize"] is None and settings["window"] == 4 and settings["sinks"] == 1


def test_window_only_after_lora_is_measured_on_the_merged_projections():
    """LoRA moves the projections: its stage's window + sinks alone is the merged model with the far part off
    (every gate at FAR_OFF_LOGIT), measured again on the same held-out sequences, not the transfer stage's."""
    from sketchlab.convert.evaluate import far_off, perplexity

    ids = _ids()
    model, report = linearize(_llama(), ids, attention="hedgehog", m=8, window=4, sinks=1, seq_len=24, holdout=0.3,
                              gate_init=0.0, transfer_steps=2, lora_steps=2, lora_lr=1e-2, batch_size=4)
    transfer, lora = report.stages[1:]
    with far_off(converted_modules(model)):
        want = perplexity(model, ids[7:], torch.ones_like(ids[7:]), batch_size=4)
    assert lora["window_only_metric"] == pytest.approx(want, rel=1e-12)
    assert lora["window_only_metric"] != transfer["window_only_metric"]  # the projections moved
    assert lora["window_only_layer_error"] == transfer["window_only_layer_error"]  # the window part's, unchanged


def test_a_diverging_transfer_stops_at_the_last_finite_values():
    """An Adam step that makes a layer's parameters non-finite is undone and the layer stops: its curve ends in
    NaN for the steps not taken, its parameters at their last finite values. A layer whose output is ``v`` with
    the gradient of ``v + gate / 1000`` (a teacher output 100 above it): its loss stays finite while Adam's steps of
    ``lr = 3e37`` (one ``lr`` a step, the gradient's sign constant) carry the float32 gate past 3.4e38."""
    from sketchlab.convert.linearize import LayerIO, attention_transfer

    class Layer(torch.nn.Module):
        far = None

        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Parameter(torch.zeros(()))

        def forward(self, q, k, v, *, scaling, key_padding_mask):
            return v + 1e-3 * (self.gate - self.gate.detach())  # the value v, the gradient of v + gate / 1000

    v = torch.randn(3, 5, 2, 4)
    io = LayerIO(q=v.clone(), k=v.clone(), v=v, out=v + 100.0, scaling=0.5)
    layer = Layer()
    (curve,) = attention_transfer([layer], [io], torch.ones(3, 5), [0, 1, 2], steps=16, lr=3e37, batch_size=2)
    taken = sum(x == x for x in curve)
    assert len(curve) == 16 and 8 <= taken < 16 and all(x != x for x in curve[taken:]), curve
    assert bool(torch.isfinite(layer.gate)) and float(layer.gate) > 3e38  # the last finite value, not a reset
