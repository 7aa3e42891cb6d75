"""Recall measures (``sketchlab.evaluate``) and ``sketchlab evaluate`` on tiny random models.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on the prompt's own sentences
(a LLaMA-style BOS added by its post-processor, so the prefix handling is exercised), the models are
a tiny random LLaMA (converted and not) and the toy :class:`TransformerLM`. Where a random model's
output says nothing (it never finds a key), stubs with known behaviour stand in: a ``generate`` that
echoes the key or never does, and an *induction oracle* whose next-token losses are written out by hand.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import transformers

import sketchlab.convert.cache as cache_mod
from sketchlab.cli import main
from sketchlab.convert import convert_attention, save_linearized, token_nll
from sketchlab.evaluate import (
    DEFAULT_FILLER,
    NEEDLE,
    QUESTION,
    copy_recall,
    format_recall,
    passkey_accuracy,
    passkey_prompt,
)
from sketchlab.tasks.model import TransformerConfig, TransformerLM

BOS = "<s>"


def _tokenizer(bos: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[BOS], show_progress=False)
    tok.train_from_iterator([DEFAULT_FILLER, NEEDLE.format(key=12345), QUESTION], trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS)


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


def _llama(vocab: int, seed: int = 0):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=1024,
                                   bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _find(ids: list, part: list) -> list[int]:
    return [i for i in range(len(ids) - len(part) + 1) if ids[i:i + len(part)] == part]


# ------------------------------------------------------------------------------------------------
# passkey_prompt


def _sentences(tok):
    return [_enc(tok, " " + s) for s in re.split(r"(?<=\.)\s+", DEFAULT_FILLER)]


@pytest.mark.parametrize("length", [88, 151, 400])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_passkey_prompt_has_the_length_and_puts_the_key_at_the_depth(tok, length, depth):
    """``length`` tokens exactly (BOS + filler + needle + question); the needle starts at a sentence
    boundary of the filler within half a sentence of ``depth · F``; the filler around it is the
    sentences in order."""
    ids = passkey_prompt(tok, length, depth, 40321).tolist()
    needle, question = _enc(tok, " " + NEEDLE.format(key=40321)), _enc(tok, " " + QUESTION)
    sentences = _sentences(tok)
    F = length - 1 - len(needle) - len(question)  # filler tokens
    assert len(ids) == length
    assert ids[0] == tok.bos_token_id and ids[-len(question):] == question
    at = _find(ids, needle)
    assert len(at) == 1
    at = at[0]
    # the needle's start in filler tokens is within half the longest sentence of the exact depth
    assert abs((at - 1) - depth * F) <= max(len(s) for s in sentences) / 2
    # at a sentence boundary: the filler before it ends a sentence (or there is none)
    before = tok.decode(ids[1:at])
    assert before == "" or before.endswith(".")
    # the filler is the sentences in order, its front cut (the first sentence may be partial)
    filler = tok.decode(ids[1:at] + ids[at + len(needle):-len(question)])
    assert ((" " + DEFAULT_FILLER) * 40).endswith(filler)
    assert len(ids[1:at] + ids[at + len(needle):-len(question)]) == F


def test_passkey_prompt_key_far_from_the_other_depth(tok):
    """Depth 0.1 and 0.9 put the key near the front and the back (not mirrored)."""
    needle = _enc(tok, " " + NEEDLE.format(key=11111))
    front = _find(passkey_prompt(tok, 400, 0.1, 11111).tolist(), needle)[0]
    back = _find(passkey_prompt(tok, 400, 0.9, 11111).tolist(), needle)[0]
    assert front < 400 * 0.2 and back > 400 * 0.7


def test_passkey_prompt_minimum_length_is_named(tok):
    needle, question = _enc(tok, " " + NEEDLE.format(key=12345)), _enc(tok, " " + QUESTION)
    minimum = 1 + len(needle) + len(question) + sum(len(s) for s in _sentences(tok))
    assert len(passkey_prompt(tok, minimum, 0.5, 12345)) == minimum
    with pytest.raises(ValueError, match=rf"length={minimum - 1} is too short .* at least {minimum} tokens"):
        passkey_prompt(tok, minimum - 1, 0.5, 12345)


def test_passkey_prompt_without_special_tokens_and_with_callables(tok):
    plain = _tokenizer(bos=False)
    ids = passkey_prompt(plain, 100, 0.5, 12345)
    assert len(ids) == 100 and int(ids[0]) != plain.bos_token_id
    codec = (lambda s: list(s.encode("utf-8")), lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    text = codec[1](passkey_prompt(codec, 300, 0.5, "00042").tolist())
    assert len(text.encode()) == 300 and text.endswith(" " + QUESTION) and NEEDLE.format(key="00042") in text


# ------------------------------------------------------------------------------------------------
# passkey_accuracy


def _echo(tok, *, change=None):
    """A ``generate`` that answers with the prompt's key (``change``: one digit replaced by it) or,
    with ``change="never"``, with filler."""

    def generate(input_ids, attention_mask=None, generation_config=None, **kwargs):
        assert input_ids.shape[0] == 1 and generation_config.do_sample is False
        key = re.search(r"The pass key is (\d+)\.", tok.decode(input_ids[0])).group(1)
        if change == "never":
            answer = " The grass is green."
        elif change is not None:
            answer = f" {change}{key[1:]}."
        else:
            answer = f" {key}. Remember"
        new = torch.tensor([_enc(tok, answer)[: generation_config.max_new_tokens]])
        return torch.cat([input_ids, new], 1)

    return generate


@pytest.mark.parametrize("change,rate", [(None, 1.0), ("never", 0.0), ("0", 0.0)])
def test_passkey_accuracy_scores_the_continuation_only(tok, monkeypatch, change, rate):
    """An echo of the key scores 1; filler, or the key with its first digit wrong, 0 — although the
    prompt holds the key: only the continuation is read."""
    model = _llama(len(tok))
    monkeypatch.setattr(model, "generate", _echo(tok, change=change))
    res = passkey_accuracy(model, tok, lengths=(90, 130), depths=(0.1, 0.9), n=3, seed=7)
    assert res.overall == rate
    assert set(res.rate) == {(90, 0.1), (90, 0.9), (130, 0.1), (130, 0.9)}
    assert all(r == rate for r in res.rate.values())
    assert all(len(res.generated[c]) == len(res.keys[c]) == len(res.hits[c]) == 3 for c in res.rate)
    if change is None:
        assert all(g.startswith(f" {k}") for c in res.rate for g, k in zip(res.generated[c], res.keys[c]))
    keys = [k for c in res.rate for k in res.keys[c]]
    assert len(set(keys)) == len(keys) and all(len(k) == 5 for k in keys)
    again = passkey_accuracy(model, tok, lengths=(90, 130), depths=(0.1, 0.9), n=3, seed=7)
    assert again.keys == res.keys  # same seed, same keys


def test_passkey_accuracy_on_the_converted_llama_decodes_from_its_state(tok, monkeypatch):
    model = _llama(len(tok))
    convert_attention(model, attention="hedgehog", m=8, window=8)
    updates = []
    real = cache_mod.StateLayer.update

    def spy(self, *args, **kwargs):
        updates.append(args[0].shape[-2])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cache_mod.StateLayer, "update", spy)
    res = passkey_accuracy(model, tok, lengths=(100, 140), depths=(0.5,), n=2, max_new_tokens=3)
    assert set(res.hits) == {(100, 0.5), (140, 0.5)}
    assert all(len(res.generated[c]) == 2 and all(isinstance(g, str) for g in res.generated[c]) for c in res.hits)
    assert 0.0 <= res.overall <= 1.0
    # per prompt and layer: the prompt once, then one token per step (2 layers, 4 prompts, 3 new tokens)
    assert sorted(set(updates)) == [1, 100, 140] and updates.count(1) == 2 * 4 * 2


def test_passkey_accuracy_on_the_toy_model_runs_through_its_generate(monkeypatch):
    import sketchlab.tasks.model as toy_mod

    torch.manual_seed(3)
    model = TransformerLM(TransformerConfig(vocab_size=256, d_model=16, n_heads=2, n_layers=1))
    convert_attention(model, attention="hedgehog", m=4, window=16)
    calls = []
    real = toy_mod.generate
    monkeypatch.setattr(toy_mod, "generate", lambda m, p, k: calls.append(p.shape) or real(m, p, k))
    codec = (lambda s: list(s.encode("utf-8")), lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    res = passkey_accuracy(model, codec, lengths=(250,), depths=(0.0, 1.0), n=2, max_new_tokens=4)
    assert calls == [torch.Size([1, 250])] * 4
    assert res.overall == 0.0 and all(len(g) > 0 for c in res.hits for g in res.generated[c])


def test_format_recall_tables(tok, monkeypatch):
    model = _llama(len(tok))
    monkeypatch.setattr(model, "generate", _echo(tok))
    res = passkey_accuracy(model, tok, lengths=(90,), depths=(0.1, 0.5), n=2)
    text = format_recall(res, title="t")
    assert text.startswith("# t\n")
    assert "| 90 | 1.00 (2/2) | 1.00 (2/2) | 1.00 |" in text and "| all lengths | 1.00 | 1.00 | **1.00** |" in text
    with pytest.raises(ValueError, match="give a PasskeyResult"):
        format_recall()


# ------------------------------------------------------------------------------------------------
# copy_recall


ALPHA, BOOST = 0.01, 5.0


class InductionOracle(TransformerLM):
    """Next-token logits ``−α·v`` for every token ``v``, plus ``BOOST`` on the token that followed the
    previous occurrence of the current token (an induction head with nothing else)."""

    def __init__(self, vocab: int):
        super().__init__(TransformerConfig(vocab_size=vocab, d_model=4, n_heads=1, n_layers=1))

    def forward(self, tokens):
        B, T = tokens.shape
        V = self.config.vocab_size
        logits = (-ALPHA * torch.arange(V, dtype=torch.float64)).expand(B, T, V).clone()
        for b in range(B):
            row = tokens[b].tolist()
            last = {}
            for t, v in enumerate(row):
                if v in last:
                    logits[b, t, row[last[v] + 1]] += BOOST
                last[v] = t
        return logits


def _fresh(v: int, V: int) -> float:
    """NLL of target ``v`` with no earlier occurrence of the current token: α·v + log Σ_u e^{−αu}."""
    return ALPHA * v + math.log(sum(math.exp(-ALPHA * u) for u in range(V)))


def _recalled(v: int, V: int) -> float:
    """NLL of target ``v`` when the oracle boosts it: −(BOOST − α·v) + log(Σ_u e^{−αu} + e^{−αv}(e^BOOST − 1))."""
    z = sum(math.exp(-ALPHA * u) for u in range(V)) + math.exp(-ALPHA * v) * (math.exp(BOOST) - 1)
    return -(BOOST - ALPHA * v) + math.log(z)


def test_copy_recall_scores_each_copy_at_its_exact_positions():
    """Every token of the held-out stream distinct: the first copy's targets have no earlier
    occurrence (loss ``_fresh``), the second copy's targets 2 … P are recalled (``_recalled``); the
    first token of each copy is scored in neither (it would be ``_fresh`` of the passage's first token,
    or of the gap's first token after the first copy)."""
    V, P, gaps = 200, 8, (0, 5, 40)
    x = torch.randperm(V, generator=torch.Generator().manual_seed(1))
    res = copy_recall(InductionOracle(V), x, gaps=gaps, passage=P, n=3, seed=4)
    assert len(res.starts) == 3 and all(0 <= a <= V - P - max(gaps) for a in res.starts)
    for G in gaps:
        want_first, want_second = [], []
        for a, b in zip(res.starts, res.gap_starts[G]):
            assert a + P <= b <= V - G  # the gap after the passage in the text, never overlapping it
            passage = x[a:a + P].tolist()
            want_first.append(sum(_fresh(v, V) for v in passage[1:]) / (P - 1))
            want_second.append(sum(_recalled(v, V) for v in passage[1:]) / (P - 1))
        assert res.first_draws[G] == pytest.approx(want_first, rel=1e-12)
        assert res.second_draws[G] == pytest.approx(want_second, rel=1e-12)
        assert res.first[G] == pytest.approx(sum(want_first) / 3, rel=1e-12)
        assert res.second[G] == pytest.approx(sum(want_second) / 3, rel=1e-12)
    assert res.first[0] == res.first[5] == res.first[40]  # the same passages at every gap


def test_copy_recall_on_the_tiny_llama_matches_token_nll_of_the_sequences(tok):
    """On a real (converted) model: each copy's mean equals token_nll of the rebuilt sequence at the
    copy's positions; the first copy's loss is the same at every gap (causal)."""
    model = _llama(len(tok))
    convert_attention(model, attention="hedgehog", m=8, window=8)
    x = torch.randint(0, len(tok), (120,), generator=torch.Generator().manual_seed(2))
    P = 6
    res = copy_recall(model, x, gaps=(0, 30), passage=P, n=2)
    for G in (0, 30):
        seqs = torch.stack([torch.cat([x[a:a + P], x[b:b + G], x[a:a + P]])
                            for a, b in zip(res.starts, res.gap_starts[G])])
        nll = token_nll(model, seqs, torch.ones_like(seqs))
        assert res.second_draws[G] == pytest.approx(nll[:, P + G:].mean(1).tolist(), rel=1e-9)
        assert res.first_draws[G] == pytest.approx(nll[:, :P - 1].mean(1).tolist(), rel=1e-9)
    assert res.first[0] == pytest.approx(res.first[30], rel=1e-6)


def test_copy_recall_refuses_a_short_text_naming_the_lengths():
    with pytest.raises(ValueError, match=r"has 47 tokens; .* at least passage \+ max\(gaps\) = 8 \+ 40 = 48"):
        copy_recall(InductionOracle(60), torch.arange(47), gaps=(0, 40), passage=8)
    assert copy_recall(InductionOracle(60), torch.arange(48), gaps=(0, 40), passage=8, n=1).starts == [0]


# ------------------------------------------------------------------------------------------------
# refusals (each argument checked once, before the model runs)


def _no_generate(*args, **kwargs):
    raise AssertionError("the model ran before the arguments were checked")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(lengths=(90, 20)), ValueError, r"length=20 is too short .* at least \d+ tokens"),
    (dict(lengths=(0,)), ValueError, r"lengths must be integers >= 1, got 0"),
    (dict(lengths=(90.5,)), TypeError, r"lengths must be integers >= 1, got 90.5 \(float\)"),
    (dict(lengths=()), ValueError, r"lengths must hold at least one value"),
    (dict(lengths=(90, 90)), ValueError, r"lengths must be distinct"),
    (dict(depths=(0.5, 1.2)), ValueError, r"depths must be numbers in \[0, 1\] .* got 1.2"),
    (dict(depths=(float("nan"),)), ValueError, r"depths must be numbers in \[0, 1\]"),
    (dict(depths=0.5), TypeError, r"depths must be a sequence"),
    (dict(n=0), ValueError, r"n must be an integer >= 1, got 0"),
    (dict(max_new_tokens=0), ValueError, r"max_new_tokens must be an integer >= 1"),
    (dict(seed=2**70), ValueError, r"seed must lie in"),
])
def test_passkey_accuracy_refusals(tok, monkeypatch, kwargs, error, match):
    model = _llama(len(tok))
    monkeypatch.setattr(model, "generate", _no_generate)
    args = dict(lengths=(90,), depths=(0.5,), n=1) | kwargs
    with pytest.raises(error, match=match):
        passkey_accuracy(model, tok, **args)


