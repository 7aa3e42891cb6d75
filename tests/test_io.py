"""Q/K dump I/O: round trips in every format and layout, and one corrupt file per validation rule."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sketchlab.io import QKDump, atomic_write, load_qk, load_theta, save_qk, save_theta, select_indices, validate_qk

FORMATS = ["safetensors", "pt", "npz", "npy"]


def _qkv(shape=(3, 2, 5, 4), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g, dtype=dtype) for _ in range(3))


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(5, 4), (2, 5, 4), (3, 2, 5, 4)], ids=["n,d", "H,n,d", "L,H,n,d"])
@pytest.mark.parametrize("with_v", [True, False])
def test_round_trip(tmp_path, fmt, shape, with_v):
    q, k, v = _qkv(shape)
    meta = {"source": "unit test", "scale": "none"}
    written = save_qk(tmp_path / f"dump.{fmt}", q, k, v if with_v else None, meta=meta)
    dump = load_qk(written)
    assert isinstance(dump, QKDump)
    full = (1,) * (4 - len(shape)) + shape  # the loader's [L, H, n, d]
    # A lossless format: bit-exact equality, dtype kept.
    torch.testing.assert_close(dump.q, q.reshape(full), rtol=0, atol=0)
    torch.testing.assert_close(dump.k, k.reshape(full), rtol=0, atol=0)
    if with_v:
        torch.testing.assert_close(dump.v, v.reshape(full), rtol=0, atol=0)
    else:
        assert dump.v is None
    assert dump.meta == {**meta, "layout": "L,H,n,d"}
    assert dump.path == written


def test_npy_round_trip_by_any_sibling_name(tmp_path):
    q, k, v = _qkv()
    written = save_qk(tmp_path / "x.npy", q, k, v)
    assert written == tmp_path / "x.q.npy"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.k.npy", "x.meta.json", "x.q.npy", "x.v.npy"]
    for name in ("x.npy", "x.q.npy", "x.k.npy", "x.v.npy"):
        torch.testing.assert_close(load_qk(tmp_path / name).k, k, rtol=0, atol=0)
    # Re-saving without v removes the stale v file instead of reading it back later.
    save_qk(tmp_path / "x.q.npy", q, k)
    assert load_qk(tmp_path / "x.npy").v is None


def test_bfloat16_round_trip_through_numpy_widens_exactly(tmp_path):
    q, k, _ = _qkv(dtype=torch.float32)
    q, k = q.bfloat16(), k.bfloat16()
    dump = load_qk(save_qk(tmp_path / "b.npz", q, k))
    assert dump.q.dtype == torch.float32  # numpy has no bfloat16; widening is exact
    torch.testing.assert_close(dump.q, q.float(), rtol=0, atol=0)
    torch.testing.assert_close(load_qk(save_qk(tmp_path / "b.safetensors", q, k)).q, q, rtol=0, atol=0)


@pytest.mark.parametrize("layer_shape", [(2, 5, 4), (5, 4)], ids=["H,n,d", "n,d"])
def test_dict_keyed_by_layer_in_every_format(tmp_path, layer_shape):
    L = 3
    qs, ks, vs = zip(*(_qkv(layer_shape, seed=i) for i in range(L)))
    flat = {f"{name}.{i}": t[i] for name, t in (("q", qs), ("k", ks), ("v", vs)) for i in range(L)}
    save_file({n: t.contiguous() for n, t in flat.items()}, str(tmp_path / "a.safetensors"))
    np.savez(tmp_path / "a.npz", **{n: t.numpy() for n, t in flat.items()})
    torch.save(flat, tmp_path / "flat.pt")
    torch.save({"q": dict(enumerate(qs)), "k": {str(i): t for i, t in enumerate(ks)}}, tmp_path / "nested.pt")
    expect_q = torch.stack([t if t.ndim == 3 else t[None] for t in qs])  # [L, H, n, d]
    for name in ("a.safetensors", "a.npz", "flat.pt", "nested.pt"):
        dump = load_qk(tmp_path / name)
        torch.testing.assert_close(dump.q, expect_q, rtol=0, atol=0, msg=name)
        assert dump.q.shape == (L,) + ((2,) if len(layer_shape) == 3 else (1,)) + (5, 4)


def test_layer_and_head_selection(tmp_path):
    q, k, v = _qkv((4, 3, 5, 2))
    path = save_qk(tmp_path / "s.safetensors", q, k, v)
    dump = load_qk(path, layers=[0, 2, -1], heads=[1])
    torch.testing.assert_close(dump.q, q[[0, 2, 3]][:, [1]], rtol=0, atol=0)
    torch.testing.assert_close(dump.v, v[[0, 2, 3]][:, [1]], rtol=0, atol=0)
    torch.testing.assert_close(load_qk(path, layers=1).k, k[1:2], rtol=0, atol=0)


@pytest.mark.parametrize("kw,msg", [
    ({"layers": [4]}, r"layer 4 is out of range: the dump has 4 layers \(valid indices 0\.\.3, or -4\.\.-1"),
    ({"layers": [-5]}, r"layer -5 is out of range: the dump has 4 layers"),
    ({"heads": [0, 3]}, r"head 3 is out of range: the dump has 3 heads \(valid indices 0\.\.2"),
    ({"heads": []}, r"heads must be a non-empty list of integers, got \[\]"),
    ({"layers": [0.5]}, r"layers must be a list of integers, got \[0\.5\]"),
    ({"layers": [1, 1]}, r"layers contain duplicates: \[1, 1\] selects position\(s\) \[1\] more than once"),
    # -4 is layer 0 of 4: a duplicate once negative indices are resolved
    ({"layers": [0, -4]}, r"layers contain duplicates: \[0, -4\] selects position\(s\) \[0\]"),
])
def test_selection_out_of_range_names_file_and_range(tmp_path, kw, msg):
    q, k, _ = _qkv((4, 3, 5, 2))
    path = save_qk(tmp_path / "s.safetensors", q, k)
    with pytest.raises(ValueError, match=msg) as err:
        load_qk(path, **kw)
    assert str(path) in str(err.value)


def test_save_is_atomic_and_leaves_no_temporary_files(tmp_path):
    q, k, _ = _qkv()
    path = tmp_path / "a.safetensors"
    save_qk(path, q, k)
    before = path.read_bytes()
    with pytest.raises(ValueError, match="non-finite"):
        save_qk(path, q, k * float("nan"))  # validation fails before any write
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_write(path) as tmp:
            tmp.write_bytes(b"half a file")
            raise RuntimeError("boom")
    assert path.read_bytes() == before  # the old file survives a failed write
    assert os.listdir(tmp_path) == ["a.safetensors"]  # and no temporary is left behind


# ---------------------------------------------------------------------------------------------
# one corrupt file per validation rule


def _write_raw(path, entries, meta=None):
    """Write entries as stored, bypassing save_qk's validation."""
    ext = path.suffix
    if ext == ".safetensors":
        save_file({n: t.contiguous().clone() for n, t in entries.items()}, str(path), metadata=meta)
    elif ext == ".pt":
        torch.save({**entries, **({"meta": meta} if meta else {})}, path)
    elif ext == ".npz":
        extra = {"__metadata__": np.array(json.dumps(meta))} if meta else {}
        np.savez(path, **{n: t.numpy() for n, t in entries.items()}, **extra)
    else:
        base = str(path)[: -len(".npy")]
        for n, t in entries.items():
            np.save(f"{base}.{n}.npy", t.numpy())
    return path


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_reports_count_and_first_index(tmp_path, fmt):
    q, k, _ = _qkv((2, 2, 5, 4))
    k[1, 0, 3, 2] = float("nan")
    k[1, 1, 0, 0] = float("inf")
    path = _write_raw(tmp_path / f"bad.{fmt}", {"q": q, "k": k})
    with pytest.raises(ValueError) as err:
        load_qk(path)
    text = str(err.value)
    assert "tensor k must be finite" in text
    assert "2 non-finite value(s) of 80" in text
    assert "first at index (1, 0, 3, 2)" in text
    assert str(tmp_path / "bad") in text


