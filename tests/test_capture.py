"""capture_qk: hooks on tiny random BERT / GPT-2 / LLaMA (GQA) models and on sketchlab's own model,
each compared with q/k/v computed by hand from the same weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers  # the optional "capture" extra; part of the dev install
from torch import nn

from sketchlab.capture import capture_qk, detect_qk_modules
from sketchlab.io import load_qk
from sketchlab.tasks.model import TransformerConfig, TransformerLM, apply_rope

# The hand computation repeats the model's float32 matmuls with the same weights but possibly a
# different summation order (fused kernels, addmm vs matmul), so agreement is to float32
# round-off: a few ulps of values of size O(1) -> atol 1e-5, rtol 1e-5.
TOL = dict(rtol=1e-5, atol=1e-5)
B, T = 2, 7


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _to_dump_layout(x: torch.Tensor, heads: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, heads·D] -> [H, n, D] over valid tokens in batch order (the dump's token axis)."""
    x = x.reshape(x.shape[0], x.shape[1], heads, -1)  # [B, T, H, D]
    valid = torch.ones(x.shape[:2], dtype=torch.bool) if valid is None else valid.bool()
    return x[valid].transpose(0, 1)  # [H, n, D]


def test_bert_query_key_value():
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=24, num_hidden_layers=3, num_attention_heads=3,
                                  intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    ids = _tokens(40)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0  # padding in sequence 1: its last two tokens must not appear in the dump
    dump = capture_qk(model, {"input_ids": ids, "attention_mask": mask})
    n = int(mask.sum())
    assert dump.q.shape == dump.k.shape == dump.v.shape == (3, 3, n, 8)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for layer in range(3):
        attn = model.encoder.layer[layer].attention.self
        x = hidden[layer]  # input of layer `layer`
        q = x @ attn.query.weight.T + attn.query.bias  # by hand: [B, T, 24]
        k = x @ attn.key.weight.T + attn.key.bias
        v = x @ attn.value.weight.T + attn.value.bias
        torch.testing.assert_close(dump.q[layer], _to_dump_layout(q, 3, mask), **TOL)
        torch.testing.assert_close(dump.k[layer], _to_dump_layout(k, 3, mask), **TOL)
        torch.testing.assert_close(dump.v[layer], _to_dump_layout(v, 3, mask), **TOL)
    # by default through the attention interface (what the attention receives); BERT has no
    # rotary embedding, so the projection hooks capture the same tensors
    assert dump.meta["scale"] == "none" and dump.meta["captured"] == "attention-inputs"
    assert json.loads(dump.meta["tokens"]) == [7, 5]
    hooks = capture_qk(model, {"input_ids": ids, "attention_mask": mask}, point="projections")
    assert hooks.meta["captured"] == "projections"
    for role in "qkv":
        torch.testing.assert_close(getattr(hooks, role), getattr(dump, role), **TOL)


