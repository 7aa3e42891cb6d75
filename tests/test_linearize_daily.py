"""Issue 35, daily use of the conversion: a progress bar with an ETA for every stage, a bounded Θ fit,
a memory estimate that covers the run and refuses one that would not fit, window + sinks alone in the
report (and ``far=False``), encoders read one sentence per sequence. Tiny random models only; the
SmolLM2 numbers are estimated, not run."""

from __future__ import annotations

import importlib
import json
import math
import re

import pytest
import torch
import transformers

from sketchlab.cli import main
from sketchlab.convert import convert_attention, converted_modules, linearize, perplexity
from tests.test_convert import _bert, _llama

lin = importlib.import_module("sketchlab.convert.linearize")
theta = importlib.import_module("sketchlab.convert.theta")


def _ids(N=6, T=16, seed=0):
    return torch.randint(1, 50, (N, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# progress


STAGE_BARS = ["teacher recording", "stage 0: Θ fit", "gates (search)", "stage 1: transfer", "stage 2: LoRA",
              "evaluate teacher", "evaluate fit", "evaluate transfer", "evaluate lora", "attention errors (fit)"]


def test_every_stage_shows_a_bar_with_an_eta_on_stderr(capsys):
    linearize(_llama(), _ids(), m=4, window=3, sinks=1, seq_len=16, holdout=0.34, fit_tokens=32, transfer_steps=2,
              lora_steps=1, batch_size=2, progress=True)
    captured = capsys.readouterr()
    for desc in STAGE_BARS:
        assert desc in captured.err, desc
    assert re.search(r"stage 1: transfer: 100%.*\[\d\d:\d\d<\d\d:\d\d", captured.err)  # elapsed < remaining
    assert "memory estimate" in captured.err.splitlines()[0]  # the estimate comes first
    assert "stage 0 fits 8 heads" in captured.err.splitlines()[0]


def test_no_progress_is_silent(capsys):
    linearize(_llama(), _ids(), m=4, window=3, sinks=1, seq_len=16, holdout=0.34, fit_tokens=32, transfer_steps=2,
              batch_size=2, progress=False)
    captured = capsys.readouterr()
    assert not any(desc in captured.err for desc in STAGE_BARS) and "memory estimate" not in captured.err


# ------------------------------------------------------------------------------------------------
# the stage-0 fit: from the recording (no second teacher pass), its effort bounded


def test_fit_from_the_recording_is_fit_theta():
    model = _llama()
    ids = _ids(4, 16)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    layers = lin.teacher_attention(model, ids, mask)
    train = torch.arange(3)
    mine, info = theta._fit_recorded(layers, mask, train, set(), p=2, m=4, rank=1, fit_tokens=20, seed=0, fit_work=None,
                                     fit_options=None, progress=False)
    theirs, their_info = lin.fit_theta(model, ids[train], mask[train], p=2, m=4, fit_tokens=20)
    torch.testing.assert_close(mine[0], theirs[0], rtol=0, atol=0)
    torch.testing.assert_close(mine[1], theirs[1], rtol=0, atol=0)
    assert info["fit_tokens"] == their_info["fit_tokens"] == 20 and info["tokens"] == their_info["tokens"] == 44


def test_the_fit_work_reaches_the_fit(monkeypatch):
    import sketchlab.fit

    seen = []
    real = sketchlab.fit.fit_sketch

    def spy(*args, **kwargs):
        seen.append(kwargs.get("work"))
        return real(*args, **kwargs)

    monkeypatch.setattr(sketchlab.fit, "fit_sketch", spy)
    linearize(_llama(), _ids(), m=4, window=3, sinks=1, seq_len=16, holdout=0.34, fit_tokens=16, transfer_steps=0,
              evaluate=False)
    assert seen == [lin.DEFAULT_FIT_WORK] * 2
    seen.clear()
    _, report = linearize(_llama(), _ids(), m=4, window=3, sinks=1, seq_len=16, holdout=0.34, fit_tokens=16,
                          transfer_steps=0, evaluate=False, fit_work=1.0)
    assert seen == [1.0] * 2 and report.stages[0]["fit"]["iterations"] == 1 and report.settings["fit_work"] == 1.0


def test_the_default_fit_keeps_smollm2_stage_0_to_minutes():
    """SmolLM2-135M: 30 layers × 9 heads, d = 64, 1024 fitting tokens, p = 2, m = 64. The preset's full
    schedule (38 iterations of 6.8e8 multiply-adds per head) took ~53 s per layer (issue 35: ~2.3e11
    multiply-adds in 53 s, ~4.4e9 per second); the default cap allows a few iterations, stage 0 in minutes."""
    full = theta._fit_plan(2, 64, 1, 64, 1024, math.inf, None)
    capped = theta._fit_plan(2, 64, 1, 64, 1024, lin.DEFAULT_FIT_WORK, None)
    assert full["iterations"] == 38 and 3 <= capped["iterations"] <= 6
    rate = 9 * full["work"] / 53.0  # multiply-adds per second measured there
    minutes = 270 * capped["work"] / rate / 60
    assert minutes < 5, minutes
    assert 270 * full["work"] / rate / 60 > 25  # what it was


@pytest.mark.parametrize("kwargs,match", [
    (dict(fit_work=0), r"fit_work must be a number > 0"),
    (dict(fit_work=-1.0), r"fit_work must be a number > 0"),
    (dict(fit_work=float("nan")), r"fit_work must be a number > 0"),
    (dict(fit_work="fast"), r"fit_work must be a number > 0"),
    (dict(fit_work=True), r"fit_work must be a number > 0"),
    (dict(fit_work=1e9, fit_options={"work": 1e8}), r"give the fit's cap once"),
])
def test_bad_fit_work_is_refused_before_any_work(kwargs, match, monkeypatch):
    monkeypatch.setattr(lin, "teacher_attention", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    with pytest.raises(ValueError, match=match):
        linearize(_llama(), _ids(), m=4, window=3, sinks=1, seq_len=16, **kwargs)


# ------------------------------------------------------------------------------------------------
# memory: the estimate covers the run, is printed up front, refuses a run that would not fit


def _smollm2_meta():
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, intermediate_size=1536, max_position_embeddings=8192)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def test_the_estimate_covers_more_than_the_recording():
    """SmolLM2 on 48 sequences of 512 tokens (24,576 tokens) in float32: the old estimate was the recording
    alone (4.5 GB; 12.2 GB resident was seen, the recording's concatenation doubling it and the fit's own
    teacher pass and float64 copies on top). The plan adds the parameters and the largest stage buffer."""
    from sketchlab.convert.families import attention_sites

    model = _smollm2_meta()
    _, sites = attention_sites(model)
    plan = lin.memory_plan(model, sites, (48, 512), batch_size=4, window=64, sinks=4, cache=0, fit_tokens=1024, m=64,
                           p=2, rank=1, gate_sequences=4, transfer=True, lora=False, encoder=False)
    assert plan["recording"] == 30 * (2 * 9 + 2 * 3) * 64 * 4 * 24576  # 4.5e9 bytes
    assert plan["parameters"] == sum(p.numel() for p in model.parameters()) * 4
    assert plan["evaluation"] >= 4 * 512 * 49152 * (4 + 8)  # the logits, float32 and float64
    assert plan["total"] >= plan["recording"] + plan["parameters"] + plan["evaluation"]
    assert plan["total"] > 7e9


def test_a_run_over_the_budget_is_refused_before_any_work(monkeypatch):
    monkeypatch.setattr(lin, "teacher_attention", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    model = _llama()
    from sketchlab.convert.families import attention_sites

    plan = lin.memory_plan(model, attention_sites(model)[1], (6, 16), batch_size=4, window=3, sinks=1, cache=0,
                           fit_tokens=None, m=4, p=2, rank=1, gate_sequences=0, transfer=True, lora=False,
                           encoder=False)
    budget = plan["parameters"] + plan["recording"] + 1  # the old check (the recording alone) let this through
    with pytest.raises(ValueError, match=r"linearize on 6 sequence\(s\) of 16 tokens .*the largest of the stages' "
                                         r"buffers; estimated\) would take .* GiB, over the memory budget"):
        linearize(model, _ids(), attention="hedgehog", m=4, window=3, sinks=1, seq_len=16, gate_init=0.0,
                  max_bytes=budget)


def test_the_recording_is_allocated_once():
    """No concatenation at the end (which held the recording twice): each layer's q, k, v and output are
    filled batch by batch into tensors allocated once, equal to one pass over all sequences."""
    model = _llama()
    ids = _ids(5, 16)
    mask = torch.ones_like(ids)
    batched = lin.teacher_attention(model, ids, mask, batch_size=2)
    whole = lin.teacher_attention(model, ids, mask, batch_size=5)
    for a, b in zip(batched, whole):
        for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v), (a.out, b.out)):
            torch.testing.assert_close(x, y)


def _cli_argv(tmp_path, capsys) -> list:
    """A tiny model directory and text under ``tmp_path`` (the output captured so far dropped) and the
    ``sketchlab linearize`` arguments on them (one transfer step)."""
    from tests.test_cli_linearize_lm import _model_dir, _text_file

    _model_dir(tmp_path / "m")
    _text_file(tmp_path / "t.txt", 200)
    capsys.readouterr()
    return ["linearize", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--attention",
            "hedgehog", "--m", "4", "--window", "4", "--sinks", "1", "--seq-len", "24", "--transfer-steps", "1"]


def test_cli_prints_the_estimate_and_refuses_over_max_memory(tmp_path, capsys):
    argv = _cli_argv(tmp_path, capsys) + ["--gate-init", "0", "--out", str(tmp_path / "o")]
    rc = main(argv + ["--max-memory", "1e-5"])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(r"memory estimate .* GiB \(parameters .*\) of the budget 1e-05 GiB", err), err
    assert re.search(r"sketchlab: error: linearize on .* would take .* GiB, over the memory budget", err)
    assert not (tmp_path / "o").exists()
    assert main(argv) == 0  # the machine's available memory by default


# ------------------------------------------------------------------------------------------------
# window + sinks alone: the floor the far part must beat; far=False


def test_each_stage_reports_window_and_sinks_alone():
    ids = _ids()
    _, report = linearize(_llama(), ids, attention="hedgehog", m=4, window=3, sinks=1, seq_len=16, holdout=0.34,
                          gate_init=0.0, transfer_steps=3)
    control = _llama()
    convert_attention(control, attention="hedgehog", m=4, window=3, sinks=1, gate_init=40.0)
    floor = perplexity(control, ids[4:], torch.ones_like(ids[4:]))
    assert [s["name"] for s in report.stages] == ["init", "transfer"]
    for stage in report.stages:
        assert stage["window_only_metric"] == pytest.approx(floor, rel=1e-12)
        assert len(stage["window_only_layer_error"]) == 2
        assert stage["far_helps"] == (stage["metric"] < floor)


def test_far_false_keeps_window_and_sinks_alone(tmp_path):
    from sketchlab.convert import load_linearized, save_linearized

    ids = _ids()
    model, report = linearize(_llama(), ids, attention="hedgehog", m=4, window=3, sinks=1, seq_len=16, holdout=0.34,
                              far=False, lora_steps=1, batch_size=2)
    control = _llama()
    convert_attention(control, attention="hedgehog", m=4, window=3, sinks=1, gate_init=40.0)
    assert [s["name"] for s in report.stages] == ["init", "lora"] and report.settings["far"] is False
    assert report.stages[0]["metric"] == pytest.approx(perplexity(control, ids[4:], torch.ones_like(ids[4:])), rel=1e-12)
    for sketch in converted_modules(model):
        assert bool((sketch.gate == 40.0).all()) and not sketch.gate.requires_grad
        assert float(1 - torch.sigmoid(sketch.gate.float()).min()) == 0.0  # the far part's weight, float32
    save_linearized(model, tmp_path / "s")
    again = load_linearized(tmp_path / "s", _llama())
    assert all(bool((s.gate == 40.0).all()) for s in converted_modules(again))


@pytest.mark.parametrize("kwargs,match", [
    (dict(far=False, window=0, sinks=0), r"far=False keeps window \+ sinks alone: window=0"),
    (dict(far=False, gate_init=0.0), r"far=False sets every gate logit to 40.0 .* gate_init=0.0 would not be used"),
    (dict(far="no"), r"far must be True or False, got 'no'"),
])
def test_bad_far_is_refused(kwargs, match, monkeypatch):
    monkeypatch.setattr(lin, "teacher_attention", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    with pytest.raises((TypeError, ValueError), match=match):
        linearize(_llama(), _ids(), **{"attention": "hedgehog", "m": 4, "window": 3, "sinks": 1, "seq_len": 16,
                                       **kwargs})


def test_cli_no_far_and_the_floor_in_the_report(tmp_path, capsys):
    base = _cli_argv(tmp_path, capsys) + ["--no-progress"]
    assert main(base + ["--gate-init", "0", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"window \+ sinks alone [\d.]+ \(the floor the far part must beat: (beaten|NOT beaten)", out), out
    md = (tmp_path / "a" / "linearize.md").read_text()
    assert "| window + sinks alone | far part helps |" in md and "*Window + sinks alone*" in md
    assert main(base + ["--no-far", "--out", str(tmp_path / "b")]) == 0
    summary = json.loads((tmp_path / "b" / "linearize.json").read_text())
    assert summary["settings"]["far"] is False and summary["cli"]["no_far"] is True
    assert "far part off" in capsys.readouterr().out
    assert main(base + ["--no-far", "--gate-init", "1", "--out", str(tmp_path / "c")]) == 2
    assert re.search(r"--no-far with --window 4, --gate-init 1.0: far=False sets every gate logit to 40",
                     capsys.readouterr().err)


# ------------------------------------------------------------------------------------------------
# encoders: one sentence per sequence, the model's own padding; cosine and neighbour agreement


def _bert_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]")


def _sentences(n=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return "\n".join(" ".join(f"w{int(i)}" for i in torch.randint(0, 40, (int(k),), generator=gen))
                     for k in torch.randint(3, 12, (n,), generator=gen)) + "\n\n"


def test_an_encoder_reads_one_sentence_per_sequence():
    text = _sentences()
    ids, mask = lin.tokenize_texts(text, _bert_tokenizer(), seq_len=64, sentences=True)
    lines = text.strip().splitlines()
    assert ids.shape[0] == len(lines)
    for row, m, line in zip(ids, mask, lines):
        n = int(m.sum())
        assert n == len(line.split()) + 2 and row[0] == 2 and row[n - 1] == 3  # [CLS] ... [SEP]
        assert bool((row[n:] == 0).all()) and bool((m[:n] == 1).all())  # [PAD] after
    short, _ = lin.tokenize_texts(text, _bert_tokenizer(), seq_len=4, sentences=True)  # truncated, [SEP] kept
    assert short.shape == (len(lines), 4) and bool((short[:, -1] == 3).all())


def test_linearize_an_encoder_on_sentences_reports_cosine_and_neighbours():
    text = _sentences(12)
    _, report = linearize(_bert(), text, tokenizer=_bert_tokenizer(), attention="hedgehog", m=4, window=3, sinks=1,
                          seq_len=64, holdout=0.34, gate_init=0.0, transfer_steps=2)
    s = report.settings
    assert s["sentences"] is True and s["sequences"] == 12 and s["held_out"] == 4
    for stage in report.stages:
        assert 0 <= stage["nn_agreement"] <= 1 and -1 <= stage["metric"] <= 1
        assert 0 <= stage["window_only_nn_agreement"] <= 1
        assert stage["far_helps"] == (stage["metric"] > stage["window_only_metric"])


# ------------------------------------------------------------------------------------------------
# small things


def test_the_readme_commands_outputs_are_ignored_by_git():
    """Every file the README's shell lines write at the repository root (``--out``, ``--plot``,
    ``--json``, ``--markdown``) is ignored by git."""
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # the suite runs from a git checkout (CI clones the repository): .gitignore is what is checked
    assert shutil.which("git") is not None and (root / ".git").exists(), "run the suite from a git checkout"
    block = "\n".join(re.findall(r"```bash\n(.*?)```", (root / "README.md").read_text(), re.S))
    outputs = sorted({m.group(1).split("/")[0] + ("/" if "/" in m.group(1) else "")
                      for m in re.finditer(r"--(?:out|plot|json|markdown) (\S+)", block)})
    assert {"qk.safetensors", "advice.png", "out.json", "out.md", "theta.safetensors", "runs/"} <= set(outputs)
    for path in outputs:
        probe = path + "x" if path.endswith("/") else path
        assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=root).returncode == 0, path


def test_the_fit_sees_the_recordings_sqrt_d_inputs(monkeypatch):
    """Stage 0 fits the kernel of ``q·D^{-1/4}, k·D^{-1/4}`` (the polynomial in ``qᵀk/√D``): each layer's
    fit gets the recording's valid tokens so scaled, keys repeated to the query heads, float64 ``[H, n, D]``."""
    import sketchlab.fit

    calls, real = [], sketchlab.fit.fit_sketch
    monkeypatch.setattr(sketchlab.fit, "fit_sketch", lambda *a, **k: calls.append(a) or real(*a, **k))
    ids = _ids(4, 16)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    layers = lin.teacher_attention(_llama(), ids, mask)
    theta._fit_recorded(layers, mask, torch.arange(3), set(), p=2, m=4, rank=1, fit_tokens=None, seed=0,
                        fit_work=1e6, fit_options=None, progress=False)
    valid = mask[:3].bool()
    for (_, q, k), io in zip(calls, layers):
        D, rep = io.q.shape[3], io.q.shape[2] // io.k.shape[2]
        want_q = io.q[:3][valid].float().transpose(0, 1).double() * D ** -0.25  # [H, n, D], float32 as captured
        want_k = io.k[:3][valid].float().repeat_interleave(rep, dim=1).transpose(0, 1).double() * D ** -0.25
        assert q.dtype == k.dtype == torch.float64 and q.shape == want_q.shape == (4, 44, 8)
        torch.testing.assert_close(q, want_q, rtol=0, atol=0)
        torch.testing.assert_close(k, want_k, rtol=0, atol=0)
