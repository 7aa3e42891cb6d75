"""Files written by the code before the one-attention-core redesign (acaf206, issue 40) load with equal outputs:
two converted transformers models saved by ``save_linearized`` (an LLoPS hybrid; Hedgehog with the cache, the
input decay and the delta state), three smaller ones converted with a fitted sketch (PSF random, MLP, element-wise:
the old adapter's keys), three converted with a fitted registered map (psf-learned, Hedgehog: the old adapter's
keys, the keys through the query map) and a Θ export run by ``LLoPSAttention.from_pretrained``
(``tests/data/saved_acaf206``, written once by that commit's code: its ``make_saves.py``).

Tolerance: 1e-10 on float64 logits of O(1): the same formulas, the calls now routed through one op, which may
add the same terms in another order (round-off, ~1e-15 relative).
"""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import sketchlab as sl
from sketchlab.convert import convert_attention, load_linearized
from tests.test_convert import _llama

SAVED = Path(__file__).resolve().parent / "data" / "saved_acaf206"


@pytest.mark.parametrize("case", ["llops-hybrid", "hedgehog-memory"])
def test_a_conversion_saved_before_the_redesign_loads_with_its_logits(case):
    expected = json.loads((SAVED / case / "expected.json").read_text())
    model = load_linearized(SAVED / case, _llama())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(expected["ids"])).logits
    want = torch.tensor(expected["logits"], dtype=torch.float64)
    assert (logits - want).abs().max() < 1e-10
    assert model.config.sketchlab["qk_conv"] == 0  # an option added since: its default, as the save was made


def test_a_theta_export_from_before_the_redesign_runs_as_it_did():
    expected = json.loads((SAVED / "theta_expected.json").read_text())
    block = sl.LLoPSAttention.from_pretrained(SAVED / "theta.safetensors", layer=0, dtype=torch.float64,
                                              **expected["block"])
    with torch.no_grad():
        y = block(torch.tensor(expected["x"], dtype=torch.float64))
    assert (y - torch.tensor(expected["y"], dtype=torch.float64)).abs().max() < 1e-10


def _small_llama(layers: int = 1):
    cfg = transformers.LlamaConfig(vocab_size=20, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=16, max_position_embeddings=32,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("case", ["psf-random-fitted", "mlp-fitted", "elementwise-fitted"])
def test_a_conversion_with_a_fitted_sketch_saved_before_the_redesign_loads_with_its_logits(case):
    """``convert_attention(model, feature_map=<fitted sketch>)`` at acaf206 saved the maps through its SketchMap
    adapter (a plain sketch's buffers, ``feature_map_q.weights_0``; a module sketch whole under each side,
    ``feature_map_q.sketch.w1_q``): converted today with today's fit of the same method (other values: the saved
    ones were moved off the fit), the save loads with its logits."""
    expected = json.loads((SAVED / case / "expected.json").read_text())
    fitted = expected["fit"]
    qk = torch.randn(2, 1, 2, 16, 8, generator=torch.Generator().manual_seed(expected["qk_seed"]), dtype=torch.float64)
    fit = sl.fit_sketch(fitted["method"], qk[0], qk[1], p=fitted["p"], m=fitted["m"], seed=fitted["seed"],
                        **fitted["options"])
    model = _small_llama()
    convert_attention(model, feature_map=fit, **expected["options"])
    load_linearized(SAVED / case, model)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(expected["ids"])).logits
    assert (logits - torch.tensor(expected["logits"], dtype=torch.float64)).abs().max() < 1e-10


def _converted_with_todays_fit(expected: dict, method: str | None = None):
    """The save's model converted as it records, with today's fit of ``method`` (default: the save's) on the same
    q, k (other values than the saved ones: those were moved off the fit)."""
    fitted = expected["fit"]
    batch = fitted["batch"] or [2]  # a fit of batch [] (one map for every head) is converted today per head
    qk = torch.randn(2, *batch, 16, 8, generator=torch.Generator().manual_seed(expected["qk_seed"]),
                     dtype=torch.float64)
    options = fitted["options"] if method is None else {"steps": 1}
    fit = sl.fit_sketch(method or fitted["method"], qk[0], qk[1], p=fitted["p"], m=fitted["m"], seed=fitted["seed"],
                        **options)
    model = _small_llama(fitted["layers"])
    convert_attention(model, feature_map=fit, **expected["options"])
    return model


@pytest.mark.parametrize("case", ["psf-learned-fitted", "hedgehog-fitted", "hedgehog-one-map-fitted"])
def test_a_conversion_with_a_fitted_registered_map_saved_before_the_redesign_loads_with_its_logits(case):
    """``convert_attention(model, feature_map=fit_sketch("psf-learned" | "hedgehog", ...).sketch)`` at acaf206 saved
    the fit's maps of all its heads under the query side (``feature_map_q.sketch.map_q.[inner.]*``), and the keys
    went through that query map too: loaded, today's query and key maps both hold it (layer 1's heads of the
    psf-learned fit of batch [2, H], layer 0 kept exact; the whole hedgehog fit of batch [H]; the one map of a
    hedgehog fit of batch [] at every head, into a model converted today with a fit of batch [H]: today a fit of
    batch [] converts no model of several heads), and the logits are acaf206's."""
    expected = json.loads((SAVED / case / "expected.json").read_text())
    saved = load_file(SAVED / case / "model.safetensors")
    assert any(".sketch.feature_map_q.sketch.map_q." in key for key in saved)  # acaf206's adapter's keys
    model = load_linearized(SAVED / case, _converted_with_todays_fit(expected))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(expected["ids"])).logits
    assert (logits - torch.tensor(expected["logits"], dtype=torch.float64)).abs().max() < 1e-10


def test_a_fitted_registered_map_saved_before_the_redesign_is_refused_where_it_cannot_load_faithfully():
    """Its heads are one layer's of the fit's ``L·H``, which only ``load_linearized`` knows (the layer's index): a
    bare ``load_state_dict`` is refused naming the file's key; a model converted with another method's fit is
    refused naming the file, the key and the saved map's tensors. Never loaded as another model."""
    expected = json.loads((SAVED / "psf-learned-fitted" / "expected.json").read_text())
    model = _converted_with_todays_fit(expected)
    saved = load_file(SAVED / "psf-learned-fitted" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.sketch\.feature_map_q\.sketch\.map_q\.inner\."
                                         r"inner\.\w+: the fitted map's 4 heads are those of 2 layers.*load_linearized"):
        model.load_state_dict(saved)
    other = _converted_with_todays_fit(expected, method="hedgehog")
    with pytest.raises(ValueError, match=r"psf-learned-fitted/model\.safetensors: model\.layers\.1\.self_attn\.sketch\."
                                         r"feature_map_q\.sketch\.map_q\.: the fitted map saved by acaf206's adapter "
                                         r"has the tensors .*inner\.inner\.ln_weight"):
        load_linearized(SAVED / "psf-learned-fitted", other)
