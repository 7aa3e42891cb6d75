"""The recall frontier (issue 41): Zoology's generator on a hand-made sequence, the state formula against
Zoology's by hand, resume after an interrupted grid, the report rebuilt from the cache."""

from __future__ import annotations

import json

import pytest
import torch

from sketchlab.tasks import IGNORE_INDEX, MQARConfig, TransformerConfig, mqar_batch
from sketchlab.tasks import frontier as fr
from sketchlab.tasks.state_size import layer_state_bytes, state_bytes


# ------------------------------------------------------------------------------------------------ the generator
@pytest.mark.parametrize("noise", [True, False])
def test_zoology_generator_one_pair_is_the_hand_made_sequence(noise):
    """T = 4, P = 1: one even query slot, so the sequence is ``k v k r`` (``r`` random, or the filler 0 with
    ``random_non_queries=False``) and the target ``v`` at position 2."""
    V = 16
    cfg = MQARConfig(V, 1, 4, layout="zoology", random_non_queries=noise)
    inputs, targets = mqar_batch(cfg, 64, generator=torch.Generator().manual_seed(3))
    for x, y in zip(inputs.tolist(), targets.tolist()):
        k, v = x[0], x[1]
        assert 1 <= k < V // 2 and V // 2 <= v < V  # keys and values from the two halves
        assert x[2] == k and (0 <= x[3] < V if noise else x[3] == 0)
        assert y == [IGNORE_INDEX, IGNORE_INDEX, v, IGNORE_INDEX]
    assert noise == (len({x[3] for x in inputs.tolist()}) > 1)


