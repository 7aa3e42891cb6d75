"""The MQAR study's method table (analysis/paper_training.py) builds what each method says: every
key makes a model with its kernel; LLoPS "from BASED" is BASED's expand map at step 0 (float64
logits to round-off); Hedgehog and PSF's learned sketch are the feature-map kernels; the verdict
sentence compares the LLoPS-BASED difference with the seed spread."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from sketchlab.featuremaps import HedgehogMap, InputNormed, MLPMap, SelfTensored
from sketchlab.tasks import TransformerConfig, TransformerLM, copy_shared_weights, kernel_modules
from sketchlab.tasks.attention import ToyKernel

_PATH = Path(__file__).resolve().parent.parent / "analysis" / "paper_training.py"
_spec = importlib.util.spec_from_file_location("paper_training", _PATH)
pt = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("paper_training", pt)  # its dataclasses look their module up there
_spec.loader.exec_module(pt)

D_MODEL, VOCAB = 16, 32  # one head: head dim 16, BASED's d' = 16 fits


def _tokens(seed=0, T=12):
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(seed))


def test_every_method_builds_its_kernel_and_runs():
    table = pt.methods(D_MODEL)
    for key in ("softmax", "poly-p2", "based", "psf-p4-m256", "psf-learned-p4-m256", "hedgehog", "hedgehog-w16",
                "llops-p4-m256", "llops-p4-m256-based", "llops-p2-m256-based", "llops-p6-m64"):
        assert key in table, key
    for key, method in table.items():
        model = pt.build_model(method, D_MODEL, VOCAB, seed=0)
        assert model.config.attention == method.attention, key
        with torch.no_grad():
            assert torch.isfinite(model(_tokens())).all(), key


def test_poly_hedgehog_and_psf_learned_methods_are_the_named_kernels():
    table = pt.methods(D_MODEL)
    poly = kernel_modules(pt.build_model(table["poly-p2"], D_MODEL, VOCAB, 0))[0]
    assert isinstance(poly, ToyKernel) and poly.map_q is None and poly.config_options["p"] == 2  # exact (s)^p
    hh = kernel_modules(pt.build_model(table["hedgehog"], D_MODEL, VOCAB, 0))[0]
    assert isinstance(hh.map_q, HedgehogMap) and isinstance(hh.map_k, HedgehogMap)
    assert torch.equal(hh.map_q.weight[0], torch.eye(D_MODEL))  # m = 2·D: Hedgehog's identity start
    psf = kernel_modules(pt.build_model(table["psf-learned-p4-m256"], D_MODEL, VOCAB, 0))[1]
    assert isinstance(psf.map_q, SelfTensored) and isinstance(psf.map_q.inner, InputNormed)
    assert isinstance(psf.map_q.inner.inner, MLPMap)
    assert psf.map_q.num_features == 256 and psf.map_q.degree == 4


@pytest.mark.parametrize("key, options, p, dim", [
    ("llops-p4-m256-based", {"p": 4, "m": 256}, 4, 4),
    ("llops-p2-m256-based", {"p": 2, "m": 256}, 2, 16),
    ("llops-nn-p2-m16-based", {"p": 2, "m": 16, "non_negative": True}, 4, 4),  # ((s')²)² = (s')⁴
])
def test_llops_from_based_is_basedexpand_at_step_0(key, options, p, dim):
    """m = d'^p (full form: 4^4, 16^2 and 4^2, no symmetric count equals them), so the LLoPS model at
    step 0 computes BASED's expand map (P q̃ · P k̃)^p on the first d' coordinates (self-tensored:
    the square of the degree-2 map's kernel)."""
    method = pt.methods(D_MODEL)[key]
    assert method.init == "based" and method.options == options
    llops = pt.build_model(method, D_MODEL, VOCAB, seed=3).double()
    torch.manual_seed(7)
    based = TransformerLM(TransformerConfig(vocab_size=VOCAB, d_model=D_MODEL, n_heads=1, n_layers=2, mlp_ratio=2,
                                            short_conv=3, attention="based",
                                            attention_options={"form": "expand", "p": p, "dim": dim,
                                                               "symmetric": False})).double()
    copy_shared_weights(llops, based)
    x = _tokens(1, T=20)
    with torch.no_grad():
        a, b = llops(x), based(x)
    # float64: Θ's 0/1 entries give the same products as the expand features, summed in another
    # order: ~1e-15 relative per layer; 1e-10 of the logits' size fails for any wrong Θ: the random
    # init below moves them by > 1e-6 of their size (at initialisation the attention's share of the
    # logits is small, ~1e-3 here)
    assert float((a - b).abs().max()) <= 1e-10 * float(b.abs().max())
    random = pt.build_model(pt.methods(D_MODEL)[key.removesuffix("-based")], D_MODEL, VOCAB, seed=3).double()
    copy_shared_weights(llops, random)
    with torch.no_grad():
        assert float((random(x) - b).abs().max()) > 1e-6 * float(b.abs().max())


def test_llops_taylor_from_based_is_based_taylor_at_step_0():
    """LLoPS of the affine input [x, 1] from BASED's own Taylor map (d' = 16, 273 features): at step 0 the
    model is the `based` method's (the same kernels and, once the shared weights are copied, the same logits)."""
    table = pt.methods(D_MODEL)
    method = table["llops-taylor-m273-based"]
    assert method.init == "based" and method.options == {"p": 2, "m": 273, "affine": True}
    llops = pt.build_model(method, D_MODEL, VOCAB, seed=3).double()
    based = pt.build_model(table["based"], D_MODEL, VOCAB, seed=7).double()
    copy_shared_weights(llops, based)
    x = _tokens(1, T=20)
    with torch.no_grad():
        a, b = llops(x), based(x)
    # as above: exact algebra, float64 round-off; a zero constant row (no 1 + s terms) fails it
    assert float((a - b).abs().max()) <= 1e-10 * float(b.abs().max())
    for kernel in kernel_modules(llops):
        with torch.no_grad():
            kernel.theta_q[..., -1, :] = 0
    with torch.no_grad():
        assert float((llops(x) - b).abs().max()) > 1e-6 * float(b.abs().max())


def test_denominator_cell_gives_each_seeds_count_or_a_dash():
    assert pt.denominator_cell([{"denominator_warnings": {"calls": 2, "rows": 17}}, {},
                                {"denominator_warnings": {"calls": 0, "rows": 0}}]) == "2 (17), –, 0 (0)"


def test_table1_run_files_share_what_the_maps_and_lengths_share():
    from dataclasses import replace

    expand, taylor = pt.LM_QUICK, replace(pt.LM_QUICK, bmap="taylor")
    name = lambda kind, s: pt.lm_path(kind, s, 0, "w").name  # noqa: E731
    assert name("based-ct", expand) == "based-ct_s0_d64_L2_T128_n300+150.json"  # the names before the choice
    assert name("llops-ct", taylor) == "llops-ct_s0_d64_L2_T128_n300+150_taylor.json"
    assert name("softmax", taylor) == name("softmax", expand)  # no BASED map in softmax
    longer = replace(taylor, extra=600)
    assert name("pretrain", longer) == name("pretrain", taylor) == "pretrain_s0_d64_L2_T128_n300_taylor.json"
    assert name("based-ct", longer) != name("based-ct", taylor)


def _run(method, seed, acc, seconds=1.0):
    slices = [{"seq_len": T, "num_pairs": P, "accuracy": acc, "queries": 1} for T, P in pt.QUICK.test_pairs()]
    return {"spec": {"method": method, "seed": seed, "scale": {"divide": pt.QUICK.divide}}, "slices": slices,
            "seconds": seconds}


def test_score_reads_only_the_training_lengths():
    r = _run("based", 0, 0.5)
    for s in r["slices"]:
        if s["seq_len"] > 64:
            s["accuracy"] = 0.0  # the length-extrapolation slices do not count
    assert pt.score(r) == 0.5


def test_verdict_compares_the_difference_with_the_seed_spread():
    based = [_run("based", s, a) for s, a in enumerate((0.80, 0.82, 0.84))]  # sd 0.02
    close = [_run("llops-p4-m256", s, a) for s, a in enumerate((0.81, 0.85, 0.86))]  # +0.02 <= 2 sd
    far = [_run("llops-p4-m256", s, a) for s, a in enumerate((0.30, 0.32, 0.34))]
    text = pt.verdict({"based": based, "llops-p4-m256": close})
    assert "no difference beyond the seed spread" in text and "ranges overlap" in text
    text = pt.verdict({"based": based, "llops-p4-m256": far})
    # d = 0.32 - 0.82, both sds 0.02: Welch SE = 0.02·√(2/3), t = -0.5 / 0.01633 = -30.6
    assert "BASED ahead" in text and "-0.500" in text and "t = -30.6" in text and "do not overlap" in text
    assert "no claim either way" in pt.verdict({"based": based[:1], "llops-p4-m256": far})
    assert math.isclose(pt.mean_sd([0.80, 0.82, 0.84])[1], 0.02)
    assert pt.fmt([0.80, 0.82, 0.84]) == "0.820 ± 0.020 (0.800, 0.820, 0.840)"
    assert pt.fmt([0.5]) == "0.500 (1 seed)"  # no "± 0.000" for a single run


def test_table1_verdict_compares_the_paired_difference_with_the_seed_spread():
    based = {0: 2.10, 1: 2.12, 2: 2.14}  # sd 0.02
    # LLoPS worse by 0.01 on every seed: consistent (paired sd 0) but within the 0.02 spread
    text = pt.table1_verdict({s: x + 0.01 for s, x in based.items()}, based)
    assert "+0.0100 ± 0.0000 nats/byte over 3 paired seeds" in text and "paired t = +inf" in text
    assert "every seed's difference is positive" in text and "within the seed spread" in text
    assert "0.0200 for LLoPS + CT and 0.0200 for BASED + CT" in text and "twice the larger seed sd, 0.0400" in text
    # 0.03 better (> 1 sd, < 2 sd): no claim by the rule
    text = pt.table1_verdict({s: x - 0.03 for s, x in based.items()}, based)
    assert "-0.0300" in text and "every seed's difference is negative" in text and "not than twice it" in text
    # LLoPS worse by 0.06, 0.07, 0.08: mean 0.07 > 2 × 0.03 (the larger sd, LLoPS's own): BASED better
    llops = {0: 2.16, 1: 2.19, 2: 2.22}
    text = pt.table1_verdict(llops, based)
    assert "+0.0700 ± 0.0100" in text and "paired t = +12.1" in text  # 0.07 / (0.01/√3) = 12.12
    assert "larger than the seed spread: BASED + CT is better here" in text and "sd, 0.0600)" in text
    # the same differences over arms that spread more (sds 0.06 and 0.07): within the spread
    wide = {0: 2.06, 1: 2.12, 2: 2.18}
    text = pt.table1_verdict({s: wide[s] + x for s, x in ((0, 0.06), (1, 0.07), (2, 0.08))}, wide)
    assert "+0.0700 ± 0.0100" in text and "within the seed spread" in text and "sd, 0.1400)" in text
    # mixed signs; unpaired seeds are left out; one seed: no claim
    text = pt.table1_verdict({0: 2.11, 1: 2.11, 2: 2.15, 5: 9.0}, based)
    assert "change sign" in text and "seed 5" not in text and "over 3 paired seeds" in text
    assert "no claim either way" in pt.table1_verdict({0: 2.2}, based)
    assert "no comparison" in pt.table1_verdict({7: 2.2}, based)


@pytest.mark.parametrize("key", ["based-w16", "llops-p4-m256-w16", "llops-p2-m256-based-w16", "hedgehog-w16",
                                 "llops-p4-m64-w16"])
def test_hybrid_methods_are_their_pure_kernel_plus_a_window(key):
    # issue 20: each method pure and with the sliding-window hybrid. The "-w16" method is its pure
    # method's kernel (same map, options, init and Θ rate) with window 16 (BASED's window 64 at a
    # quarter of Zoology's lengths) and a learned gate; at T = 24 > 16 its attention output differs
    # from the pure kernel's with the same weights (the window's exact softmax replaces the sketch
    # on the last 16 keys; here by > 1e-2 of the output's size, while a window silently dropped
    # gives the pure output to round-off).
    table = pt.methods(D_MODEL)
    hybrid, pure = table[key], table[key.removesuffix("-w16")]
    assert hybrid.options == {**pure.options, "window": 16}
    assert (hybrid.attention, hybrid.init, hybrid.kernel_lr) == (pure.attention, pure.init, pure.kernel_lr)
    h, p = pt.build_model(hybrid, D_MODEL, VOCAB, seed=0), pt.build_model(pure, D_MODEL, VOCAB, seed=0)
    kernels = kernel_modules(h)
    assert len(kernels) == 2 and all(k.config_options["window"] == 16 and k.gate is not None for k in kernels)
    assert all(k.config_options["window"] == 0 for k in kernel_modules(p))
    copy_shared_weights(h, p)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 24, 1, D_MODEL, generator=g) for _ in range(3))  # [B, T, H, D]
    with torch.no_grad():
        a, b = kernels[0](q, k, v), kernel_modules(p)[0](q, k, v)
    assert float((a - b).abs().max()) > 1e-2 * float(b.abs().max())