def test_models_that_are_not_causal_lms_are_refused(tok):
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=16))
    with pytest.raises(ValueError, match=r"passkey_accuracy: BertModel \(model_type 'bert'\) is not a causal language "
                                         r"model: an encoder"):
        passkey_accuracy(bert, tok, lengths=(90,), depths=(0.5,), n=1)
    # a language-model head that can generate, but bidirectional attention (is_decoder=False)
    head = transformers.BertLMHeadModel(transformers.BertConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=16))
    assert head.can_generate()
    with pytest.raises(ValueError, match=r"BertLMHeadModel \(model_type 'bert'\) is not a causal language model: an "
                                         r"encoder"):
        copy_recall(head, torch.arange(100), gaps=(0,), passage=4)
    bare = transformers.LlamaModel(_llama(len(tok)).config)
    with pytest.raises(ValueError, match=r"copy_recall: LlamaModel .* no language-model head"):
        copy_recall(bare, torch.arange(100), gaps=(0,), passage=4)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=32, d_model=8, d_ff=8, num_layers=1,
                                                                       num_heads=1, d_kv=8))
    with pytest.raises(ValueError, match=r"T5ForConditionalGeneration \(model_type 't5'\) is not a causal LM of a "
                                         r"supported family"):
        copy_recall(t5, torch.arange(100), gaps=(0,), passage=4)