@pytest.mark.parametrize("fmt", FORMATS)
def test_mismatched_q_k_shapes(tmp_path, fmt):
    q, k, _ = _qkv((2, 2, 5, 4))
    path = _write_raw(tmp_path / f"bad.{fmt}", {"q": q, "k": k[:, :, :4]})
    with pytest.raises(ValueError, match=r"tensors q and k must have the same shape .* q \(2, 2, 5, 4\) and k \(2, 2, 4, 4\)"):
        load_qk(path)


def test_v_must_match_k_tokens(tmp_path):
    q, k, v = _qkv((2, 2, 5, 4))
    path = _write_raw(tmp_path / "bad.safetensors", {"q": q, "k": k, "v": v[:, :1]})
    with pytest.raises(ValueError, match=r"bad.safetensors: tensor v must match k in \[L, H, n\]"):
        load_qk(path)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(7,), (1, 2, 2, 5, 4)], ids=["rank1", "rank5"])
def test_wrong_rank(tmp_path, fmt, shape):
    q = torch.ones(shape)
    path = _write_raw(tmp_path / f"bad.{fmt}", {"q": q, "k": q})
    with pytest.raises(ValueError, match=rf"tensor q must have rank 2 \[n, d\], 3 \[H, n, d\] or 4 \[L, H, n, d\], got rank {len(shape)}"):
        load_qk(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_tensor(tmp_path, fmt):
    q = torch.ones(2, 0, 4)
    path = _write_raw(tmp_path / f"bad.{fmt}", {"q": q, "k": q})
    with pytest.raises(ValueError, match=r"bad.*: tensor q is empty, shape \(1, 2, 0, 4\)"):
        load_qk(path)


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "npz"])
def test_empty_file(tmp_path, fmt):
    path = tmp_path / f"bad.{fmt}"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"bad.{fmt}: the file is empty \(0 bytes\)"):
        load_qk(path)


