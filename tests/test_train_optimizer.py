"""The optimiser settings of train_mqar, each against an independent value: the learning rate of every
step (linear warm-up then cosine), which parameters AdamW decays (never Θ, embeddings, norms,
biases), and gradient clipping (the update with a tiny clip is a tiny update)."""

import math

import pytest
import torch

from sketchlab.tasks import MQARConfig, TransformerConfig, TransformerLM, train_mqar

TASK = MQARConfig(21, 3, 12)


def _model(attention="softmax", options=None, seed=0):
    torch.manual_seed(seed)
    return TransformerLM(TransformerConfig(vocab_size=21, d_model=16, n_heads=2, n_layers=1, mlp_ratio=2,
                                           short_conv=2, attention=attention, attention_options=options or {}))


class _Recorder(torch.optim.AdamW):
    """AdamW that records, at each step, every group's lr and weight decay with its parameters."""

    log: list = []

    def step(self, closure=None):
        _Recorder.log.append([(g["lr"], g["weight_decay"], [id(p) for p in g["params"]]) for g in self.param_groups])
        return super().step(closure)


@pytest.fixture
def recorder(monkeypatch):
    _Recorder.log = []
    monkeypatch.setattr(torch.optim, "AdamW", _Recorder)
    return _Recorder


@pytest.mark.parametrize("warmup", [0, 1, 3, 20])
def test_learning_rate_of_every_step(recorder, warmup):
    steps, lr = 8, 0.01
    train_mqar(_model(), [(TASK, steps)], batch_size=2, lr=lr, warmup=warmup, seed=0, eval_sequences=2,
               progress=False)
    got = [entry[0][0] for entry in recorder.log]
    # by hand: s = 0 … 7, ramp (s+1)/warmup capped at 1 (no ramp when warmup = 0), cosine over the 8 steps
    want = [lr * (min(1.0, (s + 1) / warmup) if warmup else 1.0) * 0.5 * (1 + math.cos(math.pi * s / steps))
            for s in range(steps)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert all(len({g[0] for g in entry}) == 1 for entry in recorder.log)  # every group the same lr


def test_weight_decay_spares_theta_embeddings_norms_and_biases(recorder):
    model = _model("llops", {"p": 2, "m": 4})
    train_mqar(model, [(TASK, 1)], batch_size=2, lr=1e-3, weight_decay=0.3, warmup=0, seed=0, eval_sequences=2,
               progress=False)
    decay_of = {pid: wd for _, wd, ids in recorder.log[0] for pid in ids}
    names = dict(model.named_parameters())
    assert set(decay_of) == {id(p) for p in names.values()}  # every parameter in exactly one group
    thetas = [n for n in names if ".attention.attn." in n]
    assert thetas and all(decay_of[id(names[n])] == 0.0 for n in thetas), thetas
    for name, p in names.items():
        spared = p.ndim < 2 or "embed" in name or ".attention.attn." in name
        assert decay_of[id(p)] == (0.0 if spared else 0.3), name
    assert any(decay_of[id(p)] == 0.3 for n, p in names.items() if n.endswith("q_proj.weight"))


def test_gradient_clipping_bounds_the_update():
    """AdamW's step is m/(√v + ε) with ε = 1e-8: a gradient clipped to norm 1e-12 moves a parameter by at most
    lr · 1e-12/1e-8 = lr · 1e-4, while the unclipped first step moves the largest one by ~lr (|m/√v| = 1)."""
    lr = 1e-2

    def largest_change(clip):
        model = _model()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        train_mqar(model, [(TASK, 1)], batch_size=2, lr=lr, warmup=0, clip=clip, weight_decay=0.0, seed=0,
                   eval_sequences=2, progress=False)
        return max(float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters())

    # one step of the cosine schedule over one step: lr_at(0) = lr
    assert largest_change(1e-12) <= lr * 1.1e-4
    assert largest_change(None) == pytest.approx(lr, rel=1e-3)