def test_token_ids_outside_the_vocabulary_are_refused(tok):
    small = _llama(50)  # the tokenizer has 300 tokens
    small.generate = _no_generate
    with pytest.raises(ValueError, match=r"passkey prompt .* holds the token id \d+, outside the model's vocabulary "
                                         r"\[0, 50\)"):
        passkey_accuracy(small, tok, lengths=(90,), depths=(0.5,), n=1)
    with pytest.raises(ValueError, match=r"input_ids holds the token id 50, outside the model's vocabulary \[0, 50\)"):
        copy_recall(small, torch.arange(51), gaps=(0,), passage=4)
    with pytest.raises(ValueError, match=r"input_ids holds the token id -1"):
        copy_recall(small, torch.arange(-1, 49), gaps=(0,), passage=4)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(gaps=(-1,)), ValueError, r"gaps must be integers >= 0, got -1 in \(-1,\)"),
    (dict(gaps=()), ValueError, r"gaps must hold at least one value"),
    (dict(passage=1), ValueError, r"passage must be an integer >= 2"),
    (dict(n=0), ValueError, r"n must be an integer >= 1"),
    (dict(input_ids=torch.zeros(2, 50, dtype=torch.long)), ValueError, r"1-D integer tensor .* \(2, 50\)"),
    (dict(input_ids=torch.zeros(50)), ValueError, r"1-D integer tensor of token ids, got torch.float32"),
])
def test_copy_recall_refusals(kwargs, error, match):
    args = dict(input_ids=torch.arange(50), gaps=(0,), passage=4) | kwargs
    with pytest.raises(error, match=match):
        copy_recall(InductionOracle(60), **args)


