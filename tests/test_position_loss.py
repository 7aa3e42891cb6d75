"""analysis/position_loss.py: the position buckets and the bootstrap of the share closed, the copy classes
(which targets the far context offers to copy) and the share of a loss difference that falls in each
class (the script's SmolLM2 run is not repeated here)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parent.parent / "analysis" / "position_loss.py"
sys.path.insert(0, str(_PATH.parent))  # the script imports its sibling linearize_lm
_spec = importlib.util.spec_from_file_location("position_loss", _PATH)
pl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pl)

NEAR, FAR, PREFIX, NEW = range(4)


def _reference(ids, window, sinks, order=2, mask=None):
    """copy_classes's definition read literally: every earlier key j scanned for every target t, O(T²)."""
    out = torch.full((ids.shape[0], ids.shape[1] - 1), -1, dtype=torch.int64)
    for n in range(ids.shape[0]):
        x = ids[n].tolist()
        ok = [True] * len(x) if mask is None else [bool(v) for v in mask[n].tolist()]
        for t in range(1, len(x)):
            if not (ok[t] and ok[t - 1]):
                continue
            if t < order - 1 or not all(ok[t - order + 1 : t + 1]):
                out[n, t - 1] = NEW
                continue
            gram = x[t - order + 1 : t + 1]
            keys = [j for j in range(order - 1, t) if all(ok[j - order + 1 : j + 1])]
            seen = [j for j in keys if x[j - order + 1 : j + 1] == gram]
            visible = [j for j in seen if t - window <= j or j < sinks]
            far_prefix = [j for j in keys if x[j - order + 1 : j] == gram[:-1] and sinks <= j < t - window]
            out[n, t - 1] = NEAR if visible else FAR if seen else PREFIX if far_prefix else NEW
    return out


def test_copy_classes_on_a_hand_made_sequence():
    ids = torch.tensor([[5, 6, 7, 5, 6, 8, 5, 6]])  # positions 0..7
    # window 1: target t sees only key t - 1. t=4 (5,6) occurred ending at j=1 (far); t=5 (6,8) is new but
    # 6 ended a far key's prefix (j=2, followed by 7); t=7 (5,6) occurred at j=1 and 4, both far
    assert pl.copy_classes(ids, 1, 0).tolist() == [[NEW, NEW, NEW, FAR, PREFIX, NEW, FAR]]
    # window 3: t=4 sees keys 1..3, so (5,6) at j=1 is near; 6's prefix key j=2 is in the window: new
    assert pl.copy_classes(ids, 3, 0).tolist() == [[NEW, NEW, NEW, NEAR, NEW, NEW, NEAR]]
    # the boundary: t=7 with window 3 sees keys 4..6 (j = t - window is local), with window 2 only 5..6
    assert pl.copy_classes(ids, 2, 0)[0, 6] == FAR
    # a sink sees key 1 from anywhere: both copies of (5,6) near even with window 1
    assert pl.copy_classes(ids, 1, 2).tolist() == [[NEW, NEW, NEW, NEAR, PREFIX, NEW, NEAR]]
    # window 0 (pure linear attention): everything earlier is far; order 3: (5,6,8) never occurred, its prefix (5,6)
    # did at key j=2 (followed by 7), far; (8,5,6) never occurred and (8,5) never did
    assert pl.copy_classes(ids, 0, 0).tolist() == [[NEW, NEW, NEW, FAR, PREFIX, NEW, FAR]]
    assert pl.copy_classes(ids, 1, 0, order=3).tolist() == [[NEW, NEW, NEW, NEW, PREFIX, NEW, NEW]]
    # a repeated token: (3,3) at t=2 occurred at j=1, the key just before (near)
    assert pl.copy_classes(torch.tensor([[3, 3, 3]]), 1, 0).tolist() == [[NEW, NEAR]]


@pytest.mark.parametrize("window,sinks,order", [(0, 0, 2), (1, 0, 2), (4, 1, 2), (7, 3, 2), (5, 2, 3), (3, 0, 4),
                                                (40, 2, 2)])
