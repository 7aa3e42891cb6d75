"""The lean decoding step (sketchlab.attention.recurrent.RecurrentStep) against the reference step: one
public call per token with ``initial_state`` (linear_attention / memory_attention), in float64, for
every mechanism, after a state split anywhere, after ``.detach()`` / ``.to()`` and a write-out and
re-layout of its own state, under padding held in the state, and with parameters changed in place
between two tokens (a training step: re-validated, never a stale derived value)."""

import warnings

import pytest
import torch
from attention_calls import run_chunked

from sketchlab.attention import AttentionOptions, FarParams
from sketchlab.attention.memory import memory_attention
from sketchlab.attention.ops import fused_recurrent
from sketchlab.attention.recurrent import RecurrentStep
from sketchlab.polynomial import self_tensor

# float64 round-off of a few dozen operations on O(1) values: the two paths order sums differently
TOL = dict(rtol=1e-10, atol=1e-11)
B, T, H, D, M = 2, 23, 2, 4, 3

#: name -> (options keywords, lift (an AttentionState of self-tensored features), poly degree)
MECHANISMS = {
    "linear": (dict(window=0), False, None),
    "linear-lifted": (dict(window=0), True, None),
    "hybrid": (dict(window=4, sinks=2), False, None),
    "hybrid-lifted": (dict(window=4, sinks=2), True, None),
    "hybrid-poly": (dict(window=4, sinks=2, local="poly"), False, 2),
    "decay-fixed": (dict(window=4, sinks=2, decay=0.9), False, None),
    "decay-head": (dict(window=4, sinks=2, decay="head"), False, None),
    "decay-input": (dict(window=4, sinks=2, decay="input"), False, None),
    "decay-pure": (dict(window=0, decay="input"), False, None),
    "delta": (dict(window=4, sinks=2, state="delta"), False, None),
    "delta-input": (dict(window=3, sinks=1, state="delta", beta="input"), False, None),
    "gated-delta": (dict(window=4, sinks=2, state="delta", decay="input"), False, None),
    "delta-pure": (dict(window=0, state="delta"), False, None),
    "cache": (dict(window=4, sinks=2, cache=3, rescore=5), False, None),
    "cache-decay": (dict(window=4, sinks=2, cache=3, rescore=5, decay="input"), False, None),
    "delta-cache": (dict(window=3, sinks=2, cache=3, rescore=4, state="delta", decay="head"), False, None),
    # repeated tokens and a re-scoring every other position: cached keys of equal scores (exactly, for the
    # additive state; the delta rule's unit keys leave last-bit differences between equal keys, so a "tie"
    # there is decided by the products' round-off), the oldest evicted
    "cache-ties": (dict(window=2, sinks=1, cache=3, rescore=2), False, None),
}


def _setup(name, seed=0):
    kw, lift, degree = MECHANISMS[name]
    gen = torch.Generator().manual_seed(seed)
    options = AttentionOptions(normalize="sum", **kw)
    q, k, v = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) for _ in range(3))
    proj = torch.randn(H, D, M, generator=gen, dtype=torch.float64)
    if name.endswith("ties"):  # three distinct tokens, repeated: equal keys score equally when re-scored together
        q, k, v = (x[:, torch.arange(T) % 3] for x in (q, k, v))
    fq, fk = ((torch.einsum("bthd,hdm->bthm", x, proj)).square() + 0.1 for x in (q, k))  # φ >= 0: sum-normalisable
    params = gate = None
    if options.memory:
        params = FarParams(options, H, D, gate=False).double()
        with torch.no_grad():
            for p in params.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    if options.window:
        gate = torch.randn(H, generator=gen, dtype=torch.float64)
    return options, lift, degree, q, k, v, fq, fk, params, gate