def test_verdict_compares_each_hybrid_with_based_of_the_same_window():
    based = [_run("based", s, a) for s, a in enumerate((0.80, 0.82, 0.84))]
    bw = [_run("based-w16", s, a) for s, a in enumerate((0.90, 0.91, 0.92))]  # sd 0.01
    lw = [_run("llops-p4-m256-w16", s, a) for s, a in enumerate((0.95, 0.96, 0.97))]
    text = pt.verdict({"based": based, "based-w16": bw, "llops-p4-m256-w16": lw})
    # +0.05 against BASED w16 (> 2 × 0.01), not against pure BASED (+0.14)
    assert "llops-p4-m256-w16 − BASED w16 = +0.050" in text and "LLoPS ahead" in text and "+0.140" not in text
    assert "BASED w16 0.910 ± 0.010 over 3 seeds" in text
    # a hybrid alone has nothing to be compared with; nothing BASED at all says so
    assert pt.verdict({"based": based, "llops-p4-m256-w16": lw}) == "No LLoPS run to compare."
    assert pt.verdict({"llops-p4-m256-w16": lw}).startswith("BASED not run")


def test_m_rows_collect_each_sketch_size_in_order_with_every_seed():
    runs = [_run("llops-p4-m256", 1, 0.7, seconds=30.0), _run("llops-p4-m64", 0, 0.4), _run("llops-p4-m256", 0, 0.5,
            seconds=10.0), _run("llops-p4-m256-w16", 0, 0.9), _run("llops-p2-m256", 0, 0.1)]
    rows = pt.m_rows(runs, degree=4)
    assert [r["m"] for r in rows] == [64, 256]  # m = 128, 192 not run; the hybrid and p = 2 are other rows
    assert rows[1]["seeds"] == [0, 1] and rows[1]["scores"] == pytest.approx([0.5, 0.7])
    assert rows[1]["slices"] == pytest.approx([0.6] * len(pt.QUICK.test_pairs())) and rows[1]["seconds"] == 20.0
    hybrid = pt.m_rows(runs, degree=4, window=16)
    assert [(r["m"], r["scores"]) for r in hybrid] == [(256, pytest.approx([0.9]))]
    assert pt.m_key(192, 4) == "llops-p4-m192" and pt.m_key(64, 4, 16) == "llops-p4-m64-w16"
    assert all(pt.m_key(m, 4, w) in pt.methods(D_MODEL) for m in pt.M_SWEEP for w in (0, 16, 64))


