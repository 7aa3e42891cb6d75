"""The toy model takes the long-context memory options (DESIGN §7): ``cache``, ``decay``, ``state``,
``beta`` on every hybrid kernel, checked by :class:`~sketchlab.attention.options.AttentionOptions`,
the kernel's :class:`~sketchlab.attention.options.FarParams` trained with it, and the memory path
in the forward pass and in the decoding state (``generate``, ``forward_step``).

Checks: decoding == the full forward (token by token and split anywhere) and ``generate`` == greedy
by full forward passes, for each mechanism; ``decay=1.0`` is the plain hybrid bit for bit, and a
learned decay pinned at γ = 1 (float64) equals it to rounding, for every kernel (the memory path sees
the features, scales and gate the plain path uses); DeltaNet-style identity features enter the
delta rule as they are (no self-tensoring: ``M = D``), against the float64 definition; the new
parameters get gradients and sit in the optimiser's "kernel" group; ``sketchlab train --state
delta ...`` trains and records the options; bad options are refused by AttentionOptions' rules.

Tolerances: float64 1e-10 (chunked delta rule / decayed recurrence against the same run split
differently, ~1e-15 relative over T <= 12).
"""

import json

import pytest
import torch

from sketchlab.attention.memory import MemoryState, memory_attention_naive
from sketchlab.attention.options import FarParams
from sketchlab.tasks import TransformerConfig, TransformerLM, generate, kernel_modules
from sketchlab.tasks.attention import input_scale

H, D, V = 2, 8, 17
TOL = 1e-10


def tiny(attention, options, *, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=V, d_model=H * D, n_heads=H, n_layers=layers, mlp_ratio=2, short_conv=2,
                            attention=attention, attention_options=options, rope_base=None)
    return TransformerLM(cfg).double()


