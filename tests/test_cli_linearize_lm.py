"""``sketchlab linearize --model-dir DIR --text FILE``: the real-model path from the shell, on a tiny
random GPT-2 saved with a word-level tokenizer (nothing downloaded)."""

from __future__ import annotations

import json

import torch
import transformers

from sketchlab.cli import main
from sketchlab.convert import load_linearized

WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", ".", "a", "dog", "ran", "and", "hid"]


def _model_dir(path, n_layer: int = 2):
    """A tiny random GPT-2 (``n_layer`` layers) saved with a word-level tokenizer over WORDS at ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.GPT2Config(vocab_size=len(WORDS), n_embd=16, n_layer=n_layer, n_head=2, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)


def _text_file(path, words: int) -> None:
    """``words`` random words of WORDS (not the unknown token), seed 0, written to ``path``."""
    gen = torch.Generator().manual_seed(0)
    path.write_text(" ".join(WORDS[1 + int(i)] for i in torch.randint(0, len(WORDS) - 1, (words,), generator=gen)))


def test_cli_linearize_model_dir(tmp_path, capsys):
    _model_dir(tmp_path / "m")
    _text_file(tmp_path / "t.txt", 400)
    out = tmp_path / "lin"
    rc = main(["linearize", "--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"),
               "--attention", "hedgehog", "--m", "8", "--window", "4", "--sinks", "1", "--seq-len", "32",
               "--transfer-steps", "3", "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "held-out perplexity: teacher" in printed and "transfer" in printed
    summary = json.loads((out / "linearize.json").read_text())
    assert [s["name"] for s in summary["stages"]] == ["init", "transfer"]
    assert summary["settings"]["sequences"] == 13 and summary["settings"]["window"] == 4
    assert "| transfer |" in (out / "linearize.md").read_text()
    # the saved model reloads onto the teacher architecture with identical outputs
    ids = torch.randint(1, len(WORDS), (1, 20), generator=torch.Generator().manual_seed(1))
    fresh = load_linearized(out / "model", transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "m"))
    again = load_linearized(out / "model", transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "m"))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, again(ids).logits, rtol=0, atol=0)


def test_cli_linearize_bad_input(tmp_path, capsys):
    _model_dir(tmp_path / "m")
    capsys.readouterr()  # save_pretrained's progress bar
    (tmp_path / "t.txt").write_text("the cat sat")
    cases = [
        (["--model-dir", str(tmp_path / "m"), "--out", str(tmp_path / "o")], "--text is required"),
        (["--model-dir", str(tmp_path / "m"), "--gguf", "x.gguf", "--text", "t", "--out", "o"],
         "exactly one of CHECKPOINT"),
        (["--model-dir", str(tmp_path / "nodir"), "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o")],
         "not a transformers model directory"),
        (["--gguf", str(tmp_path / "no.gguf"), "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o")],
         "no such GGUF file"),
        (["--model-dir", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o"),
          "--window", "-1"], "expected an integer >= 0"),
    ]
    for argv, match in cases:
        rc = main(["linearize", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and match in err and err.count("\n") == 1, (argv, err)
