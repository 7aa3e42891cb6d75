"""Bad input, faults and numeric edges on the conversion path (issue 35): ``save_linearized`` /
``load_linearized``, ``convert_attention``, ``linearize``, ``load_pretrained`` and ``sketchlab
linearize`` on tiny random Llama, GPT-2 and BERT models built here (never a real checkpoint).

Each case is clean: refused before anything is written (inputs byte-identical afterwards), or one
message naming the file / option, the rule, the value and the way out; never a traceback from
torch, safetensors or transformers, never a silent wrong result. Classes, in the issue's order:
data loss, saved conversions that lie, tracebacks where a sentence belongs, vague causes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from sketchlab.cli import main
from sketchlab.convert import convert_attention, load_linearized, save_linearized
from tests.test_convert import _bert, _gpt2, _llama

MAKERS = {"llama": _llama, "gpt2": _gpt2, "bert": _bert}


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _converted(kind: str, **options):
    model = MAKERS[kind]()
    convert_attention(model, **{"attention": "hedgehog", "m": 4, "window": 3, "sinks": 1, **options})
    return model


def _ids(T=10, seed=5):
    return torch.randint(1, 50, (1, T), generator=torch.Generator().manual_seed(seed))


def _out(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.fixture(scope="module")
def teacher_dirs(tmp_path_factory):
    """The three tiny teachers saved with ``save_pretrained`` (what ``from_pretrained`` reads)."""
    root = tmp_path_factory.mktemp("teachers")
    for kind, make in MAKERS.items():
        make().save_pretrained(root / kind)
    return root


def _loaded(teacher_dirs, kind: str) -> torch.nn.Module:
    cls = {"llama": transformers.LlamaForCausalLM, "gpt2": transformers.GPT2LMHeadModel,
           "bert": transformers.BertModel}[kind]
    return cls.from_pretrained(teacher_dirs / kind).double().eval()


# ------------------------------------------------------------------------------------------------
# 1. data loss: a save never lands on an input of the run; a failed multi-file save loses nothing


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("spelling", ["same", "dotdot", "symlink", "parent"])
def test_save_onto_the_teacher_directory_is_refused(kind, spelling, teacher_dirs, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_dirs / kind, teacher)
    model = _loaded_from(teacher, kind)
    convert_attention(model, attention="hedgehog", m=4, window=3, sinks=1)
    before = _tree(tmp_path)
    target = {"same": teacher, "dotdot": teacher / ".." / "teacher", "parent": tmp_path}.get(spelling)
    if spelling == "symlink":
        target = tmp_path / "link"
        target.symlink_to(teacher, target_is_directory=True)
        before = _tree(tmp_path)
    with pytest.raises(ValueError, match=r"save_linearized: output directory .* (holds|is) the input .*teacher"):
        save_linearized(model, target)
    assert _tree(tmp_path) == before  # nothing written, nothing created


def _loaded_from(path: Path, kind: str):
    cls = {"llama": transformers.LlamaForCausalLM, "gpt2": transformers.GPT2LMHeadModel,
           "bert": transformers.BertModel}[kind]
    return cls.from_pretrained(path).double().eval()


def test_save_onto_a_declared_input_is_refused(tmp_path):
    """The text file (or any file the run read) passed as ``inputs=``: the directory is that file,
    or holds it; a hard link to it in the directory is replaced, never written through."""
    model = _converted("gpt2")
    text = tmp_path / "t.txt"
    text.write_text("a b c\n")
    with pytest.raises(ValueError, match=r"output directory .*t.txt' is the input .*t.txt"):
        save_linearized(model, text, inputs=[text])
    out = tmp_path / "out"
    out.mkdir()
    os.link(text, out / "config.json")  # another name of the input: replaced by a rename, never written through
    save_linearized(model, out, inputs=[text])
    assert text.read_text() == "a b c\n"
    with pytest.raises(ValueError, match=r"output directory .*out' holds the input .*out/t.txt"):
        shutil.copy(text, out / "t.txt")
        save_linearized(model, out, inputs=[out / "t.txt"])


def test_save_onto_the_gguf_file_is_refused(tmp_path):
    """``load_pretrained`` records the file it read: a save onto it (or its link) is refused."""
    model = _converted("gpt2")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF....")
    model.sketchlab_source = str(gguf)
    link = tmp_path / "link.gguf"
    link.symlink_to(gguf)
    for target in (gguf, link):
        with pytest.raises(ValueError, match=r"is the input .*m.gguf"):
            save_linearized(model, target)
    assert gguf.read_bytes() == b"GGUF...."


def test_a_failing_save_leaves_the_previous_one(tmp_path, monkeypatch):
    """The save is built beside the directory and moved in at the end: a save that fails half-way
    (here: writing the weights) leaves the earlier save loadable, byte for byte."""
    model = _converted("llama")
    save_linearized(model, tmp_path / "lin")
    before = _tree(tmp_path / "lin")
    other = _converted("llama", m=6)

    def broken(self, directory, *args, **kwargs):
        (Path(directory) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(other), "save_pretrained", broken)
    with pytest.raises(OSError, match="No space left"):
        save_linearized(other, tmp_path / "lin")
    assert _tree(tmp_path / "lin") == before
    assert sorted(os.listdir(tmp_path)) == ["lin"]  # no staging directory left behind
    load_linearized(tmp_path / "lin", _llama())


@pytest.mark.parametrize("kind", ["llama", "toy"])
def test_saved_files_get_the_usual_permissions(kind, tmp_path):
    """safetensors creates its files 0o600; a save's files all get ``0o666 & ~umask`` like their siblings."""
    model = _converted("llama") if kind == "llama" else _toy_converted()
    save_linearized(model, tmp_path / "lin")
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "lin").iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def _toy_converted():
    from sketchlab.tasks.model import TransformerConfig, TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2))
    convert_attention(model, attention="hedgehog", m=4, window=3, sinks=1)
    return model