def _rows(means_and_sds):
    """One row per m of M_SWEEP: three seeds at mean ± sd (sd the sample sd: values mean - sd, mean, mean + sd)."""
    runs = [_run(pt.m_key(m, 4), s, mu + (s - 1) * sd) for m, (mu, sd) in zip(pt.M_SWEEP, means_and_sds)
            for s in range(3)]
    return pt.m_rows(runs, degree=4)


def test_m_trend_compares_the_ends_with_the_seed_spread():
    # 0.40 -> 0.70 with sds 0.05: +0.30 > 2 × 0.05, rising at every step
    text = pt.m_trend(_rows([(0.40, 0.05), (0.50, 0.05), (0.60, 0.05), (0.70, 0.05)]))
    assert text.startswith("m = 256 − m = 64: +0.300") and "rise with every step in m" in text
    assert "accuracy rises with m, beyond the seed spread" in text and "do not overlap" in text
    # the same ends with sds 0.2: within 2 × 0.2 = 0.4; a dip at m = 128: not monotonic
    text = pt.m_trend(_rows([(0.40, 0.2), (0.35, 0.2), (0.60, 0.2), (0.70, 0.2)]))
    assert "no trend beyond the seed spread" in text and "not monotonic in m" in text and "0.400)" in text
    assert "spanning 0.350-0.700" in text and "ranges overlap" in text
    # falling beyond the spread (the larger end's sd, 0.02, is the one that counts)
    text = pt.m_trend(_rows([(0.90, 0.02), (0.80, 0.01), (0.70, 0.01), (0.60, 0.01)]))
    assert "-0.300" in text and "accuracy falls with m" in text and "fall with every step" in text
    # one seed at an end: no spread, no claim; one m only: nothing to read
    one = pt.m_rows([_run("llops-p4-m64", 0, 0.3), _run("llops-p4-m256", 0, 0.9), _run("llops-p4-m256", 1, 0.8)], 4)
    assert pt.m_trend(one).endswith("1 seed at one end, so no claim either way.")
    assert pt.m_trend(one[:1]).startswith("Fewer than two sketch sizes")


