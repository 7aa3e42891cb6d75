"""Written once with the code of 3fa1d18, before PolySketchFormer's learned sketch became ``InputNormed(MLPMap)``
(its own class ``PSFLearnedMap`` until then, keys ``ln_weight, ln_bias, w1, b1, w2, b2``): a toy checkpoint
(``sketchlab train --attention psf-learned``'s model, untied maps, a window) and a tiny Llama converted with
``attention="psf-learned"`` and ``input_norm=True`` (the map nested one level deeper) saved by
``save_linearized``, each with the logits that code gave (tests/test_saved_psf_learned.py). Run from a checkout
of that commit:

    PYTHONPATH=$PWD python tests/data/saved_psf_learned/make_saves.py tests/data/saved_psf_learned
"""
import json
import sys
from pathlib import Path

import torch
import transformers

import sketchlab as sl
from sketchlab.convert import convert_attention, converted_modules, save_linearized
from sketchlab.io.atomic import write_text_atomic
from sketchlab.tasks import TransformerConfig, TransformerLM, save_checkpoint

out = Path(sys.argv[1])
assert "PSFLearnedMap" in dir(sl), "run with the code from before the fold"

# the toy model: every float tensor off its construction value, the logits O(1)
torch.manual_seed(0)
cfg = TransformerConfig(vocab_size=10, d_model=16, n_heads=2, n_layers=1, mlp_ratio=1, attention="psf-learned",
                        attention_options={"p": 4, "m": 9, "hidden": 5, "tie": False, "window": 4})
toy = TransformerLM(cfg).eval()
gen = torch.Generator().manual_seed(1)
tokens = torch.arange(12).remainder(7).add(torch.arange(12) // 5)[None]  # [1, 12]
with torch.no_grad():
    for key, t in toy.state_dict().items():
        if t.is_floating_point():
            t.add_((0.1 if ".attn." in key else 0.3) * torch.randn(t.shape, generator=gen))
    logits = toy(tokens)
save_checkpoint(out / "toy", toy, extra={"tokens": tokens[0].tolist(), "logits": logits[0].tolist()})

# a converted tiny Llama, saved by save_linearized
cfg = transformers.LlamaConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=16, max_position_embeddings=32,
                               attn_implementation="sdpa")
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).double().eval()
kw = dict(attention="psf-learned", p=4, m=9, window=3, sinks=1, input_norm=True)
convert_attention(model, **kw)
gen = torch.Generator().manual_seed(7)
with torch.no_grad():  # trained values, not the initial ones
    for s in converted_modules(model):
        for p in s.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
ids = torch.randint(1, 20, (2, 9), generator=torch.Generator().manual_seed(3))
with torch.no_grad():
    logits = model(input_ids=ids).logits
save_linearized(model, out / "llama")
write_text_atomic(out / "llama" / "expected.json", json.dumps(
    {"ids": ids.tolist(), "logits": logits.tolist(), "options": kw, "written_by": "3fa1d18"}))
print("ok")