def _reference(options, lift, degree, q, k, v, fq, fk, params, gate, state, mask=None):
    """One reference call on tokens ``[a, b)`` given as tensors [B, n, H, ·] -> (o, state)."""
    w = options.window
    if options.memory:
        return memory_attention(fq, fk, v, q if w else None, k if w else None, options=options, params=params,
                                gate=gate, degree=degree, key_padding_mask=mask, initial_state=state,
                                output_final_state=True)
    return run_chunked(fq, fk, v, q=q if w else None, k=k if w else None, options=options.replace(
        non_negative=lift), gate=gate, degree=degree, key_padding_mask=mask, initial_state=state,
        output_final_state=True)


def _lean(options, lift, degree, params, gate, state):
    return RecurrentStep.from_state(state, options=options, params=params, gate=gate, degree=degree, lift=lift)


def _hd(x):  # [B, 1, H, ·] -> [B, H, 1, ·]
    return x.transpose(1, 2)


def _assert_states(lean_state, ref_state, what):
    for f in ("S", "z", "k_window", "v_window", "phi_window", "k_sink", "v_sink", "mask_window", "mask_sink",
              "k_cache", "v_cache", "phi_cache", "score_cache", "cached", "pos_cache"):
        if not hasattr(ref_state, f):
            continue
        a, b = getattr(lean_state, f), getattr(ref_state, f)
        if b is None:
            assert a is None or bool(a.all()), (what, f)
            continue
        if b.dtype in (torch.bool, torch.long):
            assert torch.equal(a, b), (what, f)
        else:
            torch.testing.assert_close(a, b, **TOL, msg=f"{what}: state field {f}")
    assert lean_state.offset == ref_state.offset, what


def _run(name, split, through=None, mask=None):
    """A prefill of ``split`` tokens by the reference (padded by ``mask [B, split]``), its state passed
    ``through`` a function, then both paths token by token: every output and the final state compared."""
    options, lift, degree, q, k, v, fq, fk, params, gate = _setup(name)
    _, state = _reference(options, lift, degree, q[:, :split], k[:, :split], v[:, :split], fq[:, :split],
                          fk[:, :split], params, gate, None, mask)
    state = through(state) if through else state  # both paths continue from it
    lean = _lean(options, lift, degree, params, gate, state)
    for t in range(split, T):
        sl = slice(t, t + 1)
        o_ref, state = _reference(options, lift, degree, q[:, sl], k[:, sl], v[:, sl], fq[:, sl], fk[:, sl], params,
                                  gate, state)
        o = lean.step(_hd(q[:, sl]), _hd(k[:, sl]), _hd(v[:, sl]), _hd(fq[:, sl]), _hd(fk[:, sl])).view(B, H, 1, -1)
        torch.testing.assert_close(o, _hd(o_ref), **TOL, msg=f"{name}: output at t={t} (split {split})")
    _assert_states(lean.state(), state, f"{name} (split {split})")
    return lean, state


@pytest.fixture(params=["compiled", "torch"])
def path(request, monkeypatch):
    """The compiled step (ops/fused_recurrent.py) and its torch twin. Every machine of this project has gcc and
    the dev extra installs ninja (make test puts it on PATH), so the compiled step must build here: a failure to
    build is a failure, not a skip (the torch twin alone would leave the compiled code untested)."""
    if request.param == "compiled":
        assert fused_recurrent.available(), ("the compiled step did not build (torch's load_inline needs gcc and "
                                             "ninja on PATH: pip install ninja, or run the suite with make test)")
    monkeypatch.setattr(fused_recurrent, "USE_COMPILED", request.param == "compiled")
    return request.param


@pytest.mark.parametrize("name", MECHANISMS)
@pytest.mark.parametrize("split", [1, 3, 6, 11])
def test_lean_step_equals_reference_step(name, split, path):
    """Every token's output and the final state, from a prefill of ``split`` tokens (inside the sinks, the
    window, the first re-scoring, far beyond), equal the reference call's, by the compiled step and by its
    torch twin."""
    _run(name, split)