def test_zoology_generator_two_pairs_matches_the_hand_made_layout():
    """T = 8, P = 2: ``k1 v1 k2 v2`` then both keys once at offsets 4 and 6 (in either order), each target its value;
    the odd offsets are random tokens with no target."""
    V = 32
    inputs, targets = mqar_batch(MQARConfig(V, 2, 8, layout="zoology"), 256, generator=torch.Generator().manual_seed(0))
    orders = set()
    for x, y in zip(inputs.tolist(), targets.tolist()):
        pairs = {x[0]: x[1], x[2]: x[3]}
        assert len(pairs) == 2 and all(1 <= k < V // 2 <= v < V for k, v in pairs.items())
        assert sorted([x[4], x[6]]) == sorted(pairs)
        expected = [IGNORE_INDEX] * 4 + [pairs[x[4]], IGNORE_INDEX, pairs[x[6]], IGNORE_INDEX]
        assert y == expected
        orders.add(x[4] == x[0])
    assert orders == {True, False}  # the gaps are drawn, not fixed


def test_zoology_gaps_follow_the_power_law():
    """P = 1 with 8 slots: gap g is drawn with probability ∝ (g + 1)^(a − 1); at a = 0.5 gap 0 is 1/Σ(g+1)^-0.5."""
    cfg = MQARConfig(64, 1, 18, layout="zoology", power_a=0.5)
    _inputs, targets = mqar_batch(cfg, 20000, generator=torch.Generator().manual_seed(1))
    gap = ((targets != IGNORE_INDEX).float().argmax(1) - 2) // 2  # [B]
    w = torch.arange(1, 9, dtype=torch.float64) ** -0.5
    want = (w / w.sum()).tolist()
    got = torch.bincount(gap, minlength=8).double().div(len(gap)).tolist()
    assert got == pytest.approx(want, abs=0.015)


def test_score_weights_every_slice_equally():
    """A run's score is the plain mean of its slices' accuracies, whatever their query counts."""
    slices = [{"accuracy": 1.0, "queries": 10}, {"accuracy": 0.0, "queries": 1000}]
    assert fr._score(slices) == 0.5


# ------------------------------------------------------------------------------------------------ state bytes
def _config(attention, options, heads=1, d=64):
    return TransformerConfig(vocab_size=32, d_model=d, n_heads=heads, n_layers=1, attention=attention,
                             attention_options=options, rope_base=None)


def test_state_bytes_of_based_is_zoologys_by_hand():
    """Zoology's Based.state_size: kv_heads·head_dim·expanded + kv_heads·expanded, times 4 bytes; the Taylor map
    on d' = 16 has expanded = 1 + 16 + 256 = 273, d_model 64, one head: 4·(64·273 + 273) = 70980."""
    assert 4 * (1 * 64 * 273 + 1 * 273) == 70980
    assert layer_state_bytes(_config("based-taylor", {"dim": 16})) == 70980
    # d' = 8 (73 features), d_model 128: 4·(128·73 + 73)
    assert layer_state_bytes(_config("based-taylor", {"dim": 8}, d=128)) == 4 * (128 * 73 + 73)


def test_state_bytes_of_deltanet_is_zoologys_by_hand():
    """Zoology's DeltaNet.state_size: num_heads·head_k_dim·head_v_dim, times 4: d_model 64, 2 heads of 32:
    4·2·32·32 = 8192; one head of 64: 16384. Its gated form counts the same."""
    assert layer_state_bytes(_config("silu", {"state": "delta", "beta": "input"}, heads=2)) == 4 * 2 * 32 * 32 == 8192
    assert layer_state_bytes(_config("silu", {"state": "delta", "beta": "input", "decay": "input"})) == 16384


def test_state_bytes_of_window_softmax_and_self_tensored_maps():
    assert layer_state_bytes(_config("sliding-window", {"window": 16})) == 4 * 2 * 16 * 64
    assert layer_state_bytes(_config("softmax", {}), seq_len=256) == 4 * 2 * 64 * 256
    # the affine self-tensored LLoPS, m = 8: 64 features in the state (additive: S and z)
    opts = {"p": 2, "m": 8, "non_negative": True, "affine": True}
    assert layer_state_bytes(_config("llops", opts)) == 4 * (64 * 64 + 64)
    assert layer_state_bytes(_config("llops", {**opts, "state": "delta"})) == 4 * 64 * 64


def test_state_bytes_names_the_parameter():
    with pytest.raises(ValueError, match="features .*mechanism 'delta'"):
        state_bytes("delta", d_model=64)
    with pytest.raises(ValueError, match="mechanism must be one of"):
        state_bytes("lstm", d_model=64)


# ------------------------------------------------------------------------------------------------ the grid
TINY = fr.Protocol(vocab=32, train_pairs=((8, 1), (8, 2)), train_weights=(1, 1), test_pairs=((8, 1), (16, 2)),
                   d_model=16, steps=3, batch=4, warmup=1, eval_sequences=4)
POINTS = [*fr.method_points("window", [2]), *fr.method_points("based", [2])]
GRID = {"lrs": [1e-3, 1e-2], "seeds": [0, 1]}


def _without_time(runs):
    return {k: {f: v for f, v in r.items() if f != "seconds"} for k, r in runs.items()}


def test_resume_after_an_interrupted_grid_gives_the_same_runs(tmp_path, monkeypatch):
    whole = fr.run_frontier(POINTS, TINY, work=tmp_path / "whole", progress=False, **GRID)
    assert len(whole) == len(POINTS) * 3  # per point: 2 rates on seed 0, then seed 1 at the best
    real, calls = fr._run_and_store, []

    def interrupted(*args):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(fr, "_run_and_store", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fr.run_frontier(POINTS, TINY, work=tmp_path / "cut", progress=False, **GRID)
    assert len(fr.load_runs(tmp_path / "cut")) == 2  # the finished runs are kept
    monkeypatch.setattr(fr, "_run_and_store", real)
    resumed = fr.run_frontier(POINTS, TINY, work=tmp_path / "cut", progress=False, **GRID)
    assert _without_time(resumed) == _without_time(whole)


def test_report_rebuilt_from_the_cache_equals_the_first(tmp_path):
    runs = fr.run_frontier(POINTS, TINY, work=tmp_path / "runs", progress=False, **GRID)
    first = fr.frontier_report(runs, POINTS, TINY, out=tmp_path / "a" / "rep", command="cmd", **GRID)
    again = fr.frontier_report(fr.load_runs(tmp_path / "runs"), POINTS, TINY, out=tmp_path / "b" / "rep",
                               command="cmd", **GRID)
    assert first == again
    for suffix in (".md", ".json"):
        assert (tmp_path / "a" / f"rep{suffix}").read_text() == (tmp_path / "b" / f"rep{suffix}").read_text()
    assert (tmp_path / "b" / "rep.png").stat().st_size > 0
    summary = json.loads((tmp_path / "b" / "rep.json").read_text())
    assert [r["method"] for r in summary["points"]] == ["window", "based"]
    assert all(len(r["scores"]) == 2 for r in summary["points"])


def test_plan_sweeps_first_then_seeds_at_the_best_rate():
    point = POINTS[0]
    key = lambda lr, s: fr.run_key(point, TINY, lr, s)
    assert fr.plan_runs([point], TINY, [1e-3, 1e-2], [0, 1], {}) == [(point, 1e-3, 0), (point, 1e-2, 0)]
    done = {key(1e-3, 0): {"score": 0.2}, key(1e-2, 0): {"score": 0.7}}
    assert fr.plan_runs([point], TINY, [1e-3, 1e-2], [0, 1], done) == [(point, 1e-2, 1)]


def test_silu_map_matches_its_float64_twin_and_deltanet_uses_it():
    from sketchlab.tasks.mixers import SiLUMap

    m, x = SiLUMap(2, 4), torch.randn(1, 5, 2, 4)
    assert torch.allclose(m.features(x).double(), m.features_naive(x), atol=1e-6)
    assert torch.allclose(m.features(x), torch.nn.functional.silu(x))
    point = fr.method_points("deltanet", [1])[0]
    assert (point.attention, point.options) == ("silu", {"state": "delta", "beta": "input"})


def test_frozen_kernel_methods_are_refused_on_the_token_harness(tmp_path):
    # kernel_lr 0 freezes the kernel on the kernel-only harness only; the token harness says so before any training
    points = fr.method_points("llops-p4-frozen", [81])
    with pytest.raises(ValueError, match=r"llops-p4-frozen freeze the kernel .* pass --preset kernel"):
        fr.run_frontier(points, fr.Protocol(), lrs=[1e-3], seeds=[0], work=tmp_path, progress=False)
    assert not any(tmp_path.iterdir())
