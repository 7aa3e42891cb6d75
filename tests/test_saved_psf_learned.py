"""Files written while PolySketchFormer's learned sketch was its own class (``PSFLearnedMap``, keys ``ln_weight,
ln_bias, w1, b1, w2, b2``; tests/data/saved_psf_learned, written once by 3fa1d18's code: its ``make_saves.py``)
load with equal outputs: a toy checkpoint (untied maps, a window), a tiny Llama converted with
``attention="psf-learned"`` and ``input_norm=True`` (the map one level deeper) saved by ``save_linearized``, and one
map's own state dict loaded by the map's own ``load_state_dict``.

Tolerances: the toy model is float32 (its old-checkpoint test's); the Llama float64, 1e-10 on O(1) logits.
"""

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

from sketchlab.convert import load_linearized
from sketchlab.featuremaps import SelfTensored, psf_learned_map
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


def test_a_bare_psf_learned_map_loads_the_old_class_state_dict_and_computes_what_it_computed():
    """``psf_learned_map(...)`` (an ``InputNormed(MLPMap)``) loads a ``PSFLearnedMap``'s state dict (the toy
    checkpoint's query map: ``ln_weight, ln_bias, w1, b1, w2, b2``) by its own ``load_state_dict`` (strict), also
    inside ``SelfTensored`` as the registry wraps it, and its features are the old class's formula on them."""
    saved = load_file(SAVED / "toy" / "model.safetensors")
    at = "blocks.0.attention.attn.map_q.inner."
    old = {key.removeprefix(at): t.double() for key, t in saved.items() if key.startswith(at)}
    assert sorted(old) == ["b1", "b2", "ln_bias", "ln_weight", "w1", "w2"]
    (H, D), hidden, m = old["ln_weight"].shape, old["w1"].shape[-1], old["w2"].shape[-1]
    x = torch.randn(2, 5, H, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    # PSFLearnedMap._features: per-head LayerNorm with its affine -> Linear -> GELU -> Linear
    y = torch.nn.functional.layer_norm(x, (D,), eps=1e-5) * old["ln_weight"] + old["ln_bias"]
    h = torch.nn.functional.gelu(torch.einsum("bthd,hde->bthe", y, old["w1"]) + old["b1"])
    want = torch.einsum("bthe,hem->bthm", h, old["w2"]) + old["b2"]
    fmap = psf_learned_map(H, D, m=m, hidden=hidden, seed=9, dtype=torch.float64)
    fmap.load_state_dict(old)
    torch.testing.assert_close(fmap.features(x), want, rtol=1e-12, atol=1e-12)
    wrapped = SelfTensored(psf_learned_map(H, D, m=m, hidden=hidden, seed=9, dtype=torch.float64))
    wrapped.load_state_dict({f"inner.{key}": t for key, t in old.items()})
    torch.testing.assert_close(wrapped.inner.features(x), want, rtol=1e-12, atol=1e-12)