@pytest.mark.parametrize("name", ["hybrid", "hybrid-lifted", "decay-input", "gated-delta", "cache", "delta-cache"])
@pytest.mark.parametrize("how", ["detach", "to", "round-trip"])
def test_lean_step_after_detach_to_and_its_own_state(name, how, path):
    """A state passed through ``.detach()``, through ``.to()`` (float32 storage and back: the values the
    reference continues from) or written out by a lean step and laid out again, continues alike."""
    if how == "round-trip":
        options, lift, degree, q, k, v, fq, fk, params, gate = _setup(name)
        lean, state = _run(name, 5)  # the reference state after T tokens, and the lean step's
        out = lean.state()
        again = _lean(options, lift, degree, params, gate, out.to(torch.float64).detach())
        _assert_states(again.state(), state, f"{name} re-laid out")
        return
    stored = (lambda s: s.to(torch.float32).to(torch.float64)) if how == "to" else (lambda s: s.detach())
    _run(name, 7, through=stored)


@pytest.mark.parametrize("name", ["hybrid", "cache", "delta-cache", "decay-input"])
def test_lean_step_continues_a_padded_prefill(name, path):
    """Pads held in the state (a left-padded row moved behind its sinks, pads inside the window) are never
    exact keys and never enter the far state, as in the reference."""
    mask = torch.ones(B, 6, dtype=torch.bool)
    mask[0, 2:4] = False  # row 0: pads after its sinks (inside the window at the split)
    mask[1, 3] = False
    _run(name, 6, mask=mask)


@pytest.mark.parametrize("name", ["hybrid", "gated-delta", "cache"])
def test_parameters_changed_in_place_are_seen(name, path):
    """A training step between two tokens (in-place updates of the gate, the decay, β) reaches the next
    token (the derived values are keyed on the tensors' versions), and a parameter made non-finite is
    refused at the next token: a stale validation would pass it."""
    options, lift, degree, q, k, v, fq, fk, params, gate = _setup(name)
    gate = torch.nn.Parameter(gate)
    split = 8
    _, state = _reference(options, lift, degree, q[:, :split], k[:, :split], v[:, :split], fq[:, :split],
                          fk[:, :split], params, gate, None)
    lean = _lean(options, lift, degree, params, gate, state)
    tensors = [gate] + ([p for p in params.parameters()] if params is not None else [])
    for t in range(split, T - 1):
        with torch.no_grad():  # an optimiser's step: in place, the same tensors
            for p in tensors:
                p.add_(0.05 * (t - split + 1))
        sl = slice(t, t + 1)
        o_ref, state = _reference(options, lift, degree, q[:, sl], k[:, sl], v[:, sl], fq[:, sl], fk[:, sl], params,
                                  gate, state)
        o = lean.step(_hd(q[:, sl]), _hd(k[:, sl]), _hd(v[:, sl]), _hd(fq[:, sl]), _hd(fk[:, sl])).view(B, H, 1, -1)
        torch.testing.assert_close(o, _hd(o_ref), **TOL, msg=f"{name}: output at t={t} after a parameter step")
    with torch.no_grad():
        tensors[-1].view(-1)[0] = float("nan")
    sl = slice(T - 1, T)
    with pytest.raises(ValueError, match="finite"):
        lean.step(_hd(q[:, sl]), _hd(k[:, sl]), _hd(v[:, sl]), _hd(fq[:, sl]), _hd(fk[:, sl]))