@pytest.mark.parametrize("name", ["dump.h5", "dump", "dump.safetensor", "dump.json"])
def test_unknown_extension(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"whatever")
    with pytest.raises(ValueError, match=r"unknown extension .* must end in one of \.safetensors, \.pt, \.npz, \.npy"):
        load_qk(path)
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match="unknown extension"):
        save_qk(path, q, k)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_truncated_or_corrupt_file(tmp_path, fmt, how):
    q, k, _ = _qkv()
    written = save_qk(tmp_path / f"ok.{fmt}", q, k)
    raw = written.read_bytes()
    bad = raw[: len(raw) // 2] if how == "truncated" else b"\x93NUMPY garbage" + bytes(range(256)) * 4
    written.write_bytes(bad)
    with pytest.raises(ValueError, match=r"unreadable .* \(truncated|unreadable .*corrupt") as err:
        load_qk(written)
    assert str(written) in str(err.value)


def test_pickled_pt_is_refused_by_weights_only(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"q": torch.ones(2, 2), "k": torch.ones(2, 2), "x": object()}, path)  # needs pickle
    with pytest.raises(ValueError, match="evil.pt: unreadable .pt file .*not weights-only"):
        load_qk(path)


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (2, 5, 4), (5,)])
def test_single_npy_array_is_ambiguous(tmp_path, shape):
    path = tmp_path / "stacked.npy"
    np.save(path, np.ones(shape))
    hint = "its leading axis of size 2 could be the \\(q, k\\) pair or L=2 layers" if shape[0] == 2 else "one array cannot hold both q and k"
    with pytest.raises(ValueError, match=rf"stacked.npy: a single .npy array of shape {re.escape(str(shape))} is ambiguous \({hint}\)"):
        load_qk(path)


