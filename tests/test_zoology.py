"""Zoology's MQAR protocol: the "zoology" layout, the mixture, query-only logits, per-slice evaluation,
and the check that the harness learns (a 1-layer softmax model on a tiny MQAR)."""

from __future__ import annotations

import pytest
import torch

from sketchlab.tasks.model import TransformerConfig, TransformerLM
from sketchlab.tasks.mqar import (
    IGNORE_INDEX,
    MQARConfig,
    MQARMixture,
    mqar_batch,
    zoology_mixture,
    zoology_tests,
)
from sketchlab.tasks.train import evaluate_mqar, train_mqar
from sketchlab.tasks.zoology import QueryLogits, evaluate_slices


def test_zoology_layout_structure():
    cfg = MQARConfig(vocab_size=64, num_pairs=5, seq_len=30, layout="zoology")
    x, y = mqar_batch(cfg, 200, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (200, 30)
    for b in range(200):
        keys, values = x[b, 0:10:2], x[b, 1:10:2]
        assert keys.unique().numel() == 5 and values.unique().numel() == 5
        assert bool(((keys >= 1) & (keys < 32)).all()) and bool(((values >= 32) & (values < 64)).all())
        pos = (y[b] != IGNORE_INDEX).nonzero().flatten()
        assert pos.numel() == 5  # every key queried once
        assert bool((pos >= 10).all()) and bool(((pos - 10) % 2 == 0).all())  # even offsets of the query region
        pair = dict(zip(keys.tolist(), values.tolist()))
        assert sorted(x[b, pos].tolist()) == sorted(pair)
        for t in pos.tolist():
            assert y[b, t].item() == pair[x[b, t].item()]
    # the rest of the query region is uniform random tokens over [0, 64), not a filler: over
    # 200 sequences × 15 free positions = 3000 draws, every one of the 64 tokens appears (the
    # chance that a given token is missing is (63/64)^3000 ≈ 3e-21)
    free = torch.ones_like(y, dtype=torch.bool)
    free[:, :10] = False
    free &= y == IGNORE_INDEX
    assert x[free].unique().numel() == 64


def test_zoology_gaps_follow_the_power_law():
    # power_a = 0.01: p(g) ∝ (g+1)^(-0.99) over g in {0, …, 49}; one pair per sequence, so the
    # gap is a single draw. Compare the empirical frequency of g = 0 with p(0) = 1 / H where
    # H = Σ (g+1)^(-0.99) ≈ 4.45: p(0) ≈ 0.2247. 4000 draws: sd = sqrt(p(1-p)/4000) ≈ 0.0066, so a
    # 4-sd window (0.026) fails with probability < 1e-4 and a uniform law (p(0) = 0.02) fails it.
    cfg = MQARConfig(vocab_size=64, num_pairs=1, seq_len=102, layout="zoology")
    _, y = mqar_batch(cfg, 4000, generator=torch.Generator().manual_seed(1))
    gap = ((y != IGNORE_INDEX).float().argmax(1) - 2) // 2
    p = torch.arange(1, 51, dtype=torch.float64) ** -0.99
    p0 = float(p[0] / p.sum())
    assert abs(float((gap == 0).double().mean()) - p0) < 4 * (p0 * (1 - p0) / 4000) ** 0.5
    uniform = MQARConfig(vocab_size=64, num_pairs=1, seq_len=102, layout="zoology", power_a=1.0)
    _, y = mqar_batch(uniform, 4000, generator=torch.Generator().manual_seed(1))
    gap = ((y != IGNORE_INDEX).float().argmax(1) - 2) // 2
    assert abs(float((gap == 0).double().mean()) - 0.02) < 4 * (0.02 * 0.98 / 4000) ** 0.5


@pytest.mark.parametrize("kw,msg", [
    (dict(vocab_size=64, num_pairs=5, seq_len=19, layout="zoology"), r"seq_len must be even and >= 4 \* num_pairs"),
    (dict(vocab_size=64, num_pairs=5, seq_len=18, layout="zoology"), r"seq_len must be even and >= 4 \* num_pairs = 20"),
    (dict(vocab_size=11, num_pairs=5, seq_len=20, layout="zoology"), r"vocab_size must be >= 2 \* num_pairs \+ 2"),
    (dict(vocab_size=64, num_pairs=5, seq_len=20, num_queries=3, layout="zoology"), r"num_queries must be None"),
    (dict(vocab_size=64, num_pairs=5, seq_len=20, layout="zoo"), r"layout must be one of"),
    (dict(vocab_size=64, num_pairs=5, seq_len=20, layout="zoology", power_a=0.0), r"power_a must be a number in \(0, 1\]"),
])
def test_zoology_config_rules(kw, msg):
    with pytest.raises(ValueError, match=msg):
        MQARConfig(**kw)


def test_compact_layout_keeps_its_identity():
    # runs and checkpoints written before the zoology layout existed record the task without it
    assert MQARConfig(65, 8, 64).to_dict() == {"vocab_size": 65, "num_pairs": 8, "seq_len": 64, "num_queries": None}
    z = MQARConfig(64, 4, 16, layout="zoology").to_dict()
    assert z["layout"] == "zoology" and z["power_a"] == 0.01


def test_mixture_draws_components_by_weight():
    mix = MQARMixture((MQARConfig(64, 2, 16, layout="zoology"), MQARConfig(64, 4, 32, layout="zoology")), (3, 1))
    gen = torch.Generator().manual_seed(0)
    lengths = [mqar_batch(mix, 2, generator=gen)[0].shape[1] for _ in range(2000)]
    # P(first) = 0.75; 2000 draws: sd ≈ 0.0097, a 4-sd window
    assert abs(lengths.count(16) / 2000 - 0.75) < 0.039 and set(lengths) == {16, 32}
    with pytest.raises(ValueError, match="share one vocab_size"):
        MQARMixture((MQARConfig(64, 2, 16), MQARConfig(65, 2, 16)), (1, 1))
    with pytest.raises(ValueError, match="one entry per component"):
        MQARMixture((MQARConfig(64, 2, 16),), (1, 1))
    with pytest.raises(ValueError, match="finite numbers > 0"):
        MQARMixture((MQARConfig(64, 2, 16),), (0,))
    std = zoology_mixture()
    assert [(c.seq_len, c.num_pairs) for c in std.components] == [(64, 4), (128, 8), (256, 16), (256, 32), (256, 64)]
    assert std.vocab_size == 8192 and std.weights == (5.0, 1.0, 1.0, 1.0, 1.0)
    assert [(c.seq_len, c.num_pairs) for c in zoology_tests()][-1] == (1024, 256)


def test_query_logits_equal_the_full_forward_at_the_mask():
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, short_conv=3)).eval()
    x, y = mqar_batch(MQARConfig(64, 4, 20, layout="zoology"), 3, generator=torch.Generator().manual_seed(2))
    mask = y != IGNORE_INDEX
    with torch.no_grad():
        full = model(x)[mask]  # [N, vocab]
        part = QueryLogits(model)(x, mask)
    assert part.shape == (12, 64)
    # the same operations on the same rows; the head's matmul over fewer rows may block differently: float32 round-off
    torch.testing.assert_close(part, full, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        QueryLogits(model)(x, mask.long())


def test_evaluate_slices_counts_each_configuration():
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=1))
    tasks = (MQARConfig(64, 2, 8, layout="zoology"), MQARConfig(64, 4, 16, layout="zoology"))
    got = evaluate_slices(model, tasks, num_sequences=10, seed=3, batch_size=4)
    assert [(g["seq_len"], g["num_pairs"], g["queries"]) for g in got] == [(8, 2, 20), (16, 4, 40)]
    # hand count for the second slice: its stream is seed + 1_000_003 + 1
    gen = torch.Generator().manual_seed(3 + 1_000_003 + 1)
    correct = 0
    for b in (4, 4, 2):
        x, y = mqar_batch(tasks[1], b, generator=gen)
        with torch.no_grad():
            pred = model(x).argmax(-1)
        correct += int((pred == y)[y != IGNORE_INDEX].sum())
    assert got[1]["accuracy"] == correct / 40


