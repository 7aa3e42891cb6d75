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


def test_configure_optimizers_groups_the_models_own_kernel_parameters():
    """The model names its kernel parameters (every ``blocks[i].attention.attn``'s); the groups partition the
    parameters: decayed matrices, undecayed embedding/norms/biases, and the kernels at ``kernel_lr``."""
    model = _model("llops", {"p": 2, "m": 4, "window": 3})  # Θ and the hybrid's gate
    kernel = [p for block in model.blocks for p in block.attention.attn.parameters()]
    assert len(kernel) == 3 and [id(p) for p in model.kernel_parameters()] == [id(p) for p in kernel]
    opt = model.configure_optimizers(lr=0.02, weight_decay=0.3, kernel_lr=0.1)
    decay, other, kern = opt.param_groups
    assert [id(p) for p in kern["params"]] == [id(p) for p in kernel]
    assert (kern["weight_decay"], kern["lr_factor"], kern["lr"]) == (0.0, 0.1, 0.02)
    assert (decay["weight_decay"], decay["lr_factor"], other["weight_decay"], other["lr_factor"]) == (0.3, 1.0, 0.0, 1.0)
    assert any(p is model.head.weight for p in decay["params"]) and any(p is model.embed.weight for p in other["params"])
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 or p is model.embed.weight for p in other["params"])
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters()) and len(set(ids)) == len(ids)
    assert opt.defaults["betas"] == (0.9, 0.98)
    soft = _model().configure_optimizers(lr=0.01, weight_decay=0.1)
    assert len(soft.param_groups) == 2 and _model().kernel_parameters() == []  # a softmax model: no kernel group
    with pytest.raises(ValueError, match=r"kernel_lr must be a finite number > 0, got 0"):
        model.configure_optimizers(lr=0.01, weight_decay=0.0, kernel_lr=0)


def test_text_training_runs_the_same_schedule_and_groups(recorder):
    """train_lm steps through the one loop: every step's rate is lr_at of its step, times each group's factor."""
    from sketchlab.tasks.text import train_lm
    from sketchlab.tasks.train import lr_at

    model = _model("llops", {"p": 2, "m": 4})
    data = torch.randint(0, 21, (400,), generator=torch.Generator().manual_seed(0))
    train_lm(model, data, data, steps=5, seq_len=8, batch_size=2, lr=0.01, warmup=2, kernel_lr=0.25, weight_decay=0.3,
             eval_every=5, eval_windows=2)
    assert len(recorder.log) == 5
    for s, groups in enumerate(recorder.log):
        want = 0.01 * min(1.0, (s + 1) / 2) * 0.5 * (1 + math.cos(math.pi * s / 5))  # by hand, as above
        assert lr_at(s, lr=0.01, warmup=2, total=5) == pytest.approx(want, rel=1e-12)
        assert [g[0] for g in groups] == pytest.approx([want, want, 0.25 * want], rel=1e-12)
        assert [g[1] for g in groups] == [0.3, 0.0, 0.0]
