"""The chunked cores with hand-written backward passes (sketchlab.attention.ops.additive.chunk's chunk_core,
ops.additive.chunk_hybrid's hybrid_core; the far state they share: ops.additive.chunk).

``chunk_core`` is checked against its formula written densely (every query against every key with
an explicit lag mask) and by ``gradcheck``; ``hybrid_core`` through the public chunked path,
whose outputs and gradients must equal autograd through the dense float64 twin.

Tolerances: float64, 1e-12 on the dense formula (the same O(10) terms summed in another order,
~1e-16 relative each); gradients 1e-9 relative to the largest gradient (sums of a few hundred
terms, and the twin's softmax goes through exp and its max); ``gradcheck``'s defaults (finite
differences at eps 1e-6, atol 1e-5).
"""

import pytest
import torch
from attention_calls import run_chunked

from sketchlab.attention.ops.additive.chunk import chunk_core
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.polynomial import self_tensor

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("non_negative", [False, True])
@pytest.mark.parametrize("n, off, lag", [(13, 0, 0), (13, 8, 5), (9, 4, 1), (10, 8, 8), (7, 0, 3), (5, 12, 9)])
def test_chunk_core_equals_its_dense_formula(non_negative, n, off, lag):
    """Query t reads key e iff e <= off + t − lag; S_out holds every key e <= off + n − 1 − lag."""
    B, H, M, Dv, C = 2, 2, 3, 2, 4
    g = _gen(n * 100 + off * 10 + lag)
    fq, fk = torch.rand(B, H, n, M, generator=g, dtype=F64), torch.rand(B, H, off + n, M, generator=g, dtype=F64)
    v = torch.randn(B, H, off + n, Dv, generator=g, dtype=F64)
    M2 = M * M if non_negative else M
    S, z = torch.randn(B, H, M2, Dv, generator=g, dtype=F64), torch.rand(B, H, M2, generator=g, dtype=F64)
    num, den, S_out, z_out = chunk_core(fq, fk, v, S, z, off=off, lag=lag, chunk_size=C, non_negative=non_negative,
                                        normalize=False, eps=0.0)
    scores = fq @ fk.mT  # [B, H, n, off + n]
    if non_negative:
        scores = scores**2
    t = torch.arange(n)[:, None] + off
    e = torch.arange(off + n)[None, :]
    scores = scores * (e <= t - lag)
    lq, lk = (self_tensor(fq), self_tensor(fk)) if non_negative else (fq, fk)
    enters = (torch.arange(off + n) <= off + n - 1 - lag)[None, None, :, None]
    assert (num - (scores @ v + lq @ S)).abs().max() < 1e-12
    assert (den - (scores.sum(-1) + (lq @ z[..., None])[..., 0])).abs().max() < 1e-12
    assert (S_out - (S + (lk * enters).mT @ v)).abs().max() < 1e-12
    assert (z_out - (z + (lk * enters).sum(2))).abs().max() < 1e-12


@pytest.mark.parametrize("stateful", [True, False])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("non_negative", [False, True])
def test_chunk_core_gradcheck(normalize, non_negative, stateful):
    """Gradients to the features, values and the incoming state, through out (or num, den) and S_out, z_out;
    stateless: no state in (``None``) and none out (``final_state=False``), the features and values only."""
    B, H, M, Dv, C, n, off, lag = 1, 2, 2, 2, 3, 7, 3, 2
    g = _gen(5 if stateful else 6)
    fq = torch.rand(B, H, n, M, generator=g, dtype=F64).requires_grad_()
    fk = torch.rand(B, H, off + n, M, generator=g, dtype=F64).requires_grad_()
    v = torch.randn(B, H, off + n, Dv, generator=g, dtype=F64).requires_grad_()
    M2 = M * M if non_negative else M
    S = torch.randn(B, H, M2, Dv, generator=g, dtype=F64).requires_grad_()
    z = torch.rand(B, H, M2, generator=g, dtype=F64).add(0.5).requires_grad_()

    def f(*args):
        state = args[3:] if stateful else (None, None)
        out = chunk_core(*args[:3], *state, off=off, lag=lag, chunk_size=C, non_negative=non_negative,
                         normalize=normalize, eps=1e-3, final_state=stateful)
        if not stateful:
            return out[0] if normalize else out[:2]
        return (out[0], out[2], out[3]) if normalize else out  # den is not differentiable when normalised

    assert torch.autograd.gradcheck(f, (fq, fk, v, S, z) if stateful else (fq, fk, v))


