"""The fused Triton LLoPS attention kernel against the float64 reference, layout ``[B, T, H, D]``.

Without CUDA the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``; fp32 only, chunk of 16 tokens). The interpreter is slow, so the grid of the
issue (T ∈ {1, 17, 64, 100}, d ∈ {16, 24}, m ∈ {8, 20}, p ∈ {1, 2, 3}, t ∈ {1, 2}, causal or not,
each normalisation) is covered by varying one factor at a time around a base case, crossing
causal × normalize on it, plus full combinations at the large corners. Every kernel-written buffer
(output, denominators, dq, dk, dv, the per-(batch, head) dΘ slices) is pre-filled with NaN, so an
element the kernel fails to write fails the comparison.

Tolerance (fp32 kernel vs float64 reference), on ``max|x − ref| / max|ref|`` per tensor:
``FP32_TOL = 1e-4``. Each output element is a sum of at most T·M ≈ 2000 fp32 products of features
that are themselves sums of t products of p fp32 dot products of length d; the worst-case relative
error of such sums is ~n·u (u = 6e-8, n ≈ 2000 → 1.2e-4), the typical ~√n·u ≈ 3e-6. With
``normalize="sum"`` the gradients of q and k contain the cancelling terms g·v + c (c = −g·out), so
they sit nearer the bound: the largest seen over this file is 1.1e-5 (dq, T = 100, p = 3). 1e-4
leaves a factor 9 above that and is 1000× below what a wrong index, mask or missed chunk gives
(O(1) relative errors, checked by breaking the kernel). On CUDA: fp32 uses exact-fp32 ``tl.dot``
(``input_precision="ieee"``), same tolerance; bf16 inputs are rounded to bf16 (2⁻⁹ relative),
features use TF32 dots (2⁻¹¹) and results are stored in bf16 (2⁻⁹): ``BF16_TOL = 2e-2`` against the
reference evaluated on the same bf16-rounded inputs.
"""

from __future__ import annotations

import os

import pytest
import torch
from attention_calls import run_llops, run_llops_naive, run_triton

from sketchlab.attention import AttentionOptions
from sketchlab.attention.triton import launch, llops_attention_triton

FP32_TOL = 1e-4
BF16_TOL = 2e-2
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
NAMES = ("out", "dq", "dk", "dv", "dtheta_q", "dtheta_k")