def test_failed_npy_dump_save_keeps_the_earlier_dump(tmp_path, monkeypatch):
    """A ``.npy`` dump is several files: a save that fails while moving them in puts every old one
    back (the earlier dump still loads, unchanged) and leaves no temporary file."""
    from sketchlab.io import load_qk, save_qk

    old_q, old_k = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    save_qk(tmp_path / "d.npy", old_q, old_k, v=torch.randn(1, 2, 6, 4))
    before = _tree(tmp_path)
    calls = {"n": 0}
    real = os.replace

    def failing(src, dst, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(5, "Input/output error")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="Input/output error"):
        save_qk(tmp_path / "d.npy", torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4))
    monkeypatch.setattr(os, "replace", real)
    assert _tree(tmp_path) == before
    dump = load_qk(tmp_path / "d.npy")
    torch.testing.assert_close(dump.q.float(), old_q) and torch.testing.assert_close(dump.k.float(), old_k)


# ------------------------------------------------------------------------------------------------
# 2. saved conversions that lie: every copy of the options agrees, the weights match them


def _edit(path: Path, key: str, value, *, nested: str | None = None) -> None:
    data = json.loads(path.read_text())
    (data[nested] if nested else data)[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("key,value", [("window", 5), ("sinks", 0), ("local", "poly"), ("eps", 1e-3), ("m", 6),
                                       ("tied", True), ("attention", "taylor"), ("seed", 3)])
@pytest.mark.parametrize("where", ["options", "config"])
def test_an_edited_option_is_refused_naming_file_key_and_values(kind, key, value, where, tmp_path):
    save_linearized(_converted(kind), tmp_path / "lin")
    if where == "options":
        _edit(tmp_path / "lin" / "sketchlab_conversion.json", key, value)
    else:
        _edit(tmp_path / "lin" / "config.json", key, value, nested="sketchlab")
    was = json.loads((tmp_path / "lin" / "sketchlab_conversion.json").read_text()) if where == "config" else \
        json.loads((tmp_path / "lin" / "config.json").read_text())["sketchlab"]
    fresh = MAKERS[kind]()
    with pytest.raises(ValueError, match=rf"options disagree: .*{key}=.*{key}=") as err:
        load_linearized(tmp_path / "lin", fresh)
    message = str(err.value)
    assert "sketchlab_conversion.json" in message and "config.json" in message
    assert repr(value) in message and repr(was[key]) in message
    assert not any(type(m).__name__ == "SketchedAttention" for m in fresh.modules())  # refused before converting


@pytest.mark.parametrize("key,value", [("window", 5), ("m", 6), ("tied", True)])
def test_an_edited_toy_option_is_refused(key, value, tmp_path):
    """The toy model has no config.json: its weights' metadata holds the second copy."""
    save_linearized(_toy_converted(), tmp_path / "toy")
    _edit(tmp_path / "toy" / "sketchlab_conversion.json", key, value)
    with pytest.raises(ValueError, match=rf"options disagree: sketchlab_conversion.json has {key}=.*"
                                         rf"model.safetensors has {key}="):
        load_linearized(tmp_path / "toy", _toy_converted_teacher())


def _toy_converted_teacher():
    from sketchlab.tasks.model import TransformerConfig, TransformerLM

    return TransformerLM(TransformerConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2))