def test_gpt2_fused_c_attn_split():
    cfg = transformers.GPT2Config(vocab_size=40, n_embd=32, n_layer=4, n_head=4, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(1)
    model = transformers.GPT2Model(cfg).eval()
    ids = _tokens(40, seed=1)
    kind, names = detect_qk_modules(model)
    assert kind == "projections" and names == {"qkv": [f"h.{i}.attn.c_attn" for i in range(4)]}
    dump = capture_qk(model, ids)
    assert dump.q.shape == (4, 4, B * T, 8)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    for layer in range(4):
        block = model.h[layer]
        x = F.layer_norm(hidden[layer], (32,), block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
        qkv = x @ block.attn.c_attn.weight + block.attn.c_attn.bias  # Conv1D: weight is [in, out]
        q, k, v = qkv[..., :32], qkv[..., 32:64], qkv[..., 64:]
        torch.testing.assert_close(dump.q[layer], _to_dump_layout(q, 4), **TOL)
        torch.testing.assert_close(dump.k[layer], _to_dump_layout(k, 4), **TOL)
        torch.testing.assert_close(dump.v[layer], _to_dump_layout(v, 4), **TOL)


def test_llama_grouped_query_repeat():
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=16)
    torch.manual_seed(2)
    model = transformers.LlamaModel(cfg).eval()
    ids = _tokens(40, seed=2)
    dump = capture_qk(model, ids, point="projections")
    assert dump.q.shape == dump.k.shape == dump.v.shape == (3, 4, B * T, 8)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    for layer in range(3):
        block = model.layers[layer]
        h = hidden[layer]
        ln = block.input_layernorm  # RMSNorm by hand
        x = ln.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ln.variance_epsilon))
        q = x @ block.self_attn.q_proj.weight.T  # [B, T, 4·8]
        k = x @ block.self_attn.k_proj.weight.T  # [B, T, 2·8]: 2 kv heads
        kh = _to_dump_layout(k, 2)  # [2, n, 8]
        torch.testing.assert_close(dump.q[layer], _to_dump_layout(q, 4), **TOL)
        # q heads 0,1 share kv head 0 and q heads 2,3 kv head 1 (transformers' repeat_kv)
        for h_q in range(4):
            torch.testing.assert_close(dump.k[layer, h_q], kh[h_q // 2], **TOL)
    assert dump.meta["captured"] == "pre-rope"
    # num_heads alone must still take the 2 kv heads from the config (k was split into 4 heads
    # of width 4 before): the dump is identical to the fully automatic one
    explicit = capture_qk(model, ids, num_heads=4, point="projections")
    assert explicit.k.shape == (3, 4, B * T, 8)
    torch.testing.assert_close(explicit.k, dump.k, rtol=0, atol=0)
    torch.testing.assert_close(explicit.v, dump.v, rtol=0, atol=0)
    # a wrong explicit kv head count is caught with the split it used, not returned as a bad dump
    with pytest.raises(ValueError, match=r"captured q has head dimension 8 but k has 4 "
                                         r"\(split with num_heads=4, num_kv_heads=4\)"):
        capture_qk(model, ids, num_heads=4, num_kv_heads=4, point="projections")


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_llama_post_rope_equals_transformers_rotary(implementation):
    """The default capture of a rotary model is q, k after transformers' own apply_rotary_pos_emb
    (GQA k heads repeated), and the model's outputs are unchanged by the recording function."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=16,
                                   attn_implementation=implementation)
    torch.manual_seed(2)
    model = transformers.LlamaModel(cfg).eval()
    ids = _tokens(40, seed=2)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 6:] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
    dump = capture_qk(model, {"input_ids": ids, "attention_mask": mask})
    assert dump.meta["captured"] == "post-rope" and json.loads(dump.meta["tokens"]) == [6, 7]
    assert model.config._attn_implementation == implementation  # restored
    positions = torch.arange(T)[None].expand(B, T)
    cos, sin = model.rotary_emb(out.hidden_states[0], positions)  # [B, T, D]
    for layer in range(3):
        block = model.layers[layer]
        x = block.input_layernorm(out.hidden_states[layer])
        q = block.self_attn.q_proj(x).view(B, T, 4, 8).transpose(1, 2)  # [B, H, T, D]
        k = block.self_attn.k_proj(x).view(B, T, 2, 8).transpose(1, 2)  # [B, H_kv, T, D]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(2, dim=1)  # transformers' repeat_kv: q head h uses kv head h // 2
        to_dump = lambda x: x.transpose(1, 2)[mask.bool()].transpose(0, 1)  # noqa: E731  [H, n, D]
        torch.testing.assert_close(dump.q[layer], to_dump(q), **TOL)
        torch.testing.assert_close(dump.k[layer], to_dump(k), **TOL)
    # the pre-RoPE capture differs from it beyond position 0 (RoPE rotates every later token)
    pre = capture_qk(model, {"input_ids": ids, "attention_mask": mask}, point="projections")
    assert float((pre.q - dump.q).abs().max()) > 1e-2
    with torch.no_grad():
        again = model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(again, out.last_hidden_state, rtol=0, atol=0)


def test_sketchlab_model_captures_post_rope_kernel_inputs(tmp_path):
    torch.manual_seed(3)
    model = TransformerLM(TransformerConfig(vocab_size=30, d_model=32, n_heads=2, n_layers=3))
    ids = _tokens(30, seed=3)
    dump = capture_qk(model, ids, path=tmp_path / "m.safetensors")
    assert dump.q.shape == (3, 2, B * T, 16)
    back = load_qk(tmp_path / "m.safetensors")
    torch.testing.assert_close(back.q, dump.q, rtol=0, atol=0)
    assert back.meta["captured"] == "post-rope"
    x = model.embed(ids)
    with torch.no_grad():
        for layer, block in enumerate(model.blocks):
            a = block.attention
            h = block.ln_1(x)
            q = apply_rope((h @ a.q_proj.weight.T).view(B, T, 2, 16))
            k = apply_rope((h @ a.k_proj.weight.T).view(B, T, 2, 16))
            torch.testing.assert_close(dump.q[layer], _to_dump_layout(q.flatten(2), 2), **TOL)
            torch.testing.assert_close(dump.k[layer], _to_dump_layout(k.flatten(2), 2), **TOL)
            x = block(x)


class _TwoLayer(nn.Module):
    """A model no pattern recognises: explicit modules are required."""

    def __init__(self):
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))  # q0, k0, q1, k1

    def forward(self, x):
        for lin in self.a:
            x = torch.tanh(lin(x))
        return x


def test_explicit_modules_and_errors():
    torch.manual_seed(4)
    model = _TwoLayer()
    x = torch.randn(B, T, 6)
    with pytest.raises(ValueError, match="could not find the q/k projections of _TwoLayer"):
        capture_qk(model, x)
    dump = capture_qk(model, x, modules={"q": ["a.0", model.a[2]], "k": ["a.1", "a.3"]}, num_heads=2)
    assert dump.v is None and dump.q.shape == (2, 2, B * T, 3)
    with torch.no_grad():
        h0 = torch.tanh(model.a[0](x))
        k0 = model.a[1](h0)
    torch.testing.assert_close(dump.k[0], _to_dump_layout(k0, 2), **TOL)
    with pytest.raises(ValueError, match="no submodule named 'nope'"):
        capture_qk(model, x, modules={"q": ["nope"], "k": ["a.1"]}, num_heads=2)
    with pytest.raises(ValueError, match="one module per layer for every role"):
        capture_qk(model, x, modules={"q": ["a.0", "a.2"], "k": ["a.1"]}, num_heads=2)
    with pytest.raises(ValueError, match="num_heads is required"):
        capture_qk(model, x, modules={"q": ["a.0"], "k": ["a.1"]})
    with pytest.raises(ValueError, match="output width 6 is not divisible by 4 heads"):
        capture_qk(model, x, modules={"q": ["a.0"], "k": ["a.1"]}, num_heads=4)
    with pytest.raises(ValueError, match="keys q, k"):
        capture_qk(model, x, modules={"query": ["a.0"]}, num_heads=2)
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1, got 0"):
        capture_qk(model, x, modules={"q": ["a.0"], "k": ["a.1"]}, num_heads=0)
    with pytest.raises(TypeError, match=r"num_kv_heads must be an integer >= 1, got 1\.5"):
        capture_qk(model, x, modules={"q": ["a.0"], "k": ["a.1"]}, num_heads=2, num_kv_heads=1.5)


def test_returned_dump_is_validated_without_path():
    # a layer whose output overflows to inf: the in-memory dump (no path) must be rejected as
    # save_qk / load_qk would reject the file
    torch.manual_seed(6)
    model = _TwoLayer()
    x = torch.randn(B, T, 6)
    with torch.no_grad():
        model.a[1].weight.fill_(float("inf"))
    with pytest.raises(ValueError, match=r"capture_qk: captured: tensor k must be finite: \d+ non-finite"):
        capture_qk(model, x, modules={"q": ["a.0"], "k": ["a.1"]}, num_heads=2)
    # q and k of different head dimensions (explicit modules of different widths) are rejected
    wide = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 4))
    with pytest.raises(ValueError, match="captured q has head dimension 3 but k has 2"):
        capture_qk(wide, x, modules={"q": ["0"], "k": ["1"]}, num_heads=2)


# ---------------------------------------------------------------------------------------------
# a local model directory (save_pretrained) with and without a tokenizer


def _save_tiny_gpt2(directory, *, with_tokenizer: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "."]
    cfg = transformers.GPT2Config(vocab_size=len(words), n_embd=16, n_layer=3, n_head=2, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(5)
    model = transformers.GPT2Model(cfg).eval()
    model.save_pretrained(directory)
    if with_tokenizer:
        tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)
    return model, words


def test_capture_pretrained_from_text(tmp_path):
    from sketchlab.capture import capture_pretrained

    model, words = _save_tiny_gpt2(tmp_path / "m", with_tokenizer=True)
    (tmp_path / "t.txt").write_text("the cat sat on the mat . a dog ran on the mat .\n")
    dump = capture_pretrained(tmp_path / "m", text=tmp_path / "t.txt", max_tokens=8, path=tmp_path / "d.safetensors")
    ids = torch.tensor([[words.index(w) for w in "the cat sat on the mat . a".split()]])  # first 8 tokens
    expect = capture_qk(model, ids)  # the in-process model the directory was saved from
    assert dump.q.shape == (3, 2, 8, 8)
    torch.testing.assert_close(dump.q, expect.q, rtol=0, atol=0)
    torch.testing.assert_close(dump.k, expect.k, rtol=0, atol=0)
    back = load_qk(tmp_path / "d.safetensors")
    torch.testing.assert_close(back.v, expect.v, rtol=0, atol=0)
    assert back.meta["source"] == "m (gpt2) on text t.txt"


def test_capture_pretrained_splits_long_text(tmp_path):
    """A text longer than seq_len becomes several sequences (meta "tokens"), max_tokens in all, each
    captured as if alone (attention and positions restart at every piece)."""
    from sketchlab.capture import capture_pretrained, split_sequences

    model, words = _save_tiny_gpt2(tmp_path / "m", with_tokenizer=True)
    text = "the cat sat on the mat . a dog ran on the mat ."
    (tmp_path / "t.txt").write_text(text + "\n")
    dump = capture_pretrained(tmp_path / "m", text=tmp_path / "t.txt", max_tokens=12, seq_len=5)
    assert json.loads(dump.meta["tokens"]) == [5, 5, 2] and dump.q.shape == (3, 2, 12, 8)
    ids = [words.index(w) for w in text.split()]
    start = 0
    for piece in (ids[:5], ids[5:10], ids[10:12]):
        alone = capture_qk(model, torch.tensor([piece]))
        n = len(piece)
        torch.testing.assert_close(dump.k[:, :, start:start + n], alone.k, **TOL)
        start += n
    got_ids, got_mask = split_sequences([[1, 2, 3], [4, 5, 6, 7, 8]], seq_len=2, max_tokens=6)
    assert got_ids.tolist() == [[1, 2], [3, 0], [4, 5], [6, 0]] and got_mask.sum(1).tolist() == [2, 1, 2, 1]


def test_capture_pretrained_from_token_ids_without_tokenizer(tmp_path):
    from sketchlab.capture import capture_pretrained

    model, _ = _save_tiny_gpt2(tmp_path / "m", with_tokenizer=False)
    (tmp_path / "ids.txt").write_text("1 2 3 4 5\n\n6 7 8\n")
    dump = capture_pretrained(tmp_path / "m", token_ids=tmp_path / "ids.txt")
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    expect = capture_qk(model, {"input_ids": ids, "attention_mask": mask})
    assert dump.q.shape == (3, 2, 8, 8)  # 5 + 3 valid tokens, padding dropped
    torch.testing.assert_close(dump.q, expect.q, rtol=0, atol=0)
    (tmp_path / "t.txt").write_text("the cat")
    with pytest.raises(ValueError, match="no tokenizer in the model directory"):
        capture_pretrained(tmp_path / "m", text=tmp_path / "t.txt")
    (tmp_path / "bad.txt").write_text("1 2 x\n")
    with pytest.raises(ValueError, match=r"bad.txt:1: token ids must be whitespace-separated integers"):
        capture_pretrained(tmp_path / "m", token_ids=tmp_path / "bad.txt")
    (tmp_path / "big.txt").write_text("1 99\n")
    with pytest.raises(ValueError, match="token id 99 is outside the model's vocabulary of 10"):
        capture_pretrained(tmp_path / "m", token_ids=tmp_path / "big.txt")
    with pytest.raises(ValueError, match="exactly one of text"):
        capture_pretrained(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="not a transformers model directory"):
        capture_pretrained(tmp_path, token_ids=tmp_path / "ids.txt")


def test_cli_capture(tmp_path, capsys):
    from sketchlab.cli import main

    model, _ = _save_tiny_gpt2(tmp_path / "m", with_tokenizer=True)
    (tmp_path / "t.txt").write_text("the cat sat on the mat")
    out = tmp_path / "d.npz"
    assert main(["capture", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--out", str(out)]) == 0
    assert "q, k, v of shape [L=3, H=2, n=6, d=8]" in capsys.readouterr().out
    ids = torch.tensor([[1, 2, 3, 4, 1, 5]])  # "the cat sat on the mat"
    torch.testing.assert_close(load_qk(out).k, capture_qk(model, ids).k, rtol=0, atol=0)
    # errors: one line on stderr, exit status 2, no traceback
    assert main(["capture", "--model-dir", str(tmp_path / "m"), "--out", str(out)]) == 2
    assert "one of the arguments --text --token-ids is required" in capsys.readouterr().err
    code = main(["capture", "--model-dir", str(tmp_path / "nodir"), "--token-ids", str(tmp_path / "t.txt"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("sketchlab: error: ") and "not a transformers model directory" in err
    assert err.count("\n") == 1
