"""Bad and extreme input, through the CLI and the API: a clear error (exit code, message naming the
file/tensor/rule and the way out), never a traceback, inf/NaN output, a stall, or a lost file.

Every CLI case hashes every file in the run's directory before and after: a rejected run must leave
its inputs (and any existing output) byte-for-byte unchanged.
"""

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import sketchlab.io as sio
from sketchlab import fit_sketch, load_qk, load_theta, poly_features, poly_kernel, save_qk, save_theta
from sketchlab._validation import MAX_DEGREE, as_float_tensor, check_pair
from sketchlab.cli import main
from sketchlab.featuremaps._common import make_generator
from sketchlab.featuremaps.psf_random import PSFRandomMap
from sketchlab.featuremaps.tensorsketch import TensorSketchMap, tensorsketch_features

SHA = "0" * 64


def _qk(L=1, H=2, n=24, d=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, H, n, d, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(L, H, n, d, generator=g, dtype=torch.float64).to(dtype))


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """One directory of good and bad dumps; the CLI cases run against it."""
    root = tmp_path_factory.mktemp("bad_input")
    q, k = _qk()
    save_qk(root / "good.safetensors", q, k)
    save_qk(root / "npy.npy", q, k)
    save_qk(root / "huge64.safetensors", q.double() * 1e80, k.double() * 1e80)
    save_qk(root / "big32.safetensors", q * 1e10, k * 1e10)
    save_qk(root / "one.safetensors", q[:, :, :1], k[:, :, :1])
    zero = q.clone()
    zero[0, 1] = 0
    save_qk(root / "zero.safetensors", zero, k)
    # [n, d, L, H] stored with its layout spelled out: must load as [L, H, n, d]
    save_file({"q": q.permute(2, 3, 0, 1).contiguous(), "k": k.permute(2, 3, 0, 1).contiguous()},
              str(root / "seqfirst.safetensors"), metadata={"layout": "token, dim, layer, head"})
    save_file({"q": q[0].clone(), "k": k[0].clone()}, str(root / "batch.safetensors"), metadata={"layout": "batch,n,d"})
    save_file({"q": q.to(torch.float8_e4m3fn), "k": k.to(torch.float8_e4m3fn)}, str(root / "f8.safetensors"))
    torch.save({"q": q[0, 0].to_sparse(), "k": k[0, 0].to_sparse()}, root / "sparse.pt")
    return root