def test_missing_file_and_missing_tensor(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors: no such file"):
        load_qk(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError, match="no such dump"):
        load_qk(tmp_path / "nope.npy")
    path = _write_raw(tmp_path / "onlyq.safetensors", {"q": torch.ones(3, 2)})
    with pytest.raises(ValueError, match="onlyq.safetensors: tensor k is missing"):
        load_qk(path)


def test_unexpected_entry_and_mixed_layouts(tmp_path):
    q, k, _ = _qkv((2, 5, 4))
    with pytest.raises(ValueError, match=r"unexpected entry 'query'"):
        load_qk(_write_raw(tmp_path / "a.safetensors", {"query": q, "q": q, "k": k}))
    with pytest.raises(ValueError, match=r"tensor q is given both whole \('q'\) and per layer"):
        load_qk(_write_raw(tmp_path / "b.safetensors", {"q": q, "q.0": q, "k": k}))


def test_layer_dict_rules(tmp_path):
    a = torch.ones(2, 5, 4)
    with pytest.raises(ValueError, match=r"layers must be numbered 0\.\.L-1 without gaps, got \[0, 2\]"):
        load_qk(_write_raw(tmp_path / "gap.safetensors", {"q.0": a, "q.2": a, "k.0": a, "k.1": a}))
    with pytest.raises(ValueError, match=r"every layer must have the same shape, layer 0 has \(2, 5, 4\), layer 1 has \(2, 4, 4\)"):
        load_qk(_write_raw(tmp_path / "ragged.safetensors", {"q.0": a, "q.1": a[:, :4], "k.0": a, "k.1": a}))
    with pytest.raises(ValueError, match=r"tensor q\[layer 0\] must have rank 2 \[n, d\] or 3 \[H, n, d\], got rank 4"):
        load_qk(_write_raw(tmp_path / "r4.safetensors", {"q.0": a[None], "k.0": a[None]}))
    torch.save({"q": {"first": a}, "k": a}, tmp_path / "key.pt")
    with pytest.raises(ValueError, match=r"layer keys must be integers \(or digit strings\), got 'first'"):
        load_qk(tmp_path / "key.pt")


def test_dtype_and_metadata_rules(tmp_path):
    i = torch.ones(5, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"ints.safetensors: tensor q must have a real floating-point dtype .*, got torch.int64"):
        load_qk(_write_raw(tmp_path / "ints.safetensors", {"q": i, "k": i}))
    with pytest.raises(ValueError, match=r"ints.npz: tensor q must be a floating-point array, got dtype int64"):
        load_qk(_write_raw(tmp_path / "ints.npz", {"q": i, "k": i}))
    f = torch.ones(2, 5, 4)
    with pytest.raises(ValueError, match=r"metadata layout 'L,H,n,d' names 4 axes but the tensor has rank 3"):
        load_qk(_write_raw(tmp_path / "lay.safetensors", {"q": f, "k": f}, meta={"layout": "L,H,n,d"}))
    assert load_qk(_write_raw(tmp_path / "ok.safetensors", {"q": f, "k": f}, meta={"layout": "[H, n, d]"})).q.shape == (1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"metadata layout 'B,T,H,D' has an axis name 'B' that is not understood; accepted names .*layer: layer/layers/l"):
        load_qk(_write_raw(tmp_path / "lay2.pt", {"q": f, "k": f}, meta={"layout": "B,T,H,D"}))
    with pytest.raises(ValueError, match=r"metadata must map strings to strings .* 'p': 2 \(int\)"):
        save_qk(tmp_path / "m.safetensors", f, f, meta={"p": 2})
    (tmp_path / "j.meta.json").write_text("{not json")
    np.save(tmp_path / "j.q.npy", f.numpy())
    np.save(tmp_path / "j.k.npy", f.numpy())
    with pytest.raises(ValueError, match=r"j.meta.json: corrupt metadata file, not JSON"):
        load_qk(tmp_path / "j.npy")



def test_safetensors_bytes_do_not_depend_on_metadata_order(tmp_path):
    # safetensors writes __metadata__ from a hash map (process-dependent order); save_qk must
    # produce the same bytes for the same dump, whatever the insertion order of meta.
    q, k, v = _qkv(dtype=torch.float32)
    keys = [f"key{i}" for i in range(12)]
    a = save_qk(tmp_path / "a.safetensors", q, k, v, meta={key: key.upper() for key in keys})
    b = save_qk(tmp_path / "b.safetensors", q, k, v, meta={key: key.upper() for key in reversed(keys)})
    assert a.read_bytes() == b.read_bytes()
    assert (8 + int.from_bytes(a.read_bytes()[:8], "little")) % 8 == 0  # data section stays 8-byte aligned
    dump = load_qk(a)
    torch.testing.assert_close(dump.v, v, rtol=0, atol=0)
    assert dump.meta == {**{key: key.upper() for key in keys}, "layout": "L,H,n,d"}


# ---------------------------------------------------------------------------------------------
# shared helpers used by compare/capture


def test_select_indices_rules():
    assert select_indices(None, 3, "head", "d") == [0, 1, 2]
    assert select_indices(-1, 3, "head", "d") == [2]
    assert select_indices((2, -3), 3, "head", "d") == [2, 0]  # order kept, negatives resolved
    with pytest.raises(ValueError, match=r"^d: heads must be a list of integers, got \[True\]$"):
        select_indices([True], 3, "head", "d")
    with pytest.raises(ValueError, match=r"^d: heads must be a non-empty list of integers, got 'x'$"):
        select_indices("x", 3, "head", "d")


def test_validate_qk_normalises_and_names_the_source():
    q = torch.randn(5, 4, dtype=torch.float64)
    tq, tk, tv = validate_qk(q, q.clone(), where="mem")
    assert tq.shape == tk.shape == (1, 1, 5, 4) and tv is None
    with pytest.raises(ValueError, match=r"^mem: tensors q and k must have the same shape"):
        validate_qk(q, q[:3], where="mem")
    with pytest.raises(ValueError, match=r"^mem: tensor k must have rank 2 \[n, d\], 3 \[H, n, d\] or 4"):
        validate_qk(q, q[None, None, None], where="mem")


# ---------------------------------------------------------------------------------------------
# Θ export

SHA = "0123456789abcdef" * 4


def _theta(L=2, H=3, t=2, p=2, d=4, m=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, H, t, p, d, m, generator=g, dtype=dtype),
            torch.randn(L, H, t, p, d, m, generator=g, dtype=dtype))


