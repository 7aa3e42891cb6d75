"""MQAR data, the small transformer (softmax kernel vs its naive twin, RoPE, causality), training and checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from sketchlab.attention import softmax_attention_naive
from sketchlab.tasks.model import (
    SoftmaxAttention,
    TransformerConfig,
    TransformerLM,
    apply_rope,
    attention_registry,
    register_attention,
)
from sketchlab.tasks.mqar import IGNORE_INDEX, MQARConfig, mqar_accuracy, mqar_batch
from sketchlab.tasks.train import evaluate_mqar, load_checkpoint, save_checkpoint, train_mqar

# ---------------------------------------------------------------------------------------------
# data


def test_mqar_batch_structure():
    cfg = MQARConfig(vocab_size=41, num_pairs=6, seq_len=30, num_queries=5)
    x, y = mqar_batch(cfg, 64, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (64, 30) and x.dtype == y.dtype == torch.long
    K = cfg.num_keys  # 20 key tokens 1..20, values 21..40
    for b in range(64):
        keys, values = x[b, 0:12:2], x[b, 1:12:2]
        assert keys.unique().numel() == 6 and values.unique().numel() == 6  # distinct within a sequence
        assert bool(((keys >= 1) & (keys <= K)).all()) and bool(((values > K) & (values < 41)).all())
        pos = (y[b] != IGNORE_INDEX).nonzero().flatten()
        assert pos.numel() == 5 and bool((pos >= 12).all())  # queries only in the query region
        pair = dict(zip(keys.tolist(), values.tolist()))
        for t in pos.tolist():
            assert y[b, t].item() == pair[x[b, t].item()]  # target = value of the queried key
        rest = torch.ones(30, dtype=torch.bool)
        rest[:12] = False
        rest[pos] = False
        assert bool((x[b, rest] == 0).all())  # filler elsewhere
        assert len(set(x[b, pos].tolist())) == 5  # each key queried at most once


def test_mqar_batch_is_seeded():
    cfg = MQARConfig(vocab_size=65, num_pairs=8, seq_len=40)
    a = mqar_batch(cfg, 4, generator=torch.Generator().manual_seed(7))
    b = mqar_batch(cfg, 4, generator=torch.Generator().manual_seed(7))
    c = mqar_batch(cfg, 4, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("kw,msg", [
    (dict(vocab_size=10, num_pairs=5, seq_len=20), r"vocab_size must be >= 2 \* num_pairs \+ 1"),
    (dict(vocab_size=65, num_pairs=8, seq_len=20), r"seq_len must be >= 2 \* num_pairs \+ num_queries = 24"),
    (dict(vocab_size=65, num_pairs=8, seq_len=40, num_queries=9), r"num_queries must be <= num_pairs"),
    (dict(vocab_size=65, num_pairs=0, seq_len=40), r"num_pairs must be an integer >= 1, got 0"),
])
def test_mqar_config_rules(kw, msg):
    with pytest.raises(ValueError, match=msg):
        MQARConfig(**kw)


def test_mqar_accuracy_counts_only_query_positions():
    targets = torch.tensor([[IGNORE_INDEX, 2, IGNORE_INDEX, 1]])
    logits = torch.zeros(1, 4, 3)
    logits[0, 1, 2] = 1.0  # right
    logits[0, 3, 0] = 1.0  # wrong (target 1)
    logits[0, 0, 1] = logits[0, 2, 1] = 5.0  # ignored positions
    assert mqar_accuracy(logits, targets) == 0.5
    with pytest.raises(ValueError, match="no query position"):
        mqar_accuracy(logits, torch.full((1, 4), IGNORE_INDEX))


# ---------------------------------------------------------------------------------------------
# model


def test_softmax_attention_matches_naive_twin():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    # float64 SDPA vs the written-out softmax: same math, different summation order -> round-off only.
    torch.testing.assert_close(SoftmaxAttention()(q, k, v), softmax_attention_naive(q, k, v), rtol=1e-12, atol=1e-12)


def test_softmax_step_and_sliding_window_match_naive_twin():
    """The toy softmax kernel's KV-cache step (a prompt, then 3 tokens, then 1) and the sliding-window mixer
    against the float64 twin: the step's queries are the last n of the cached positions."""
    from sketchlab.tasks.mixers import SlidingWindowAttention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    want = softmax_attention_naive(q, k, v)
    attn, state, rows = SoftmaxAttention(), None, []
    for a, b in ((0, 5), (5, 8), (8, 9)):
        out, state = attn.step(q[:, a:b], k[:, a:b], v[:, a:b], state)
        rows.append(out)
    assert state[0].shape == (2, 9, 3, 8)
    torch.testing.assert_close(torch.cat(rows, 1), want, rtol=1e-12, atol=1e-12)
    for window in (1, 3):
        torch.testing.assert_close(SlidingWindowAttention(window)(q, k, v),
                                   softmax_attention_naive(q, k, v, window=window), rtol=1e-12, atol=1e-12)