@pytest.mark.parametrize("key,value,match", [
    ("window", -1, r"window must be an integer >= 0, got -1"),
    ("m", "64", r"m must be an integer >= 1, got '64'"),
    ("local", "nope", r"local must be one of"),
    ("eps", "nan", r"eps must be a finite number >= 0"),
    ("attention", 3, r"attention must be a feature-map name"),
    ("gate", "yes", r"gate must be a bool"),
])
def test_an_invalid_option_in_both_copies_names_the_file_and_rule(key, value, match, tmp_path):
    save_linearized(_converted("gpt2"), tmp_path / "lin")
    _edit(tmp_path / "lin" / "sketchlab_conversion.json", key, value)
    _edit(tmp_path / "lin" / "config.json", key, value, nested="sketchlab")
    with pytest.raises(ValueError, match=r"sketchlab_conversion.json: the saved conversion options are refused: " + match):
        load_linearized(tmp_path / "lin", _gpt2())


def test_unknown_and_missing_options_are_named(tmp_path):
    save_linearized(_converted("gpt2"), tmp_path / "lin")
    for path, nested in ((tmp_path / "lin" / "sketchlab_conversion.json", None), (tmp_path / "lin" / "config.json", "sketchlab")):
        _edit(path, "windw", 5, nested=nested)
    with pytest.raises(ValueError, match=r"sketchlab_conversion.json: unknown conversion option 'windw'"):
        load_linearized(tmp_path / "lin", _gpt2())
    for path, nested in ((tmp_path / "lin" / "sketchlab_conversion.json", None), (tmp_path / "lin" / "config.json", "sketchlab")):
        data = json.loads(path.read_text())
        target = data[nested] if nested else data
        del target["windw"], target["window"]
        path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"the conversion option 'window' is missing"):
        load_linearized(tmp_path / "lin", _gpt2())


def test_weights_of_another_save_are_named_with_both_shapes(tmp_path):
    """Weights copied in from a save with another m: the tensor and both shapes, not torch's
    "size mismatch"."""
    save_linearized(_converted("llama", m=4), tmp_path / "a")
    save_linearized(_converted("llama", m=6), tmp_path / "b")
    shutil.copy(tmp_path / "b" / "model.safetensors", tmp_path / "a" / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor '.*sketch.*' has shape \[4, 8, 3\] in the saved weights and \[4, 8, 2\] "
                                         r"in the model converted with the saved options"):
        load_linearized(tmp_path / "a", _llama())