def _theta_kw(**over):
    kw = dict(p=2, m=5, t=2, d=4, method="llops", scale="sqrt-d", source_sha256=SHA,
              errors={"rel_mae": [0.1, 0.2], "holdout_optimality_ratio": float("inf")}, sketchlab_version="0.1.0")
    kw.update(over)
    return kw


def test_theta_round_trip(tmp_path):
    tq, tk = _theta(dtype=torch.float64)
    path = save_theta(tmp_path / "theta.safetensors", tq, tk, **_theta_kw())
    lq, lk, meta = load_theta(path)
    torch.testing.assert_close(lq, tq, rtol=0, atol=0)  # stored bit-exactly, dtype kept
    torch.testing.assert_close(lk, tk, rtol=0, atol=0)
    assert meta == {"p": 2, "m": 5, "t": 2, "d": 4, "method": "llops", "scale": "sqrt-d", "source_sha256": SHA,
                    "errors": {"rel_mae": [0.1, 0.2], "holdout_optimality_ratio": float("inf")},
                    "sketchlab_version": "0.1.0", "tied": False}
    # the same call writes the same bytes (canonical header), and leaves no temporary file
    first = path.read_bytes()
    save_theta(path, tq, tk, **_theta_kw())
    assert path.read_bytes() == first and sorted(x.name for x in tmp_path.iterdir()) == ["theta.safetensors"]
    # a numeric scale is stored with compare's label
    save_theta(path, tq, tq, **_theta_kw(scale=0.5))
    assert load_theta(path)[2]["scale"] == "0.5"