class _FakeModel:
    """Advances a shared fake clock by cost[T][call] per call: the timing helper's bookkeeping, not the machine."""

    def __init__(self, clock, log, key, costs):
        self.config = type("C", (), {"vocab_size": 7})()
        self.clock, self.log, self.key, self.costs, self.calls = clock, log, key, costs, {}

    def eval(self):
        return self

    def __call__(self, x):
        T = x.shape[1]
        n = self.calls.get(T, 0)
        self.calls[T] = n + 1
        self.log.append((self.key, T))
        self.clock[0] += self.costs[T][n]


def test_time_side_by_side_is_round_robin_and_takes_the_median(monkeypatch):
    clock, log = [0.0], []
    monkeypatch.setattr(pt.time, "perf_counter", lambda: clock[0])
    # call 0 is the warm-up (cost 100 s: must not count); then 3 rounds with one slow outlier each
    a = _FakeModel(clock, log, "a", {4: [100, 0.001, 0.009, 0.002], 8: [100, 0.004, 0.004, 0.5]})
    b = _FakeModel(clock, log, "b", {4: [100, 0.020, 0.030, 0.010], 8: [100, 9.0, 0.040, 0.040]})
    out = pt.time_side_by_side({"a": a, "b": b}, (4, 8), batch=2, rounds=3)
    assert out == {"a": {4: pytest.approx(2.0), 8: pytest.approx(4.0)}, "b": {4: pytest.approx(20.0),
                                                                            8: pytest.approx(40.0)}}  # ms
    # warm-ups first, then every round times each (length, model) once: a change of load hits all models
    assert log[:4] == [("a", 4), ("a", 8), ("b", 4), ("b", 8)]
    assert log[4:] == [("a", 4), ("b", 4), ("a", 8), ("b", 8)] * 3