if not INTERPRETED and not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1 (set by conftest without CUDA)",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Every buffer the launchers hand to a kernel starts as NaN. On CUDA the broad grid runs one
    fixed config (compiling every autotuning config for each shape would take many minutes);
    ``test_cuda_compiled`` turns autotuning back on."""
    monkeypatch.setenv("SKETCHLAB_TRITON_AUTOTUNE", "0")
    def nan_empty(shape, *, like, dtype=None):
        return torch.full(shape, float("nan"), device=like.device, dtype=like.dtype if dtype is None else dtype)

    monkeypatch.setattr(launch, "_empty", nan_empty)


def _problem(T, D, M, P, R, normalize, *, B=2, H=2, DV=12, S=None, seed=0, dtype=torch.float32, signed=False):
    """q [B, T, H, D], k [B, S, H, D], v [B, S, H, DV], Θ [H, R, P, D, M], grad_out [B, T, H, DV]
    (``S = T`` unless given).

    For ``normalize="sum"`` q, k and Θ are non-negative unless ``signed`` (used with the
    self-tensor, whose scores are ≥ 0 for any map), so every score a_ts > 0 and the denominator is
    well conditioned (the regime "sum" is documented for); Θ is scaled by d^{-1/2} so features
    stay O(1) for every p.
    """
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, H, DV, generator=g, dtype=torch.float64)
    tq, tk = torch.randn(2, H, R, P, D, M, generator=g, dtype=torch.float64) / D**0.5
    if normalize == "sum" and not signed:
        q, k, tq, tk = q.abs(), k.abs(), tq.abs(), tk.abs()
    grad = torch.randn(B, T, H, DV, generator=g, dtype=torch.float64)
    return [x.to(DEVICE, dtype) for x in (q, k, v, tq, tk, grad)]


def _run(fn, q, k, v, tq, tk, grad, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, tq, tk)]
    out = fn(*leaves, **kw)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [x.grad for x in leaves]


def _compare(T, D, M, P, R, causal, normalize, non_negative=False, *, dtype=torch.float32, tol=FP32_TOL, **shape):
    q, k, v, tq, tk, grad = _problem(T, D, M, P, R, normalize, dtype=dtype, signed=non_negative, **shape)
    kw = dict(causal=causal, normalize=normalize, non_negative=non_negative, eps=1e-6)
    got = _run(run_triton, q, k, v, tq, tk, grad, **kw)
    want = _run(run_llops_naive, *(x.double() for x in (q, k, v, tq, tk, grad)), **kw)
    errors = {}
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == dtype, (name, a.shape, b.shape, a.dtype)
        errors[name] = ((a.double() - b).abs().max() / b.abs().max()).item()  # NaN if any NaN
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative max errors over {tol}: {bad} (all: {errors})"


# T = 1 runs unnormalised: with one token "sum" gives out = v·a/(a + eps), whose q, k and Θ
# gradients are O(eps/a) left over from the cancellation g·v + c = 0, below fp32's resolution.
BASE = dict(T=17, D=16, M=8, P=2, R=1, causal=True, normalize="sum")
ONE_AT_A_TIME = [dict(BASE, **change) for change in (
    {}, {"T": 1, "normalize": "none"}, {"T": 1, "causal": False, "normalize": "none"}, {"T": 64}, {"T": 100}, {"D": 24}, {"M": 20}, {"P": 1}, {"P": 3}, {"R": 2},
    {"causal": False}, {"normalize": "none"}, {"causal": False, "normalize": "none"},
)]
CORNERS = [
    dict(T=100, D=24, M=20, P=3, R=2, causal=False, normalize="none"),
    dict(T=64, D=24, M=20, P=3, R=2, causal=True, normalize="sum"),
    dict(T=100, D=24, M=20, P=1, R=2, causal=True, normalize="none"),
    dict(T=1, D=24, M=20, P=3, R=2, causal=True, normalize="none"),
    dict(T=64, D=16, M=20, P=2, R=2, causal=False, normalize="sum"),
]


# The self-tensor φ ⊗ φ (M² features, degree 2p) on signed maps, where "sum" is safe.
SELF_TENSOR = [
    dict(BASE, non_negative=True),
    dict(BASE, T=64, M=20, R=2, P=1, causal=False, non_negative=True),
    dict(BASE, T=40, D=24, P=3, normalize="none", non_negative=True),
]


def _id(case):
    return "T{T}-d{D}-m{M}-p{P}-t{R}-{c}-{normalize}{s}".format(
        c="causal" if case["causal"] else "full", s="-self" if case.get("non_negative") else "", **case)


@pytest.mark.parametrize("case", ONE_AT_A_TIME + CORNERS + SELF_TENSOR, ids=_id)
def test_output_and_gradients_match_reference(case):
    _compare(**case)


def test_value_dim_above_one_block_and_single_head():
    """Dv = 40: three forward value blocks of 16 (the last masked), one backward block of 64;
    B = 3, H = 1 checks the (batch, head) indexing and dΘ's sum over B."""
    _compare(**dict(BASE, T=20), B=3, H=1, DV=40)


@pytest.mark.parametrize("S, non_negative", [(40, False), (5, True)])
def test_keys_longer_or_shorter_than_queries(S, non_negative):
    """Non-causal attention of T = 17 queries over S ≠ T keys (chunks of keys and queries differ)."""
    _compare(**dict(BASE, causal=False, non_negative=non_negative), S=S)


def test_functional_dispatch(monkeypatch):
    """``run_llops(backend="triton")`` reaches this kernel, handing it the caller's options object unchanged (already
    resolved, so the op's ``resolve`` returns it: nothing re-flattens it), and equals the reference backend."""
    import sketchlab.attention.triton as package

    calls = []
    monkeypatch.setattr(package, "llops_attention_triton",
                        lambda *a, **kw: calls.append((a[5:], kw)) or llops_attention_triton(*a, **kw))
    q, k, v, tq, tk, grad = _problem(**{k: BASE[k] for k in ("T", "D", "M", "P", "R", "normalize")})
    options = AttentionOptions(normalize="sum", non_negative=False, backend="triton")
    got = _run(run_llops, q, k, v, tq, tk, grad, options=options)
    assert len(calls) == 1 and len(calls[0][0]) == 1 and calls[0][0][0] is options, calls
    assert calls[0][1] == dict(gate=None, key_padding_mask=None, initial_state=None, output_final_state=False)
    want = _run(run_llops, *(x.double() for x in (q, k, v, tq, tk, grad)), backend="reference")
    for name, a, b in zip(NAMES, got, want):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() <= FP32_TOL, name


