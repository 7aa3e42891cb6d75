"""The Triton hybrid (sliding window + sinks exact, LLoPS far) and the carried state, against float64.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``; fp32, chunks of 16 tokens), so sizes stay tiny (T ≤ 40, D = 8, M ≤ 8) and
windows are chosen against the chunk: w ∈ {1, 7, 16 (= the chunk), 50 (> T)}; sinks 3 (inside the
first chunk) and 20 (two chunks of sinks).

Reference: the float64 naive twin :func:`run_llops_naive` (``window=``,
``sinks=``, ...: the formula of docs/DESIGN.md §6 with explicit masks; gradients by autograd, so the
gradient through ``c_i = max_L s·qᵀk`` is whatever autograd of the formula gives), and its
:class:`~sketchlab.attention.AttentionState` (states pass between the backends).

Tolerance (fp32 kernel vs float64), on ``max|x − ref| / max|ref|`` per tensor: ``FP32_TOL = 1e-4``,
as in ``test_attention_triton.py`` (each output is a sum of ≤ T·(M + D) fp32 products, worst case
n·u ≈ 40·16·6e-8 ≈ 4e-5 before the features' own products; the largest seen here is ~8e-6 on
non-negative inputs, on which the shared denominator is well conditioned). The gate's gradient
``∂L/∂γ = Σ_{b,i,j} ±a_ij δ_ij`` is a sum of B·T·T signed terms that cancel to a small total, so it
is compared on ``|dγ − ref| ≤ GATE_TOL · Σ_{b,i,j} |a_ij δ_ij|`` (the round-off bound of such a
sum, computed in float64 by :func:`_gate_roundoff_scale`) with ``GATE_TOL = 1e-6``: the largest seen is 3e-8
(≈ u/2), while the true ``|dγ|`` is 3e-5 to 4e-3 of that sum whenever there are far keys, so a
wrong gate gradient cannot hide under the bound. A wrong mask, a window shifted by one, a dropped
gate or gradient term gives O(1) relative errors (checked by breaking the kernel).
"""

from __future__ import annotations

import os

import pytest
import torch
from attention_calls import run_llops, run_llops_naive, run_triton

from sketchlab.attention import AttentionState
from sketchlab.attention.triton import launch
from sketchlab.llops.maps import llops_features

FP32_TOL = 1e-4
GATE_TOL = 1e-6
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
NAMES = ("out", "dq", "dk", "dv", "dtheta_q", "dtheta_k")

if not INTERPRETED and not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1 (set by conftest without CUDA)",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Every buffer the launchers allocate starts as NaN, so an element a kernel fails to write shows."""
    def nan_empty(shape, *, like, dtype=None):
        dtype = like.dtype if dtype is None else dtype
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, device=like.device, dtype=dtype)

    monkeypatch.setattr(launch, "_empty", nan_empty)