def test_nope_variant_is_the_same_method_without_positional_encoding():
    # Zoology's models have no positional encoding: <key>-nope is <key> with rope_base=None, nothing else changed
    table = pt.methods(D_MODEL)
    for key in ("softmax", "based", "llops-p4-m256", "based-w16", "llops-p4-m256-w16"):
        rope, nope = table[key], table[f"{key}-nope"]
        assert rope.rope_base == 10000.0 and nope.rope_base is None
        assert pt.replace(nope, key=key, label=rope.label, rope_base=rope.rope_base) == rope
    a = pt.build_model(table["softmax-nope"], D_MODEL, VOCAB, seed=0).double()
    b = pt.build_model(table["softmax"], D_MODEL, VOCAB, seed=0).double()
    assert a.config.rope_base is None and b.config.rope_base == 10000.0
    x = _tokens(T=12)
    with torch.no_grad():  # the same weights (RoPE has none): position 0 is unrotated in both, later ones differ
        ya, yb = a(x), b(x)
    assert torch.allclose(ya[:, 0], yb[:, 0], rtol=0, atol=1e-12)
    assert float((ya[:, 1:] - yb[:, 1:]).abs().max()) > 1e-6 * float(yb.abs().max())


def test_verdict_compares_a_nope_llops_with_nope_based_only():
    based = [_run("based", s, a) for s, a in enumerate((0.80, 0.82, 0.84))]  # sd 0.02
    nope = [_run("based-nope", s, a) for s, a in enumerate((0.60, 0.62, 0.64))]
    far = [_run("llops-p4-m256-nope", s, a) for s, a in enumerate((0.90, 0.92, 0.94))]
    text = pt.verdict({"based": based, "based-nope": nope, "llops-p4-m256-nope": far})
    assert "llops-p4-m256-nope − BASED nope = +0.300" in text and "LLoPS ahead" in text
    assert " − BASED = " not in text  # no comparison across positional encodings
    assert pt.verdict({"based": based, "llops-p4-m256-nope": far}) == "No LLoPS run to compare."


