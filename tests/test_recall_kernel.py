"""The kernel-only recall harness (issue 41, Build 4): Zoology's continuous MQAR generator decoded back to its
pairs, the attention matrix a kernel applies (linear in v) against exact softmax and polynomial attention,
one run's record, and the frontier grid and report on it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from sketchlab.tasks import IGNORE_INDEX, TransformerConfig
from sketchlab.tasks import frontier as fr
from sketchlab.tasks.inits import init_llops
from sketchlab.tasks.recall_kernel import (
    RecallModel,
    attention_matrix,
    attention_matrix_errors,
    continuous_mqar,
    spherical_embeddings,
    train_recall,
)
from sketchlab.tasks.state_size import layer_state_bytes


# ------------------------------------------------------------------------------------------------ the generator
def test_continuous_mqar_is_the_hand_made_layout():
    """With one-hot embeddings (V = 12, d = 12) every token decodes to its ids: P pair tokens ``[key | value]``
    with distinct keys and values, then the P keys again as ``[key | 0]`` in another order, each query's
    target the value its key was shown with."""
    V, P, B = 12, 4, 50
    inputs, targets = continuous_mqar(torch.eye(V), P, B, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == (B, 2 * P, 2 * V) and targets.shape == (B, 2 * P)
    assert (targets[:, :P] == IGNORE_INDEX).all()
    orders_differ = 0
    for b in range(B):
        pair_keys = inputs[b, :P, :V].argmax(-1)  # key rows 0 … 5
        pair_values = inputs[b, :P, V:].argmax(-1) - V // 2  # value rows 6 … 11 -> 0 … 5
        assert (inputs[b, :P, :V].sum(-1) == 1).all() and (inputs[b, :P, V:].sum(-1) == 1).all()
        assert (pair_keys < V // 2).all() and (inputs[b, :P, V:].argmax(-1) >= V // 2).all()
        assert len(set(pair_keys.tolist())) == P and len(set(pair_values.tolist())) == P
        paired = dict(zip(pair_keys.tolist(), pair_values.tolist()))
        query_keys = inputs[b, P:, :V].argmax(-1)
        assert (inputs[b, P:, V:] == 0).all() and sorted(query_keys.tolist()) == sorted(paired)
        assert targets[b, P:].tolist() == [paired[k] for k in query_keys.tolist()]
        orders_differ += query_keys.tolist() != pair_keys.tolist()
    assert orders_differ > B // 2  # the queries come in their own order (24 of 24 orders: equal by chance 1/24)


def test_continuous_mqar_refuses_more_pairs_than_keys():
    with pytest.raises(ValueError, match="num_pairs must be at most V/2 = 3"):
        continuous_mqar(torch.eye(6), 4, 1, generator=torch.Generator())


def test_spherical_embeddings_are_unit_rows():
    e = spherical_embeddings(50, 8, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(e.norm(dim=-1), torch.ones(50), atol=1e-6)


# ------------------------------------------------------------------------------------------------ the model
def _config(attention="softmax", **options):
    return TransformerConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=1, mlp_ratio=2, short_conv=0,
                             attention=attention, attention_options=options, rope_base=None)


def test_the_embeddings_are_frozen_and_the_model_has_one_layer():
    model = RecallModel(_config(), embed_seed=3)
    assert "embeddings" not in dict(model.named_parameters()) and "embeddings" in model.state_dict()
    assert torch.equal(model.embeddings, RecallModel(_config(), embed_seed=3).embeddings)
    with pytest.raises(ValueError, match="n_layers=1 and rope_base=None"):
        RecallModel(replace(_config(), n_layers=2))


def _qk(T=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, T, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize("attention,options", [("softmax", {}), ("sliding-window", {"window": 3}),
                                               ("llops", {"m": 6}), ("llops", {"m": 6, "window": 3}),
                                               ("hedgehog", {"m": 8}), ("poly", {"p": 2})])
def test_attention_matrix_times_v_is_the_kernels_output(attention, options):
    """The kernels here are linear in v: ``A v`` equals ``kernel(q, k, v)`` to float64 round-off, and ``A`` is
    causal."""
    kernel = RecallModel(_config(attention, **options)).double().blocks[0].attention.attn
    q, k, v = _qk()
    A = attention_matrix(kernel, q, k)  # [B, H, T, T]
    with torch.no_grad():
        out = kernel(q, k, v)  # [B, T, H, D]
    assert torch.allclose(torch.einsum("bhts,bshd->bthd", A, v), out, atol=1e-12, rtol=1e-10)
    assert (A.triu(1) == 0).all()


def test_attention_matrix_of_a_memory_kernel_is_none():
    kernel = RecallModel(_config("llops", m=4, state="delta")).blocks[0].attention.attn
    q, k, _ = _qk()
    assert attention_matrix(kernel, q.float(), k.float()) is None


@pytest.mark.parametrize("attention,options,zero", [("softmax", {}, "softmax"), ("poly", {"p": 2}, "poly2")])
def test_attention_errors_vanish_against_the_kernel_they_compute(attention, options, zero):
    """Softmax attention is exactly the softmax reference (logits qᵀk/√D), exact degree-2 attention exactly the
    polynomial one (s = qᵀk/√D): error at float64 round-off; the other reference is far (> 0.05). The
    projections are scaled up from their N(0, 0.02²) start, so that the scores dwarf the kernel's ε = 1e-6 (its relative effect ε / Σ s² is then < 1e-10)."""
    model = RecallModel(_config(attention, **options)).double()
    with torch.no_grad():
        for proj in (model.blocks[0].attention.q_proj, model.blocks[0].attention.k_proj, model.in_proj):
            proj.weight.mul_(1000.0)
    inputs, _ = continuous_mqar(model.embeddings, 6, 3, generator=torch.Generator().manual_seed(2))
    errors = attention_matrix_errors(model, inputs)
    other = {"softmax": "poly2", "poly2": "softmax"}[zero]
    assert errors[zero] < 1e-10 and errors[other] > 0.05, errors