def test_copy_classes_equal_the_literal_definition_on_random_sequences(window, sinks, order):
    g = torch.Generator().manual_seed(window * 100 + sinks * 10 + order)
    ids = torch.randint(0, 4, (3, 60), generator=g)  # 4 symbols: every class occurs
    got = pl.copy_classes(ids, window, sinks, order=order)
    assert torch.equal(got, _reference(ids, window, sinks, order))
    if 0 < window < 40:
        assert set(got.unique().tolist()) == {NEAR, FAR, PREFIX, NEW}
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, 50:] = 0  # right padding
    mask[2, 20:23] = 0  # a hole
    got = pl.copy_classes(ids, window, sinks, order=order, mask=mask.bool())
    assert torch.equal(got, _reference(ids, window, sinks, order, mask))
    assert (got[0, :5] == -1).all() and (got[1, 49:] == -1).all() and (got[0, 5:] >= 0).all()


def test_copy_classes_padding_never_matches():
    ids = torch.tensor([[0, 0, 9, 9, 9, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])  # (0,0) at positions 0,1 is padding: t=6's (0,0) is new
    assert pl.copy_classes(ids, 1, 0, mask=mask).tolist() == [[-1, -1, NEW, NEAR, PREFIX, NEW]]
    assert pl.copy_classes(ids, 1, 0).tolist() == [[NEW, NEW, NEW, NEAR, PREFIX, FAR]]


def test_copy_classes_refuses_bad_arguments():
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"ids must be an \[N, T\] integer tensor"):
        pl.copy_classes(ids.double(), 1, 0)
    with pytest.raises(ValueError, match="ids must be"):
        pl.copy_classes(ids[0], 1, 0)
    with pytest.raises(ValueError, match="T >= 2"):
        pl.copy_classes(ids[:, :1], 1, 0)
    with pytest.raises(ValueError, match="window"):
        pl.copy_classes(ids, -1, 0)
    with pytest.raises(ValueError, match="sinks"):
        pl.copy_classes(ids, 1, -2)
    with pytest.raises(ValueError, match="order must be >= 2"):
        pl.copy_classes(ids, 1, 0, order=1)
    with pytest.raises(ValueError, match="mask must be a tensor of ids' shape"):
        pl.copy_classes(ids, 1, 0, mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="only 0/1"):
        pl.copy_classes(ids, 1, 0, mask=torch.tensor([[1, 2, 1]]))


def test_class_sums_add_each_class_from_the_start_position():
    classes = torch.tensor([[NEAR, FAR, FAR, NEW, -1, PREFIX], [FAR, FAR, NEAR, NEAR, NEAR, NEW]])
    nll = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0, 32.0], [1.0, 2.0, 4.0, 8.0, float("nan"), 32.0]],
                       dtype=torch.float64)  # column c: target c + 1
    sums, counts = pl.class_sums(nll, classes)
    assert sums.tolist() == [[1.0, 6.0, 32.0, 8.0], [12.0, 3.0, 0.0, 32.0]]  # -1 and NaN left out
    assert counts.tolist() == [[1.0, 2.0, 1.0, 1.0], [2.0, 2.0, 0.0, 1.0]]
    sums, counts = pl.class_sums(nll, classes, start=3)  # targets 3..6: columns 2..5
    assert sums.tolist() == [[0.0, 4.0, 32.0, 8.0], [12.0, 0.0, 0.0, 32.0]]
    assert counts.tolist() == [[0.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="one shape"):
        pl.class_sums(nll[:, 1:], classes)


def test_share_interval_splits_a_summed_difference_over_classes():
    diff = torch.tensor([[3.0, 1.0, 0.0, 0.0]] * 5, dtype=torch.float64)  # every sequence alike: a point interval
    share, lo, hi = pl.share_interval(diff, draws=200)
    assert share == [0.75, 0.25, 0.0, 0.0] and lo == pytest.approx(share) and hi == pytest.approx(share)
    diff = torch.tensor([[4.0, 0.0], [0.0, 4.0], [2.0, 2.0], [2.0, 2.0]], dtype=torch.float64)
    share, lo, hi = pl.share_interval(diff)
    assert share == [0.5, 0.5]
    for a, z in zip(lo, hi):  # the point value inside, the interval inside the per-sequence range [0, 1]
        assert 0.0 <= a < 0.5 < z <= 1.0
    share, _, _ = pl.share_interval(-diff, draws=10)  # no positive total: no share
    assert all(s != s for s in share)


def test_copy_report_attributes_a_far_copy_deficit_to_far_copies():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 7, 8]] * 2)
    classes = pl.copy_classes(ids, 2, 0)  # per sequence: target 7, the second (1,2), the far copy; target 8
    assert classes[0].tolist() == [NEW] * 6 + [FAR, PREFIX, NEW]  # (2,7): 2 ended key 2's prefix, followed by 3
    teacher = torch.ones(2, 9, dtype=torch.float64)
    window = teacher + 1.0  # the window loses 1 nat everywhere
    hybrid = teacher + 0.5 + 0.5 * (classes == FAR)  # closes half, except on the far copy: nothing
    text = "\n".join(pl.copy_report([("t", teacher), ("w", window), ("h", hybrid)], classes, [1, 5], 2))
    assert "| tokens (share) | 0 (0.0%) | 2 (11.1%) | 2 (11.1%) | 14 (77.8%) | 18 |" in text
    assert "| mean loss: h | – | 2.000 | 1.500 | 1.500 | 1.556 |" in text
    # the gain splits like the tokens; the excess per sequence 0.5 (far) + 0.5 (prefix) + 7·0.5 (new) = 5
    assert "| share of the teacher's gain over w | – | 0.11 [0.11, 0.11] | 0.11 [0.11, 0.11] | 0.78 [0.78, 0.78] " \
           "| +1.000 nats/token |" in text
    assert "| share of h's excess over the teacher | – | 0.20 [0.20, 0.20] | 0.10 [0.10, 0.10] | 0.70 [0.70, 0.70] " \
           "| +0.556 nats/token |" in text
    assert "| h: closed | – | 0.00 [0.00, 0.00] | 0.50 [0.50, 0.50] | 0.50 [0.50, 0.50] | 0.44 [0.44, 0.44] |" in text
    assert "Targets at positions t ≥ 5 (10 tokens):" in text  # targets 5..9 of two sequences
    # where the teacher does not reliably beat the window the ratio means nothing: "–". Far copy: the teacher
    # gains 1 nat in sequence 0 but loses 0.5 in sequence 1 (summed gain +0.5, but a bootstrap draw of sequence 1
    # twice gives a negative one); the overall ratio too when the teacher gains nothing anywhere
    window = teacher + 1.0 - torch.tensor([[0.0], [1.5]], dtype=torch.float64) * (classes == FAR)
    text = "\n".join(pl.copy_report([("t", teacher), ("w", window), ("h", hybrid)], classes, [1], 2))
    assert "| h: closed | – | – | 0.50 [0.50, 0.50] | 0.50 [0.50, 0.50] |" in text
    text = "\n".join(pl.copy_report([("t", teacher), ("w", teacher), ("h", hybrid)], classes, [1], 2))
    assert "| h: closed | – | – | – | – | – |" in text