def test_softmax_check_names_the_worst_slice_at_training_and_at_every_length():
    a, b = _run("softmax", 0, 0.995), _run("softmax", 1, 0.999)
    b["slices"][4]["accuracy"] = 0.991  # (64, 16): the longest training length
    a["slices"][-1]["accuracy"] = 0.40  # (256, 64): 4x the longest training length
    text = pt.softmax_check([a, b], 64)
    assert "at training lengths (T ≤ 64) is **0.991** (seed 1, slice (64, 16); passes)" in text
    assert "**0.400** (seed 0, slice (256, 64); FAILS)" in text and "2 seed(s) (0, 1)" in text
    assert "Worst seed per test slice (T, P): (16, 1) 0.995; (16, 2) 0.995; (16, 4) 0.995; (32, 8) 0.995; " \
           "(64, 16) 0.991; (128, 32) 0.995; (256, 64) 0.400." in text
    assert "Runs made by" not in text  # the runs record no command: none quoted
    a["command"], b["command"] = "python x --seeds 0", "python x --seeds 1"
    assert pt.softmax_check([a, b], 64).endswith(" Runs made by `python x --seeds 0`, `python x --seeds 1`.")
    b["slices"][0]["accuracy"] = 0.98
    assert "**0.980** (seed 1, slice (16, 1); FAILS)" in pt.softmax_check([a, b], 64)
    a["slices"][-1]["accuracy"] = 0.995
    assert "**0.980** (seed 1, slice (16, 1); FAILS); at every" in pt.softmax_check([a, b], 64)


def test_budget_table_gives_the_worst_seed_per_slice_for_each_step_count():
    runs = [_run("softmax-nope", s, 0.995) for s in (0, 1)] + [_run("softmax-nope", s, 0.999) for s in (0, 1)]
    for r, steps in zip(runs, (800, 800, 1600, 1600)):
        r["spec"]["scale"]["steps"], r["spec"]["lr"] = steps, 0.01
    runs[1]["slices"][-1]["accuracy"] = 0.97  # 800 steps, seed 1, (256, 64)
    runs[2]["slices"][0]["accuracy"] = 0.992  # 1600 steps, seed 0, (16, 1)
    head, rule, r800, r1600 = pt.budget_table(runs, 64)
    assert head.startswith("| method | steps | lr | seeds | (16, 1) |") and head.endswith("| T ≤ 64 | every length |")
    assert r800 == ("| softmax-nope | 800 | 0.01 | 0, 1 | " + "0.995 | " * 6 + "0.970 | 0.995 passes | 0.970 FAILS |")
    assert r1600 == ("| softmax-nope | 1600 | 0.01 | 0, 1 | 0.992 | " + "0.999 | " * 6
                     + "0.992 passes | 0.992 passes |")
    assert pt.budget_table([], 64) == []


_METHOD_ROPE = object()