@pytest.mark.parametrize("over,shape,err,msg", [
    ({"m": 6}, None, ValueError,
     r"tensor theta_q has shape \(2, 3, 2, 2, 4, 5\), but the metadata says \[L, H, t, p, d, m\] = \[L, H, 2, 2, 4, 6\]"),
    ({"p": 0}, None, ValueError, r"metadata p must be a decimal integer >= 1, got '0'"),
    ({"t": 2.0}, None, TypeError, r"t must be an integer >= 1, got 2\.0"),
    ({"source_sha256": "abc"}, None, ValueError, r"source_sha256 must be 64 lowercase hex digits.*got 'abc'"),
    ({"method": ""}, None, ValueError, r"metadata method must be a non-empty string"),
    ({"scale": -1.0}, None, ValueError, r"scale must be 'none', 'sqrt-d' or a positive finite number, got -1\.0"),
    ({"errors": {"x": object()}}, None, TypeError, r"errors must be JSON-serialisable"),
    ({"errors": [1]}, None, TypeError, r"errors must be a dict with string keys"),
    ({}, (2, 2, 4, 5), ValueError, r"tensor theta_q must have rank 6 \[L, H, t, p, d, m\], got rank 4"),
])
def test_save_theta_rejects(tmp_path, over, shape, err, msg):
    tq, tk = _theta()
    if shape is not None:
        tq = tq[0, 0]
    path = tmp_path / "theta.safetensors"
    with pytest.raises(err, match=msg) as info:
        save_theta(path, tq, tk, **_theta_kw(**over))
    assert str(path) in str(info.value) and not path.exists()


def test_save_theta_rejects_mismatch_nan_and_extension(tmp_path):
    tq, tk = _theta()
    with pytest.raises(ValueError, match=r"theta_q \(2, 3, 2, 2, 4, 5\) and theta_k \(1, 3, 2, 2, 4, 5\) must have the same"):
        save_theta(tmp_path / "a.safetensors", tq, tk[:1], **_theta_kw())
    tk[1, 2, 0, 1, 3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"tensor theta_k must be finite: 1 non-finite value\(s\).*\(1, 2, 0, 1, 3, 4\)"):
        save_theta(tmp_path / "a.safetensors", tq, tk, **_theta_kw())
    with pytest.raises(ValueError, match=r"a Θ export must be a \.safetensors file, got extension '\.pt'"):
        save_theta(tmp_path / "a.pt", tq, tq, **_theta_kw())
    assert list(tmp_path.iterdir()) == []


def _raw_theta(path, meta_over=None, drop=(), tensors=None):
    """Write a Θ file by hand (bypassing save_theta's checks) with some metadata replaced/dropped."""
    tq, tk = _theta()
    meta = {"p": "2", "m": "5", "t": "2", "d": "4", "method": "llops", "scale": "none", "source_sha256": SHA,
            "errors": "{}", "sketchlab_version": "0.1.0", "layout": "L,H,t,p,d,m", **(meta_over or {})}
    for key in drop:
        meta.pop(key)
    save_file(tensors if tensors is not None else {"theta_q": tq, "theta_k": tk}, str(path), metadata=meta)
    return path


@pytest.mark.parametrize("meta_over,drop,msg", [
    ({}, ("errors", "d"), r"metadata is missing 'd', 'errors'; a Θ export records p, m, t, d"),
    ({"p": "two"}, (), r"metadata p must be a decimal integer >= 1, got 'two'"),
    ({"m": "-5"}, (), r"metadata m must be a decimal integer >= 1, got '-5'"),
    ({"errors": "{not json"}, (), r"metadata errors must be a JSON object, not valid JSON"),
    ({"errors": "[1, 2]"}, (), r"metadata errors must be a JSON object, got JSON list"),
    ({"d": "3"}, (), r"tensor theta_q has shape \(2, 3, 2, 2, 4, 5\), but the metadata says .* = \[L, H, 2, 2, 3, 5\]"),
    ({"layout": "L,H,n,d"}, (), r"metadata layout must be 'L,H,t,p,d,m' for a Θ export, got 'L,H,n,d'"),
    ({"source_sha256": SHA.upper()}, (), r"source_sha256 must be 64 lowercase hex digits"),
    ({"tied": "yes"}, (), r"metadata tied must be 'true' or 'false', got 'yes'"),
])
def test_load_theta_rejects_corrupt_metadata(tmp_path, meta_over, drop, msg):
    path = _raw_theta(tmp_path / "bad.safetensors", meta_over, drop)
    with pytest.raises(ValueError, match=msg) as info:
        load_theta(path)
    assert str(path) in str(info.value)