# ------------------------------------------------------------------------------------------------
# sketchlab evaluate


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny LLaMA teacher folder, its converted save, a text file, a BERT folder."""
    root = tmp_path_factory.mktemp("evaluate")
    tok = _tokenizer()
    teacher = _llama(len(tok))
    teacher.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    convert_attention(teacher, attention="hedgehog", m=8, window=8)
    save_linearized(teacher, root / "conv")
    tok.save_pretrained(root / "conv")
    words = re.findall(r"\w+", DEFAULT_FILLER + " " + QUESTION)
    gen = torch.Generator().manual_seed(0)
    (root / "text.txt").write_text(" ".join(words[i] for i in torch.randint(0, len(words), (200,), generator=gen)))
    (root / "short.txt").write_text("The grass is green.")
    bert = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=16))
    bert.save_pretrained(root / "bert")
    tok.save_pretrained(root / "bert")
    return root


FAST = ["--passkey-lengths", "100,120", "--depths", "0.5", "--n", "1", "--max-new-tokens", "2", "--gaps", "0,16",
        "--passage", "8", "--copy-n", "2", "--no-progress"]


@pytest.mark.parametrize("which", ["teacher", "converted save", "teacher + --converted"])
def test_cli_evaluate_prints_and_writes_the_tables(saved, tmp_path, capsys, monkeypatch, which):
    layers = []
    real = cache_mod.StateLayer.update
    monkeypatch.setattr(cache_mod.StateLayer, "update", lambda self, *a, **k: layers.append(1) or real(self, *a, **k))
    model = {"teacher": ["--model-dir", str(saved / "teacher")],
             "converted save": ["--model-dir", str(saved / "conv")],
             "teacher + --converted": ["--model-dir", str(saved / "teacher"), "--converted", str(saved / "conv")]}[which]
    out, js = tmp_path / "sub" / "recall.md", tmp_path / "recall.json"
    rc = main(["evaluate", *model, "--text", str(saved / "text.txt"), *FAST, "--out", str(out), "--json", str(js)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "| length (tokens) | depth 0.5 | all depths |" in captured.out and "| 100 | " in captured.out
    assert "| gap (tokens) | first copy | second copy | first − second |" in captured.out
    assert re.search(r"^\| 16 \| \d+\.\d{4} \| \d+\.\d{4} \| -?\d+\.\d{4} \|$", captured.out, re.M)
    assert out.read_text() == captured.out
    record = json.loads(js.read_text())
    assert [c["length"] for c in record["passkey"]["cells"]] == [100, 120] and len(record["copy"]["gaps"]) == 2
    assert f"wrote {out}" in captured.err
    assert bool(layers) == (which != "teacher")  # a converted model decodes from its SketchStateCache


@pytest.mark.parametrize("argv,match", [
    (["--model-dir", "{root}/teacher", "--passkey-lengths", "20"], r"length=20 is too short .* at least \d+ tokens"),
    (["--model-dir", "{root}/teacher", "--depths", "0.5,1.5"], r"argument --depths: expected .* in \[0, 1\], got '1.5'"),
    (["--model-dir", "{root}/teacher", "--gaps", "-3"], r"argument --gaps: expected comma-separated integers >= 0"),
    (["--model-dir", "{root}/teacher", "--passage", "1"], r"--passage must be at least 2"),
    (["--model-dir", "{root}/teacher", "--depths", "0.5,0.5"], r"--depths: the values must be distinct"),
    (["--model-dir", "{root}/teacher", "--converted", "{root}/teacher"], r"--converted .*: not a converted save"),
    (["--model-dir", "{root}/conv", "--converted", "{root}/conv"], r"is already a converted save"),
    (["--model-dir", "{root}/nowhere"], r"--model-dir .*nowhere: not a transformers model directory"),
    (["--model-dir", "{root}/teacher", "--text", "{root}/short.txt"],
     r"copy recall needs at least --passage \+ the longest of --gaps = 8 \+ 16 = 24"),
    (["--model-dir", "{root}/teacher", "--text", "{root}/text.txt", "--out", "{root}/text.txt"], r"is the input"),
    (["--model-dir", "{root}/bert"], r"Bert\w+ \(model_type 'bert'\) is not a causal language model"),
])
def test_cli_evaluate_refusals_exit_2_with_one_line(saved, capsys, monkeypatch, argv, match):
    """Refused with one line, exit 2, before the model runs a forward pass."""
    ran = []
    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", lambda *a, **k: ran.append(1))
    base = ["--depths", "0.5", "--n", "1", "--passkey-lengths", "100", "--gaps", "0,16", "--passage", "8",
            "--no-progress"]
    argv = ["evaluate", *base, *[a.format(root=saved) for a in argv]]
    rc = main(argv)
    assert ran == []
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    if "bert" in argv[-1]:  # transformers reports the masked-LM head it drops when loading the encoder
        lines = [line for line in lines if line.startswith("sketchlab: error:")]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1 and re.search(match, lines[0]), err


# ------------------------------------------------------------------------------------------------
# issue 35 mutation round (seed 35): checks a wrong implementation could pass otherwise


@pytest.mark.parametrize("key", ["12a", "abc", "\u0661\u0662\u0663", "-5", ""])
def test_a_key_that_is_not_ascii_digits_is_refused(tok, key):
    """Letters, a sign, an empty key and non-ASCII digits (Arabic-Indic, ``isdigit()`` but not ASCII) are
    refused: each condition on its own, so an 'and' in place of the 'or' would let letters through."""
    with pytest.raises(ValueError, match=r"key must be a non-negative int or a string of digits, got "):
        passkey_prompt(tok, 90, 0.5, key)
    assert len(passkey_prompt(tok, 90, 0.5, "0123")) == 90


def test_an_encoder_decoder_config_of_a_supported_family_is_refused(tok):
    """A LLaMA marked ``is_encoder_decoder`` (it can generate, and its family is supported) is not a causal LM."""
    model = _llama(len(tok))
    model.config.is_encoder_decoder = True
    with pytest.raises(ValueError, match=r"copy_recall: LlamaForCausalLM .* is not a causal language model"):
        copy_recall(model, torch.arange(100), gaps=(0,), passage=4)


def test_a_tokenizer_pair_that_is_not_two_callables_says_what_it_must_be():
    with pytest.raises(TypeError, match=r"tokenizer as a pair must be \(encode, decode\): two callables, encode\(str\) "
                                        r"-> list of token ids and decode\(list of ids\) -> str"):
        passkey_prompt((str.split,), 90, 0.5, 12345)


def test_sentence_embeddings_cover_more_sentences_than_tokens():
    """N = 11 sentences of 3 tokens in batches of 4: one embedding per sentence (batches over the sentences,
    not the tokens), equal to the mean of that sentence's own hidden states."""
    from sketchlab.convert.evaluate import sentence_embeddings

    bert = transformers.BertModel(transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=16)).eval()
    ids = torch.randint(1, 50, (11, 3), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[4, 2] = 0
    emb = sentence_embeddings(bert, ids, mask, batch_size=4)
    assert emb.shape == (11, 16)
    with torch.no_grad():
        one = bert(input_ids=ids[4:5, :2], attention_mask=mask[4:5, :2]).last_hidden_state.double().mean(1)
    torch.testing.assert_close(emb[4:5], one[0:1], rtol=1e-5, atol=1e-6)


def test_copy_recall_as_dict_keeps_every_field_under_its_name():
    V, P = 200, 8
    x = torch.randperm(V, generator=torch.Generator().manual_seed(1))
    res = copy_recall(InductionOracle(V), x, gaps=(0, 5), passage=P, n=2, seed=4)
    d = json.loads(json.dumps(res.as_dict()))
    assert d["passage"] == P and d["n"] == 2 and d["seed"] == 4 and d["starts"] == list(res.starts)
    assert [g["gap"] for g in d["gaps"]] == [0, 5] and d["gaps"][1]["gap_starts"] == list(res.gap_starts[5])
