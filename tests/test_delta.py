"""Decayed linear attention and the (gated) delta rule: chunked forms against their float64 twins.

Tolerances, as max |chunked − naive| / max(|naive|, 1) per tensor:
float64 1e-12 — the chunked form sums the same terms in another order (and solves a unit
triangular system instead of stepping), which moves float64 results by ~1e-14 at the sizes here
(T ≤ 130, measured worst 3e-15); 1e-12 fails only on a real error.
float32 1e-5 — measured worst 6e-7 (T = 130, a few fp32 ulp after ≤ 130 terms); ~17x margin.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from attention_calls import run_llops

from sketchlab.attention.ops.decayed.chunk import decayed_linear_chunked
from sketchlab.attention.ops.decayed.naive import decayed_linear_naive
from sketchlab.attention.ops.delta.chunk import delta_rule_chunked
from sketchlab.attention.ops.delta.naive import delta_rule_naive

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
B, H, M, DV = 2, 3, 4, 3  # M != Dv: a transposed state cannot pass by shape


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _close(got, ref, name, dtype=torch.float64):
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert got.dtype == dtype, (name, got.dtype)
    err = (got.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1.0)
    assert err <= TOL[dtype], f"{name}: relative error {err:.3g} > {TOL[dtype]}"


def _decayed_inputs(T, *, decay=True, nulls=False, init=False, seed=0, strength=1.0):
    g = _gen(seed)
    fq = torch.rand(B, T, H, M, generator=g, dtype=torch.float64)
    fk = torch.rand(B, T, H, M, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, DV, generator=g, dtype=torch.float64)
    ld = -strength * torch.rand(B, T, H, generator=g, dtype=torch.float64) if decay else None
    if nulls:  # null events: φ(k) = 0 and v = 0 at random steps
        null = torch.rand(B, T, H, generator=g) < 0.3
        fk, v = fk.masked_fill(null[..., None], 0.0), v.masked_fill(null[..., None], 0.0)
    state = (torch.randn(B, H, M, DV, generator=g, dtype=torch.float64),
             torch.rand(B, H, M, generator=g, dtype=torch.float64)) if init else None
    return (fq, fk, v, ld), state


def _delta_inputs(T, *, decay=True, nulls=False, init=False, seed=0, strength=1.0):
    g = _gen(seed)
    q = F.normalize(torch.randn(B, T, H, M, generator=g, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, M, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, DV, generator=g, dtype=torch.float64)
    beta = 2 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    la = -strength * torch.rand(B, T, H, generator=g, dtype=torch.float64) if decay else None
    if nulls:  # null events: k = 0, v = 0, β = 0 at random steps
        null = torch.rand(B, T, H, generator=g) < 0.3
        k, v = k.masked_fill(null[..., None], 0.0), v.masked_fill(null[..., None], 0.0)
        beta = beta.masked_fill(null, 0.0)
    state = torch.randn(B, H, M, DV, generator=g, dtype=torch.float64) if init else None
    return (q, k, v, beta, la), state


VARIANTS = {"plain": dict(decay=False), "decay": dict(decay=True), "nulls": dict(decay=False, nulls=True),
            "all": dict(decay=True, nulls=True, init=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("chunk", [1, 7, 64, 200])
@pytest.mark.parametrize("T", [1, 5, 64, 130])
def test_decayed_chunked_matches_naive(T, chunk, variant):
    args, state = _decayed_inputs(T, seed=T + chunk, **VARIANTS[variant])
    num, den, (S, z) = decayed_linear_naive(*args, initial_state=state)
    num_c, den_c, (S_c, z_c) = decayed_linear_chunked(*args, initial_state=state, chunk_size=chunk)
    for got, ref, name in ((num_c, num, "num"), (den_c, den, "den"), (S_c, S, "S"), (z_c, z, "z")):
        _close(got, ref, name)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("chunk", [1, 7, 64, 200])
@pytest.mark.parametrize("T", [1, 5, 64, 130])
def test_delta_chunked_matches_naive(T, chunk, variant):
    args, state = _delta_inputs(T, seed=T + chunk, **VARIANTS[variant])
    o, S = delta_rule_naive(*args, initial_state=state)
    o_c, S_c = delta_rule_chunked(*args, initial_state=state, chunk_size=chunk)
    _close(o_c, o, "o")
    _close(S_c, S, "S")


@pytest.mark.parametrize("which", ["decayed", "delta"])
def test_float32_chunked_close_to_naive(which):
    if which == "decayed":
        args, state = _decayed_inputs(130, nulls=True, init=True, seed=3)
        naive, chunked = decayed_linear_naive, decayed_linear_chunked
        state32 = tuple(s.float() for s in state)
    else:
        args, state = _delta_inputs(130, nulls=True, init=True, seed=3)
        naive, chunked = delta_rule_naive, delta_rule_chunked
        state32 = state.float()
    ref = naive(*args, initial_state=state)
    got = chunked(*(a.float() for a in args), initial_state=state32, chunk_size=32)
    flat = lambda r: [r[0], r[1], *r[2]] if which == "decayed" else list(r)  # noqa: E731
    for i, (g, r) in enumerate(zip(flat(got), flat(ref))):
        _close(g, r, f"output {i}", dtype=torch.float32)


def test_strong_decay_stays_finite():
    # log γ = −30 everywhere: the chunk-cumulative log-decay reaches −30·64 = −1920, so any
    # exp(+|L|) (e.g. exp(L_i)·exp(−L_j)) overflows to inf and the result turns NaN
    T, chunk = 130, 64
    (fq, fk, v, _), state = _decayed_inputs(T, init=True, seed=5)
    (q, k, vd, beta, _), S0 = _delta_inputs(T, init=True, seed=6)
    ld = torch.full((B, T, H), -30.0, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (fq, fk, v, q, k, vd, beta)]
    lq, lk, lv, dq, dk, dv, db = leaves
    num, den, (S, z) = decayed_linear_chunked(lq, lk, lv, ld, initial_state=state, chunk_size=chunk)
    o, Sd = delta_rule_chunked(dq, dk, dv, db, ld, initial_state=S0, chunk_size=chunk)
    ref = decayed_linear_naive(fq, fk, v, ld, initial_state=state)
    ref_d = delta_rule_naive(q, k, vd, beta, ld, initial_state=S0)
    _close(num.detach(), ref[0], "num")
    _close(den.detach(), ref[1], "den")
    _close(o.detach(), ref_d[0], "o")
    _close(Sd.detach(), ref_d[1], "S (delta)")
    (num.sum() + den.sum() + S.sum() + z.sum() + o.sum() + Sd.sum()).backward()
    for x, name in zip(leaves, ("fq", "fk", "v", "q", "k", "v (delta)", "beta")):
        assert torch.isfinite(x.grad).all(), name


@pytest.mark.parametrize("split", [1, 37, 64, 99])
@pytest.mark.parametrize("path", ["naive", "chunked"])
def test_split_equals_whole(path, split):
    T = 100
    kw = {} if path == "naive" else {"chunk_size": 16}
    dec = decayed_linear_naive if path == "naive" else decayed_linear_chunked
    dlt = delta_rule_naive if path == "naive" else delta_rule_chunked
    cut = lambda xs, a, b: [None if x is None else x[:, a:b] for x in xs]  # noqa: E731

    args, state = _decayed_inputs(T, nulls=True, init=True, seed=7)
    num, den, (S, z) = dec(*args, initial_state=state, **kw)
    n1, d1, st = dec(*cut(args, 0, split), initial_state=state, **kw)
    n2, d2, (S2, z2) = dec(*cut(args, split, T), initial_state=st, **kw)
    _close(torch.cat([n1, n2], 1), num, "num", dtype=num.dtype)
    _close(torch.cat([d1, d2], 1), den, "den", dtype=den.dtype)
    _close(S2, S, "S", dtype=S.dtype)
    _close(z2, z, "z", dtype=z.dtype)

    args, state = _delta_inputs(T, nulls=True, init=True, seed=8)
    o, S = dlt(*args, initial_state=state, **kw)
    o1, st = dlt(*cut(args, 0, split), initial_state=state, **kw)
    o2, S2 = dlt(*cut(args, split, T), initial_state=st, **kw)
    _close(torch.cat([o1, o2], 1), o, "o", dtype=o.dtype)
    _close(S2, S, "S (delta)", dtype=S.dtype)


def _small(seed):
    g = _gen(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return g, r


def test_gradcheck_decayed_chunked():
    g, r = _small(11)
    T = 5  # chunk 2: three chunks, the last one padded
    ld = -0.1 - 0.9 * torch.rand(1, T, 2, generator=g, dtype=torch.float64)  # away from 0: stays <= 0 under eps
    inputs = [r(1, T, 2, 3), r(1, T, 2, 3), r(1, T, 2, 2), ld, r(1, 2, 3, 2), r(1, 2, 3)]
    inputs = [x.requires_grad_() for x in inputs]

    def f(fq, fk, v, log_decay, S0, z0):
        num, den, (S, z) = decayed_linear_chunked(fq, fk, v, log_decay, initial_state=(S0, z0), chunk_size=2)
        return num, den, S, z

    assert torch.autograd.gradcheck(f, inputs)


def test_gradcheck_delta_chunked():
    g, r = _small(12)
    T = 5
    q, k = F.normalize(r(1, T, 2, 3), dim=-1), F.normalize(r(1, T, 2, 3), dim=-1)
    beta = 0.2 + 1.3 * torch.rand(1, T, 2, generator=g, dtype=torch.float64)  # inside (0, 2) under eps
    la = -0.1 - 0.9 * torch.rand(1, T, 2, generator=g, dtype=torch.float64)
    inputs = [x.requires_grad_() for x in (q, k, r(1, T, 2, 2), beta, la, r(1, 2, 3, 2))]

    def f(q, k, v, beta, log_alpha, S0):
        return delta_rule_chunked(q, k, v, beta, log_alpha, initial_state=S0, chunk_size=2)

    assert torch.autograd.gradcheck(f, inputs)


def _t(values, *tail):
    return torch.tensor(values, dtype=torch.float64).reshape(1, len(values), 1, *tail)


@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_hand_computed_tiny_case(chunk):
    # decayed: γ = (1/2, 1/4), φ(q) = (1, 2), φ(k) = (3, 1/2), v = (2, −4)
    #   t=0: S = 3·2 = 6, z = 3;        num = 1·6 = 6,     den = 1·3 = 3
    #   t=1: S = 6/4 + (1/2)(−4) = −1/2, z = 3/4 + 1/2 = 5/4; num = 2·(−1/2) = −1, den = 2·5/4 = 5/2
    dec = decayed_linear_naive if chunk is None else decayed_linear_chunked
    kw = {} if chunk is None else {"chunk_size": chunk}
    ld = _t([math.log(0.5), math.log(0.25)])
    num, den, (S, z) = dec(_t([1.0, 2.0], 1), _t([3.0, 0.5], 1), _t([2.0, -4.0], 1), ld, **kw)
    assert torch.allclose(num.flatten(), torch.tensor([6.0, -1.0], dtype=torch.float64), atol=1e-14, rtol=0)
    assert torch.allclose(den.flatten(), torch.tensor([3.0, 2.5], dtype=torch.float64), atol=1e-14, rtol=0)
    assert abs(S.item() + 0.5) < 1e-14 and abs(z.item() - 1.25) < 1e-14
    # delta: α = (1, 1/2), β = (1/2, 3/2), q = (1, 2), k = (1, 1), v = (2, 5)
    #   t=0: S = 0 + (1/2)(2 − 0) = 1;              o = 1·1 = 1
    #   t=1: S = 1/2; S = 1/2 + (3/2)(5 − 1/2) = 29/4; o = 2·29/4 = 29/2
    dlt = delta_rule_naive if chunk is None else delta_rule_chunked
    o, S = dlt(_t([1.0, 2.0], 1), _t([1.0, 1.0], 1), _t([2.0, 5.0], 1), _t([0.5, 1.5]),
               _t([0.0, math.log(0.5)]), **kw)
    assert torch.allclose(o.flatten(), torch.tensor([1.0, 14.5], dtype=torch.float64), atol=1e-14, rtol=0)
    assert abs(S.item() - 7.25) < 1e-14


@pytest.mark.parametrize("path", ["naive", "chunked"])
def test_delta_rule_overwrites_where_additive_sums(path):
    # one unit key written T times with β = 1: the delta state reads back the last value written,
    # the additive state the sum of all of them
    T = 9
    g = _gen(13)
    key = F.normalize(torch.randn(M, generator=g, dtype=torch.float64), dim=0)
    k = key.expand(B, T, H, M)
    v = torch.randn(B, T, H, DV, generator=g, dtype=torch.float64)
    beta = torch.ones(B, T, H, dtype=torch.float64)
    kw = {} if path == "naive" else {"chunk_size": 4}
    dlt = delta_rule_naive if path == "naive" else delta_rule_chunked
    dec = decayed_linear_naive if path == "naive" else decayed_linear_chunked
    o, S = dlt(k, k, v, beta, **kw)
    _close(o, v, "o_t = Sᵀk (the value just written)")
    _close(torch.einsum("m,bhmd->bhd", key, S), v[:, -1], "final readout = last value")
    num, _, _ = dec(k, k, v, **kw)
    _close(num, v.cumsum(1), "additive readout = running sum")


def _bad_cases():
    (fq, fk, v, ld), _ = _decayed_inputs(6, seed=20)
    (q, k, vd, beta, la), _ = _delta_inputs(6, seed=21)
    S_bad = torch.zeros(B, H, DV, M, dtype=torch.float64)  # transposed
    dec = dict(fq=fq, fk=fk, v=v, log_decay=ld)
    dlt = dict(q=q, k=k, v=vd, beta=beta, log_alpha=la)
    pos, nan = ld.clone(), ld.clone()
    pos[0, 2, 1], nan[1, 3, 0] = 0.5, float("nan")
    return [
        ("decayed", dict(dec, fk=fk[:, :, :2]), ValueError, r"must share the batch B .* and heads H"),
        ("decayed", dict(dec, v=v[:, :5]), ValueError, r"fk and v must share the token axis"),
        ("decayed", dict(dec, fq=fq[..., :3]), ValueError, r"fq and fk must share the last axis"),
        ("decayed", dict(dec, fq=fq.long()), TypeError, r"fq must have a real floating-point dtype"),
        ("decayed", dict(dec, fk=fk.float()), TypeError, r"must share one dtype"),
        ("decayed", dict(dec, log_decay=pos), ValueError,
         r"log_decay must be <= 0.0 everywhere, got 0.5 at index \(0, 2, 1\)"),
        ("decayed", dict(dec, log_decay=nan), ValueError, r"log_decay must be finite"),
        ("decayed", dict(dec, log_decay=ld[:, :5]), ValueError, r"log_decay must have shape \[B, T, H\] = \(2, 6, 3\)"),
        ("decayed", dict(dec, log_decay=ld.long()), TypeError, r"log_decay must have a real floating-point dtype"),
        ("decayed", dict(dec, initial_state=(S_bad, torch.zeros(B, H, M))), ValueError,
         r"initial_state\[0\] \(S\) must have shape \(2, 3, 4, 3\), got \(2, 3, 3, 4\)"),
        ("decayed", dict(dec, initial_state=(torch.zeros(B, H, M, DV), torch.zeros(B, H))), ValueError,
         r"initial_state\[1\] \(z\) must have shape \(2, 3, 4\)"),
        ("decayed", dict(dec, initial_state=torch.zeros(B, H, M, DV)), TypeError, r"initial_state must be a pair"),
        ("delta", dict(dlt, beta=beta + 2.5), ValueError, r"beta must be <= 2.0 everywhere"),
        ("delta", dict(dlt, beta=beta - 3.0), ValueError, r"beta must be >= 0.0 everywhere"),
        ("delta", dict(dlt, beta=None), TypeError, r"beta must be a tensor \[B, T, H\]"),
        ("delta", dict(dlt, beta=beta[..., :2]), ValueError, r"beta must have shape \[B, T, H\]"),
        ("delta", dict(dlt, log_alpha=-la), ValueError, r"log_alpha must be <= 0.0 everywhere"),
        ("delta", dict(dlt, log_alpha=la / 0), ValueError, r"log_alpha must be finite"),
        ("delta", dict(dlt, k=k[..., :2]), ValueError, r"q and k must share the last axis"),
        ("delta", dict(dlt, initial_state=S_bad), ValueError, r"initial_state \(S\) must have shape \(2, 3, 4, 3\)"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
@pytest.mark.parametrize("path", ["naive", "chunked"])
def test_bad_inputs_named(path, case):
    which, kwargs, exc, match = _bad_cases()[case]
    fn = {("decayed", "naive"): decayed_linear_naive, ("decayed", "chunked"): decayed_linear_chunked,
          ("delta", "naive"): delta_rule_naive, ("delta", "chunked"): delta_rule_chunked}[which, path]
    with pytest.raises(exc, match=match):
        fn(**kwargs)


@pytest.mark.parametrize("fn", [decayed_linear_chunked, delta_rule_chunked])
@pytest.mark.parametrize("chunk, exc, match", [(0, ValueError, r"chunk_size must be an integer >= 1, got 0"),
                                               (2.5, TypeError, r"chunk_size must be an integer >= 1, got 2.5"),
                                               (True, TypeError, r"chunk_size must be an integer >= 1, got True")])
def test_bad_chunk_size(fn, chunk, exc, match):
    if fn is decayed_linear_chunked:
        args, _ = _decayed_inputs(4)
    else:
        args, _ = _delta_inputs(4)
    with pytest.raises(exc, match=match):
        fn(*args, chunk_size=chunk)


def test_delta_rule_naive_computes_float32_inputs_in_float64():
    """The definition runs in float64 whatever the inputs' dtype (its docstring; the twin every fast path is
    measured against): float32 inputs give float64 outputs equal, bit for bit, to those of their float64
    copies (issue 35 mutation round)."""
    g = torch.Generator().manual_seed(5)
    B, T, H, M, Dv = 2, 9, 2, 4, 3
    q = F.normalize(torch.randn(B, T, H, M, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, M, generator=g), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=g)
    beta = torch.rand(B, T, H, generator=g) * 2
    log_alpha = -torch.rand(B, T, H, generator=g)
    o32, S32 = delta_rule_naive(q, k, v, beta, log_alpha)
    o64, S64 = delta_rule_naive(q.double(), k.double(), v.double(), beta.double(), log_alpha.double())
    assert o32.dtype == S32.dtype == torch.float64
    assert torch.equal(o32, o64) and torch.equal(S32, S64)


def test_llops_attention_under_the_delta_rule_does_not_self_tensor_a_signed_theta():
    """``non_negative=None`` means "self-tensor when a signed Θ would be divided by": the delta state divides by
    nothing, so the default equals ``non_negative=False`` (M features in the state) and differs from ``True`` (M²)."""
    import sketchlab as sl

    g = _gen(7)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    tq, tk = (torch.randn(2, 1, 2, 4, 3, generator=g, dtype=torch.float64) for _ in range(2))  # signed Θ, M = 3

    def run(non_negative):
        options = sl.AttentionOptions(state="delta", non_negative=non_negative, backend="reference")
        params = sl.FarParams(options, heads=2, dim_v=4).double()
        out, state = run_llops(q, k, v, tq, tk, options=options, params=params, output_final_state=True)
        return out, state.S.shape[-2]

    (default, m_default), (signed, m_signed), (tensored, m_tensored) = run(None), run(False), run(True)
    assert torch.equal(default, signed) and m_default == m_signed == 3 and m_tensored == 9
    assert (default - tensored).abs().max() > 1e-3