@pytest.mark.parametrize("name", MECHANISMS)
def test_compiled_step_in_float32_equals_its_torch_twin(name, monkeypatch):
    """In float32 (the buffers' dtype; the inputs' float64 converted in and out) the compiled step and its
    torch twin, from one state, give outputs and states equal to float32 round-off, token by token."""
    assert fused_recurrent.available(), "the compiled step did not build: this test would compare the twin with itself"
    options, lift, degree, q, k, v, fq, fk, params, gate = _setup(name)
    _, state = _reference(options, lift, degree, q[:, :6], k[:, :6], v[:, :6], fq[:, :6], fk[:, :6], params, gate, None)
    state = state.to(torch.float32)
    leans = []
    for compiled in (True, False):
        monkeypatch.setattr(fused_recurrent, "USE_COMPILED", compiled)
        leans.append(_lean(options, lift, degree, params, gate, state))
    tol = dict(rtol=2e-5, atol=2e-6)
    for t in range(6, T):
        sl = slice(t, t + 1)
        outs = []
        for compiled, lean in zip((True, False), leans):
            monkeypatch.setattr(fused_recurrent, "USE_COMPILED", compiled)
            outs.append(lean.step(_hd(q[:, sl]), _hd(k[:, sl]), _hd(v[:, sl]), _hd(fq[:, sl]), _hd(fk[:, sl])))
        assert outs[0].dtype == torch.float64
        torch.testing.assert_close(outs[0], outs[1], **tol, msg=f"{name}: float32 output at t={t}")
    a, b = leans[0].state(), leans[1].state()
    for f in ("S", "z", "k_window", "phi_window", "k_cache", "score_cache", "cached", "pos_cache"):
        if hasattr(b, f):
            torch.testing.assert_close(getattr(a, f), getattr(b, f), **tol, msg=f"{name}: float32 state field {f}")


@pytest.mark.parametrize("name", ["cache", "cache-ties", "cache-decay", "delta-cache"])
def test_float32_cache_choices_are_the_references(name, path):
    """In float32 (the usual dtype, and the torch twin's on a GPU) the lean step keeps the cache's scores as the
    state stores them, rounded to float32, re-scored ones too: its choices (which key sits in which slot) are
    the reference call's token by token, over 8 draws (a re-scoring on the token a key leaves, stored unrounded
    by the twin, changed later choices in 13 of 25 draws of the ties case)."""
    for seed in range(8):
        options, lift, degree, q, k, v, fq, fk, params, gate = _setup(name, seed)
        q, k, v, fq, fk = (x.float() for x in (q, k, v, fq, fk))
        params, gate = (None if x is None else x.float() for x in (params, gate))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            _, state = _reference(options, lift, degree, q[:, :3], k[:, :3], v[:, :3], fq[:, :3], fk[:, :3], params,
                                  gate, None)
            lean = _lean(options, lift, degree, params, gate, state)
            for t in range(3, T):
                sl = slice(t, t + 1)
                _, state = _reference(options, lift, degree, q[:, sl], k[:, sl], v[:, sl], fq[:, sl], fk[:, sl],
                                      params, gate, state)
                lean.step(_hd(q[:, sl]), _hd(k[:, sl]), _hd(v[:, sl]), _hd(fq[:, sl]), _hd(fk[:, sl]))
                got = lean.state()
                assert torch.equal(got.pos_cache, state.pos_cache), f"{name}, draw {seed}: slots differ at t={t}"
                assert torch.equal(got.cached, state.cached), f"{name}, draw {seed}: filled slots differ at t={t}"


@pytest.mark.parametrize("name", ["linear", "hybrid"])
def test_signed_denominators_are_reported(name, path):
    """Signed features under a normalised read: a denominator ``<= 0`` is reported (warned) by either path,
    as the reference does, and the output is ``n / (d + eps)`` as the reference's."""
    options, lift, degree, q, k, v, fq, fk, params, gate = _setup(name)
    fq, fk = fq - 2.0, -(fk + 1.0)  # φ(q)·φ(k) < 0 for these: the sums turn negative
    refs = []
    with warnings.catch_warnings():  # the reference's own reports
        warnings.simplefilter("ignore", RuntimeWarning)
        _, state = _reference(options, lift, degree, q[:, :3], k[:, :3], v[:, :3], fq[:, :3], fk[:, :3], params, gate,
                              None)
        lean = _lean(options, lift, degree, params, gate, state)
        for t in range(3, 9):
            sl = slice(t, t + 1)
            o_ref, state = _reference(options, lift, degree, q[:, sl], k[:, sl], v[:, sl], fq[:, sl], fk[:, sl],
                                      params, gate, state)
            refs.append(o_ref)
    assert lean.check_den
    with pytest.warns(RuntimeWarning, match="denominator <= 0"):
        for t, o_ref in zip(range(3, 9), refs):
            sl = slice(t, t + 1)
            o = lean.step(_hd(q[:, sl]), _hd(k[:, sl]), _hd(v[:, sl]), _hd(fq[:, sl]), _hd(fk[:, sl]))
            torch.testing.assert_close(o.view(B, H, 1, -1), _hd(o_ref), **TOL)