def _perturb_far(model, seed=1):
    """Move the gates, decays and β off their starts (a trained model's values), so every term counts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".far." in name or name.endswith("attn.gate"):
                p.add_(0.7 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _tokens(B=2, T=12, seed=3):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


LLOPS = {"p": 2, "m": 3, "affine": True, "non_negative": True}
MECHANISMS = [  # (attention, options): each mechanism, and the kernels it is wired to
    ("llops", {**LLOPS, "state": "delta"}),
    ("llops", {**LLOPS, "window": 3, "sinks": 1, "state": "delta", "beta": "input", "decay": "input"}),
    ("llops", {**LLOPS, "window": 3, "sinks": 1, "cache": 2}),
    ("llops", {**LLOPS, "decay": 0.8}),
    ("based-taylor", {"dim": 3, "window": 2, "decay": "head", "cache": 2}),
    ("psf-random", {"p": 2, "m": 9, "window": 2, "state": "delta"}),
    ("hedgehog", {"m": 6, "window": 2, "sinks": 1, "cache": 3, "decay": "input"}),
    ("psf-learned", {"p": 4, "m": 9, "decay": "head"}),
    ("identity", {"state": "delta"}),
    ("identity", {"window": 2, "state": "delta", "beta": "input", "cache": 1}),
]


def _id(case):
    attention, options = case
    return attention + "-" + "-".join(f"{k}={v}" for k, v in options.items() if k not in LLOPS)


@pytest.mark.parametrize("attention, options", MECHANISMS, ids=[_id(c) for c in MECHANISMS])
def test_decoding_equals_the_full_forward(attention, options):
    model = tiny(attention, options)
    _perturb_far(model)
    assert model.blocks[0].attention.attn.options.memory
    x = _tokens()
    model.eval()
    with torch.no_grad():
        full = model(x)
        # token by token
        logits, cache, rows = None, None, []
        for t in range(x.shape[1]):
            logits, cache = model.forward_step(x[:, t:t + 1], cache)
            rows.append(logits)
        assert (torch.cat(rows, 1) - full).abs().max() < TOL
        assert isinstance(cache[0]["attn"], MemoryState)
        # split anywhere
        a, cache = model.forward_step(x[:, :5])
        b, _ = model.forward_step(x[:, 5:], cache)
        assert (torch.cat([a, b], 1) - full).abs().max() < TOL
        # generate == greedy by full forward passes
        out = generate(model, x[:, :4], 6)
        seq = x[:, :4]
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
        assert torch.equal(out, seq)


def test_the_decoding_state_is_flat_in_the_context_length():
    from sketchlab.tasks.model import cache_nbytes

    model = tiny("llops", {**LLOPS, "window": 3, "sinks": 1, "cache": 2, "state": "delta"})
    model.eval()
    sizes = []
    with torch.no_grad():
        _, cache = model.forward_step(_tokens(T=8))
        for t in range(24):
            _, cache = model.forward_step(_tokens(T=1, seed=t), cache)
            sizes.append(cache_nbytes(cache))
    assert len(set(sizes)) == 1


HYBRIDS = [
    ("llops", {**LLOPS, "window": 3, "sinks": 1}),
    ("llops", {"p": 2, "m": 4, "window": 3}),  # neither affine nor self-tensored
    ("based-taylor", {"dim": 3, "window": 2, "sinks": 1}),
    ("based-expand", {"p": 2, "dim": 3, "window": 2, "local": "poly"}),
    ("psf-random", {"p": 2, "m": 9, "window": 2}),
    ("hedgehog", {"m": 6, "window": 2, "sinks": 1}),
    ("psf-learned", {"p": 4, "m": 9, "window": 2}),
    ("identity", {"window": 2}),
    ("dpfp", {"window": 2, "nu": 1}),
    ("identity", {}),  # pure linear attention
]


@pytest.mark.parametrize("attention, options", HYBRIDS, ids=[_id(c) for c in HYBRIDS])
def test_decay_one_is_the_plain_hybrid(attention, options):
    x = _tokens()
    plain = tiny(attention, options)
    _perturb_far(plain)
    one = tiny(attention, {**options, "decay": 1})
    assert one.config.attention_options["decay"] == 1.0 and not kernel_modules(one)[0].options.memory
    assert type(one.config.attention_options["decay"]) is float  # completed by AttentionOptions: 1 -> 1.0
    one.load_state_dict(plain.state_dict())  # the same tensors: decay 1 adds none
    assert torch.equal(one(x), plain(x))
    # a learned decay pinned at γ = 1 (σ(40) = 1 in float64) runs the memory path: the same numbers to rounding
    pinned = tiny(attention, {**options, "decay": "head"})
    state = {**plain.state_dict(), **{k: v for k, v in pinned.state_dict().items() if ".far." in k}}
    pinned.load_state_dict(state)
    with torch.no_grad():
        for kernel in kernel_modules(pinned):
            kernel.far.decay_bias.fill_(40.0)
    assert kernel_modules(pinned)[0].options.memory
    assert (pinned(x) - plain(x)).abs().max() < TOL


def test_identity_features_enter_the_delta_rule_as_they_are():
    """DeltaNet's φ(x) = x (M = D, L2-normalised inside the rule), not self-tensored, against the definition."""
    model = tiny("identity", {"window": 2, "state": "delta", "beta": "input"}, layers=1)
    _perturb_far(model)
    kernel = kernel_modules(model)[0]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 9, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    s = input_scale(D)
    want = memory_attention_naive(q * s, k * s, v, q * s, k * s, options=kernel.options, params=kernel.far,
                                  gate=kernel.gate)  # features: the scaled q, k themselves
    assert (kernel(q, k, v) - want).abs().max() < TOL
    _, state = kernel.step(q, k, v, None)
    assert state.S.shape == (2, H, D, D)  # M = D: the far state is D × Dv, DeltaNet's


