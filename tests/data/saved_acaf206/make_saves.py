"""Written once with the code of acaf206 (issue 40's start): saves whose reload today must give the same outputs
(tests/test_saved_acaf206.py). Run with that commit checked out elsewhere:

    git worktree add /tmp/old acaf206
    python tests/data/saved_acaf206/make_saves.py /tmp/old tests/data/saved_acaf206 data/mqar_softmax_qk.safetensors

It writes only the saves that are missing: the committed ones stay as written (rewritten on another machine their
float64 logits and the fitted Θ differ in the last bits: another thread count, another summation order).
"""
import json
import sys
from pathlib import Path

import torch
import transformers

old, out, dump_file = sys.argv[1:4]
sys.path.insert(0, old)
import sketchlab as sl  # noqa: E402  (the old checkout's, put first above)
from sketchlab.convert import convert_attention, converted_modules, save_linearized  # noqa: E402
from sketchlab.io.atomic import write_text_atomic  # noqa: E402

assert sl.__file__.startswith(old), sl.__file__

out = Path(out)

def llama():
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().eval()

ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(3))
cases = {"llops-hybrid": dict(attention="llops", p=2, m=6, window=3, sinks=1),
         "hedgehog-memory": dict(attention="hedgehog", m=8, window=3, sinks=1, cache=2, decay="input", state="delta", beta="input")}
def save_trained(model, name, ids, record):
    """The converted layers' parameters moved off their initial values (trained values, seed 7: a fit's unread
    map_k's too), then the model saved with its logits on ``ids`` and ``record`` in ``expected.json``."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for s in converted_modules(model):
            for p in s.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        logits = model(input_ids=ids).logits
    save_linearized(model, out / name)
    write_text_atomic(out / name / "expected.json", json.dumps(
        {"ids": ids.tolist(), "logits": logits.tolist(), **record, "written_by": "acaf206"}))


for name, kw in cases.items():
    if (out / name).exists():
        continue
    model = llama()
    convert_attention(model, **kw)
    save_trained(model, name, ids, {"options": kw})
# a Θ export of acaf206: fit on the shipped dump's layer 0, and the block's output on it
if not (out / "theta.safetensors").exists():
    dump = sl.load_qk(dump_file, layers=[0])
    f = dump.q.shape[-1] ** -0.25
    fit = sl.fit_sketch("llops", dump.q[..., :64, :] * f, dump.k[..., :64, :] * f, p=2, m=6, seed=0)
    sl.export_theta(fit, out / "theta.safetensors", dump=dump, scale="sqrt-d")
    block = sl.LLoPSAttention.from_pretrained(out / "theta.safetensors", layer=0, dtype=torch.float64, window=4,
                                              sinks=1)
    x = torch.randn(1, 10, block.embed_dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        write_text_atomic(out / "theta_expected.json", json.dumps(
            {"x": x.tolist(), "y": block(x).tolist(), "written_by": "acaf206", "block": {"window": 4, "sinks": 1}}))
# conversions with a fitted sketch, convert_attention(feature_map=fit_sketch(...).sketch): at acaf206 their maps were
# the SketchMap adapter (a plain sketch's tensors as buffers of feature_map_q; a module sketch whole under each side,
# feature_map_q.sketch.*, feature_map_k.sketch.*); a smaller Llama (2 heads of 8; 1 layer unless said)
def small_llama(layers=1):
    cfg = transformers.LlamaConfig(vocab_size=20, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=16, max_position_embeddings=32,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().eval()

qk = torch.randn(2, 1, 2, 16, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)  # [q|k, L, H, n, D]
small_ids = torch.randint(1, 20, (2, 9), generator=torch.Generator().manual_seed(3))
fits = {"psf-random-fitted": {"method": "psf-random", "p": 2, "m": 9, "seed": 4, "options": {}},
        "mlp-fitted": {"method": "mlp", "p": 2, "m": 6, "seed": 4, "options": {"steps": 5}},
        "elementwise-fitted": {"method": "elementwise", "p": 2, "m": 6, "seed": 4, "options": {"steps": 5}}}
kw = dict(window=3, sinks=1)
for name, fitted in fits.items():
    if (out / name).exists():
        continue
    model = small_llama()
    sketch = sl.fit_sketch(fitted["method"], qk[0], qk[1], p=fitted["p"], m=fitted["m"], seed=fitted["seed"],
                           **fitted["options"]).sketch
    convert_attention(model, feature_map=sketch, **kw)
    save_trained(model, name, small_ids, {"options": kw, "fit": fitted, "qk_seed": 5})  # a plain sketch's buffers
    # stay its draw
# conversions with a fitted *registered* map (fit_sketch("psf-learned" | "hedgehog")): at acaf206 the fit was a
# FeatureMapSketch whose maps hold all its heads. One SketchMap adapter per layer, shared by q and k, held it (of a
# fit of batch [L, H], layer l's selection: HeadSelection of heads l·H .. l·H + H - 1), so the keys too went through
# the fit's query map (feature_map_q.sketch.map_q.[inner.]*; the fitted key map, feature_map_q.sketch.map_k.*, saved
# unread). Every converted layer held the same tensors: save_pretrained refused a model of two converted layers
# ("shared tensors"), so such saves have one converted layer: of a 2-layer model with layer 0 kept exact and a fit
# of batch [2, H] (layer 1's heads), of a 1-layer model with a fit of batch [H] (no selection), and of one with a fit
# of batch [] (one map of one head for every head).
registered = {"psf-learned-fitted": {"method": "psf-learned", "p": 2, "m": 4, "seed": 4, "layers": 2, "batch": [2, 2],
                                     "options": {"steps": 5, "hidden": 8},
                                     "convert": {"window": 3, "sinks": 1, "exact_layers": [0]}},
              "hedgehog-fitted": {"method": "hedgehog", "p": 2, "m": 6, "seed": 4, "layers": 1, "batch": [2],
                                  "options": {"steps": 5}, "convert": {"window": 3, "sinks": 1}},
              "hedgehog-one-map-fitted": {"method": "hedgehog", "p": 2, "m": 6, "seed": 4, "layers": 1, "batch": [],
                                          "options": {"steps": 5}, "convert": {"window": 3, "sinks": 1}}}
for name, fitted in registered.items():
    if (out / name).exists():
        continue
    qk = torch.randn(2, *fitted["batch"], 16, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    sketch = sl.fit_sketch(fitted["method"], qk[0], qk[1], p=fitted["p"], m=fitted["m"], seed=fitted["seed"],
                           **fitted["options"]).sketch
    model = small_llama(fitted["layers"])
    convert_attention(model, feature_map=sketch, **fitted["convert"])
    for s in converted_modules(model):  # one adapter for q and k, its query side: the keys through the fit's map_q
        assert s.feature_map_k is s.feature_map_q and s.feature_map_q.side == "q"
    save_trained(model, name, small_ids, {"options": fitted["convert"], "fit": fitted, "qk_seed": 5})
print("ok")