def _hashes(root: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


def _cli(argv, capsys, root):
    before = _hashes(root)
    rc = main(argv)
    captured = capsys.readouterr()
    after = _hashes(root)
    for name, digest in before.items():
        assert after.get(name) == digest, f"{name} was changed or removed by a run with exit {rc}"
    return rc, captured


# ------------------------------------------------------------------------------------------------
# CLI: each case is (argv after "compare", exit code, regex the one-line error must match)

COMPARE_CASES = [
    # unbounded work: rejected at once, not after a 48 s stall or a 2 GB allocation
    ("good.safetensors --p 1000000000 --m 4", 2, rf"argument --p: expected an integer in \[1, {MAX_DEGREE}\] .*got 1000000000"),
    # silent garbage: scales whose kernel overflows the fitting dtype
    ("good.safetensors --p 2 --m 4 --methods psf --scale 1e30", 2, r"the kernel \(qᵀk\)\^p with p=2 overflows torch.float32 at head \(0, 0\).*--scale"),
    ("huge64.safetensors --p 2 --m 4 --methods optimal", 2, r"overflows torch.float64 at head \(0, 0\): max \|qᵀk\| = .*e\+160"),
    ("big32.safetensors --p 2 --m 4 --methods optimal,psf", 2, r"overflows torch.float32.*convert the dump to float64"),
    ("good.safetensors --p 100 --m 4 --methods psf --scale none", 2, r"overflows torch.float32"),
    # vague messages made precise
    ("one.safetensors --p 2 --m 1 --methods psf", 2, r"one.safetensors: n=1 token\(s\), and holdout 0.25 leaves 0 to fit.*--holdout"),
    ("zero.safetensors --p 2 --m 4 --methods psf", 2, r"zero.safetensors: tensor q of layer 0, head 1 is all zeros.*--heads"),
    ("good.safetensors --p 2 --m 4 --methods psf --seed 18446744073709551616", 2,
     r"argument --seed: expected an integer seed in \[0, 2\*\*62\], got 18446744073709551616"),
    ("missing.npy --p 2 --m 4", 2, r"missing.npy: no such dump, it does not exist \(looked for .*missing.q.npy"),
    # input dtypes and layouts
    ("f8.safetensors --p 2 --m 4 --methods psf", 2, r"f8.safetensors: tensor q must have a real floating-point dtype .*float8_e4m3fn; upcast"),
    ("sparse.pt --p 2 --m 4 --methods psf", 2, r"sparse.pt: tensor q must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    ("batch.safetensors --p 2 --m 4 --methods psf", 2, r"layout 'batch,n,d' has an axis name 'batch' that is not understood; accepted names .*token: token/tokens/seq"),
    # data loss: outputs that are inputs or each other, refused before any fit
    ("good.safetensors --p 2 --m 4 --methods psf --json good.safetensors", 2, r"--json: output .*good.safetensors' is the input"),
    ("npy.npy --p 2 --m 4 --methods psf --markdown npy.k.npy", 2, r"--markdown: output .*npy.k.npy' is the input"),
    ("good.safetensors --p 2 --m 4 --methods psf --json out.txt --markdown out.txt", 2, r"outputs --json and --markdown are the same file"),
    ("good.safetensors --p 2 --m 4 --methods psf --json link_to_good", 2, r"--json: output .*link_to_good' is the input"),
    ("good.safetensors --p 2 --m 4 --methods psf --json good.safetensors/x.json", 2, r"--json: cannot create the output directory of 'good.safetensors/x.json': .*good.safetensors' is a file"),
    ("good.safetensors --p 2 --m 4 --methods psf --json .", 2, r"--json: output '\.' is a directory"),
]


@pytest.mark.parametrize("args,code,match", COMPARE_CASES, ids=[c[0].split()[0] + ":" + c[2][:30] for c in COMPARE_CASES])
def test_compare_rejects_bad_input(args, code, match, dumps, capsys, monkeypatch):
    monkeypatch.chdir(dumps)
    if not (dumps / "link_to_good").is_symlink():
        os.symlink("good.safetensors", dumps / "link_to_good")
    import importlib

    def refuse(*a, **kw):
        raise AssertionError("compare fitted a sketch before refusing the input")

    monkeypatch.setattr(importlib.import_module("sketchlab.compare"), "_fit_checked", refuse)  # fails fast: nothing is fitted
    rc, out = _cli(["compare", *args.split(), "--no-progress"], capsys, dumps)
    assert rc == code, out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sketchlab: error: ") and "Traceback" not in out.err, out.err
    assert re.search(match, lines[0]), lines[0]
    assert out.out == ""
    assert not (dumps / "out.txt").exists()


def test_compare_accepts_layouts_by_axis_role_and_the_npy_name(dumps, capsys, monkeypatch):
    # "token, dim, layer, head" is transposed to [L, H, n, d]: same table as the canonical dump.
    monkeypatch.chdir(dumps)
    tables = []
    for name in ("good.safetensors", "seqfirst.safetensors", "npy.npy"):
        rc, out = _cli(["compare", name, "--p", "2", "--m", "4", "--methods", "psf", "--no-progress"], capsys, dumps)
        assert rc == 0, out.err
        tables.append(out.out.split("**Relative mean", 1)[1].split("**Sizes")[0])  # the error tables, not the timings
    assert tables[0] == tables[1] == tables[2]
    torch.testing.assert_close(load_qk(dumps / "seqfirst.safetensors").q, load_qk(dumps / "good.safetensors").q,
                               rtol=0, atol=0)


def test_compare_writes_through_a_symlinked_output(dumps, tmp_path, capsys):
    target = tmp_path / "real.json"
    target.write_text("old")
    os.symlink(target, tmp_path / "link.json")
    rc = main(["compare", str(dumps / "good.safetensors"), "--p", "2", "--m", "4", "--methods", "psf",
               "--json", str(tmp_path / "link.json"), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "link.json").is_symlink()  # the link is kept, its target replaced
    assert json.loads(target.read_text())["config"]["p"] == 2


# ------------------------------------------------------------------------------------------------
# capture: inputs checked against the model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers  # the dev extra installs it: capture's tests always run
    root = tmp_path_factory.mktemp("model")
    cfg = transformers.GPT2Config(vocab_size=10, n_embd=8, n_layer=1, n_head=2, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2Model(cfg).save_pretrained(root / "m")
    return root


@pytest.mark.parametrize("ids,extra,match", [
    ("1 2 99", [], r"ids.txt: token id 99 is outside the model's vocabulary of 10 .*sequence 1, position 2"),
    ("1 " * 20, ["--seq-len", "20"], r"a sequence of 20 tokens exceeds the model's position limit of 16 \(config\.\w+\); "
                                     r"pass seq_len \(--seq-len\) <= 16"),
    ("1 18446744073709551616", [], r"ids.txt:1: token id 18446744073709551616 is beyond the largest id"),
])
def test_capture_checks_inputs_against_the_model(ids, extra, match, model_dir, capsys):
    (model_dir / "ids.txt").write_text(ids + "\n")
    rc, out = _cli(["capture", "--model-dir", str(model_dir / "m"), "--token-ids", str(model_dir / "ids.txt"),
                    "--out", str(model_dir / "d.safetensors"), *extra], capsys, model_dir)
    assert rc == 2 and "Traceback" not in out.err
    assert re.search(match, out.err), out.err
    assert not (model_dir / "d.safetensors").exists()


def test_capture_rejects_corrupt_weights_and_output_onto_input(model_dir, tmp_path, capsys):
    import shutil

    (tmp_path / "ids.txt").write_text("1 2 3\n")
    broken = tmp_path / "broken"
    shutil.copytree(model_dir / "m", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated
    rc, out = _cli(["capture", "--model-dir", str(broken), "--token-ids", str(tmp_path / "ids.txt"),
                    "--out", str(tmp_path / "d.npz")], capsys, broken)
    assert rc == 2 and "could not load the model (missing, truncated or corrupt weights or config)" in out.err
    rc, out = _cli(["capture", "--model-dir", str(model_dir / "m"), "--token-ids", str(tmp_path / "ids.txt"),
                    "--out", str(tmp_path / "ids.txt")], capsys, tmp_path)
    assert rc == 2 and "--out: output" in out.err and "is the input" in out.err
    assert (tmp_path / "ids.txt").read_text() == "1 2 3\n"


# ------------------------------------------------------------------------------------------------
# API: dtypes, overflow, budgets, degrees, seeds


@pytest.mark.parametrize("make,match", [
    (lambda x: x.to_sparse(), r"x must be a dense \(strided\) tensor, got layout torch.sparse_coo; convert it with .to_dense\(\)"),
    (lambda x: x.to_sparse_csr(), r"layout torch.sparse_csr"),
    (lambda x: x.to(torch.float8_e5m2), r"got torch.float8_e5m2; upcast it first"),
    (lambda x: x.to(torch.complex64), r"real floating-point dtype .*got torch.complex64"),
    (lambda x: x.numpy().astype(np.int32), r"got numpy int32"),
])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_unsupported_tensors_are_rejected(make, match):
    x = make(torch.ones(3, 2))
    with pytest.raises(TypeError, match=match):
        as_float_tensor(x, "x")
    with pytest.raises(TypeError):
        poly_kernel(x, x, 2)


def test_meta_tensors_have_no_values_to_fit():
    q = torch.empty(2, 6, 3, device="meta")
    with pytest.raises(TypeError, match=r"q is a 'meta' tensor \(shape only, no values"):
        check_pair(q, q)
    with pytest.raises(TypeError, match="'meta' tensor"):
        fit_sketch("psf", q, q, p=2, m=4)


def test_power_overflow_is_an_error_never_inf():
    q = torch.full((3, 2), 10.0)
    with pytest.raises(FloatingPointError, match=r"poly_kernel: \(qᵀk\)\^40 overflows torch.float32: 9 of 9 .*200\^40 ≈ 1e92"):
        poly_kernel(q, q, 40)
    assert torch.isfinite(poly_kernel(q.double(), q.double(), 40)).all()  # 200^40 = 1e92 fits float64
    with pytest.raises(FloatingPointError, match=r"poly_features\(p=40\) .* overflows torch.float32"):
        poly_features(q, 40, symmetric=True)
    with pytest.raises(FloatingPointError, match=r"overflows torch.float64"):
        poly_kernel(q.double() * 1e10, q.double(), 30)  # (2e12)^30 ≈ 1e372


@pytest.mark.parametrize("method", ["psf", "tensorsketch", "based", "elementwise"])
def test_sketches_at_high_degree_stop_with_the_cause(method):
    # |x| ~ 3 in float32 at p = 100: ‖x‖^100 ~ 1e48 > 3.4e38, every method must say so.
    q, k = _qk(L=1, H=1, n=30, d=4, seed=3)
    q, k = q[0] * 1.5, k[0] * 1.5
    with pytest.raises(FloatingPointError, match=r"overflow"):
        fit_sketch(method, q, k, p=100, m=4, **({"steps": 2} if method == "elementwise" else {}))


def test_memory_budgets_fire_before_allocating(monkeypatch):
    q = torch.ones(100, 3)
    with pytest.raises(ValueError, match=r"the kernel matrix \(QKᵀ\)\^p of shape \(100, 100\).* over the memory budget"):
        poly_kernel(q, q, 2, max_bytes=1000)
    allocated = [0]  # elements allocated since the guard went in: more than 10^7 (80 MB) means no budget check ran
    for name in ("randn", "zeros", "empty", "randint", "ones"):
        original = getattr(torch, name)

        def guarded(*size, _original=original, _name=name, **kwargs):
            dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            allocated[0] += math.prod(int(n) for n in dims if isinstance(n, int)) if dims else 1
            assert allocated[0] < 10**7, f"torch.{_name}: {allocated[0]} elements allocated before the budget check"
            return _original(*size, **kwargs)

        monkeypatch.setattr(torch, name, guarded)
    with pytest.raises(ValueError, match=r"Gaussian matrices of a degree-1024 PolySketch .*memory budget"):
        PSFRandomMap.draw(32, 64, p=MAX_DEGREE, m=4096, seed=0)
    with pytest.raises(ValueError, match=r"dense CountSketch matrices .*memory budget"):
        TensorSketchMap.draw(32 * 32, 128, p=1000, m=100_000, seed=0)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"CountSketches of 2000 tokens .*memory budget"):
        tensorsketch_features(torch.ones(2000, 3), TensorSketchMap.draw(1, 3, p=2, m=50, seed=0).matrices[0], max_bytes=10_000)


@pytest.mark.parametrize("seed,err,match", [
    (2**64, ValueError, r"seed must lie in \[-2\*\*63, 2\*\*64 - 1\]"),
    (-(2**63) - 1, ValueError, r"seed must lie in"),
    (1.5, TypeError, r"seed must be an int, got 1.5"),
])
def test_seeds_beyond_the_generator_range(seed, err, match):
    with pytest.raises(err, match=match):
        make_generator(seed)
    assert make_generator(2**64 - 1).initial_seed() == 2**64 - 1


# ------------------------------------------------------------------------------------------------
# files: JSON depth, Θ scale, atomic writes, all-or-nothing .npy dumps


def test_deeply_nested_json_is_rejected_not_a_recursion_error(tmp_path):
    tq = torch.zeros(1, 1, 1, 2, 2, 2)
    deep = "[" * 100_000 + "]" * 100_000
    save_file({"theta_q": tq, "theta_k": tq.clone()}, str(tmp_path / "t.safetensors"), metadata={
        "p": "2", "m": "2", "t": "1", "d": "2", "method": "llops", "scale": "none", "source_sha256": SHA,
        "errors": deep, "sketchlab_version": "0", "layout": "L,H,t,p,d,m"})
    with pytest.raises(ValueError, match=r"metadata errors: JSON nested 100000 levels deep, over the limit of 64"):
        load_theta(tmp_path / "t.safetensors")
    q, k = _qk()
    save_qk(tmp_path / "x.npy", q, k)
    (tmp_path / "x.meta.json").write_text('{"a": "' + "[" * 500 + '"}')  # brackets inside a string are text
    assert load_qk(tmp_path / "x.npy").meta == {"a": "[" * 500}  # (a marker without checksums: not verified)
    (tmp_path / "x.meta.json").write_text('{"a": ' + "[" * 70 + "]" * 70 + "}")
    with pytest.raises(ValueError, match=r"x.meta.json: JSON nested 71 levels deep"):
        load_qk(tmp_path / "x.npy")


@pytest.mark.parametrize("scale", ["banana", "-5", "0", "nan", "inf", ""])
def test_theta_scale_must_be_a_label_or_a_positive_number(tmp_path, scale):
    tq = torch.zeros(1, 1, 1, 2, 2, 2)
    kw = dict(p=2, m=2, t=1, d=2, method="llops", source_sha256=SHA, errors={}, sketchlab_version="0")
    with pytest.raises(ValueError, match="scale must be"):
        save_theta(tmp_path / "t.safetensors", tq, tq, scale=scale, **kw)
    save_file({"theta_q": tq, "theta_k": tq.clone()}, str(tmp_path / "r.safetensors"), metadata={
        "p": "2", "m": "2", "t": "1", "d": "2", "method": "llops", "scale": scale, "source_sha256": SHA,
        "errors": "{}", "sketchlab_version": "0"})
    with pytest.raises(ValueError, match="scale must be"):
        load_theta(tmp_path / "r.safetensors")
    assert load_theta(save_theta(tmp_path / "ok.safetensors", tq, tq, scale="0.25", **kw))[2]["scale"] == "0.25"


def test_atomic_write_is_durable_keeps_modes_and_never_touches_the_umask(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), real_fsync(fd)))
    monkeypatch.setattr(os, "umask", lambda *a: pytest.fail("atomic_write toggled the process umask"))
    new = tmp_path / "new.txt"
    with sio.atomic_write(new) as tmp:
        tmp.write_text("a")
    assert synced == [False, True]  # the file, then its directory
    mask = int(open("/proc/self/status").read().split("Umask:")[1].split()[0], 8)
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~mask
    os.chmod(new, 0o640)
    with sio.atomic_write(new) as tmp:
        tmp.write_text("b")
    assert stat.S_IMODE(new.stat().st_mode) == 0o640 and new.read_text() == "b"
    # through a symlink: the target is replaced, the link kept
    os.symlink(new, tmp_path / "link")
    with sio.atomic_write(tmp_path / "link") as tmp:
        tmp.write_text("c")
    assert (tmp_path / "link").is_symlink() and new.read_text() == "c"
    # a failure leaves the old file and no temporary file
    with pytest.raises(RuntimeError):
        with sio.atomic_write(new) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert new.read_text() == "c" and sorted(p.name for p in tmp_path.iterdir()) == ["link", "new.txt"]


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_npy_dump_save_is_all_or_nothing(tmp_path, monkeypatch, fail_at):
    # the parts and the marker (meta.json) are moved in together (io.atomic.replace_together): a failure at any
    # os.replace puts every old file back, so the old dump still loads, never old k with new q (issue 35)
    q0, k0 = _qk(seed=0)
    q1, k1 = _qk(seed=1)
    save_qk(tmp_path / "d.npy", q0, k0)
    calls = []
    real_replace = os.replace

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == fail_at:
            raise OSError("simulated crash")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="simulated crash"):
        save_qk(tmp_path / "d.npy", q1, k1)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".old"))]
    torch.testing.assert_close(load_qk(tmp_path / "d.npy").k, k0, rtol=0, atol=0)
    save_qk(tmp_path / "d.npy", q1, k1)  # a completed save repairs it
    torch.testing.assert_close(load_qk(tmp_path / "d.npy").k, k1, rtol=0, atol=0)


def test_memory_refusal_states_the_size_and_the_budget_in_gib():
    """check_memory's message gives the size and the budget in GiB (2 GiB asked, 1 GiB allowed)."""
    from sketchlab._validation import check_memory

    with pytest.raises(ValueError, match=r"^the test tensor would take 2 GiB, over the memory budget max_bytes=1 GiB; "
                                         r"shrink it, or raise max_bytes"):
        check_memory(2 * 2**30, what="the test tensor", way_out="shrink it", max_bytes=2**30)