def test_the_gate_init_used_is_recorded_and_reloads(tmp_path):
    """``linearize(gate_init="search")`` records "search" (not the 0.0 it converted with) and the save reloads."""
    from sketchlab.convert import linearize

    model = _llama()
    ids = torch.randint(1, 50, (6, 16), generator=torch.Generator().manual_seed(0))
    model, report = linearize(model, ids, attention="hedgehog", m=4, window=3, sinks=1, gate_init="search",
                              transfer_steps=0, seq_len=16, holdout=0.34, evaluate=False)
    assert model.config.sketchlab["gate_init"] == "search" == report.settings["gate_init"]
    save_linearized(model, tmp_path / "lin")
    assert json.loads((tmp_path / "lin" / "sketchlab_conversion.json").read_text())["gate_init"] == "search"
    fresh = load_linearized(tmp_path / "lin", _llama())
    ids = _ids()
    torch.testing.assert_close(_out(fresh, ids), _out(model, ids), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# 3. tracebacks where a sentence belongs


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_a_damaged_weight_file_is_named_by_load_linearized(damage, tmp_path):
    save_linearized(_converted("gpt2"), tmp_path / "lin")
    weights = tmp_path / "lin" / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes({"empty": b"", "truncated": raw[: len(raw) // 2], "garbage": b"\x00" * 64}[damage])
    fresh = _gpt2()
    with pytest.raises(ValueError, match=r"model.safetensors: (the file is empty|unreadable safetensors file)"):
        load_linearized(tmp_path / "lin", fresh)
    assert not any(type(m).__name__ == "SketchedAttention" for m in fresh.modules())


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_a_damaged_teacher_is_named_by_load_pretrained(damage, tmp_path):
    from sketchlab.hf.pretrained import load_pretrained
    from tests.test_cli_linearize_lm import _model_dir

    _model_dir(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(b"" if damage == "empty" else raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=r"m: could not load the model \(missing, truncated or corrupt weights or "
                                         r"config\) \(model.safetensors: \d+ bytes"):
        load_pretrained(tmp_path / "m")


def test_load_linearized_of_a_file_or_missing_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    for target in (tmp_path / "f", tmp_path / "missing"):
        with pytest.raises(ValueError, match=r"not a directory"):
            load_linearized(target, _gpt2())


@pytest.mark.parametrize("texts,match", [
    (torch.tensor([[1, 2, 50, 3] * 4] * 3), r"linearize: texts: token id 50 is outside the model's vocabulary of 50"),
    (torch.tensor([[1, 2, 3, 4] * 4] * 3) * 1000, r"token id 4000 is outside the model's vocabulary of 50"),
    ([[1, 2, -3, 4] * 4] * 3, r"texts: token ids must be >= 0"),
    ([[], []], r"texts hold no tokens"),
])
@pytest.mark.parametrize("kind", list(MAKERS))
def test_linearize_token_ids_outside_the_vocabulary(kind, texts, match):
    """Not torch's IndexError from the embedding: the id, the vocabulary, refused before any work."""
    from sketchlab.convert import linearize

    model = MAKERS[kind]()
    with pytest.raises(ValueError, match=match):
        linearize(model, texts, attention="hedgehog", m=4, window=3, sinks=1, seq_len=16, transfer_steps=0)
    assert not any(type(m).__name__ == "SketchedAttention" for m in model.modules())


class _Tokenizer:
    def __call__(self, text):
        return {"input_ids": [1 + (ord(c) % 40) for c in text.split()]}


@pytest.mark.parametrize("text", ["", "   \n\t ", ["", " "]])
def test_linearize_empty_text(text):
    from sketchlab.convert import linearize

    with pytest.raises(ValueError, match=r"texts hold no tokens \(an empty or whitespace-only text"):
        linearize(_gpt2(), text, tokenizer=_Tokenizer(), attention="hedgehog", m=4, seq_len=16)


@pytest.mark.parametrize("kind", list(MAKERS))
def test_a_map_of_a_billion_features_is_estimated_and_refused(kind):
    """convert_attention and linearize: the size, the budget, the way out, before any map is drawn
    (and, for linearize, before the teacher pass)."""
    from sketchlab.convert import linearize

    model = MAKERS[kind]()
    with pytest.raises(ValueError, match=r"feature maps of 2 layers .* m=1000000000.* would take [\d.e+]+ GiB, over the "
                                         r"memory budget .*give a smaller m, rank or p"):
        convert_attention(model, m=10**9)
    with pytest.raises(ValueError, match=r"would take .* GiB, over the memory budget max_bytes=1 GiB"):
        convert_attention(model, attention="hedgehog", m=2**24, max_bytes=2**30)
    ids = torch.randint(1, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"m=1000000000.* would take"):
        linearize(model, ids, m=10**9, seq_len=16)
    assert not any(type(m).__name__ == "SketchedAttention" for m in model.modules())


@pytest.mark.parametrize("kwargs,match", [
    (dict(embed_dim=100000, num_heads=1), r"LLoPSAttention\(100000, 1\): its four 100000x100000 projections .* would "
                                          r"take 447 GiB, over the memory budget"),
    (dict(embed_dim=16, num_heads=2, m=10**9), r"LLoPSAttention\(16, 2\): .* would take 477 GiB"),
    (dict(embed_dim=64, num_heads=2, max_bytes=2**10), r"would take .* over the memory budget"),
    (dict(embed_dim=16, num_heads=2, scale=1e-200, window=4), r"scale=1e-200: the window's softmax divides the scaled "
                                                             r"qᵀk by scale² = 0, which under- or overflows float64"),
    (dict(embed_dim=16, num_heads=2, scale=1e200, window=4), r"scale=1e\+200: .* scale² = inf"),
])
def test_llops_attention_sizes_and_scales_named(kwargs, match):
    """Not an 80 GB torch allocation error, not a ZeroDivisionError in attention/module.py."""
    from sketchlab.attention.module import LLoPSAttention

    with pytest.raises(ValueError, match=match):
        LLoPSAttention(**kwargs)


def test_llops_attention_tiny_scale_without_window_still_runs():
    """Without a window the local scale is unused: a tiny scale is not refused (its far part underflows
    to 0 with the denominator warning, as before the regression)."""
    from sketchlab.attention.module import LLoPSAttention

    block = LLoPSAttention(16, 2, scale=1e-200)
    with pytest.warns(RuntimeWarning, match="denominator"):
        out = block(torch.randn(1, 5, 16))
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------------
# 4. vague or wrong causes: sketchlab linearize --text


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    from tests.test_cli_linearize_lm import _model_dir

    root = tmp_path_factory.mktemp("gpt2dir")
    _model_dir(root / "m")
    return root / "m"


def _cli_exit_2(argv, capsys, match):
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("sketchlab: error: "), err
    assert re.search(match, err[0]), err[0]


@pytest.mark.parametrize("content,match", [
    (b"", r"--text .*: holds no text \(empty\)"),
    (b"  \n\t\n  ", r"--text .*: holds no text \(whitespace only\)"),
    ("caf\xe9 au lait".encode("latin-1"), r"--text .*: not UTF-8 \(byte 0xe9 at offset 3\); convert it, e.g. iconv"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", r"--text .*: a binary file \(NUL byte at offset 8\)"),
    ("dir", r"--text .*: is a directory; give a UTF-8 text file"),
    ("missing", r"--text .*: no such file"),
])
def test_cli_text_causes_are_named(content, match, gpt2_dir, tmp_path, capsys, monkeypatch):
    import sketchlab.hf.pretrained

    monkeypatch.setattr(sketchlab.hf.pretrained, "load_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("started its work")))
    text = tmp_path / "t.txt"
    if content == "dir":
        text.mkdir()
    elif content != "missing":
        text.write_bytes(content)
    _cli_exit_2(["linearize", "--model-dir", str(gpt2_dir), "--text", str(text), "--out", str(tmp_path / "o"),
                 "--no-progress"], capsys, match)
    assert not (tmp_path / "o").exists()


def test_cli_unreadable_text_is_named(gpt2_dir, tmp_path, capsys, monkeypatch):
    """A chmod-000 ``--text``: "cannot be read (Permission denied)". The tests run as root (CI too), who
    reads any file: reading that path raises the kernel's answer to anyone else, EACCES, as the dump tests
    stand ``os.access`` in for it (the text is read with ``Path.read_bytes``, not checked with ``os.access``)."""
    import errno

    text = tmp_path / "t.txt"
    text.write_text("a b c")
    text.chmod(0)
    real = Path.read_bytes

    def read_bytes(self):
        if Path(self) == text:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    try:
        _cli_exit_2(["linearize", "--model-dir", str(gpt2_dir), "--text", str(text), "--out", str(tmp_path / "o")],
                    capsys, r"--text .*: cannot be read \(Permission denied\)")
    finally:
        text.chmod(0o644)


def test_cli_truncated_model_dir_is_named(gpt2_dir, tmp_path, capsys):
    from tests.test_cli_linearize_lm import _text_file

    broken = tmp_path / "m"
    shutil.copytree(gpt2_dir, broken)
    raw = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(raw[: len(raw) // 3])
    _text_file(tmp_path / "t.txt", 100)
    _cli_exit_2(["linearize", "--model-dir", str(broken), "--text", str(tmp_path / "t.txt"), "--out",
                 str(tmp_path / "o"), "--no-progress"], capsys,
                r"could not load the model \(missing, truncated or corrupt weights or config\) \(model.safetensors: "
                r"\d+ bytes\)")


# ------------------------------------------------------------------------------------------------
# 4. vague or wrong causes: Q/K dumps (a directory, an unreadable file, a single .npy array)


def _dump_case(case: str, tmp_path: Path) -> Path:
    if case == "single-npy":
        np.save(tmp_path / "single.npy", np.zeros((4, 8)))
        return tmp_path / "single.npy"
    if case == "single-npy-pair":
        np.save(tmp_path / "pair.npy", np.zeros((2, 4, 8)))
        return tmp_path / "pair.npy"
    path = tmp_path / {"dir-safetensors": "d.safetensors", "dir-npy": "d.npy", "dir-pt": "d.pt",
                       "dir-noext": "dumps", "dir-npy-part": "x.npy"}[case]
    (tmp_path / "x.q.npy" if case == "dir-npy-part" else path).mkdir()
    return path


@pytest.mark.parametrize("case,match", [
    ("single-npy", r"single.npy: a single .npy array of shape \(4, 8\) is ambiguous"),
    ("single-npy-pair", r"pair.npy: a single .npy array of shape \(2, 4, 8\) is ambiguous \(its leading axis of size 2"),
    ("dir-safetensors", r"d.safetensors: is a directory, not a file"),
    ("dir-npy", r"d.npy: is a directory, not a file"),
    ("dir-pt", r"d.pt: is a directory, not a file"),
    ("dir-noext", r"dumps: is a directory, not a file"),
    ("dir-npy-part", r"x.q.npy: is a directory, not a file"),
])
@pytest.mark.parametrize("entry", ["load_qk", "load_dump", "cli"])
def test_dump_causes_are_named(case, match, entry, tmp_path, capsys):
    """The library's own message on every entry point: not "does not exist" (the regression in
    ``_dumpsel``), not "no such file" for a directory, not "unknown extension ''"."""
    from sketchlab._dumpsel import load_dump
    from sketchlab.io import load_qk

    path = _dump_case(case, tmp_path)
    if entry == "cli":
        _cli_exit_2(["compare", str(path), "--p", "2", "--m", "4", "--methods", "psf"], capsys, match)
        return
    with pytest.raises((ValueError, OSError), match=match):
        (load_qk if entry == "load_qk" else load_dump)(path)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".npz", ".npy"])
def test_an_unreadable_dump_is_named(suffix, tmp_path, monkeypatch, capsys):
    """A chmod-000 dump: "cannot be read (permission denied ...)", not "No such file or directory".
    (The tests run as root, who reads any file: ``os.access`` stands in for the kernel's answer.)"""
    from sketchlab.io import load_qk, save_qk

    path = save_qk(tmp_path / f"d{suffix}", torch.randn(6, 4), torch.randn(6, 4))
    path.chmod(0)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if Path(p) == path else real(p, mode, *a, **k))
    try:
        with pytest.raises(PermissionError, match=rf"d(.q)?{re.escape(suffix)}: cannot be read \(permission denied: "
                                                  r"the file's mode is 000\)"):
            load_qk(tmp_path / f"d{suffix}")
        _cli_exit_2(["compare", str(tmp_path / f"d{suffix}"), "--p", "2", "--m", "4", "--methods", "psf"], capsys,
                    r"cannot be read \(permission denied")
    finally:
        path.chmod(0o644)


@pytest.mark.parametrize("kind", list(MAKERS))
def test_nan_teacher_weights_are_named(kind):
    """Not "no valid next-token target" after the teacher pass: the weight, before any work."""
    from sketchlab.convert import linearize

    model = MAKERS[kind]()
    name, weight = next(iter(model.named_parameters()))
    with torch.no_grad():
        weight.view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match=rf"the teacher's weight '{re.escape(name)}' holds 1 non-finite value"):
        linearize(model, _ids(16).repeat(4, 1), attention="hedgehog", m=4, window=3, sinks=1, seq_len=16)


@pytest.mark.parametrize("half", [False, True])
def test_a_stage_that_diverges_names_itself_and_the_way_out(half, monkeypatch):
    """"phi_q must be finite" from inside a stage: which stage, and what to do (float32 for a
    half-precision model)."""
    import importlib

    lin = importlib.import_module("sketchlab.convert.linearize")

    def diverged(*args, **kwargs):
        raise ValueError("phi_q must be finite: 3 non-finite value(s) of 96")

    monkeypatch.setattr(lin, "attention_errors", diverged)
    model = _llama().half() if half else _llama()
    way = r"the model is float16, .* convert it in float32" if half else r"give another map"
    with pytest.raises(FloatingPointError, match=r"linearize: stage init diverged \(phi_q must be finite.*\); " + way):
        lin.linearize(model, _ids(16).repeat(4, 1), attention="hedgehog", m=4, window=3, sinks=1, seq_len=16,
                      evaluate=False, transfer_steps=0)


# ------------------------------------------------------------------------------------------------
# 6. a stage that makes the model worse is not reported as done: the layer keeps its start, and says so


@pytest.mark.parametrize("lr", [3.0, 1e30])
@pytest.mark.parametrize("kind", list(MAKERS))
def test_transfer_that_makes_layers_worse_keeps_their_start(kind, lr):
    from sketchlab.convert import converted_modules, linearize

    ids = torch.randint(1, 50, (6, 16), generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match=r"stage transfer made the held-back attention error of 2 of 2 layer\(s\) "
                                            r"worse .*keep what they had before the stage. Lower transfer_lr"):
        model, report = linearize(MAKERS[kind](), ids, attention="hedgehog", m=4, window=3, sinks=1, seq_len=16,
                                  holdout=0.34, transfer_steps=5, transfer_lr=lr, gate_init=0.0)
    init, transfer = report.stages
    assert transfer["kept_initial"] == [0, 1] and transfer["layer_error"] == init["layer_error"]
    assert all(not (t <= i) for t, i in zip(transfer["layer_error_trained"], init["layer_error"]))
    assert transfer["metric"] == pytest.approx(init["metric"], rel=1e-9)  # the model is the stage-0 model again
    for sketch in converted_modules(model):
        assert all(bool(torch.isfinite(p).all()) for p in sketch.parameters())


def test_cli_reports_the_layers_kept(gpt2_dir, tmp_path, capsys):
    from tests.test_cli_linearize_lm import _text_file

    _text_file(tmp_path / "t.txt", 300)
    rc = main(["linearize", "--model-dir", str(gpt2_dir), "--text", str(tmp_path / "t.txt"), "--attention", "hedgehog",
               "--m", "4", "--window", "3", "--sinks", "1", "--seq-len", "16", "--gate-init", "0",
               "--transfer-steps", "3", "--transfer-lr", "1e30", "--out", str(tmp_path / "o"), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0
    assert re.search(r"sketchlab: warning: linearize: stage transfer made the held-back attention error of 2 of 2 "
                     r"layer\(s\) worse", captured.err), captured.err
    assert "stage transfer made layers [0, 1] worse: they keep their maps from before it" in captured.out
    assert "keep what they had before the stage" in (tmp_path / "o" / "linearize.md").read_text()
    assert json.loads((tmp_path / "o" / "linearize.json").read_text())["stages"][1]["kept_initial"] == [0, 1]


# ------------------------------------------------------------------------------------------------
# 5. silent garbage at the numeric edges: exact polynomial attention


def _qkv(scale=1.0, T=6, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(1, T, 2, 4, generator=gen, dtype=torch.float64) * s).to(dtype) for s in (scale, scale, 1.0))


@pytest.mark.parametrize("p", [3, 5])
def test_poly_attention_odd_p_sum_warns_like_the_feature_maps(p):
    """(q·k)^p of odd p is signed: ``normalize="sum"`` divides by sums <= 0 in some rows; the same
    warning (and ``denominator_check="raise"``) as the feature-map paths give."""
    from sketchlab.attention import poly_attention

    q, k, v = _qkv(seed=1)
    with pytest.warns(RuntimeWarning, match=r"poly_attention: \d+ of 12 query rows have a normalising denominator <= 0"):
        poly_attention(q, k, v, p)
    with pytest.raises(FloatingPointError, match=r"poly_attention: \d+ of 12 query rows"):
        poly_attention(q, k, v, p, denominator_check="raise")
    poly_attention(q, k, v, p, denominator_check="off")  # asked for: silent
    poly_attention(q, k, v, p, normalize="none")  # no division: nothing to warn of


@pytest.mark.parametrize("dtype,scale,p", [(torch.float32, 1e6, 8), (torch.float64, 1e40, 8), (torch.float32, 30.0, 40)])
@pytest.mark.parametrize("normalize", ["sum", "none"])
def test_poly_attention_overflow_is_refused_not_nan(dtype, scale, p, normalize):
    from sketchlab.attention import poly_attention

    q, k, v = _qkv(scale, dtype=dtype)
    with pytest.raises(ValueError, match=rf"poly_attention: \(q·k\)\^{p} overflows {str(dtype)[6:]} in \d+ of 12 query "
                                         r"rows \(largest \|q·k\| = .*\); scale q and k down"):
        poly_attention(q, k, v, p, normalize=normalize, max_bytes=2**30)


# ------------------------------------------------------------------------------------------------
# 7. the long-context memory options (cache, decay, state, beta, exact layers): each bad value a
# clear error naming it, through the API (convert_attention, linearize) and the CLI (exit 2, one
# line naming the flag), before any work


MEMORY_BAD = [  # (API keyword arguments, CLI flags, what the message says)
    ({"cache": -1}, ["--cache", "-1"], r"cache must be an integer >= 0, got -1"),
    ({"cache": 3, "window": 0, "sinks": 0}, ["--cache", "3", "--window", "0"], r"cache=3 needs window >= 1"),
    ({"decay": 1.5}, ["--decay", "1.5"], r"decay \(a fixed decay per step\) must be a finite number > 0.0 and <= 1.0, got 1.5"),
    ({"decay": 0.0}, ["--decay", "0"], r"decay \(a fixed decay per step\) must be a finite number > 0.0 and <= 1.0, got 0.0"),
    ({"decay": float("nan")}, ["--decay", "nan"], r"decay \(a fixed decay per step\) must be a finite number > 0.0 and <= 1.0, got nan"),
    ({"decay": "gla"}, ["--decay", "gla"], r"decay must be one of \['head', 'input'\], got 'gla'"),
    ({"state": "x"}, ["--state", "x"], r"state must be one of \['additive', 'delta'\], got 'x'"),
    ({"state": "delta", "beta": "x"}, ["--state", "delta", "--beta", "x"], r"beta must be one of \['head', 'input'\], got 'x'"),
]
EXACT_BAD = [  # the tiny models have 2 layers
    ([2], ["--exact-layers", "2"], r"exact_layers: 2 is not a layer index in \[0, 2\)"),
    ([-1], ["--exact-layers", "-1"], r"exact_layers: -1 is not a layer index in \[0, 2\)"),
    ([0, 0], ["--exact-layers", "0,0"], r"exact_layers lists a layer twice: \[0, 0\]"),
    ([0, 1], ["--exact-layers", "0,1"], r"exact_layers keeps all 2 layers exact: nothing would be converted"),
]


def _no_work(monkeypatch):
    """Any teacher pass fails the test: a refusal must come before the work."""
    import importlib

    lin = importlib.import_module("sketchlab.convert.linearize")
    monkeypatch.setattr(lin, "teacher_attention", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))


@pytest.mark.parametrize("kwargs,flags,match", MEMORY_BAD, ids=[" ".join(c[1]) for c in MEMORY_BAD])
@pytest.mark.parametrize("entry", ["convert_attention", "linearize"])
def test_bad_memory_values_are_named_by_the_api(kwargs, flags, match, entry, monkeypatch):
    from sketchlab.convert import linearize

    _no_work(monkeypatch)
    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = {"attention": "hedgehog", "m": 4, "window": 3, "sinks": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        if entry == "convert_attention":
            convert_attention(model, **options)
        else:
            linearize(model, _ids(16).repeat(4, 1), seq_len=16, **options)
    assert not hasattr(model.config, "sketchlab") and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_lora_on_the_toy_model_is_refused_before_any_work(monkeypatch):
    """Not when stage 2 starts, after the teacher recording and stages 0 and 1: ``lora_steps``, the rule and the
    value, before the texts are even read (``lora_finetune`` by the same rule, naming its ``steps``)."""
    import importlib

    from sketchlab.convert import linearize, lora_finetune

    lin = importlib.import_module("sketchlab.convert.linearize")
    _no_work(monkeypatch)
    for name in ("tokenize_texts", "StageMeasures"):
        monkeypatch.setattr(lin, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    model = _toy_converted_teacher()
    ids = torch.randint(1, 16, (4, 16), generator=torch.Generator().manual_seed(0))
    rule = r"the LoRA stage supports transformers models \(peft\), not the toy model .*sketchlab.tasks.train_mqar"
    with pytest.raises(ValueError, match=rf"^lora_steps=2: {rule}"):
        linearize(model, ids, attention="hedgehog", m=4, window=3, sinks=1, seq_len=16, lora_steps=2)
    with pytest.raises(ValueError, match=rf"^steps=3: {rule}"):
        lora_finetune(model, ids, torch.ones_like(ids), [0, 1], steps=3)
    assert not any(type(m).__name__ == "SketchedAttention" for m in model.modules())


@pytest.mark.parametrize("layers,flags,match", EXACT_BAD, ids=[" ".join(c[1]) for c in EXACT_BAD])
@pytest.mark.parametrize("entry", ["convert_attention", "linearize"])
def test_bad_exact_layers_are_named_by_the_api(layers, flags, match, entry, monkeypatch):
    from sketchlab.convert import linearize

    _no_work(monkeypatch)
    model = _llama()
    with pytest.raises(ValueError, match=match):
        if entry == "convert_attention":
            convert_attention(model, attention="hedgehog", m=4, window=3, sinks=1, exact_layers=layers)
        else:
            linearize(model, _ids(16).repeat(4, 1), seq_len=16, attention="hedgehog", m=4, window=3, sinks=1,
                      exact_layers=layers)
    assert not hasattr(model.config, "sketchlab")


@pytest.mark.parametrize("entry", ["convert_attention", "linearize"])
def test_memory_on_an_encoder_is_refused_naming_it(entry, monkeypatch):
    from sketchlab.convert import linearize

    _no_work(monkeypatch)
    with pytest.raises(ValueError, match=r"cache=2 need causal=True"):
        if entry == "convert_attention":
            convert_attention(_bert(), attention="hedgehog", m=4, window=3, sinks=1, cache=2)
        else:
            linearize(_bert(), _ids(16).repeat(4, 1), seq_len=16, attention="hedgehog", m=4, window=3, sinks=1,
                      cache=2)


@pytest.mark.parametrize("kwargs,flags,match", MEMORY_BAD + EXACT_BAD, ids=[" ".join(c[1]) for c in MEMORY_BAD + EXACT_BAD])
def test_bad_memory_flags_exit_2_naming_the_flag(kwargs, flags, match, gpt2_dir, tmp_path, capsys, monkeypatch):
    from tests.test_cli_linearize_lm import _text_file

    _no_work(monkeypatch)
    _text_file(tmp_path / "t.txt", 50)
    flag = flags[0] if flags[0] != "--window" else "--cache"
    _cli_exit_2(["linearize", "--model-dir", str(gpt2_dir), "--text", str(tmp_path / "t.txt"), "--attention",
                 "hedgehog", "--m", "4", "--window", "3", "--sinks", "0", "--out", str(tmp_path / "o"), "--no-progress",
                 *flags], capsys, re.escape(flag) + r" .*: .*" + match)
    assert not (tmp_path / "o").exists()


def test_memory_flag_on_an_encoder_exits_2_naming_it(tmp_path, capsys, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.test_cli_linearize_lm import WORDS, _text_file

    _no_work(monkeypatch)
    _bert().save_pretrained(tmp_path / "bert")
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "bert")
    _text_file(tmp_path / "t.txt", 50)
    capsys.readouterr()  # save_pretrained's progress bar
    _cli_exit_2(["linearize", "--model-dir", str(tmp_path / "bert"), "--text", str(tmp_path / "t.txt"), "--attention",
                 "hedgehog", "--m", "4", "--window", "3", "--out", str(tmp_path / "o"), "--no-progress",
                 "--decay", "head"], capsys, r"--decay head, .*an encoder\): decay='head' need causal=True")
    assert not (tmp_path / "o").exists()