@pytest.mark.parametrize("window, local, non_negative, masked, degree", [
    (1, "softmax", False, True, 2), (3, "poly", True, False, 2), (4, "softmax", True, True, 2),
    (4, "poly", False, True, 2), (9, "softmax", False, False, 2), (40, "softmax", True, True, 2),
    (4, "poly", False, True, 1), (3, "poly", True, False, 1), (9, "poly", False, True, 3)])
def test_hybrid_gradients_equal_the_naive_twin(window, local, non_negative, masked, degree):
    """Every gradient of the causal hybrid (q, k, v, the features, the gate) equals autograd through
    the dense twin: windows below, at (4) and above the chunk size and beyond T, sinks, padding,
    self-tensored features, both local kinds (poly of degree 1, 2, 3: degree 1 takes the core's
    unmasked-logit path), the state carried over two blocks of two chunks."""
    g = _gen(window)
    B, T, H, D, M = 2, 19, 2, 3, 3
    base = [torch.randn(B, T, H, D, generator=g, dtype=F64) for _ in range(3)]
    base += [torch.rand(B, T, H, M, generator=g, dtype=F64) for _ in range(2)] + [torch.randn(H, generator=g, dtype=F64)]
    mask = torch.rand(B, T, generator=g) > 0.25 if masked else None
    weight = torch.randn(B, T, H, D, generator=g, dtype=F64)  # a random linear loss of the output
    if masked:
        weight = weight * mask[:, :, None, None]  # padded queries' outputs are not compared
    grads = []
    for fn, extra in ((feature_attention_naive, {}), (run_chunked, {"chunk_size": 4, "block_chunks": 2})):
        xs = [x.clone().requires_grad_() for x in base]
        out = fn(xs[3], xs[4], xs[2], q=xs[0], k=xs[1], window=window, sinks=2, gate=xs[5], local=local,
                 degree=degree, key_padding_mask=mask, non_negative=non_negative, denominator_check="off", **extra)
        (out * weight).sum().backward()
        grads.append([x.grad for x in xs])
    for name, a, b in zip(("q", "k", "v", "phi_q", "phi_k", "gate"), *grads):
        assert (a - b).abs().max() <= 1e-9 * (1 + b.abs().max()), name


def test_hybrid_gradient_through_a_tied_maximum():
    """Two equal local logits (a duplicated key): the gradient through c_i is split between them as
    autograd's amax splits it in the dense twin."""
    g = _gen(11)
    B, T, H, D, M = 1, 9, 1, 2, 2
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=F64) for _ in range(3))
    k[:, 4] = k[:, 4] * 4 / k[:, 4].norm()
    k[:, 5] = k[:, 4]  # keys 4 and 5 equal and long: for queries 5 and 6 along them, the local maximum is a tie
    k[:, 6] = k[:, 6] / k[:, 6].norm()
    q[:, 5:7] = k[:, 4:5]
    fq, fk = (torch.rand(B, T, H, M, generator=g, dtype=F64) for _ in range(2))
    grads = []
    for fn, extra in ((feature_attention_naive, {}), (run_chunked, {"chunk_size": 4})):
        xs = [x.clone().requires_grad_() for x in (q, k, v, fq, fk)]
        fn(xs[3], xs[4], xs[2], q=xs[0], k=xs[1], window=3, **extra).square().sum().backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 1e-9 * (1 + b.abs().max())


def _hybrid_grads(base, mask=None, **kw):
    """Output and gradients (q, k, v, φ_q, φ_k, gate) of a random linear loss, the dense twin's and the
    chunked path's, for ``base = [q, k, v, φ_q, φ_k, gate]``."""
    weight = torch.randn(base[2].shape, generator=_gen(99), dtype=F64)
    res = []
    for fn, extra in ((feature_attention_naive, {}), (run_chunked, {"chunk_size": 4, "block_chunks": 1})):
        xs = [x.clone().requires_grad_() for x in base]
        out = fn(xs[3], xs[4], xs[2], q=xs[0], k=xs[1], gate=xs[5], key_padding_mask=mask, denominator_check="off",
                 **kw, **extra)
        (out * weight).sum().backward()
        res.append([out.detach()] + [x.grad for x in xs])
    return res