def test_rope_preserves_norms_and_depends_on_offset_only():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64).expand(1, 12, 1, 16)
    k = torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64).expand(1, 12, 1, 16)
    rq, rk = apply_rope(q), apply_rope(k)
    # A rotation: norms unchanged; float64 round-off.
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-12, atol=1e-12)
    scores = torch.einsum("td,sd->ts", rq[0, :, 0], rk[0, :, 0])  # [T, T]
    for offset in range(-3, 4):
        diag = torch.diagonal(scores, offset)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="even head dimension"):
        apply_rope(torch.zeros(1, 2, 1, 3))


def test_model_is_causal_and_validates_tokens():
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=20, d_model=32, n_heads=2, n_layers=2, short_conv=2)).eval()
    x = torch.randint(0, 20, (2, 10), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % 20  # change the future only
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :6], model(y)[:, :6], rtol=0, atol=0)
        assert not torch.equal(model(x)[:, 6:], model(y)[:, 6:])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 20\)"):
        model(torch.tensor([[1, 20]]))


def test_attention_is_pluggable(monkeypatch):
    import sketchlab.tasks.model as model_module

    monkeypatch.setattr(model_module, "_ATTENTION", dict(model_module._ATTENTION))  # the test's entry leaves with it
    calls = []

    class Recording(SoftmaxAttention):
        def forward(self, q, k, v):
            calls.append(q.shape)
            return super().forward(q, k, v)

    name = "recording-softmax-test"
    register_attention(name)(lambda config, layer: Recording())
    assert name in attention_registry()
    model = TransformerLM(TransformerConfig(vocab_size=10, d_model=16, n_heads=2, n_layers=3, attention=name))
    model(torch.zeros(1, 5, dtype=torch.long))
    assert calls == [(1, 5, 2, 8)] * 3  # [B, T, H, D] into every layer's kernel
    with pytest.raises(ValueError, match="attention must be one of"):
        TransformerConfig(vocab_size=10, attention="nope")


@pytest.mark.parametrize("base,msg", [
    (0.0, r"rope_base must be a finite number > 1 .*got 0\.0"),
    (-10.0, r"rope_base must be a finite number > 1 .*got -10\.0"),
    (1.0, r"rope_base must be a finite number > 1 .*got 1\.0"),  # base 1: every frequency is 1
    (float("nan"), r"rope_base must be a finite number > 1 .*got nan"),
    (float("inf"), r"rope_base must be a finite number > 1 .*got inf"),
    ("10000", r"rope_base must be a finite number > 1 .*got '10000'"),
    (True, r"rope_base must be a finite number > 1 .*got True"),
])
def test_transformer_config_rejects_bad_rope_base(base, msg):
    with pytest.raises(ValueError, match=msg):
        TransformerConfig(vocab_size=10, d_model=16, n_heads=2, rope_base=base)


