"""Model families in one table (``sketchlab.convert.families.FAMILY_TABLE``): OPT, added as one entry, converts
with ``window >= T`` to its teacher's logits (float64 round-off, as tests/test_convert.py checks for Llama),
capture finds its projections, and its LoRA targets are exactly the q, k, v and output projections.

Tolerance: 1e-10 on float64 logits (the converted forward repeats the teacher's arithmetic in another order).
"""

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import sketchlab as sl  # noqa: E402
from sketchlab.capture import capture_qk, detect_qk_modules  # noqa: E402
from sketchlab.convert.families import FAMILIES, FAMILY_TABLE, attention_sites, family_of  # noqa: E402


def _opt():
    cfg = transformers.OPTConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, ffn_dim=48, num_attention_heads=4,
                                 max_position_embeddings=64, word_embed_proj_dim=32, attn_implementation="sdpa")
    torch.manual_seed(3)
    return transformers.OPTForCausalLM(cfg).double().eval()


def test_opt_with_a_window_over_every_token_is_its_teacher():
    model = _opt()
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits
    assert family_of(model) == "opt" and FAMILIES["opt"] == ("opt",)
    sl.convert_attention(model, attention="hedgehog", m=4, window=ids.shape[1], sinks=0, eps=0.0)
    with torch.no_grad():
        ours = model(ids).logits
    assert (ours - want).abs().max() < 1e-10


def test_opt_sites_capture_and_lora_targets_come_from_its_entry():
    model = _opt()
    family, sites = attention_sites(model)
    assert family == "opt" and [s.name for s in sites] == [f"model.decoder.layers.{i}.self_attn" for i in range(2)]
    assert all((s.heads, s.kv_heads, s.head_dim, s.causal) == (4, 4, 8, True) for s in sites)
    kind, found = detect_qk_modules(model, projections=True)
    assert found["k"] == [f"model.decoder.layers.{i}.self_attn.k_proj" for i in range(2)]
    dump = capture_qk(model, {"input_ids": torch.randint(0, 50, (1, 5))})
    assert dump.q.shape == (2, 4, 5, 8) and dump.meta["captured"] == "attention-inputs"  # no rotary: the inputs
    targets = [n for n, _ in model.named_modules() if re.fullmatch(FAMILY_TABLE["opt"].lora, n)]
    assert sorted({n.rsplit(".", 1)[-1] for n in targets}) == ["k_proj", "out_proj", "q_proj", "v_proj"]
    assert len(targets) == 8


def test_a_fit_converts_a_model_as_llops_does():
    """``convert_attention(feature_map=fit)``: an ``[L, H]`` MLP fit gives each layer its own maps (``fit.layer``),
    a ``[H]`` fit (PSF) its maps at every layer, each layer a copy of its own."""
    model = _opt()
    q, k = torch.randn(2, 4, 30, 8, dtype=torch.float64) * 0.5, torch.randn(2, 4, 30, 8, dtype=torch.float64) * 0.5
    mlp = sl.fit_sketch("mlp", q, k, p=2, m=6, steps=3)
    layers = sl.convert_attention(model, feature_map=mlp, window=4)
    x = torch.randn(1, 5, 4, 8, dtype=torch.float64)
    with torch.no_grad():  # layer 1's heads are the fit's heads 4..7
        for layer in (0, 1):
            want_q, want_k = mlp.layer(layer)
            torch.testing.assert_close(layers[layer].map_q.features(x).double(), want_q.features(x).double())
            torch.testing.assert_close(layers[layer].map_k.features(x).double(), want_k.features(x).double())
        assert float((layers[1].map_q.features(x) - mlp.layer(0)[0].features(x)).abs().max()) > 1e-6
    ids = torch.randint(0, 50, (1, 7))
    assert torch.isfinite(model(ids).logits).all()
    psf = sl.fit_sketch("psf-random", q[0], k[0], p=2, m=9)
    model = _opt()
    layers = sl.convert_attention(model, feature_map=psf, window=4)
    assert layers[0].map_q is not layers[1].map_q  # a copy per layer
    with torch.no_grad():
        torch.testing.assert_close(layers[1].map_q.features(x).double(), psf.map_q.features(x).double())
    assert torch.isfinite(model(ids).logits).all()
    with pytest.raises(ValueError, match=r"the fit's maps of layer 0 have heads=2.*the model's attention has heads=4"):
        sl.convert_attention(_opt(), feature_map=sl.fit_sketch("psf-random", q[0, :2], k[0, :2], p=2, m=9))