def test_position_buckets_double_and_average_the_right_columns():
    assert pl.buckets_of(2048) == [(1, 64), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048)]
    assert pl.buckets_of(100) == [(1, 64), (64, 100)]
    # column t of token_nll predicts target position t + 1: value = the target position, NaN = padding
    nll = torch.arange(1, 100, dtype=torch.float64).repeat(2, 1)  # [2, 99]: targets 1..99
    nll[1, 80:] = float("nan")
    sums, counts = pl.bucket_sums(nll, pl.buckets_of(100))
    got = (sums.sum(0) / counts.sum(0)).tolist()
    assert got[0] == pytest.approx(sum(range(1, 64)) / 63)
    assert got[1] == pytest.approx((sum(range(64, 100)) + sum(range(64, 81))) / (36 + 17))


def test_closed_interval_is_a_bootstrap_over_paired_sequences():
    counts = torch.full((4, 2), 10.0)
    teacher = torch.full((4, 2), 30.0)  # mean loss 3 per token in every sequence and bucket
    window = torch.full((4, 2), 40.0)   # 4
    hybrid = torch.tensor([[35.0, 32.0]] * 4)  # closes 0.5 and 0.8 in every sequence: a point interval
    lo, hi = pl.closed_interval(hybrid, window, teacher, counts, draws=200)
    assert lo == pytest.approx([0.5, 0.8]) and hi == pytest.approx([0.5, 0.8])
    hybrid = torch.tensor([[31.0, 40.0], [39.0, 30.0], [35.0, 35.0], [35.0, 35.0]])  # closed per sequence vary
    lo, hi = pl.closed_interval(hybrid, window, teacher, counts, draws=2000)
    for a, z in zip(lo, hi):  # the point value 0.5 inside, the interval inside the per-sequence range [0, 1]
        assert 0.0 <= a < 0.5 < z <= 1.0
    with pytest.raises(ValueError, match="context must be >= 2"):
        pl.buckets_of(1)
    assert pl.buckets_of(32) == [(1, 32)]
