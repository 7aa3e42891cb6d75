"""One dtype rule for the recurrent state on every backend (:func:`sketchlab.attention.state.state_dtype`).

The torch path computes fp16/bf16 inputs in float32 and returns every floating field of the
:class:`~sketchlab.attention.AttentionState` in float32; the Triton path must return the same
fields in the same dtypes with the same values, and take a state of any floating dtype the way the
torch path does. Triton's interpreter runs fp32 kernels only, so on the CPU the kernels are
replaced by a stub (the state is assembled in torch beside them, from the keys and values alone);
a CUDA machine runs the compiled bf16 kernels against the torch path
(:func:`test_cuda_bf16_state_matches_the_torch_path`).

Tolerances on ``max|x − torch| / max|torch|``: the held keys and values are the inputs' own values
on both paths (compared exactly); ``S, z`` and the window features differ by where the features are
rounded: the torch path forms them in the inputs' dtype (bf16: 2⁻⁸ relative per factor, a product
of two factors and a sum of a few of them: 2e-2; fp16: 2⁻¹¹, 3e-3), Triton in float32 (fp32
inputs: round-off of sums of ≤ 12 terms, 1e-5). A held key in the input dtype instead of float32,
or an ``S`` left in float64, fails the dtype checks.
"""

from __future__ import annotations

import pytest
import torch
from attention_calls import run_llops

from sketchlab.attention.state import state_dtype
from sketchlab.attention.triton import function

FIELDS = ("S", "z", "k_window", "v_window", "phi_window", "k_sink", "v_sink")
EXACT = ("k_window", "v_window", "k_sink", "v_sink")
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _problem(dtype, *, B=2, T=12, H=2, D=4, M=5, device="cpu"):
    q, k, v = (_rand(B, T, H, D, seed=s).to(device, dtype) for s in (1, 2, 3))
    theta = (_rand(H, 1, 1, D, M, seed=4) / 2).expand(H, 1, 2, D, M).clone().to(device, dtype)  # p = 2, >= 0
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    mask[1, 3] = mask[0, 9] = False  # a padded sink and a padded window key
    return q, k, v, theta, mask


def _real(state, name):
    """Bool ``[B, L]`` of the real rows of a window/sink field (``None`` masks: all real)."""
    mask = getattr(state, "mask_sink" if name.endswith("sink") else "mask_window")
    n = getattr(state, name).shape[2]
    return torch.ones(state.S.shape[0], n, dtype=torch.bool, device=state.S.device) if mask is None else mask


def _assert_same_state(got, want, dtype):
    """Field by field: float32 on both, equal shapes and real/padded rows, equal values on the real
    rows (a padded row is never read: the torch path zeroes its features, Triton and the reference keep them)."""
    assert got.offset == want.offset
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.float32, (name, a.dtype, b.dtype)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if name not in ("S", "z"):
            real = _real(got, name)
            assert torch.equal(real, _real(want, name)), name
            a, b = a.transpose(1, 2)[real], b.transpose(1, 2)[real]  # [rows, H, ·]
        if name in EXACT:
            assert torch.equal(a, b), name
        elif b.numel():
            err = ((a - b).abs().max() / b.abs().max()).item()
            assert err < TOL[dtype], (name, err)


@pytest.fixture
def stub_kernels(monkeypatch):
    """Zero outputs instead of the kernels: the state is built in torch from the keys and values."""
    def zero_out(q, k, v, *args):
        return v.new_zeros(*q.shape[:3], v.shape[-1])  # [B, T, H, Dv]

    monkeypatch.setattr(function.LLoPSAttentionTriton, "apply", zero_out)
    monkeypatch.setattr(function.HybridAttentionTriton, "apply", zero_out)


def test_state_dtype_is_float32_for_half_inputs_and_the_inputs_own_otherwise():
    assert [state_dtype(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)] == [
        torch.float32, torch.float32, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hybrid", [dict(), dict(window=5, sinks=2)], ids=["linear", "hybrid"])
@pytest.mark.parametrize("carried", [None, "torch", "bfloat16", "float64"])
def test_triton_state_has_the_torch_paths_dtypes_and_values(stub_kernels, dtype, hybrid, carried):
    """Seven tokens, then five more from a state made by the torch path (as it is, kept in bf16, or
    a float64 one from the reference backend): the Triton path's final state equals the torch
    path's field by field, dtypes included (float32 throughout)."""
    q, k, v, theta, mask = _problem(dtype)
    kw = dict(key_padding_mask=mask, output_final_state=True, **hybrid)
    first = {"torch": "torch", "bfloat16": "torch", "float64": "reference"}.get(carried)
    state = None
    if first is not None:
        cut = (q[:, :7], k[:, :7], v[:, :7], theta, theta)
        if first == "reference":
            cut = tuple(x.double() for x in cut)
        _, state = run_llops(*cut, backend=first, **{**kw, "key_padding_mask": mask[:, :7]})
        state = state.to(torch.bfloat16) if carried == "bfloat16" else state
    lo = 0 if state is None else 7
    rest = (q[:, lo:], k[:, lo:], v[:, lo:], theta, theta)
    kw["key_padding_mask"] = mask[:, lo:]
    _, want = run_llops(*rest, backend="torch", initial_state=state, **kw)
    _, got = run_llops(*rest, backend="triton", initial_state=state, **kw)
    _assert_same_state(got, want, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled bf16 Triton kernels")
def test_cuda_bf16_state_matches_the_torch_path():
    """The compiled bf16 hybrid (d = 64, m = 16, T = 300 over chunks, window 64, 4 sinks, padding)
    returns the torch path's state (dtypes, values), and each backend continues from the other's
    state: 40 more tokens give the same outputs (bf16 outputs, 2e-2 relative) either way."""
    dtype = torch.bfloat16
    q, k, v, theta, mask = _problem(dtype, B=2, T=340, H=3, D=64, M=16, device="cuda")
    kw = dict(window=64, sinks=4, output_final_state=True)
    head = (q[:, :300], k[:, :300], v[:, :300], theta, theta)
    _, st_torch = run_llops(*head, backend="torch", key_padding_mask=mask[:, :300], **kw)
    _, st_triton = run_llops(*head, backend="triton", key_padding_mask=mask[:, :300], **kw)
    _assert_same_state(st_triton, st_torch, dtype)
    tail = (q[:, 300:], k[:, 300:], v[:, 300:], theta, theta)
    outs = {}
    for backend, state in (("torch", st_triton), ("triton", st_torch)):
        out, st = run_llops(*tail, backend=backend, initial_state=state, key_padding_mask=mask[:, 300:], **kw)
        assert out.dtype == dtype and all(getattr(st, f).dtype == torch.float32 for f in FIELDS), backend
        outs[backend] = out.float()
    err = ((outs["triton"] - outs["torch"]).abs().max() / outs["torch"].abs().max()).item()
    assert err < TOL[dtype], err