@pytest.mark.parametrize("kw,err,msg", [
    (dict(d_model=0), ValueError, r"d_model must be an integer >= 1, got 0"),
    (dict(n_heads=3), ValueError, r"d_model must be divisible by n_heads, got d_model=16, n_heads=3"),
    (dict(d_model=18), ValueError, r"head dimension d_model/n_heads must be even for RoPE, got 9"),
    (dict(short_conv=-1), ValueError, r"short_conv must be an integer >= 0 \(0 = none\), got -1"),
    (dict(mlp_ratio=1.5), TypeError, r"mlp_ratio must be an integer >= 1, got 1\.5"),
    (dict(attention=["softmax"]), ValueError, r"attention must be one of .*got \['softmax'\]"),
])
def test_transformer_config_rejects_bad_fields(kw, err, msg):
    with pytest.raises(err, match=msg):
        TransformerConfig(**{"vocab_size": 10, "d_model": 16, "n_heads": 2, **kw})


def test_small_rope_base_gives_finite_outputs():
    # base 1.5 > 1 is accepted and RoPE stays finite (the rule only excludes base <= 1 and non-finite)
    model = TransformerLM(TransformerConfig(vocab_size=10, d_model=16, n_heads=2, n_layers=1, rope_base=1.5))
    assert bool(torch.isfinite(model(torch.arange(10).reshape(1, 10))).all())


def test_rope_base_none_is_no_positional_encoding():
    """rope_base=None (NoPE): without the short conv, one causal attention layer sees the earlier tokens
    as a set, so the last position's logits do not depend on their order (float64, to round-off; with
    more layers the earlier positions' own prefixes differ); with RoPE they do. An odd head dimension
    is allowed then (no rotation pairs)."""
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    shuffled = ids[:, [4, 0, 6, 2, 1, 5, 3, 7]]  # the first 7 permuted, the last kept
    for base, same in ((None, True), (10000.0, False)):
        torch.manual_seed(0)
        model = TransformerLM(TransformerConfig(vocab_size=10, d_model=16, n_heads=2, n_layers=1,
                                                rope_base=base)).double().eval()
        with torch.no_grad():
            a, b = model(ids)[0, -1], model(shuffled)[0, -1]
        assert torch.allclose(a, b, rtol=0, atol=1e-12) is same, (base, float((a - b).abs().max()))
    TransformerLM(TransformerConfig(vocab_size=10, d_model=6, n_heads=2, n_layers=1, rope_base=None))  # head dim 3
    with pytest.raises(ValueError, match="must be even for RoPE, got 3"):
        TransformerConfig(vocab_size=10, d_model=6, n_heads=2)


# ---------------------------------------------------------------------------------------------
# training and checkpoints


def test_small_model_learns_mqar_well_above_chance(tmp_path):
    torch.manual_seed(0)
    task = MQARConfig(vocab_size=33, num_pairs=4, seq_len=16)
    model = TransformerLM(TransformerConfig(vocab_size=33, d_model=32, n_heads=2, n_layers=2, mlp_ratio=2, short_conv=2))
    result = train_mqar(model, [(task, 150)], batch_size=32, lr=1e-2, weight_decay=0.0, seed=0,
                        eval_sequences=128, progress=False)
    # Chance: a model that knows the answer is one of the 4 values in the context but not which
    # scores 1/4; uniform guessing over the 16 values 1/16. 128 held-out sequences give 512 queries,
    # so at p = 0.25 the standard error is sqrt(.25·.75/512) ≈ 0.019: 0.9 is > 30 standard errors
    # above the best content-blind strategy, reachable only by recalling the pairs. (This run
    # reaches ≈ 1.0 in 150 steps thanks to the short convolution; 0.9 leaves room for platform
    # differences in float32 round-off that change the optimisation path.)
    assert result.heldout_accuracy > 0.9, result.history
    assert result.steps == 150 and len(result.history) == 1

    save_checkpoint(tmp_path / "ckpt", model, extra={"acc": result.heldout_accuracy})
    loaded, extra = load_checkpoint(tmp_path / "ckpt")
    assert extra == {"acc": result.heldout_accuracy}
    assert loaded.config == model.config
    x, _ = mqar_batch(task, 3, generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)  # bit-exact weights
    assert evaluate_mqar(loaded, task, num_sequences=128, seed=0) == result.heldout_accuracy