def _gate_roundoff_scale(q, k, v, theta_q, theta_k, grad_out, *, window, sinks, local="softmax", local_scale=None,
                         gate=None, non_negative=False, eps=1e-6, key_padding_mask=None, causal=True):
    r"""``Σ_{b,i,j} |a_ij δ_ij|`` per head over the local and far keys of the hybrid (float64):
    the round-off scale of ``∂L/∂γ = Σ ±a_ij δ_ij``, with ``δ_ij = G_i·v_j + C_i`` (``G = dO/den``,
    ``C = −G·o``). Only a tolerance; the reference values come from ``run_llops_naive``."""
    B, T, H, D = q.shape
    s = D ** -0.5 if local_scale is None else local_scale
    q, k, v = (x.to(torch.float64).transpose(1, 2) for x in (q, k, v))  # [B, H, T, ·]
    f = llops_features(q, theta_q.to(torch.float64)) @ llops_features(k, theta_k.to(torch.float64)).mT  # [B, H, T, T]
    f = f**2 if non_negative else f
    u = s * (q @ k.mT)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    real = torch.ones(B, T, dtype=torch.bool) if key_padding_mask is None else key_padding_mask.cpu()
    allowed = ((j <= i) if causal else torch.ones(T, T, dtype=torch.bool))[None, None] & real[:, None, None, :]
    loc = allowed & (((i - j).abs() < window) | (j < sinks))
    far = allowed & ~loc
    if local == "softmax":
        c = u.masked_fill(~loc, float("-inf")).amax(-1, keepdim=True).clamp_min(-1e300)
        a = torch.where(loc, torch.exp(u - c), 0.0)
    else:
        a = torch.where(loc, u ** theta_q.shape[2], 0.0)
    f = torch.where(far, f, 0.0)
    g = (torch.full((H,), 0.5, dtype=torch.float64) if gate is None else torch.sigmoid(gate.double())).view(1, H, 1, 1)
    num = g * (a @ v) + (1 - g) * (f @ v)
    den = g * a.sum(-1, keepdim=True) + (1 - g) * f.sum(-1, keepdim=True) + eps
    G = grad_out.to(torch.float64).transpose(1, 2) / den  # [B, H, T, Dv]
    delta = G @ v.mT - (G * (num / den)).sum(-1, keepdim=True)  # δ_ij
    return ((a + f) * delta).abs().sum((0, 2, 3))  # [H]