@pytest.mark.parametrize("name", ["hybrid", "cache", "delta-cache"])
def test_the_state_laid_out_is_left_as_it_was(name, path):
    """The step writes only its own buffers: the state it was laid out from (float64, whose cache scores the step
    keeps in float64 too) is unchanged after tokens, so a caller may continue it on another path."""
    options, lift, degree, q, k, v, fq, fk, params, gate = _setup(name)
    _, state = _reference(options, lift, degree, q[:, :8], k[:, :8], v[:, :8], fq[:, :8], fk[:, :8], params, gate, None)
    before = {f: getattr(state, f).clone() for f in vars(state) if isinstance(getattr(state, f), torch.Tensor)}
    lean = _lean(options, lift, degree, params, gate, state)
    for t in range(8, T):
        sl = slice(t, t + 1)
        lean.step(_hd(q[:, sl]), _hd(k[:, sl]), _hd(v[:, sl]), _hd(fq[:, sl]), _hd(fk[:, sl]))
    for f, x in before.items():
        assert torch.equal(getattr(state, f), x), f


def test_from_state_refuses_a_state_of_other_options():
    options, lift, degree, q, k, v, fq, fk, params, gate = _setup("cache")
    _, state = _reference(options, lift, degree, q[:, :5], k[:, :5], v[:, :5], fq[:, :5], fk[:, :5], params, gate, None)
    with pytest.raises(ValueError, match="other options"):
        RecurrentStep.from_state(state, options=options.replace(cache=4), params=params, gate=gate)
    with pytest.raises(ValueError, match="memory"):
        RecurrentStep.from_state(state, options=AttentionOptions(window=4, sinks=2), gate=gate)
    with pytest.raises(TypeError, match="from_state"):
        RecurrentStep()


def test_self_tensor_is_the_lift():  # the lifted mechanisms above compare against the reference's own lift
    x = torch.randn(2, 3, dtype=torch.float64)
    assert torch.equal(self_tensor(x), (x[:, :, None] * x[:, None, :]).flatten(-2))


def test_a_build_lock_left_by_a_killed_build_is_removed(tmp_path, monkeypatch):
    """torch's next build waits forever on the lock file of a build that was killed midway: the build directory
    drops a lock older than STALE_LOCK_S before building, and leaves a live build's lock alone."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    where = fused_recurrent.build_directory()
    assert where.parent == tmp_path and where.is_dir()
    lock = where / "lock"
    lock.touch()
    assert fused_recurrent.build_directory() == where and lock.exists()  # a build in progress: kept
    old = time.time() - fused_recurrent.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    fused_recurrent.build_directory()
    assert not lock.exists()


def test_the_compiled_step_refuses_a_misshapen_input():
    """The compiled step reads raw lanes: an input of the right size but another shape (``[B, H, D, 1]`` for
    ``q``) is refused by name, as the torch twin refuses it, never read as something else."""
    assert fused_recurrent.available()
    options, lift, degree, q, k, v, fq, fk, params, gate = _setup("hybrid")
    _, state = _reference(options, lift, degree, q[:, :5], k[:, :5], v[:, :5], fq[:, :5], fk[:, :5], params, gate, None)
    lean = _lean(options, lift, degree, params, gate, state)
    sl = slice(5, 6)
    with pytest.raises(RuntimeError, match="fused step: an input of shape"):
        lean.step(_hd(q[:, sl]).mT, _hd(k[:, sl]), _hd(v[:, sl]), _hd(fq[:, sl]), _hd(fk[:, sl]))