@pytest.mark.parametrize("local", ["softmax", "poly"])
def test_hybrid_with_a_gate_at_one(local):
    """A head whose gate is exactly 1 (sigmoid(40) rounds to 1 in float64: no far part): the chunked core
    then keeps the factors g and 1 − g as written instead of dividing by 1 − g; output and gradients equal
    the twin's."""
    assert torch.sigmoid(torch.tensor(40.0, dtype=F64)) == 1.0  # the case under test
    g = _gen(5)
    B, T, H, D, M = 2, 19, 2, 3, 3
    base = [torch.randn(B, T, H, D, generator=g, dtype=F64) for _ in range(3)]
    base += [torch.rand(B, T, H, M, generator=g, dtype=F64) for _ in range(2)] + [torch.tensor([40.0, -0.4], dtype=F64)]
    ref, got = _hybrid_grads(base, window=4, sinks=2, local=local, degree=2, eps=1e-3)
    for name, a, b in zip(("out", "q", "k", "v", "phi_q", "phi_k", "gate"), got, ref):
        assert (a - b).abs().max() <= 1e-9 * (1 + b.abs().max()), name


@pytest.mark.parametrize("padded", [False, True])
def test_hybrid_tie_of_zero_logits_at_a_row_without_local_keys(padded):
    """A zero query (every local logit 0 = c_i, all of them tied) in the last row of a chunk, whose lag-1 key
    chunk holds no local key when w = C: that row's logits there are kept finite for the softmax and must not
    count as ties (they would dilute the share of dc_i). Without padding or sinks the lag masks are the
    matmul's bias (the path the benchmark takes); with a padded key, the masks are filled in."""
    g = _gen(8)
    B, T, H, D, M = 1, 16, 1, 3, 2
    base = [torch.randn(B, T, H, D, generator=g, dtype=F64) for _ in range(3)]
    base[0][:, 11] = 0.0  # position 11: the last row of chunk 2 (C = 4), in the third block
    base += [torch.rand(B, T, H, M, generator=g, dtype=F64) for _ in range(2)] + [torch.tensor([0.3], dtype=F64)]
    mask = None
    if padded:
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[:, 5] = False
    ref, got = _hybrid_grads(base, mask, window=4, local="softmax")
    for name, a, b in zip(("out", "q", "k", "v", "phi_q", "phi_k", "gate"), got, ref):
        assert (a - b).abs().max() <= 1e-9 * (1 + b.abs().max()), name


@pytest.mark.parametrize("local, degree", [("softmax", 2), ("poly", 2), ("poly", 1)])
def test_hybrid_with_a_padded_sink_in_later_blocks(local, degree):
    """A padded sink in one sequence is hidden from every later query, in blocks whose own keys are all real
    (the core's data mask for the sinks alone), forward and backward; the other sequence sees both sinks.
    Output and gradients equal the twin's (poly of degree 1 takes the core's unmasked-logit path)."""
    g = _gen(21)
    B, T, H, D, M = 2, 23, 2, 3, 3
    base = [torch.randn(B, T, H, D, generator=g, dtype=F64) for _ in range(3)]
    base += [torch.rand(B, T, H, M, generator=g, dtype=F64) for _ in range(2)] + [torch.tensor([0.7, -0.4], dtype=F64)]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 1] = False  # the second sink of the second sequence
    ref, got = _hybrid_grads(base, mask, window=5, sinks=2, local=local, degree=degree)
    for name, a, b in zip(("out", "q", "k", "v", "phi_q", "phi_k", "gate"), got, ref):
        assert (a - b).abs().max() <= 1e-9 * (1 + b.abs().max()), name