def _problem(T, *, B=2, H=2, D=8, M=8, P=2, R=1, DV=8, seed=0, signed=False):
    """q, k [B, T, H, D] and Θ [H, R, P, D, M] non-negative unless ``signed`` (then the shared
    denominator is well conditioned), v, grad_out [B, T, H, DV], gate logits [H]; float64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, DV, generator=g, dtype=torch.float64)
    tq, tk = torch.randn(2, H, R, P, D, M, generator=g, dtype=torch.float64) / D**0.5
    if not signed:
        q, k, tq, tk = q.abs(), k.abs(), tq.abs(), tk.abs()
    gate = torch.randn(H, generator=g, dtype=torch.float64)
    grad = torch.randn(B, T, H, DV, generator=g, dtype=torch.float64)
    return q, k, v, tq, tk, gate, grad


def _padding(B, T):
    """A key-padding mask [B, T]: row 0 left-padded (4 tokens), row 1 right-padded from 3T/4, and a
    hole in the middle of row 0 (a padded key inside the window of real queries)."""
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :4] = False
    mask[0, T // 2] = False
    if B > 1:
        mask[1, 3 * T // 4:] = False
    return mask


def _rel(a, b):
    """max|a − b| / max|b| (an exact 0 reference needs an exact 0; empty tensors agree)."""
    if b.numel() == 0:
        return 0.0
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _grads(fn, leaves, grad, **kw):
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in leaves]
    out = fn(*leaves[:5], gate=leaves[5], normalize="sum", eps=1e-6, **kw)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [x.grad for x in leaves[:5]], (None if leaves[5] is None else leaves[5].grad)


def _compare(T=37, *, window, sinks, local="softmax", gate=True, local_scale=None, non_negative=False, padded=False,
             causal=True, **shape):
    q, k, v, tq, tk, gl, grad = _problem(T, signed=non_negative, **shape)
    gl = gl if gate else None
    mask = _padding(q.shape[0], T) if padded else None
    opts = dict(window=window, sinks=sinks, local=local, local_scale=local_scale, non_negative=non_negative,
                causal=causal)
    got, dgate = _grads(run_triton, [x.to(DEVICE, torch.float32) for x in (q, k, v, tq, tk)]
                        + [None if gl is None else gl.to(DEVICE, torch.float32)], grad.to(DEVICE),
                        key_padding_mask=None if mask is None else mask.to(DEVICE), **opts)
    want, dgate_ref = _grads(run_llops_naive, [q, k, v, tq, tk, gl], grad, key_padding_mask=mask, **opts)
    errors = {name: _rel(a.cpu(), b) for name, a, b in zip(NAMES, got, want)}
    bad = {n: e for n, e in errors.items() if not e <= FP32_TOL}
    assert not bad, f"relative max errors over {FP32_TOL}: {bad} (all: {errors})"
    if gate:
        scale = _gate_roundoff_scale(q, k, v, tq, tk, grad, gate=gl, key_padding_mask=mask, **opts)
        dsig = torch.sigmoid(gl) * (1 - torch.sigmoid(gl))  # ∂γ/∂logit
        err = (dgate.cpu().double() - dgate_ref).abs()
        assert (err <= GATE_TOL * scale * dsig).all(), (err / (scale * dsig), dgate_ref / (scale * dsig))


CASES = [
    dict(window=1, sinks=0, local="softmax"),
    dict(window=7, sinks=3, local="softmax"),
    dict(window=16, sinks=3, local="softmax"),
    dict(window=50, sinks=0, local="softmax"),  # w > T: exact softmax, no far keys
    dict(window=7, sinks=20, local="softmax"),  # two chunks of sinks
    dict(window=7, sinks=3, local="softmax", padded=True),  # key-padding mask (a padded sink, left and right)
    dict(window=16, sinks=0, local="poly", padded=True),
    dict(window=1, sinks=3, local="poly", P=1),  # linear local scores: ∂a/∂u = u⁰ = 1
    dict(window=7, sinks=0, local="poly"),
    dict(window=16, sinks=3, local="poly", P=3, R=2),
    dict(window=50, sinks=3, local="poly"),
    dict(window=7, sinks=3, local="softmax", gate=False, local_scale=0.7, M=5, D=6, DV=20),
    dict(window=7, sinks=3, local="softmax", non_negative=True, M=4),  # self-tensor far part, signed Θ
    dict(window=7, sinks=3, local="poly", T=3),  # one partial chunk (T = 1 is a 1-token call of the state tests)
    dict(window=5, sinks=2, local="softmax", T=40, B=1, H=3),
    # non-causal (an encoder's window |i−j| < w): far keys on both sides
    dict(window=7, sinks=3, local="softmax", causal=False),
    dict(window=1, sinks=20, local="softmax", causal=False),  # sink blocks beyond the right frontier
    dict(window=16, sinks=0, local="poly", causal=False, padded=True),
    dict(window=50, sinks=0, local="softmax", causal=False, T=33),  # w > T: exact softmax attention
]


def _id(case):
    extra = "".join(f"-{k}{v}" for k, v in case.items() if k not in ("window", "sinks", "local", "causal"))
    extra += "-full" if case.get("causal") is False else ""
    return f"w{case['window']}-s{case['sinks']}-{case['local']}{extra}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_hybrid_matches_dense_formula(case):
    _compare(**case)


def test_window_zero_is_the_pure_kernel():
    """``window = sinks = 0`` runs today's kernel: bitwise the call without the new options (a gate
    is ignored), and the float64 LLoPS reference within FP32_TOL."""
    q, k, v, tq, tk, gl, grad = (x.to(DEVICE, torch.float32) for x in _problem(33))
    kw = dict(causal=True, normalize="sum", non_negative=False, eps=1e-6)
    base = run_triton(q, k, v, tq, tk, **kw)
    new = run_triton(q, k, v, tq, tk, **kw, window=0, sinks=0, local="poly", gate=gl.float(), local_scale=3.0)
    assert torch.equal(base, new)
    want = run_llops_naive(*(x.cpu().double() for x in (q, k, v, tq, tk)), **kw)
    assert _rel(new.cpu(), want) <= FP32_TOL


def _chain(leaves, splits, *, mask=None, fn=run_triton, state=None, **kw):
    """Run ``[0, T)`` as calls on the pieces ``splits`` (cumulative cut points), carrying the state."""
    q, k, v, tq, tk, gate = leaves
    outs = []
    cuts = [0, *splits, q.shape[1]]
    for a, b in zip(cuts[:-1], cuts[1:]):
        piece = None if mask is None else mask[:, a:b]
        o, state = fn(q[:, a:b], k[:, a:b], v[:, a:b], tq, tk, gate=gate, initial_state=state,
                      output_final_state=True, key_padding_mask=piece, **kw)
        outs.append(o)
    return torch.cat(outs, 1), state


STATE_CASES = [
    dict(window=7, sinks=3, local="softmax", splits=(2, 17, 18)),  # the first cut inside the sinks
    dict(window=16, sinks=0, local="poly", splits=(20,)),
    dict(window=50, sinks=2, local="softmax", splits=(9, 30)),
    dict(window=0, sinks=0, local="softmax", splits=(5, 21), normalize="sum"),  # pure, today's kernel
    dict(window=0, sinks=0, local="softmax", splits=(16,), normalize="none", non_negative=True),
    dict(window=7, sinks=3, local="softmax", splits=(1, 20), padded=True),  # padded keys carried in the state
]

STATE_FIELDS = ("S", "z", "k_window", "v_window", "phi_window", "k_sink", "v_sink")


@pytest.mark.parametrize("case", STATE_CASES, ids=lambda c: _id({k: v for k, v in c.items()}))
def test_state_split_equals_whole(case):
    """Cutting the sequence anywhere and carrying the state gives the whole sequence's output, final
    state and gradients (to q, k, v, Θ and the gate, through the carried S, z, window and sinks)."""
    _check_split(37, **case)


def _check_split(T, *, splits, normalize="sum", non_negative=False, window, sinks, local, padded=False, **shape):
    kw = dict(causal=True, normalize=normalize, non_negative=non_negative, eps=1e-6, window=window, sinks=sinks,
              local=local)
    shape.setdefault("M", 4 if non_negative else 8)
    q, k, v, tq, tk, gl, grad = _problem(T, signed=non_negative, **shape)
    mask = _padding(q.shape[0], T).to(DEVICE) if padded else None
    base = [x.to(DEVICE, torch.float32) for x in (q, k, v, tq, tk, gl)]
    results = []
    for cuts in ((), splits):
        leaves = [x.clone().requires_grad_() for x in base]
        out, state = _chain(leaves, cuts, mask=mask, **kw)
        # the loss reaches the final state too, so its gradient path is checked
        loss = (out * grad.to(out)).sum() + state.S.square().sum() * 1e-2 + state.z.sum() * 1e-2
        loss.backward()
        results.append((out.detach(), state, [x.grad for x in leaves]))
    (o1, s1, g1), (o2, s2, g2) = results
    assert _rel(o2, o1) <= FP32_TOL
    for name in STATE_FIELDS:
        assert getattr(s2, name).shape == getattr(s1, name).shape, name
        assert _rel(getattr(s2, name).detach(), getattr(s1, name).detach().double()) <= FP32_TOL, name
    assert s1.offset == s2.offset == T
    for name in ("mask_window", "mask_sink"):
        assert (getattr(s1, name) is None) == (getattr(s2, name) is None) == (not padded), name
        if padded:
            assert torch.equal(getattr(s1, name), getattr(s2, name)), name
    names = ("dq", "dk", "dv", "dtheta_q", "dtheta_k", "dgate")
    for name, a, b in zip(names, g2, g1):
        if b is None:  # the gate of the pure kernel is unused
            assert a is None and window == sinks == 0, name
            continue
        if name == "dgate" and window >= T:
            # no far keys: the gate enters only through eps/g in the shared denominator, so dgate is O(eps)
            # (~1e-6) and made of O(1) float32 terms: its round-off is absolute, ~1e-7, not relative to it
            assert (a.double() - b.double()).abs().max() <= 1e-6, name
            continue
        assert _rel(a, b.double()) <= FP32_TOL, name


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_state_passes_between_backends(padded):
    """The Triton final state equals the float64 naive twin's field by field (same layout: the last
    w positions with their features, the sinks, S and z over the far real keys, the masks), and a
    state from either backend continues on the other to the whole sequence's output."""
    T, cut = 37, 20
    q, k, v, tq, tk, gl, _ = _problem(T)
    mask = _padding(2, T) if padded else None
    kw = dict(causal=True, normalize="sum", non_negative=False, eps=1e-6, window=7, sinks=3, local="softmax")
    f32 = [x.to(DEVICE, torch.float32) for x in (q, k, v, tq, tk, gl)]
    dmask = None if mask is None else mask.to(DEVICE)
    _, got = _chain(f32, (), mask=dmask, **kw)
    whole, want = _chain([q, k, v, tq, tk, gl], (), mask=mask, fn=run_llops_naive, **kw)
    for name in STATE_FIELDS:
        assert _rel(getattr(got, name).detach().cpu(), getattr(want, name)) <= FP32_TOL, name
    assert got.offset == want.offset == T
    for name in ("mask_window", "mask_sink"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None and not padded) or torch.equal(a.cpu(), b), name
    # the first `cut` tokens on one backend, the rest on the other
    head = [x[:, :cut] if x.ndim == 4 and x.shape[1] == T else x for x in f32]
    _, st = _chain(head, (), mask=None if dmask is None else dmask[:, :cut], **kw)
    st64 = AttentionState(**{f: getattr(st, f).detach().cpu().double() if getattr(st, f).is_floating_point()
                             else getattr(st, f).cpu()
                             for f in STATE_FIELDS + ("mask_window", "mask_sink") if getattr(st, f) is not None},
                          offset=st.offset)
    tail = [x[:, cut:] if x.ndim == 4 and x.shape[1] == T else x for x in (q, k, v, tq, tk, gl)]
    rest, _ = _chain(tail, (), mask=None if mask is None else mask[:, cut:], fn=run_llops_naive, state=st64, **kw)
    assert _rel(rest, whole[:, cut:]) <= FP32_TOL
    _, st_ref = _chain([x[:, :cut] if x.ndim == 4 and x.shape[1] == T else x for x in (q, k, v, tq, tk, gl)], (),
                       mask=None if mask is None else mask[:, :cut], fn=run_llops_naive, **kw)
    st32 = st_ref.to(DEVICE, torch.float32)
    rest32, _ = _chain([x[:, cut:] if x.ndim == 4 and x.shape[1] == T else x for x in f32], (),
                       mask=None if dmask is None else dmask[:, cut:], state=st32, **kw)
    assert _rel(rest32.cpu(), whole[:, cut:]) <= FP32_TOL