def test_harness_learns_one_layer_softmax_on_tiny_mqar():
    # The harness check of issue 20: a 1-layer softmax model (short conv 2, so one attention layer
    # can match a query against the token after each key) on a tiny zoology-layout MQAR, fixed
    # steps. Chance is 1/16 over the value alphabet (1/4 for a model that knows only that the
    # answer is one of the 4 values present); 128 held-out sequences = 512 queries, so 0.9 is
    # > 30 standard errors above 1/4.
    torch.manual_seed(0)
    task = MQARConfig(vocab_size=32, num_pairs=4, seq_len=24, layout="zoology")
    model = TransformerLM(TransformerConfig(vocab_size=32, d_model=32, n_heads=2, n_layers=1, mlp_ratio=2,
                                            short_conv=2))
    result = train_mqar(model, [(task, 200)], batch_size=32, lr=1e-2, weight_decay=0.1, warmup=20, seed=0,
                        eval_sequences=128, progress=False)
    assert result.heldout_accuracy >= 0.9, result.history
    assert evaluate_mqar(model, task, num_sequences=128, seed=0) == result.heldout_accuracy


def test_cli_kernel_lr_is_checked_and_recorded(tmp_path, capsys):
    import json

    from sketchlab.cli import main

    base = ["train", "--task", "mqar", "--attention", "llops", "--p", "2", "--m", "4", "--vocab-size", "9",
            "--num-pairs", "2", "--seq-len", "8", "--d-model", "8", "--n-heads", "2", "--n-layers", "1",
            "--steps", "2", "--eval-sequences", "4", "--batch-size", "2", "--no-progress"]
    assert main(base + ["--out", str(tmp_path / "bad"), "--kernel-lr", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --kernel-lr: expected a finite number > 0, got '0'" in err[0]
    assert main(base + ["--out", str(tmp_path / "ok"), "--kernel-lr", "0.5"]) == 0
    summary = json.loads((tmp_path / "ok" / "train.json").read_text())
    assert summary["kernel_lr"] == 0.5


def test_kernel_lr_scales_the_kernels_step_only():
    # Adam's first step moves every parameter with a non-zero gradient by lr·g/(|g| + eps) ≈ ±lr
    # (bias-corrected moments), so after one step at full rate (warmup 0, cosine factor 1 at step 0)
    # the largest move of Θ is kernel_lr·lr and that of a projection lr (weight decay 0)
    from sketchlab.tasks import TransformerConfig, TransformerLM, kernel_modules

    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=16, d_model=16, n_heads=2, n_layers=1, attention="llops",
                                            attention_options={"p": 2, "m": 4}))
    theta = kernel_modules(model)[0].theta_q.detach().clone()
    proj = model.blocks[0].attention.q_proj.weight.detach().clone()
    train_mqar(model, [(MQARConfig(16, 2, 8), 1)], batch_size=4, lr=1e-2, kernel_lr=0.1, weight_decay=0.0,
               warmup=0, eval_sequences=2, progress=False)
    d_theta = float((kernel_modules(model)[0].theta_q - theta).abs().max())
    d_proj = float((model.blocks[0].attention.q_proj.weight - proj).abs().max())
    assert d_theta == pytest.approx(1e-3, rel=1e-3) and d_proj == pytest.approx(1e-2, rel=1e-3)