def test_no_double_backward():
    """The cores' backward passes work in place: a second derivative is refused, not wrong."""
    fq, fk, v = (torch.rand(1, 1, 4, 2, dtype=F64, requires_grad=True) for _ in range(3))
    out = chunk_core(fq, fk, v, torch.zeros(1, 1, 2, 2, dtype=F64), torch.zeros(1, 1, 2, dtype=F64), off=0, lag=0,
                     chunk_size=2, non_negative=False, normalize=True, eps=1e-6)[0]
    (gq,) = torch.autograd.grad(out.sum(), fq, create_graph=True)
    with pytest.raises(RuntimeError):
        gq.sum().backward()


def test_chunk_core_rejects_a_misaligned_offset():
    x = torch.zeros(1, 1, 5, 2)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        chunk_core(x[:, :, :2], x, x, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2), off=3, lag=0, chunk_size=2,
                   non_negative=False, normalize=False, eps=0.0)


def _core_args(**change):
    """Valid ``chunk_core`` arguments (B = 1, H = 2, n = 4, off = 2, M = 3, Dv = 5, C = 2), some replaced."""
    args = dict(fq=torch.zeros(1, 2, 4, 3), fk=torch.zeros(1, 2, 6, 3), v=torch.zeros(1, 2, 6, 5),
                S_in=torch.zeros(1, 2, 3, 5), z_in=torch.zeros(1, 2, 3), off=2, lag=1, chunk_size=2,
                non_negative=False, normalize=True, eps=1e-6)
    args.update(change)
    return args


@pytest.mark.parametrize("change, match", [
    (dict(fq=torch.zeros(2, 4, 3)), "fq must be a 4-D tensor"),
    (dict(z_in=torch.zeros(1, 2, 3, 1)), "z_in must be a 3-D tensor"),
    (dict(v=torch.zeros(1, 2, 6, 5, dtype=torch.float64)), "v must be a floating tensor of fq's dtype"),
    (dict(fk=torch.zeros(1, 2, 6, 3, dtype=torch.int64)), "fk must be a floating tensor"),
    (dict(fk=torch.zeros(1, 2, 5, 3)), r"fk must be \[1, 2, 6, 3\]"),
    (dict(fk=torch.zeros(1, 2, 6, 4)), r"fk must be \[1, 2, 6, 3\]"),
    (dict(v=torch.zeros(1, 1, 6, 5)), r"v must be \[1, 2, 6, 5\]"),
    (dict(S_in=torch.zeros(1, 2, 3, 4)), r"S_in must be \[1, 2, 3, 5\]"),
    (dict(S_in=torch.zeros(1, 2, 3, 5), non_negative=True), r"S_in must be \[1, 2, 9, 5\].*M2=9 = M²"),
    (dict(z_in=torch.zeros(1, 2, 4)), r"z_in must be \[1, 2, 3\]"),
    (dict(lag=-1), "lag must be an int >= 0, got -1"),
    (dict(off=-2), "off must be an int >= 0"),
    (dict(chunk_size=0), "chunk_size must be an int >= 1, got 0"),
    (dict(chunk_size=2.0), "chunk_size must be an int"),
    (dict(S_in=None), "S_in and z_in must both be tensors or both None"),
    (dict(z_in=None), "S_in and z_in must both be tensors or both None"),
    (dict(final_state=1), "final_state must be a bool, got 1"),
])
def test_chunk_core_validates_its_arguments(change, match):
    """The core checks its own arguments (its callers validate the public ones): each error names the tensor or
    option, the rule and the value."""
    with pytest.raises(ValueError, match=match):
        chunk_core(**_core_args(**change))


def test_chunk_core_accepts_the_valid_arguments():
    """The arguments the rejection tests start from are valid (so each rejection is the changed argument's)."""
    out, den, S, z = chunk_core(**_core_args())
    assert out.shape == (1, 2, 4, 5) and den.shape == (1, 2, 4) and S.shape == (1, 2, 3, 5) and z.shape == (1, 2, 3)
    _, _, S2, _ = chunk_core(**_core_args(S_in=torch.zeros(1, 2, 9, 5), z_in=torch.zeros(1, 2, 9), non_negative=True))
    assert S2.shape == (1, 2, 9, 5)


@pytest.mark.parametrize("n, off, lag, C", [(16, 4, 4, 4), (13, 8, 5, 4), (9, 4, 9, 4), (5, 4, 7, 4), (13, 0, 0, 4),
                                           (10, 8, 8, 4), (4, 0, 0, 4), (5, 12, 9, 4)])