def test_training_is_deterministic():
    def run():
        torch.manual_seed(3)
        model = TransformerLM(TransformerConfig(vocab_size=21, d_model=16, n_heads=2, n_layers=1))
        train_mqar(model, [(MQARConfig(21, 3, 10), 4), (MQARConfig(21, 4, 12), 3)], batch_size=4, seed=3,
                   eval_sequences=8, progress=False)
        return torch.cat([p.flatten() for p in model.parameters()])

    torch.testing.assert_close(run(), run(), rtol=0, atol=0)


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        load_checkpoint(tmp_path)
    model = TransformerLM(TransformerConfig(vocab_size=10, d_model=16, n_heads=2, n_layers=1))
    save_checkpoint(tmp_path, model)
    assert json.loads((tmp_path / "config.json").read_text())["config"]["vocab_size"] == 10
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="unreadable safetensors file"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a sketchlab TransformerLM config"):
        load_checkpoint(tmp_path)


def test_train_rejects_bad_stages():
    model = TransformerLM(TransformerConfig(vocab_size=10, d_model=16, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match="stages must hold at least one"):
        train_mqar(model, [], progress=False)
    with pytest.raises(ValueError, match=r"stages\[0\] has vocab_size=21 > the model's 10"):
        train_mqar(model, [(MQARConfig(21, 3, 10), 2)], progress=False)


@pytest.mark.parametrize("kw,err,msg", [
    (dict(batch_size=0), ValueError, r"batch_size must be an integer >= 1, got 0"),
    (dict(warmup=-1), ValueError, r"warmup must be an integer >= 0, got -1"),
    (dict(warmup=2.5), TypeError, r"warmup must be an integer >= 0, got 2\.5"),
    (dict(lr=0.0), ValueError, r"lr must be a finite number > 0, got 0\.0"),
    (dict(lr=float("nan")), ValueError, r"lr must be a finite number > 0, got nan"),
    (dict(lr="1e-3"), TypeError, r"lr must be a finite number > 0, got '1e-3'"),
    (dict(weight_decay=-0.1), ValueError, r"weight_decay must be a finite number >= 0, got -0\.1"),
    (dict(weight_decay=float("inf")), ValueError, r"weight_decay must be a finite number >= 0, got inf"),
    (dict(seed=-1), ValueError, r"seed must be an integer in \[0, 2\*\*64 - 1000003\), got -1"),
    (dict(seed=1.0), TypeError, r"seed must be an integer >= 0, got 1\.0"),
    (dict(seed=True), TypeError, r"seed must be an integer >= 0, got True"),
    (dict(eval_sequences=0), ValueError, r"eval_sequences must be an integer >= 1, got 0"),
])
def test_train_rejects_bad_hyperparameters(kw, err, msg):
    model = TransformerLM(TransformerConfig(vocab_size=21, d_model=16, n_heads=2, n_layers=1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(err, match=msg):
        train_mqar(model, [(MQARConfig(21, 3, 10), 2)], progress=False, **kw)
    # rejected before any step: the weights are untouched
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_train_without_warmup_starts_at_full_lr():
    # warmup=0 used to divide by zero when the schedule was built; now it means no warm-up and
    # the run completes both steps and updates the weights
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=21, d_model=16, n_heads=2, n_layers=1))
    before = model.head.weight.detach().clone()
    result = train_mqar(model, [(MQARConfig(21, 3, 10), 2)], batch_size=4, warmup=0, eval_sequences=8,
                        progress=False)
    assert result.steps == 2 and len(result.history) == 1
    assert not torch.equal(before, model.head.weight)


def test_evaluate_mqar_matches_hand_count_and_uses_ignore_index(monkeypatch):
    import sketchlab.tasks.mqar as mqar_mod
    import sketchlab.tasks.train as train_mod

    torch.manual_seed(1)
    model = TransformerLM(TransformerConfig(vocab_size=21, d_model=16, n_heads=2, n_layers=1)).eval()
    task = MQARConfig(21, 4, 12, num_queries=3)
    # a non-default ignore label: code hard-coding -100 would count every position as a query
    monkeypatch.setattr(mqar_mod, "IGNORE_INDEX", -7)
    monkeypatch.setattr(train_mod, "IGNORE_INDEX", -7)
    gen = torch.Generator().manual_seed(5 + train_mod.HELDOUT_OFFSET)
    correct = total = 0
    for b in (4, 4, 2):  # 10 sequences in batches of 4: the last batch is short
        inputs, targets = mqar_batch(task, b, generator=gen)
        assert int((targets == -7).sum()) == b * (12 - 3)  # the patched label is the one used
        with torch.no_grad():
            pred = model(inputs).argmax(-1)
        mask = targets != -7
        correct += int((pred[mask] == targets[mask]).sum())
        total += int(mask.sum())
    assert total == 10 * 3
    # some queries are right (2 of 30 with this seed), so counting all 120 positions instead of
    # the 30 query positions would change the result
    assert correct > 0
    got = evaluate_mqar(model, task, num_sequences=10, seed=5, batch_size=4)
    # per-batch float32 means re-weighted in float64: equal to correct/total up to ~1e-7
    assert got == pytest.approx(correct / total, abs=1e-6)


@pytest.mark.parametrize("kw,err,msg", [
    (dict(batch_size=0), ValueError, r"batch_size must be an integer >= 1, got 0"),
    (dict(num_sequences=0), ValueError, r"num_sequences must be an integer >= 1, got 0"),
    (dict(seed=-3), ValueError, r"seed must be an integer in \[0, 2\*\*64"),
])
def test_evaluate_mqar_rejects_bad_arguments(kw, err, msg):
    model = TransformerLM(TransformerConfig(vocab_size=21, d_model=16, n_heads=2, n_layers=1))
    with pytest.raises(err, match=msg):
        evaluate_mqar(model, MQARConfig(21, 3, 10), **kw)


def test_evaluate_mqar_restores_train_mode_on_error():
    # the task's vocabulary (41) exceeds the model's (21): the forward pass raises mid-evaluation
    model = TransformerLM(TransformerConfig(vocab_size=21, d_model=16, n_heads=2, n_layers=1)).train()
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 21\)"):
        evaluate_mqar(model, MQARConfig(41, 3, 10), num_sequences=4)
    assert model.training is True
    model.eval()
    evaluate_mqar(model, MQARConfig(21, 3, 10), num_sequences=4)
    assert model.training is False