def test_load_theta_rejects_bad_tensors_and_files(tmp_path):
    tq, tk = _theta()
    path = _raw_theta(tmp_path / "x.safetensors", tensors={"theta_q": tq, "theta_k": tk, "v": tk.clone()})
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \['v'\]; a Θ export holds exactly theta_q and theta_k"):
        load_theta(path)
    path = _raw_theta(tmp_path / "y.safetensors", tensors={"theta_q": tq})
    with pytest.raises(ValueError, match=r"y\.safetensors: tensor theta_k is missing"):
        load_theta(path)
    path = _raw_theta(tmp_path / "w.safetensors", {"tied": "true"})  # tied, yet both tensors
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \['theta_k'\]; a Θ export holds theta_q alone"):
        load_theta(path)
    path = _raw_theta(tmp_path / "u.safetensors", {"tied": "false"})  # said explicitly: two tensors
    assert load_theta(path)[2]["tied"] is False
    path = _raw_theta(tmp_path / "z.safetensors", tensors={"theta_q": tq, "theta_k": tk.to(torch.int32)})
    with pytest.raises(ValueError, match=r"tensor theta_k must have a real floating-point dtype .*, got torch\.int32"):
        load_theta(path)
    good = save_theta(tmp_path / "good.safetensors", tq, tk, **_theta_kw())
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(good.read_bytes()[:-40])
    with pytest.raises(ValueError, match=r"trunc\.safetensors: unreadable safetensors file"):
        load_theta(trunc)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_theta(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match=r"must be a \.safetensors file, got extension '\.npz'"):
        load_theta(tmp_path / "t.npz")


# ------------------------------------------------------------------------------------------------
# staged_directory: a run directory's files appear together or not at all