def test_key_padding_mask_pure():
    """Pure linear attention with a key-padding mask equals the dense formula with those keys removed."""
    q, k, v, tq, tk, _, grad = _problem(21)
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[1, 15:] = False  # right padding
    got = run_triton(*(x.to(DEVICE, torch.float32) for x in (q, k, v, tq, tk)), causal=True,
                     normalize="sum", non_negative=False, eps=1e-6, key_padding_mask=mask.to(DEVICE))
    phi_q, phi_k = llops_features(q.transpose(1, 2), tq), llops_features(k.transpose(1, 2), tk)  # [B, H, T, M]
    scores = (phi_q @ phi_k.mT) * torch.ones(21, 21, dtype=torch.bool).tril() * mask[:, None, None, :]
    want = (scores @ v.transpose(1, 2)) / (scores.sum(-1, keepdim=True) + 1e-6)
    assert _rel(got.cpu(), want.transpose(1, 2)) <= FP32_TOL
    unmasked = run_triton(*(x.to(DEVICE, torch.float32) for x in (q, k, v, tq, tk)), causal=True,
                          normalize="sum", non_negative=False, eps=1e-6)
    assert _rel(unmasked.cpu(), want.transpose(1, 2)) > 1e-2  # the mask matters here


def test_bad_input_is_refused_on_the_way_to_the_kernel():
    """The op (``run_llops(backend="triton")``) checks the hybrid's options, the gate, the mask and the window's
    lengths once before the kernel; the Triton backend checks the carried state against the call (as the torch
    backend does)."""
    q, k, v, tq, tk, gl, _ = (x.to(DEVICE, torch.float32) for x in _problem(9))
    kw = dict(causal=True, normalize="sum", non_negative=False, eps=1e-6, backend="triton")
    with pytest.raises(ValueError, match=r"non-causal hybrid window \|i−j\| < w needs T == S, got T=9, S=5"):
        run_llops(q, k[:, :5], v[:, :5], tq, tk, **dict(kw, causal=False), window=4)
    with pytest.raises(ValueError, match=r"initial_state/output_final_state need causal=True"):
        run_llops(q, k, v, tq, tk, **dict(kw, causal=False), output_final_state=True)
    with pytest.raises(ValueError, match=r"always normalised: pass normalize='sum' \(or None\), got 'none'"):
        run_llops(q, k, v, tq, tk, **dict(kw, normalize="none"), window=3)
    with pytest.raises(ValueError, match=r"sinks=2 needs window >= 1"):
        run_llops(q, k, v, tq, tk, **kw, sinks=2)
    mask = torch.ones(2, 9, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \[B, S\] = \[2, 9\]"):
        run_llops(q, k, v, tq, tk, **kw, window=4, key_padding_mask=mask[:, :5])
    with pytest.raises(ValueError, match=r"window must be an integer >= 0, got -1"):
        run_llops(q, k, v, tq, tk, **kw, window=-1)
    with pytest.raises(ValueError, match=r"local must be one of \['softmax', 'poly'\], got 'relu'"):
        run_llops(q, k, v, tq, tk, **kw, window=3, local="relu")
    with pytest.raises(ValueError, match=r"gate must have shape \[H\] = \[2\]"):
        run_llops(q, k, v, tq, tk, **kw, window=3, gate=gl[:1])
    with pytest.raises(ValueError, match=r"local_scale must be a finite number > 0.0, got 0.0"):
        run_llops(q, k, v, tq, tk, **kw, window=3, local_scale=0.0)
    _, state = run_llops(q, k, v, tq, tk, **kw, window=4, sinks=1, output_final_state=True)
    with pytest.raises(ValueError, match=r"initial_state.k_window must have shape \[2, 2, 6, 8\] for this call"):
        run_llops(q, k, v, tq, tk, **kw, window=6, sinks=1, initial_state=state)
    with pytest.raises(TypeError, match=r"initial_state must be an AttentionState"):
        run_llops(q, k, v, tq, tk, **kw, window=4, sinks=1, initial_state=(state.S, state.z))


@pytest.mark.skipif(INTERPRETED, reason="compiled kernel at realistic sizes: CUDA only")
@pytest.mark.parametrize("local, window, sinks", [("softmax", 64, 4), ("poly", 37, 0), ("softmax", 300, 0)])
def test_cuda_compiled_hybrid(local, window, sinks):
    """The compiled hybrid (chunks of 32/16 tokens) at d = 64, m = 32, T = 300, fp32, against the
    dense formula; and three cuts with the carried state against the whole sequence."""
    shape = dict(D=64, M=32, DV=40, B=2, H=3)
    _compare(300, window=window, sinks=sinks, local=local, **shape)
    _check_split(300, splits=(3, 150, 151), window=window, sinks=sinks, local=local, **shape)


def test_functional_dispatch_of_the_hybrid():
    """``run_llops(backend="triton")`` hands the hybrid, the mask and the state to this kernel
    and equals ``backend="reference"``, final state included."""
    q, k, v, tq, tk, gl, grad = _problem(21)
    mask = _padding(2, 21)
    kw = dict(window=5, sinks=2, local="poly", output_final_state=True)
    got, st = run_llops(*(x.to(DEVICE, torch.float32) for x in (q, k, v, tq, tk)), gate=gl.to(DEVICE).float(),
                        key_padding_mask=mask.to(DEVICE), backend="triton", **kw)
    want, st_ref = run_llops(q, k, v, tq, tk, gate=gl, key_padding_mask=mask, backend="reference", **kw)
    assert _rel(got.cpu(), want) <= FP32_TOL
    for name in STATE_FIELDS:
        assert _rel(getattr(st, name).detach().cpu(), getattr(st_ref, name)) <= FP32_TOL, name