def test_mixture_accuracy_is_the_mean_over_all_its_components(capsys):
    # Issue 20: a mixture stage's held-out accuracy is the unweighted mean over all its
    # components, component i scored on its own eval_sequences sequences from the stream
    # seed + 1_000_003 + i (hand count below), not the accuracy of the one or two components
    # that a few randomly drawn evaluation batches happen to hit. A short model trained on the
    # mixture (almost only on its 2-pair component: weights 1000 : 1) recalls the 2-pair
    # component much better than the 16-pair one (0.92 vs 0.10) (asserted: the two differ by > 0.2, so no single
    # component's accuracy equals the mean), and a sampled evaluation would score the 2-pair
    # component alone.
    torch.manual_seed(0)
    easy, hard = MQARConfig(64, 2, 12, layout="zoology"), MQARConfig(64, 16, 64, layout="zoology")
    mix = MQARMixture((easy, hard), (1000, 1))
    model = TransformerLM(TransformerConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=1, mlp_ratio=2,
                                            short_conv=2))
    result = train_mqar(model, [(mix, 100)], batch_size=32, lr=1e-2, warmup=10, seed=0, eval_sequences=24,
                        eval_every=50, progress=False)
    per = []
    for i, task in enumerate((easy, hard)):  # hand count: 24 sequences in batches of 64 (one batch)
        x, y = mqar_batch(task, 24, generator=torch.Generator().manual_seed(0 + 1_000_003 + i))
        with torch.no_grad():
            pred = model.eval()(x).argmax(-1)
        per.append(int((pred == y)[y != IGNORE_INDEX].sum()) / int((y != IGNORE_INDEX).sum()))
    assert per[0] - per[1] > 0.2, per
    mean = (per[0] + per[1]) / 2
    assert result.heldout_accuracy == pytest.approx(mean, abs=1e-12)
    assert result.history[0]["component_accuracies"] == pytest.approx(per, abs=1e-12)
    assert [e["step"] for e in result.evals] == [0, 50, 100]
    assert result.evals[-1]["component_accuracies"] == pytest.approx(per, abs=1e-12)
    assert evaluate_mqar(model, mix, num_sequences=24, seed=0) == pytest.approx(mean, abs=1e-12)
    # the stage line keeps the form "... held-out accuracy X after N steps ..." and names the components
    text = capsys.readouterr()
    line = [ln for ln in (text.out + text.err).splitlines() if ln.startswith("stage 0 ")]
    assert len(line) == 1, line
    assert (f"held-out accuracy {mean:.4f} after 100 steps (the mean over its 2 components: {per[0]:.4f}, "
            f"{per[1]:.4f})") in line[0], line[0]
    assert "(T=12, P=2), (T=64, P=16)" in line[0]