# ------------------------------------------------------------------------------------------------ runs and the grid
KTINY = fr.KernelProtocol(vocab=64, train_pairs=((4, 2), (8, 4)), train_weights=(1, 1), test_pairs=((4, 2), (8, 4)),
                          d_model=16, steps=3, batch=4, warmup=1, eval_sequences=4)
POINTS = [*fr.method_points("softmax"), *fr.method_points("based", [2]), *fr.method_points("deltanet", [2])]
GRID = {"lrs": [1e-3, 1e-2], "seeds": [0, 1]}


def test_a_run_record_holds_its_scores_state_and_attention_error():
    point = fr.method_points("based", [2])[0]
    record = fr.train_point(point, KTINY, 1e-2, 0)
    assert record == {**fr.train_point(point, KTINY, 1e-2, 0), "seconds": record["seconds"]}  # deterministic
    assert record["state_bytes"] == layer_state_bytes(point.config(KTINY), seq_len=KTINY.max_len)
    assert [(s["seq_len"], s["num_pairs"], s["queries"]) for s in record["slices"]] == [(4, 2, 8), (8, 4, 16)]
    assert set(record["attention_error"]) == {"softmax", "poly2"} and record["key"] == fr.run_key(point, KTINY, 1e-2, 0)
    assert fr.train_point(fr.method_points("deltanet", [2])[0], KTINY, 1e-2, 0)["attention_error"] is None


def test_softmax_learns_the_kernel_harness():
    """Chance is 1/32 (V/2 = 32 values); 150 steps of softmax attention recall P = 2 and 4 pairs to over 0.5
    (it reaches ~1.0: the harness trains)."""
    protocol = replace(KTINY, steps=150, batch=16, warmup=10, eval_sequences=32)
    assert fr.train_point(fr.method_points("softmax")[0], protocol, 1e-2, 0)["score"] > 0.5


@pytest.mark.parametrize("method", ["llops-p4-based-frozen", "llops-p4-frozen", "llops-taylor-frozen",
                                    "llops-p4-based-lr1"])
