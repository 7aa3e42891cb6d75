"""Files written while PolySketchFormer's learned sketch was its own class (``PSFLearnedMap``, keys ``ln_weight,
ln_bias, w1, b1, w2, b2``; tests/data/saved_psf_learned, written once by 3fa1d18's code: its ``make_saves.py``)
load with equal outputs: a toy checkpoint (untied maps, a window) and a tiny Llama converted with
``attention="psf-learned"`` and ``input_norm=True`` (the map one level deeper) saved by ``save_linearized``.

Tolerances: the toy model is float32 (its old-checkpoint test's); the Llama float64, 1e-10 on O(1) logits.
"""

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from sketchlab.convert import load_linearized
from sketchlab.tasks import load_checkpoint

SAVED = Path(__file__).resolve().parent / "data" / "saved_psf_learned"


def _old_format(path: Path) -> bool:
    return any(key.endswith(".ln_weight") for key in load_file(path))


def test_a_toy_checkpoint_of_the_learned_sketch_loads_with_its_logits():
    assert _old_format(SAVED / "toy" / "model.safetensors")
    model, extra = load_checkpoint(SAVED / "toy")
    with torch.no_grad():
        out = model(torch.tensor([extra["tokens"]]))[0]
    torch.testing.assert_close(out, torch.tensor(extra["logits"]), rtol=1e-5, atol=1e-6)


def test_a_converted_model_with_the_learned_sketch_loads_with_its_logits():
    assert _old_format(SAVED / "llama" / "model.safetensors")
    expected = json.loads((SAVED / "llama" / "expected.json").read_text())
    cfg = transformers.LlamaConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=16, max_position_embeddings=32,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = load_linearized(SAVED / "llama", transformers.LlamaForCausalLM(cfg).double().eval())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(expected["ids"])).logits
    assert (logits - torch.tensor(expected["logits"], dtype=torch.float64)).abs().max() < 1e-10
