"""sketchlab.attention.ops.hybrid, the one hybrid combine, against the formula written out per query (float64)."""

import math

import pytest
import torch

from sketchlab.attention.ops.hybrid import combine, combine_delta, exact_sums, gate_weight, local_weights, mix


def _case(seed=0, H=3, T=5, n1=4, n2=2, Dv=3):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ok1 = torch.rand(1, H, T, n1, generator=g) < 0.7
    ok1[:, :, 0] = False  # a row without keys in the first piece
    ok2 = torch.rand(1, H, T, n2, generator=g) < 0.7
    ok2[:, :, 0] = False  # ... nor in the second: no exact key at all
    return dict(x1=r(1, H, T, n1), ok1=ok1, v1=r(1, H, n1, Dv), x2=r(1, H, T, n2), ok2=ok2, v2=r(1, H, n2, Dv),
                fn=r(1, H, T, Dv), fd=r(1, H, T).abs() + 0.5, gate=r(H))


def _written_out(c, local, p=2):
    """Per (head, query): a_j over both pieces with one shift, Σ a v, Σ a."""
    H, T, Dv = c["x1"].shape[1], c["x1"].shape[2], c["v1"].shape[-1]
    num, den = torch.zeros(1, H, T, Dv, dtype=torch.float64), torch.zeros(1, H, T, dtype=torch.float64)
    for h in range(H):
        for t in range(T):
            keys = [(c["x1"][0, h, t, j], c["v1"][0, h, j]) for j in range(c["x1"].shape[-1]) if c["ok1"][0, h, t, j]]
            keys += [(c["x2"][0, h, t, j], c["v2"][0, h, j]) for j in range(c["x2"].shape[-1]) if c["ok2"][0, h, t, j]]
            if not keys:
                continue
            top = max(float(x) for x, _ in keys)
            for x, v in keys:
                a = math.exp(float(x) - top) if local == "softmax" else float(x) ** p
                num[0, h, t] += a * v
                den[0, h, t] += a
    return num, den


@pytest.mark.parametrize("local", ["softmax", "poly"])
def test_exact_sums_share_one_shift_over_the_pieces(local):
    c = _case()
    num, den = exact_sums([(c["x1"], c["ok1"], c["v1"]), (c["x2"], c["ok2"], c["v2"]),
                           (c["x2"][..., :0], c["ok2"][..., :0], c["v2"][:, :, :0])], local=local, degree=2)
    want_num, want_den = _written_out(c, local)
    torch.testing.assert_close(num, want_num, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(den, want_den, rtol=1e-12, atol=1e-12)
    assert bool((den[:, :, 0] == 0).all())  # the row without exact keys: no weight (c = 0, no NaN)


def test_local_weights_row_without_keys_and_a_given_shift():
    x = torch.tensor([[1.0, 3.0, 2.0], [5.0, 4.0, 0.0]], dtype=torch.float64)
    ok = torch.tensor([[True, False, True], [False, False, False]])
    a = local_weights(x, ok, local="softmax", degree=None)
    torch.testing.assert_close(a, torch.tensor([[math.exp(-1.0), 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64))
    a = local_weights(x, ok, local="softmax", degree=None, shift=torch.tensor([[3.0], [0.0]], dtype=torch.float64))
    torch.testing.assert_close(a[0], torch.tensor([math.exp(-2.0), 0.0, math.exp(-1.0)], dtype=torch.float64))


def test_combine_is_the_gated_shared_normaliser():
    c = _case(seed=1)
    en, ed = exact_sums([(c["x1"], c["ok1"], c["v1"])], local="softmax", degree=None)
    g = gate_weight(c["gate"], 3, dtype=torch.float64, device="cpu")
    torch.testing.assert_close(g, 1 / (1 + torch.exp(-c["gate"])))
    torch.testing.assert_close(gate_weight(None, 3, dtype=torch.float64, device="cpu"), torch.full((3,), 0.5,
                                                                                                  dtype=torch.float64))
    gb = g[None, :, None]  # [1, H, 1]
    out, den = combine(en, ed, c["fn"], c["fd"], gb, eps=0.25)
    for h in range(3):
        gh = float(g[h])
        want_den = gh * ed[0, h] + (1 - gh) * c["fd"][0, h]
        want = (gh * en[0, h] + (1 - gh) * c["fn"][0, h]) / (want_den + 0.25)[:, None]
        torch.testing.assert_close(den[0, h], want_den, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[0, h], want, rtol=1e-12, atol=1e-12)
    # packed sums [Σ v | Σ 1] mix as they are
    packed = mix(torch.cat([en, ed[..., None]], -1), torch.cat([c["fn"], c["fd"][..., None]], -1), gb[..., None])
    torch.testing.assert_close(packed[..., -1], den, rtol=1e-12, atol=1e-12)


def test_combine_delta_mixes_normalised_parts_and_a_row_without_exact_keys_reads_the_far_part():
    c = _case(seed=2)
    en, ed = exact_sums([(c["x1"], c["ok1"], c["v1"])], local="softmax", degree=None)
    some = c["ok1"].any(-1).expand_as(ed)
    g = gate_weight(c["gate"], 3, dtype=torch.float64, device="cpu")[None, :, None]
    out = combine_delta(en, ed, some, c["fn"], g)
    exact = torch.where(some[..., None], en / ed.clamp_min(1e-300)[..., None], 0.0)
    torch.testing.assert_close(out, g[..., None] * exact + (1 - g[..., None]) * c["fn"], rtol=1e-12, atol=1e-12)
    assert not bool(some[:, :, 0].any())
    torch.testing.assert_close(out[:, :, 0], ((1 - g[..., None]) * c["fn"])[:, :, 0])


def test_poly_weights_need_the_allowed_keys_mask():
    """``ok=None`` means the logits are already −inf off the allowed keys: softmax only (a poly score has no −inf)."""
    x = torch.tensor([[0.5, -1.0, 2.0]])
    assert torch.allclose(local_weights(x, None, local="softmax", degree=None), (x - 2.0).exp())
    with pytest.raises(ValueError, match="ok=None .* needs local='softmax'"):
        local_weights(x, None, local="poly", degree=2)