def test_kernel_lr_zero_freezes_the_kernel_at_its_start(method):
    """The ablation's frozen methods: after training, Θ equals its start exactly while the projections moved;
    a method that trains Θ (``llops-p4-based-lr1``) moves it."""
    point = fr.method_points(method, [16 if "p4" in method else 21])[0]  # m = 2^4; 1 + 4 + 4²
    assert (point.kernel_lr == 0) == method.endswith("-frozen") and point.init == ("random" if method ==
                                                                                   "llops-p4-frozen" else "based")
    torch.manual_seed(0)
    model = RecallModel(point.config(KTINY))
    init_llops(model, point.init, seed=0)
    start = [p.detach().clone() for p in model.kernel_parameters()]
    projection = model.blocks[0].attention.q_proj.weight.detach().clone()
    train_recall(model, replace(KTINY, steps=5), lr=1e-2, seed=0, kernel_lr=point.kernel_lr)
    kept = [torch.equal(a, b) for a, b in zip(start, model.kernel_parameters(), strict=True)]
    assert start and kept == [point.kernel_lr == 0] * len(start)
    assert not torch.equal(projection, model.blocks[0].attention.q_proj.weight)
    if point.kernel_lr == 0:  # no group holds the frozen kernel
        opt = model.configure_optimizers(lr=1e-2, weight_decay=0.1, kernel_lr=0)
        held = {id(p) for g in opt.param_groups for p in g["params"]}
        assert len(opt.param_groups) == 2 and not held & {id(p) for p in model.kernel_parameters()}


@pytest.mark.parametrize("method, size, features", [("llops-gated-delta", 8, 64), ("psf-learned-gated-delta", 16, 16)])
def test_gated_delta_methods_are_their_map_under_the_gated_rule(method, size, features):
    """LLoPS's and PSF-learned's features under the gated delta rule: β and the decay from the input, the state
    features × D (Zoology's d_k × d_v, no normaliser), and a run on the harness has no attention matrix."""
    point = fr.method_points(method, [size])[0]
    assert {k: point.options[k] for k in ("state", "beta", "decay")} == {"state": "delta", "beta": "input",
                                                                         "decay": "input"}
    assert layer_state_bytes(point.config(fr.KERNEL_CPU)) == 4 * features * 64
    assert fr.train_point(point, KTINY, 1e-2, 0)["attention_error"] is None


def test_kernel_protocol_checks_its_pairs():
    with pytest.raises(ValueError, match="T = 2P"):
        fr.KernelProtocol(train_pairs=((8, 3),), train_weights=(1,))
    with pytest.raises(ValueError, match="P <= vocab/2 = 8"):
        fr.KernelProtocol(vocab=16, test_pairs=((32, 16),))


def test_the_grid_and_its_report_on_the_kernel_harness(tmp_path):
    runs = fr.run_frontier(POINTS, KTINY, work=tmp_path / "runs", progress=False, **GRID)
    assert len(runs) == len(POINTS) * 3
    first = fr.frontier_report(runs, POINTS, KTINY, out=tmp_path / "a" / "rep", command="cmd", **GRID)
    again = fr.frontier_report(fr.load_runs(tmp_path / "runs"), POINTS, KTINY, out=tmp_path / "b" / "rep",
                               command="cmd", **GRID)
    assert first == again
    text = (tmp_path / "b" / "rep.md").read_text()
    assert "kernel-only harness" in text and "attention error vs softmax" in text
    rows = {r["method"]: r for r in json.loads((tmp_path / "b" / "rep.json").read_text())["points"]}
    assert rows["deltanet"]["attention_error"] is None
    assert rows["softmax"]["attention_error"]["softmax"] < 1e-5  # float32 softmax against the float64 reference
    assert "| — | — |" in next(line for line in text.splitlines() if line.startswith("| deltanet"))


def test_cli_refuses_random_non_queries_with_the_kernel_preset(tmp_path, capsys):
    from sketchlab.cli import main

    code = main(["frontier", "--preset", "kernel", "--random-non-queries", "--methods", "based", "--work",
                 str(tmp_path / "w"), "--out", str(tmp_path / "r"), "--no-progress"])
    assert code == 2 and "kernel-only harness" in capsys.readouterr().err
