"""``capture --gguf`` / ``capture_pretrained(gguf=)`` on a tiny random LLaMA written as a GGUF file in
the test (gguf's ``GGUFWriter``; a byte-level tokenizer of single letters), and the source checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sketchlab.capture import capture_pretrained
from sketchlab.cli import main

VOCAB = ("<unk>", "<s>", "</s>", "Ġ") + tuple("abcdefghijklmnopqrstuvwxyz")  # "Ġ": the byte-level space


def write_tiny_llama_gguf(path, *, layers=2, hidden=16, heads=4, kv_heads=2, ff=24, seed=0):
    """A random LLaMA (GQA) GGUF of float32 tensors with a letter-level tokenizer, as llama.cpp names them."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_rope_dimension_count(hidden // heads)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(VOCAB))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(list(VOCAB))
    w.add_token_types([1] * len(VOCAB))
    w.add_token_scores([0.0] * len(VOCAB))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    kv = kv_heads * (hidden // heads)

    def rand(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.3).astype(np.float32))

    rand("token_embd.weight", len(VOCAB), hidden)
    for i in range(layers):
        rand(f"blk.{i}.attn_q.weight", hidden, hidden)
        rand(f"blk.{i}.attn_k.weight", kv, hidden)
        rand(f"blk.{i}.attn_v.weight", kv, hidden)
        rand(f"blk.{i}.attn_output.weight", hidden, hidden)
        rand(f"blk.{i}.ffn_gate.weight", ff, hidden)
        rand(f"blk.{i}.ffn_up.weight", ff, hidden)
        rand(f"blk.{i}.ffn_down.weight", hidden, ff)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    rand("output.weight", len(VOCAB), hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_capture_gguf_equals_capture_of_the_loaded_model(tmp_path, capsys):
    from sketchlab.capture import capture_qk
    from sketchlab.hf.pretrained import load_pretrained
    from sketchlab.io import load_qk

    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "t.txt").write_text("the cat sat on the mat and the dog hid under it " * 3)
    rc = main(["capture", "--gguf", str(tmp_path / "tiny.gguf"), "--text", str(tmp_path / "t.txt"), "--max-tokens", "40",
               "--seq-len", "16", "--out", str(tmp_path / "d.safetensors"), "--no-progress"])
    assert rc == 0 and "in 3 sequence(s) (post-rope)" in capsys.readouterr().out
    dump = capture_pretrained(gguf=tmp_path / "tiny.gguf", text=tmp_path / "t.txt", max_tokens=40, seq_len=16)
    assert dump.q.shape == (2, 4, 40, 4) and "tiny.gguf (llama)" in dump.meta["source"]
    # the same model and tokens, captured directly: identical (post-RoPE, GQA heads repeated)
    model, tok = load_pretrained(gguf=tmp_path / "tiny.gguf")
    ids = tok((tmp_path / "t.txt").read_text())["input_ids"][:40]
    inputs = {"input_ids": torch.tensor([ids[:16], ids[16:32], ids[32:] + [0] * 8]),
              "attention_mask": torch.tensor([[1] * 16, [1] * 16, [1] * 8 + [0] * 8])}
    want = capture_qk(model, inputs)
    torch.testing.assert_close(dump.q, want.q, atol=0, rtol=0)
    torch.testing.assert_close(dump.k, want.k, atol=0, rtol=0)
    saved = load_qk(tmp_path / "d.safetensors")
    torch.testing.assert_close(saved.q, dump.q, atol=0, rtol=0)


def _rc(argv):
    try:
        return main(argv)
    except SystemExit as err:  # argparse's own refusals
        return err.code


def test_capture_gguf_refusals(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("some text")
    assert _rc(["capture", "--gguf", str(tmp_path / "none.gguf"), "--text", str(tmp_path / "t.txt"),
                "--out", str(tmp_path / "d.safetensors"), "--no-progress"]) == 2
    assert "--gguf" in capsys.readouterr().err and not (tmp_path / "d.safetensors").exists()
    assert _rc(["capture", "--gguf", "a.gguf", "--model-dir", str(tmp_path), "--text", str(tmp_path / "t.txt"),
                "--out", str(tmp_path / "d.safetensors")]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert _rc(["capture", "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "d.safetensors")]) == 2
    assert "one of the arguments --model-dir --gguf is required" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exactly one of model_dir .* or gguf"):
        capture_pretrained(tmp_path, gguf=tmp_path / "x.gguf", text=tmp_path / "t.txt")
    with pytest.raises(ValueError, match="exactly one of model_dir .* or gguf"):
        capture_pretrained(text=tmp_path / "t.txt")
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        capture_pretrained(gguf=tmp_path / "x.gguf", text=tmp_path / "t.txt")


def test_linearize_gguf_cli_round_trip(tmp_path, capsys):
    import json

    from sketchlab.convert import load_linearized
    from sketchlab.convert.scale import TiedLLoPSMap
    from sketchlab.hf.pretrained import load_pretrained

    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "t.txt").write_text("the cat sat on the mat and the dog hid under it " * 6)
    out = tmp_path / "lin"
    rc = main(["linearize", "--gguf", str(tmp_path / "tiny.gguf"), "--text", str(tmp_path / "t.txt"), "--m", "4",
               "--window", "4", "--sinks", "1", "--seq-len", "32", "--transfer-steps", "2", "--no-fit",
               "--out", str(out), "--no-progress"])
    assert rc == 0 and "held-out perplexity: teacher" in capsys.readouterr().out
    summary = json.loads((out / "linearize.json").read_text())
    assert [s["name"] for s in summary["stages"]] == ["init", "transfer"] and summary["settings"]["gate_init"] == "search"
    model, _ = load_pretrained(gguf=tmp_path / "tiny.gguf")
    fresh = load_linearized(out / "model", model)
    sketch = fresh.model.layers[0].self_attn.sketch
    assert isinstance(sketch.map_q, TiedLLoPSMap) and sketch.gate.abs().max() > 0.1  # tied, gates searched
    ids = torch.tensor([[5, 6, 7, 3, 8, 9, 10, 3, 11, 12]])
    again = load_linearized(out / "model", load_pretrained(gguf=tmp_path / "tiny.gguf")[0])
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, again(input_ids=ids).logits, atol=0, rtol=0)