def _write_run(work, method, seed, steps, acc, scale=None, lr=0.01, rope_base=_METHOD_ROPE):
    """A finished run's JSON, as run_one writes it, every slice at ``acc`` (``rope_base``: the method's)."""
    import json
    from dataclasses import asdict

    s = pt.replace(scale or pt.QUICK, steps=steps)
    spec = pt.RunSpec(method, lr, seed, s)
    slices = [{"seq_len": T, "num_pairs": P, "accuracy": acc, "queries": 1} for T, P in s.test_pairs()]
    out = {"spec": {"method": method, "lr": lr, "seed": seed, "scale": asdict(s)}, "label": method,
           "mixture_accuracy": acc, "slices": slices, "evals": [], "seconds": 1.0, "diverged": None,
           "forward_ms_T256": 1.0, "threads": 1, "command": f"python run {steps}",
           "rope_base": pt.methods(s.d_model)[method].rope_base if rope_base is _METHOD_ROPE else rope_base}
    path = work / f"{spec.name}.json"
    path.write_text(json.dumps(out))
    return path


def test_report_only_states_the_positional_encoding_and_the_check_by_budget(tmp_path, capsys):
    for seed in (0, 1):
        _write_run(tmp_path, "softmax-nope", seed, 800, 0.97)
        _write_run(tmp_path, "softmax-nope", seed, 1600, 0.995)
    _write_run(tmp_path, "softmax-nope", 5, 800, 0.10)  # a seed outside --seeds: not in the table
    _write_run(tmp_path, "softmax-nope", 0, 400, 0.10, scale=pt.replace(pt.QUICK, vocab=1024))  # another scale
    assert pt.main(["--quick", "--steps", "1600", "--seeds", "0,1", "--sweep", "softmax-nope", "--fixed-lr",
                    "softmax-nope=0.01", "--methods", "softmax-nope", "--report-only", "--work", str(tmp_path),
                    "--out", str(tmp_path), "--report", "check"]) == 0
    capsys.readouterr()
    text = (tmp_path / "check.md").read_text()
    assert "positional encoding: none (NoPE, `TransformerConfig(rope_base=None)`, as Zoology) for softmax-nope." \
        in text and "RoPE (base" not in text
    assert "at every test length, the longer ones included (Zoology's test set runs to 4× its training lengths), " \
           "**0.995** (seed 0, slice (16, 1); passes)" in text and "Runs made by `python run 1600`." in text
    assert "## Table 4 and Table 5" not in text  # none of their methods ran: no table of "not run" rows
    rows = [line for line in text.splitlines() if line.startswith("| softmax-nope |")]
    assert rows == ["| softmax-nope | 800 | 0.01 | 0, 1 | " + "0.970 | " * 7 + "0.970 FAILS | 0.970 FAILS |",
                    "| softmax-nope | 1600 | 0.01 | 0, 1 | " + "0.995 | " * 7 + "0.995 passes | 0.995 passes |"]


def test_a_run_of_another_positional_encoding_is_refused_naming_the_file(tmp_path):
    """``softmax-nope`` once meant RoPE base 1e300: such a run (or one older than the rope_base field)
    found by its file name is refused, not read back as NoPE."""
    stale = _write_run(tmp_path, "softmax-nope", 0, 800, 0.97, rope_base=1e300)
    with pytest.raises(ValueError, match=r"softmax-nope.*rope_base=1e\+300.*now has rope_base=None"):
        pt.read_run(stale, None)
    old = _write_run(tmp_path, "softmax", 1, 800, 0.97)
    assert pt.read_run(old, 10000.0)["spec"]["seed"] == 1  # the method's own encoding: read back
    with pytest.raises(ValueError, match="move the file out of the work directory"):
        pt.main(["--quick", "--steps", "800", "--seeds", "0", "--sweep", "softmax-nope", "--fixed-lr",
                 "softmax-nope=0.01", "--methods", "softmax-nope", "--report-only", "--work", str(tmp_path),
                 "--out", str(tmp_path), "--report", "check"])


