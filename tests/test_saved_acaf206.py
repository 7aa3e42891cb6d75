"""Files written by the code before the one-attention-core redesign (acaf206, issue 40) load with equal outputs:
two converted transformers models saved by ``save_linearized`` (an LLoPS hybrid; Hedgehog with the cache, the
input decay and the delta state) and a Θ export run by ``LLoPSAttention.from_pretrained``
(``tests/data/saved_acaf206``, written once by that commit's code: its ``make_saves.py``).

Tolerance: 1e-10 on float64 logits of O(1): the same formulas, the calls now routed through one op, which may
add the same terms in another order (round-off, ~1e-15 relative).
"""

import json
from pathlib import Path

import pytest
import torch

import sketchlab as sl
from sketchlab.convert import load_linearized
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