def test_new_parameters_get_gradients_and_sit_in_the_kernel_group(monkeypatch):
    from sketchlab.tasks import MQARConfig, train_mqar

    opts = {**LLOPS, "window": 3, "sinks": 1, "cache": 2, "decay": "input", "state": "delta", "beta": "input"}
    model = tiny("llops", opts).float()
    far = {name: p for name, p in model.named_parameters() if ".far." in name}
    assert sorted(n.split(".far.")[1] for n in far) == sorted(["decay_bias", "decay_weight", "beta_bias",
                                                               "beta_weight"] * 2)
    assert all(isinstance(kernel.far, FarParams) for kernel in kernel_modules(model))
    model(_tokens()).square().mean().backward()
    for name, p in far.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad()
    made = []

    class Capture(torch.optim.AdamW):
        def __init__(self, groups, **kw):
            made.append(groups)
            super().__init__(groups, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", Capture)
    before = {name: p.detach().clone() for name, p in far.items()}
    train_mqar(model, [(MQARConfig(V, 2, 12), 3)], batch_size=4, lr=1e-2, kernel_lr=0.5, warmup=0, eval_every=0,
               eval_sequences=4, progress=False)
    (groups,) = made
    kernel_group = [g for g in groups if g["lr_factor"] == 0.5]
    assert len(kernel_group) == 1
    ids = {id(p) for p in kernel_group[0]["params"]}
    assert all(id(p) in ids for p in far.values())
    assert all(not torch.equal(before[name], p) for name, p in far.items())  # trained


def test_options_are_checked_by_attention_options():
    with pytest.raises(ValueError, match="cache=2 needs window >= 1"):
        TransformerConfig(vocab_size=V, attention="llops", attention_options={"cache": 2})
    with pytest.raises(ValueError, match="state must be one of"):
        TransformerConfig(vocab_size=V, attention="hedgehog", attention_options={"state": "gated"})
    with pytest.raises(ValueError, match=r"decay \(a fixed decay per step\) must be a finite number > 0.0 and <= 1.0, got 1.5"):
        TransformerConfig(vocab_size=V, attention="based-taylor", attention_options={"decay": 1.5})
    with pytest.raises(ValueError, match="state='delta' mixes two normalised parts"):
        TransformerConfig(vocab_size=V, attention="identity", attention_options={"state": "delta", "normalize": "none"})
    with pytest.raises(ValueError, match="beta must be one of"):
        TransformerConfig(vocab_size=V, attention="psf-random", attention_options={"state": "delta", "beta": 2})
    cfg = TransformerConfig(vocab_size=V, attention="llops", attention_options={"p": 2})
    assert {k: cfg.attention_options[k] for k in ("cache", "decay", "state", "beta")} == {
        "cache": 0, "decay": None, "state": "additive", "beta": "head"}  # completed: today's hybrid
    # "poly" and "softmax" take no memory options
    with pytest.raises(ValueError, match=r"unknown attention option\(s\) \['state'\]"):
        TransformerConfig(vocab_size=V, attention="poly", attention_options={"state": "delta"})


def test_sketchlab_train_takes_the_memory_flags(tmp_path, capsys):
    from sketchlab.cli import main

    common = ["--task", "mqar", "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--seq-len", "16",
              "--num-pairs", "2", "--batch-size", "4", "--eval-sequences", "4", "--eval-every", "0", "--no-progress",
              "--steps", "2"]
    out = tmp_path / "delta"
    assert main(["train", "--attention", "llops", "--state", "delta", "--beta", "input", "--decay", "head",
                 "--window", "4", "--sinks", "1", "--cache", "2", *common, "--out", str(out)]) == 0
    options = json.loads((out / "config.json").read_text())["config"]["attention_options"]
    assert {k: options[k] for k in ("state", "beta", "decay", "window", "sinks", "cache")} == {
        "state": "delta", "beta": "input", "decay": "head", "window": 4, "sinks": 1, "cache": 2}
    summary = json.loads((out / "train.json").read_text())
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    out = tmp_path / "fixed"
    assert main(["train", "--attention", "identity", "--state", "delta", "--decay", "0.9", *common,
                 "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["config"]["attention_options"]["decay"] == 0.9
    capsys.readouterr()
    for flags, message in ((["--cache", "4"], "cache=4 needs window >= 1"),
                           (["--decay", "1.5"], "got 1.5"),
                           (["--decay", "sometimes"], "decay must be one of ['head', 'input'], got 'sometimes'")):
        assert main(["train", "--attention", "llops", *flags, *common, "--out", str(tmp_path / "bad")]) == 2
        assert message in capsys.readouterr().err
    assert main(["train", "--attention", "llops", "--state", "gated", *common, "--out", str(tmp_path / "bad")]) == 2
    assert "argument --state: invalid choice: 'gated'" in capsys.readouterr().err