def _snapshot(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_staged_directory_creates_a_new_directory_in_one_step(tmp_path):
    from sketchlab.io import staged_directory

    out = tmp_path / "run"
    old_umask = os.umask(0o022)
    os.umask(old_umask)
    with staged_directory(out) as stage:
        assert stage.parent == tmp_path and stage.is_dir() and not out.exists()  # built aside
        (stage / "a.txt").write_text("a")
        (stage / "sub").mkdir()
        (stage / "sub" / "b.txt").write_text("b")
    assert _snapshot(out) == {"a.txt": b"a", "sub": None, "sub/b.txt": b"b"}
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~old_umask  # a new directory's usual mode, not mkdtemp's 0o700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing left beside it


def test_staged_directory_failure_in_the_block_leaves_the_directory_as_it_was(tmp_path):
    from sketchlab.io import staged_directory

    out = tmp_path / "run"
    with pytest.raises(OSError, match="disk full"), staged_directory(out) as stage:
        (stage / "a.txt").write_text("a")
        raise OSError("disk full")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    out.mkdir()
    (out / "a.txt").write_text("old a")
    (out / "keep.txt").write_text("mine")
    before = _snapshot(out)
    with pytest.raises(OSError, match="disk full"), staged_directory(out) as stage:
        (stage / "a.txt").write_text("new a")
        raise OSError("disk full")
    assert _snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_staged_directory_replaces_same_named_entries_and_keeps_the_others(tmp_path, monkeypatch):
    import sketchlab.io.atomic as atomic
    from sketchlab.io import staged_directory

    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    (out / "model" / "old.bin").write_bytes(b"old")
    (out / "done.json").write_text("old")
    (out / "finetune").mkdir()
    (out / "finetune" / "step-1").write_text("ckpt")
    link = tmp_path / "link"
    link.symlink_to(out, target_is_directory=True)
    moved_in = []
    real_rename = os.rename

    def rename(src, dst):
        if os.path.dirname(dst) == str(out) and os.path.dirname(src) != str(out):
            moved_in.append(os.path.basename(dst))
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with staged_directory(link, last=("done.json",)) as stage:
        (stage / "model").mkdir()
        (stage / "model" / "new.bin").write_bytes(b"new")
        (stage / "done.json").write_text("new")
    assert link.is_symlink()  # written through the link
    assert _snapshot(out) == {"done.json": b"new", "finetune": None, "finetune/step-1": b"ckpt", "model": None,
                              "model/new.bin": b"new"}
    assert moved_in == ["model", "done.json"]  # the file that marks the set finished comes last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "run"]


def test_staged_directory_undoes_the_moves_when_a_rename_fails(tmp_path, monkeypatch):
    """A rename failing half-way through the set (a file system error) puts every entry back."""
    import sketchlab.io.atomic as atomic
    from sketchlab.io import staged_directory

    out = tmp_path / "run"
    (out / "a").mkdir(parents=True)  # a directory (a rename cannot replace a non-empty one), two files
    (out / "a" / "x").write_text("old x")
    for name in ("b", "c"):
        (out / name).write_text(f"old {name}")
    before = _snapshot(out)
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src) == "c" and os.path.dirname(dst) == str(out) and "new" in Path(src).read_text():
            raise OSError("rename failed")  # the last new entry moving in (a, b and d are in by then)
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"), staged_directory(out, last=("c",)) as stage:
        (stage / "a").mkdir()
        (stage / "a" / "x").write_text("new x")
        for name in ("b", "c", "d"):  # d: a name the directory did not hold
            (stage / name).write_text(f"new {name}")
    assert _snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_staged_directory_refuses_a_file_or_a_missing_parent(tmp_path):
    from sketchlab.io import staged_directory

    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"output directory '.*f' is a file"):
        with staged_directory(tmp_path / "f"):
            pass
    with pytest.raises(FileNotFoundError, match=r"parent .*no.* does not exist"):
        with staged_directory(tmp_path / "no" / "run"):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_staged_directory_keeps_what_it_could_not_put_back(tmp_path, monkeypatch):
    """Moving the set in fails, and so does putting one replaced entry back: the staging directory is
    kept (the old entry is not deleted with it) and the error names where the old entries are."""
    import sketchlab.io.atomic as atomic
    from sketchlab.io import staged_directory

    out = tmp_path / "run"
    out.mkdir()
    for name in ("a", "b"):
        (out / name).write_text(f"old {name}")
    real_rename = os.rename

    def rename(src, dst):
        src, dst = Path(src), Path(dst)
        if src.name == "b" and dst.parent == out and src.read_text() == "new b":
            raise OSError("disk full")  # moving the new b in
        if src.name == "a" and dst.parent == out and src.read_text() == "old a":
            raise OSError("I/O error")  # putting the old a back
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(OSError, match=r"putting back a failed too: the previous entries are in '(.*previous[^']*)'") \
            as err, staged_directory(out, last=("b",)) as stage:
        for name in ("a", "b"):
            (stage / name).write_text(f"new {name}")
    kept = Path(re.search(r"are in '([^']*)'", str(err.value)).group(1))
    assert (kept / "a").read_text() == "old a"  # the old a survives where the error says
    assert (out / "b").read_text() == "old b" and not (out / "a").exists()


def test_staged_directory_refuses_a_mount_point_before_making_anything(tmp_path, monkeypatch):
    """An output directory on another file system than its parent (a container volume) cannot take the
    final renames (EXDEV): refused up front, by the library and by a command's output check."""
    import sketchlab.io.atomic as atomic
    from sketchlab.cli._common import Outputs
    from sketchlab.io import staged_directory

    out = tmp_path / "vol"
    out.mkdir()
    real = atomic._device
    monkeypatch.setattr(atomic, "_device", lambda p: real(p) + (1 if Path(p) == out else 0))
    with pytest.raises(OSError, match="is a mount point"):
        with staged_directory(out):
            pass
    with pytest.raises(OSError, match="is a mount point"):
        Outputs({}, directories={"--out": str(out)}, staged=["--out"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vol"] and not any(out.iterdir())


def test_missing_output_directory_names_the_output_and_its_path(tmp_path):
    """An output in a directory that does not exist is refused before work, naming the label, the missing
    directory and the output path as given."""
    from sketchlab.io.atomic import check_output_paths

    out = tmp_path / "nope" / "x.json"
    with pytest.raises(FileNotFoundError, match=r"^--json: output directory .*nope' does not exist \(for '.*nope/x\.json'\)"):
        check_output_paths({"--json": out})