def test_far_matrix_rows_are_the_far_states_and_s_out(n, off, lag, C):
    """Both cores form the far states and S_out as one GEMM ``[P; S_out] = R·[S_in; upd]``: column 0 of ``R`` is ones
    (S_in enters every row), column ``1 + e`` key chunk ``e``; row ``c < N`` marks the key chunks wholly far for query
    chunk ``c`` (last key ``eC + C − 1 <= off + cC − lag``), row ``N`` those wholly in S_out (``eC + C − 1 < off + n −
    lag``; S_out's other keys, ``rem`` of them, are added apart)."""
    from sketchlab.attention.ops.additive.far import chunk_geometry

    N, _, Ne, _, R, _, reach = chunk_geometry(n, off, lag, C, torch.device("cpu"), F64)
    want = [[1.0] + [float(e * C + C - 1 <= off + c * C - lag) for e in range(Ne)] for c in range(N)]
    want.append([1.0] + [float(e * C + C - 1 < off + n - lag) for e in range(Ne)])
    assert torch.equal(R, torch.tensor(want, dtype=F64))
    assert not R[:N, 1 + reach:].any() and (reach == 0 or R[:N, reach].any())  # the queries read key chunks < reach


@pytest.mark.parametrize("non_negative", [False, True])
@pytest.mark.parametrize("n, off, lag", [(13, 0, 0), (13, 8, 5), (10, 8, 8), (4, 0, 0)])
def test_chunk_core_without_a_state(non_negative, n, off, lag):
    """``S_in = z_in = None`` is the zero state and ``final_state=False`` forms no ``S_out, z_out``: the outputs equal
    those of an explicit zero state with the final state formed (the same sums less an added zero; the prefix GEMM's
    inner length differs by zero columns, which a BLAS may block differently: 1e-13 on O(1) float64 values)."""
    B, H, M, Dv, C = 2, 2, 3, 2, 4
    g = _gen(n + off + lag)
    fq, fk = torch.rand(B, H, n, M, generator=g, dtype=F64), torch.rand(B, H, off + n, M, generator=g, dtype=F64)
    v = torch.randn(B, H, off + n, Dv, generator=g, dtype=F64)
    M2 = M * M if non_negative else M
    zero = (torch.zeros(B, H, M2, Dv, dtype=F64), torch.zeros(B, H, M2, dtype=F64))
    kw = dict(off=off, lag=lag, chunk_size=C, non_negative=non_negative, normalize=True, eps=1e-3)
    out, den, S_out, z_out = chunk_core(fq, fk, v, *zero, **kw)
    out0, den0, S0, z0 = chunk_core(fq, fk, v, None, None, **kw, final_state=False)
    assert S0 is None and z0 is None
    out1, den1, S1, z1 = chunk_core(fq, fk, v, None, None, **kw)  # no state in, the final state out
    for name, a, b in (("out", out0, out), ("den", den0, den), ("out, S out", out1, out), ("S_out", S1, S_out),
                       ("z_out", z1, z_out)):
        assert (a - b).abs().max() < 1e-13, name


def _spy_far_state(monkeypatch):
    """Record the ``used`` argument of every per-chunk update the cores form (``ops.additive.far._far_state``)."""
    from sketchlab.attention.ops.additive import far as cc

    calls, real = [], cc._far_state

    def spy(R, lk, vc, S_in, z_in, used):
        calls.append((R, lk.shape[0], used))
        return real(R, lk, vc, S_in, z_in, used)

    monkeypatch.setattr(cc, "_far_state", spy)
    return calls