# ---------------------------------------------------------------------------------------------
# the shipped model and dump (data/, made by `make data`)

DATA = __import__("pathlib").Path(__file__).resolve().parents[1] / "data"


def test_shipped_dump_matches_its_checkpoint():
    from sketchlab.capture import capture_qk
    from sketchlab.io import load_qk

    dump = load_qk(DATA / "mqar_softmax_qk.safetensors")
    L, H, n, d = dump.q.shape
    assert L >= 3 and 32 <= d <= 64 and 256 <= n <= 512 and H >= 2  # the contract other modules rely on
    assert dump.q.dtype == dump.k.dtype == dump.v.dtype == torch.float32 and dump.v.shape == dump.q.shape
    assert dump.meta["scale"] == "none" and dump.meta["layout"] == "L,H,n,d"
    assert dump.meta["captured"] == "post-rope"
    model, extra = load_checkpoint(DATA / "mqar_softmax")
    assert float(dump.meta["heldout_accuracy"]) == pytest.approx(extra["heldout_accuracy"]) and extra["heldout_accuracy"] >= 0.95
    # Re-capturing from the shipped checkpoint on the recorded input reproduces the dump: the
    # same float32 computation on the same machine class; a different BLAS may reorder sums,
    # hence float32 round-off tolerance rather than bit equality.
    ids = torch.tensor(json.loads(dump.meta["input_ids"]))  # [B, T] sequences, joined along n
    again = capture_qk(model, ids)
    for name in ("q", "k", "v"):
        torch.testing.assert_close(getattr(again, name), getattr(dump, name), rtol=1e-4, atol=1e-4, msg=name)
    # Held-out accuracy from a fresh stream (64 sequences × 32 queries = 2048 queries; the shipped
    # model scores ≈ 1.0, and 0.95 is the documented floor).
    task = MQARConfig(**json.loads(dump.meta["task"]))
    assert evaluate_mqar(model, task, num_sequences=64, seed=12345) >= 0.95