def test_any_strides():
    """Inputs that are views with permuted strides give the contiguous inputs' result."""
    q, k, v, tq, tk, grad = _problem(**{k: BASE[k] for k in ("T", "D", "M", "P", "R", "normalize")})
    kw = dict(causal=True, normalize="sum", non_negative=False, eps=1e-6)
    want = _run(run_triton, q, k, v, tq, tk, grad, **kw)
    # [B, H, T, D] storage viewed as [B, T, H, D]; Θ stored [H, R, P, M, D] viewed as [H, R, P, D, M]
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    views += [x.transpose(-1, -2).contiguous().transpose(-1, -2) for x in (tq, tk)]
    assert not any(x.is_contiguous() for x in views)
    got = _run(run_triton, *views, grad, **kw)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_rejects_what_the_kernel_cannot_do():
    """Float64 is the kernel's own refusal (it accumulates in float32), on the function itself."""
    q, k, v, tq, tk, _ = _problem(**{k: BASE[k] for k in ("T", "D", "M", "P", "R", "normalize")})
    kw = dict(causal=True, normalize="sum", eps=1e-6, non_negative=False)
    with pytest.raises(ValueError, match=r"q has dtype torch.float64.*float32"):
        run_triton(q.double(), k, v, tq, tk, **kw)
    with pytest.raises(ValueError, match=r"theta_k has dtype torch.float64.*float32"):
        run_triton(q, k, v, tq, tk.double(), **kw)


def test_options_are_checked_by_their_one_rule():
    """The options reaching the kernel are checked once, by ``AttentionOptions``' rules (normalize, eps) where the op's
    caller builds them, and the op checks its flag: a ``normalize="max"``, a negative ``eps``, a non-bool
    ``output_final_state`` are refused on the way to the Triton backend, naming them."""
    q, k, v, tq, tk, _ = _problem(**{k: BASE[k] for k in ("T", "D", "M", "P", "R", "normalize")})
    kw = dict(causal=True, normalize="sum", eps=1e-6, non_negative=False, backend="triton")
    for change, match in ((dict(normalize="max"), r"normalize must be one of .*'max'"),
                          (dict(eps=-1.0), r"eps must be a finite number >= 0.0, got -1.0"),
                          (dict(output_final_state=1), r"output_final_state must be True or False, got 1")):
        with pytest.raises((ValueError, TypeError), match=match):
            run_llops(q, k, v, tq, tk, **{**kw, **change})


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    q, k, v, tq, tk, _ = (x.cpu() for x in _problem(**{k: BASE[k] for k in ("T", "D", "M", "P", "R", "normalize")}))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"q is on cpu; the Triton kernel needs CUDA"):
        run_triton(q, k, v, tq, tk, causal=True, normalize="sum", non_negative=False, eps=1e-6)


@pytest.mark.skipif(INTERPRETED, reason="compiled kernel at realistic sizes and bf16: CUDA only")
@pytest.mark.parametrize("dtype, causal, normalize, non_negative, M", [
    (torch.float32, True, "sum", False, 48),
    (torch.bfloat16, True, "sum", False, 48),
    (torch.float32, False, "none", False, 48),
    (torch.bfloat16, True, "sum", True, 12),
], ids=["fp32-causal-sum", "bf16-causal-sum", "fp32-full-none", "bf16-causal-sum-self"])
def test_cuda_compiled(dtype, causal, normalize, non_negative, M, monkeypatch):
    """Autotuned configs (chunks of 16-64 tokens, value blocks) at d = 64, m = 48 (self-tensor:
    m = 12, 144 features) and T crossing many chunks, odd sizes included; fp32 and bf16 tolerances.
    Few cases: each compiles every autotuning config (tens of seconds each on sm_90)."""
    monkeypatch.setenv("SKETCHLAB_TRITON_AUTOTUNE", "1")
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    _compare(T=300, D=64, M=M, P=2, R=2, causal=causal, normalize=normalize, non_negative=non_negative,
             dtype=dtype, tol=tol, B=2, H=3, DV=40)


def test_the_kernels_share_device_functions_by_their_public_names():
    """The device functions the pure and the hybrid kernel both call live once, in ``triton/features.py``, under
    public names (its ``__all__``): no module of the package imports another's underscore names (its private
    modules, ``_kernels`` and ``_hybrid``, are the package's own)."""
    import ast
    from pathlib import Path

    from sketchlab.attention.triton import _hybrid, _kernels, features

    root = Path(features.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sketchlab"):
                private = [a.name for a in node.names if a.name.startswith("_") and not (root / f"{a.name}.py").exists()]
                assert not private, f"{path.name} imports {private} from {node.module}"
    defined = {node.name: ast.get_docstring(node) for node in ast.parse((root / "features.py").read_text()).body
               if isinstance(node, ast.FunctionDef)}
    assert set(features.__all__) == set(defined) and all(defined.values())  # each public, with its docstring
    for name in set(features.__all__) - {"chunk_llops_map"}:  # the map itself is called by chunk_features only
        assert getattr(_kernels, name) is getattr(features, name) is getattr(_hybrid, name), name