@pytest.mark.parametrize("final_state", [False, True])
@pytest.mark.parametrize("n, off, lag", [(16, 0, 0), (13, 0, 0), (13, 8, 5), (10, 8, 8), (5, 12, 9), (8, 0, 9)])
def test_chunk_core_forms_updates_only_for_the_key_chunks_it_reads(monkeypatch, final_state, n, off, lag):
    """Key chunk ``e``'s update ``φ(k)ᵀv`` is read when some query chunk ``c`` holds it wholly far (its last key
    ``eC + C − 1 <= off + cC − lag``) and, with ``final_state``, when it lies wholly in ``S_out`` (``eC + C − 1 <
    off + n − lag``). The core forms the updates of the chunks up to the last one read, no more (the backward: those
    the queries read), and none when the caller reads no final state and no query reads any."""
    C, N = 4, -(-n // 4)
    reads_q = [e for e in range((off + n) // C + 1) if any(e * C + C - 1 <= off + c * C - lag for c in range(N))]
    reads_s = [e for e in range((off + n) // C + 1) if e * C + C - 1 < off + n - lag] if final_state else []
    want_fwd, want_bwd = max(reads_q + reads_s, default=-1) + 1, max(reads_q, default=-1) + 1
    calls = _spy_far_state(monkeypatch)
    fq, fk = torch.rand(1, 1, n, 2, dtype=F64, requires_grad=True), torch.rand(1, 1, off + n, 2, dtype=F64)
    out = chunk_core(fq, fk, torch.rand(1, 1, off + n, 2, dtype=F64), None, None, off=off, lag=lag, chunk_size=C,
                     non_negative=False, normalize=True, eps=1e-3, final_state=final_state)[0]
    out.sum().backward()
    assert [used for _, _, used in calls] == [want_fwd, want_bwd]


def test_hybrid_core_forms_updates_only_for_the_key_chunks_it_reads(monkeypatch):
    """The hybrid core's updates are those its far-state GEMM reads (the rows of the query chunks' far states and, in
    the forward, the row of ``S_out``): every column past them is zero and the last one formed is not. In a steady
    block (window = C, a held window of one chunk) the block's last key chunk is read by neither: the next block
    forms its update (as its held window), this one does not."""
    C, T = 4, 24
    g = _gen(12)
    q, k, v = (torch.randn(1, T, 2, 3, generator=g, dtype=F64) for _ in range(3))
    fq, fk = (torch.rand(1, T, 2, 3, generator=g, dtype=F64) for _ in range(2))
    calls = _spy_far_state(monkeypatch)
    fq.requires_grad_()
    run_chunked(fq, fk, v, q=q, k=k, window=C, chunk_size=C, block_chunks=2).sum().backward()
    assert len(calls) == 6  # three blocks of two chunks, forward then backward (blocks in reverse)
    for R, Ne, used in calls:  # (column 0 of R: S_in; column 1 + e: key chunk e)
        assert not R[:, 1 + used:].any() and (used == 0 or R[:, used].any())
    # steady blocks: the held window's chunk + 2; the forward forms 2 (the first for a query chunk, both for S_out),
    # the backward 1 (the queries' far states alone)
    assert [(Ne, used) for _, Ne, used in calls[1:3] + calls[3:5]] == [(3, 2), (3, 2), (3, 1), (3, 1)]


def _spy_gemms(monkeypatch):
    """Record, per call of the far-state GEMM (``ops.additive.far._far_state``), its rows, whether it read ``S_in`` and what
    it returned; per backward (``chunk._far_state_grads``), the rows of its GEMM and ``need_in``."""
    from sketchlab.attention.ops.additive import far as cc

    fwd, bwd, real_f, real_b = [], [], cc._far_state, cc._far_state_grads

    def spy_f(R, lk, vc, S_in, z_in, used):
        res = real_f(R, lk, vc, S_in, z_in, used)
        fwd.append((R.shape[0], S_in is not None, res))
        return res

    def spy_b(R, dP, dzP, lk, vc, g_S, g_z, last, need_in):
        bwd.append((dP.shape[0], dzP.shape[0], need_in))
        return real_b(R, dP, dzP, lk, vc, g_S, g_z, last, need_in)

    monkeypatch.setattr(cc, "_far_state", spy_f)
    monkeypatch.setattr(cc, "_far_state_grads", spy_b)
    return fwd, bwd


@pytest.mark.parametrize("state_in", ["none", "tensor", "requires_grad"])
@pytest.mark.parametrize("final_state", [False, True])
def test_chunk_core_final_state_is_a_row_of_the_far_gemm(monkeypatch, final_state, state_in):
    """The forward forms the query chunks' far states and ``S_out, z_out`` in one GEMM ``[P; S_out] = R·[S_in; upd]``:
    ``N + 1`` rows with a final state (``S_out`` is row ``N``: n = 16 ends on a whole chunk, no ``rem`` keys), ``N``
    without; ``S_in`` is its column 0, read only when a state comes in. The backward's GEMM by ``Rᵀ`` has ``g_S, g_z``
    as row ``N`` when the loss reads the final state, and forms ``dS_in`` only when the incoming state needs a
    gradient (``None``, or a tensor without one: skipped)."""
    B, H, M, Dv, C, n = 1, 2, 3, 2, 4, 16
    g = _gen(13)
    fq = torch.rand(B, H, n, M, generator=g, dtype=F64, requires_grad=True)
    fk, v = torch.rand(B, H, n, M, generator=g, dtype=F64), torch.randn(B, H, n, Dv, generator=g, dtype=F64)
    state = (None, None) if state_in == "none" else (torch.randn(B, H, M, Dv, generator=g, dtype=F64),
                                                     torch.rand(B, H, M, generator=g, dtype=F64))
    if state_in == "requires_grad":
        state = tuple(x.requires_grad_() for x in state)
    fwd, bwd = _spy_gemms(monkeypatch)
    out, _, S_out, z_out = chunk_core(fq, fk, v, *state, off=0, lag=0, chunk_size=C, non_negative=False,
                                      normalize=True, eps=1e-3, final_state=final_state)
    N = n // C
    (rows, read_in, (P, zP)), = fwd
    assert (rows, read_in) == (N + final_state, state_in != "none")
    if final_state:
        assert torch.equal(S_out, P[N]) and torch.equal(z_out, zP[N])
    loss = out.sum() + (S_out.sum() + z_out.sum() if final_state else 0)
    loss.backward()
    assert bwd == [(N + final_state, N + final_state, state_in == "requires_grad")]


@pytest.mark.parametrize("read", ["S_out", "z_out"])
def test_chunk_core_gradcheck_through_one_part_of_the_final_state(read):
    """A loss that reads ``S_out`` but not ``z_out`` (or the reverse): the unread one's gradient is ``None``, a zero
    row of the backward's GEMM (``rem`` keys too: n = 7, off = 3, lag = 2, C = 3 puts 2 keys of chunk 2 in S_out)."""
    B, H, M, Dv, C, n, off, lag = 1, 2, 2, 2, 3, 7, 3, 2
    g = _gen(14)
    fq = torch.rand(B, H, n, M, generator=g, dtype=F64).requires_grad_()
    fk = torch.rand(B, H, off + n, M, generator=g, dtype=F64).requires_grad_()
    v = torch.randn(B, H, off + n, Dv, generator=g, dtype=F64).requires_grad_()
    S = torch.randn(B, H, M, Dv, generator=g, dtype=F64).requires_grad_()
    z = torch.rand(B, H, M, generator=g, dtype=F64).add(0.5).requires_grad_()

    def f(*args):
        out, _, S_out, z_out = chunk_core(*args, off=off, lag=lag, chunk_size=C, non_negative=False, normalize=True,
                                          eps=1e-3)
        return out, (S_out if read == "S_out" else z_out)

    assert torch.autograd.gradcheck(f, (fq, fk, v, S, z))


def test_hybrid_core_forms_the_incoming_state_gradient_only_when_needed(monkeypatch):
    """The hybrid's blocks carry a state: the first one's is a zero state without a gradient (its ``dS_in`` is
    skipped), the later ones' come from the block before (formed). The last block's ``S_out`` is read by no one (no
    ``g_S`` row); the others' feed the next block (a row). The backward runs the blocks in reverse."""
    C, T = 4, 24
    g = _gen(15)
    q, k, v = (torch.randn(1, T, 2, 3, generator=g, dtype=F64) for _ in range(3))
    fq, fk = (torch.rand(1, T, 2, 3, generator=g, dtype=F64, requires_grad=True) for _ in range(2))
    _, bwd = _spy_gemms(monkeypatch)
    run_chunked(fq, fk, v, q=q, k=k, window=C, chunk_size=C, block_chunks=2).sum().backward()
    assert bwd == [(2, 2, True), (3, 3, True), (3, 3, False)]