def test_paper_rows_face_the_nope_runs_when_every_method_is_nope():
    nope = {k: [_run(k, 0, 0.5)] for k in ("based-nope", "llops-p2-m256-nope", "llops-p6-m256-nope")}
    rows = pt.paper_rows(nope)
    assert ("Table 4: BASED (NoPE)", "91.9", "based-nope") in rows
    assert [r for r in rows if r[0].startswith("Table 5")] == [
        ("Table 5: LLoPS p = 2, m = 256 (NoPE)", "88.7", "llops-p2-m256-nope"),
        ("Table 5: LLoPS p = 4, m = 256 (NoPE)", "93.2", "llops-p4-m256-nope"),
        ("Table 5: LLoPS p = 6, m = 256 (NoPE)", "86.6", "llops-p6-m256-nope")]
    assert not any(key in ("based", "llops-p4-m256") for _, _, key in rows)  # no RoPE "not run" rows
    rows = pt.paper_rows({**nope, "based-w16-nope": [_run("based-w16-nope", 0, 0.5)]})  # a NoPE hybrid follows
    assert rows[-1] == ("Table 4, hybrid: BASED + window 16 (NoPE)", "–", "based-w16-nope")
    mixed = {"based": [_run("based", 0, 0.5)], "based-nope": [_run("based-nope", 0, 0.5)]}
    rows = pt.paper_rows(mixed)  # RoPE runs present: the paper's rows keep the RoPE keys, NoPE rows follow
    assert rows[0] == ("Table 4: BASED", "91.9", "based") and ("Table 4, NoPE: BASED", "–", "based-nope") in rows
    assert pt.paper_rows({})[0][2] == "based"


def test_verdict_compares_llops_p6_with_based():
    based = [_run("based-nope", s, a) for s, a in enumerate((0.80, 0.82, 0.84))]
    p6 = [_run("llops-p6-m256-nope", s, a) for s, a in enumerate((0.30, 0.32, 0.34))]
    text = pt.verdict({"based-nope": based, "llops-p6-m256-nope": p6})
    assert "llops-p6-m256-nope − BASED nope = -0.500" in text and "BASED ahead" in text


def test_report_only_of_a_nope_invocation_puts_each_paper_number_beside_its_nope_run(tmp_path, capsys):
    for seed, acc in ((0, 0.995), (1, 0.996), (2, 0.997)):
        _write_run(tmp_path, "softmax-nope", seed, 3200, acc)
    for key, accs in (("based-nope", (0.90, 0.91, 0.92)), ("llops-p4-m256-nope", (0.60, 0.70, 0.80)),
                      ("llops-p2-m256-nope", (0.40,))):
        for seed, acc in enumerate(accs):
            _write_run(tmp_path, key, seed, 3200, acc, lr=0.003)
    assert pt.main(["--quick", "--steps", "3200", "--seeds", "0,1,2", "--sweep", "based-nope", "--fixed-lr",
                    "softmax-nope=0.01,based-nope=0.003,llops-p4-m256-nope=0.003,llops-p2-m256-nope=0.003,"
                    "llops-p6-m256-nope=0.003", "--methods",
                    "softmax-nope,based-nope,llops-p4-m256-nope,llops-p2-m256-nope,llops-p6-m256-nope",
                    "--report-only", "--work", str(tmp_path), "--out", str(tmp_path), "--report", "nope"]) == 0
    capsys.readouterr()
    text = (tmp_path / "nope.md").read_text()
    assert "| Table 4: BASED (NoPE) | 91.9 | 0.910 ± 0.010 (0.900, 0.910, 0.920) |" in text
    assert "| Table 5: LLoPS p = 4, m = 256 (NoPE) | 93.2 | 0.700 ± 0.100 (0.600, 0.700, 0.800) |" in text
    assert "| Table 5: LLoPS p = 2, m = 256 (NoPE) | 88.7 | 0.400 (1 seed) |" in text
    assert "| Table 5: LLoPS p = 6, m = 256 (NoPE) | 86.6 | not run |" in text
    assert "**Harness check (softmax, NoPE ≥ 0.99 on every seed):**" in text and "**0.995** (seed 0" in text
    assert "llops-p4-m256-nope − BASED nope = -0.210" in text and "| Table 4: BASED |" not in text


def test_the_mqar_part_no_longer_trains_and_names_the_frontier(tmp_path):
    """Issue 41: new MQAR runs are `sketchlab frontier`; the MQAR part only rebuilds its reports (--report-only)."""
    with pytest.raises(SystemExit, match="sketchlab frontier"):
        pt.main(["--quick", "--steps", "1", "--seeds", "0", "--sweep", "", "--methods", "softmax-nope", "--jobs", "1",
                 "--work", str(tmp_path), "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written
