"""Training loop (resume, identity checks, atomic checkpoints), the sketched kernels of the model
registry, and the LLoPS initialisations (random, BASED, exported Θ)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from attention_calls import run_llops_naive

import sketchlab.tasks.checkpoint as checkpoint_module
import sketchlab.tasks.train as train_module
from sketchlab.attention import (
    poly_attention_naive,
)
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.featuremaps.based import taylor_features_naive
from sketchlab.featuremaps.psf_random import psf_features_naive
from sketchlab.io import save_theta
from sketchlab.tasks import (
    MQARConfig,
    TransformerConfig,
    TransformerLM,
    based_init_dim,
    copy_shared_weights,
    init_llops,
    kernel_modules,
    latest_checkpoint,
    mqar_batch,
    train_mqar,
)
from sketchlab.tasks.attention import input_scale

SHA = "0" * 64


def tiny(attention="softmax", options=None, layers=1, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=21, d_model=16, n_heads=2, n_layers=layers, mlp_ratio=2, short_conv=2,
                            attention=attention, attention_options=options or {}, **kw)
    return TransformerLM(cfg)


TASK = MQARConfig(21, 3, 12)
KW = dict(batch_size=4, lr=1e-2, warmup=2, seed=1, eval_sequences=8, eval_every=3, progress=False)


# ---------------------------------------------------------------------------------------------
# resume


def test_interrupted_run_resumes_to_the_identical_loss_curve(tmp_path, monkeypatch):
    stages = [(TASK, 5), (MQARConfig(21, 4, 14), 5)]
    full = train_mqar(tiny(), stages, out=tmp_path / "a", checkpoint_every=3, **KW)
    assert len(full.losses) == 10 and full.resumed_from is None

    calls = {"n": 0}
    real = train_module.mqar_batch

    def interrupting(task, batch, **kwargs):  # the 8th training batch never arrives: killed in step 8
        calls["n"] += batch == KW["batch_size"]  # (held-out batches have 8 sequences)
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return real(task, batch, **kwargs)

    monkeypatch.setattr(train_module, "mqar_batch", interrupting)
    with pytest.raises(KeyboardInterrupt):
        train_mqar(tiny(), stages, out=tmp_path / "b", checkpoint_every=3, **KW)
    monkeypatch.setattr(train_module, "mqar_batch", real)
    assert latest_checkpoint(tmp_path / "b").name == "step-00000006"

    # a differently initialised model: everything must come from the checkpoint
    model = tiny(seed=7)
    resumed = train_mqar(model, stages, out=tmp_path / "b", checkpoint_every=3, **KW)
    assert resumed.resumed_from == 6
    # one thread, deterministic algorithms, same data stream: bit-identical, not merely close
    assert resumed.losses == full.losses
    assert resumed.evals == full.evals and resumed.history == full.history
    ref = tiny()
    train_mqar(ref, stages, **{**KW, "eval_every": 0})
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)

    # a finished run resumes to its end without training
    again = train_mqar(tiny(seed=9), stages, out=tmp_path / "b", checkpoint_every=3, **KW)
    assert again.resumed_from == 10 and again.losses == full.losses


def test_checkpoint_of_another_config_is_refused(tmp_path):
    train_mqar(tiny(), [(TASK, 2)], out=tmp_path, **KW)
    with pytest.raises(ValueError, match=r"another run configuration.*lr: 0\.01 in the checkpoint, 0\.02 in this run"):
        train_mqar(tiny(), [(TASK, 2)], out=tmp_path, **{**KW, "lr": 2e-2})
    with pytest.raises(ValueError, match=r"another run configuration.*model: .*\"attention\": \"softmax\""):
        train_mqar(tiny("poly"), [(TASK, 2)], out=tmp_path, **KW)
    with pytest.raises(ValueError, match=r"another run configuration.*run_info"):
        train_mqar(tiny(), [(TASK, 2)], out=tmp_path, run_info={"init": "based"}, **KW)


def test_a_checkpoint_from_before_an_attention_option_existed_still_resumes(tmp_path):
    # checkpoints written before `affine` existed hold llops options without it: completed with its
    # default (false) they are the same run, and resume; a real difference is still refused
    train_mqar(tiny("llops", {"p": 2, "m": 6}), [(TASK, 2)], out=tmp_path, checkpoint_every=2, **KW)
    state_file = latest_checkpoint(tmp_path) / "state.json"
    state = json.loads(state_file.read_text())
    assert state["identity"]["model"]["attention_options"].pop("affine") is False
    state_file.write_text(json.dumps(state))
    again = train_mqar(tiny("llops", {"p": 2, "m": 6}), [(TASK, 2)], out=tmp_path, checkpoint_every=2, **KW)
    assert again.resumed_from == 2
    with pytest.raises(ValueError, match=r"another run configuration.*\"affine\": true"):
        train_mqar(tiny("llops", {"p": 2, "m": 6, "affine": True}), [(TASK, 2)], out=tmp_path, checkpoint_every=2, **KW)


def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    real = checkpoint_module._fill_checkpoint
    count = {"n": 0}

    def failing(tmp, *args):
        count["n"] += 1
        if count["n"] == 2:  # the second checkpoint (step 4) dies half-written
            (tmp / "model.safetensors").write_bytes(b"partial")
            raise OSError("disk full")
        return real(tmp, *args)

    monkeypatch.setattr(checkpoint_module, "_fill_checkpoint", failing)
    with pytest.raises(OSError, match="disk full"):
        train_mqar(tiny(), [(TASK, 6)], out=tmp_path, checkpoint_every=2, **KW)
    monkeypatch.setattr(checkpoint_module, "_fill_checkpoint", real)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000002"]  # no temporary left
    resumed = train_mqar(tiny(), [(TASK, 6)], out=tmp_path, checkpoint_every=2, **KW)
    assert resumed.resumed_from == 2
    assert resumed.losses == train_mqar(tiny(), [(TASK, 6)], **KW).losses


def test_checkpoints_are_written_whole_pruned_and_a_killed_writers_staging_ignored(tmp_path):
    # a writer killed outright (SIGKILL) leaves its staging directory beside the step directories: the
    # reader never takes it for a checkpoint, the next writer removes it; only the newest keep_checkpoints stay
    stale = tmp_path / "checkpoints" / ".step-00000004.0123456789ab.partial"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) is None
    train_mqar(tiny(), [(TASK, 6)], out=tmp_path, checkpoint_every=2, keep_checkpoints=2, **KW)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]
    for step_dir in (tmp_path / "checkpoints").iterdir():
        assert sorted(p.name for p in step_dir.iterdir()) == ["model.safetensors", "state.json", "trainer.safetensors"]
    # rewriting an existing step (a crash between its rename and the next step) replaces it whole
    model = tiny(seed=4)
    opt = model.configure_optimizers(lr=1e-2, weight_decay=0.0)
    state = {"identity": {}, "history": [], "losses": [], "evals": []}
    checkpoint_module.write_training_state(tmp_path, 6, model, opt, torch.Generator(), state, 2)
    assert json.loads((tmp_path / "checkpoints" / "step-00000006" / "state.json").read_text())["losses"] == []
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]


def test_corrupt_checkpoint_is_reported(tmp_path):
    train_mqar(tiny(), [(TASK, 2)], out=tmp_path, **KW)
    state = tmp_path / "checkpoints" / "step-00000002" / "state.json"
    state.write_text("{")
    with pytest.raises(ValueError, match="step-00000002: unreadable state.json"):
        train_mqar(tiny(), [(TASK, 2)], out=tmp_path, **KW)
    state.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="is not a sketchlab.tasks.train/1 training state"):
        train_mqar(tiny(), [(TASK, 2)], out=tmp_path, **KW)


@pytest.mark.parametrize("kw,err,msg", [
    (dict(clip=0.0), ValueError, r"clip must be a finite number > 0, got 0\.0"),
    (dict(eval_every=-1), ValueError, r"eval_every must be an integer >= 0, got -1"),
    (dict(checkpoint_every=0), ValueError, r"checkpoint_every must be an integer >= 1, got 0"),
    (dict(keep_checkpoints=0), ValueError, r"keep_checkpoints must be an integer >= 1, got 0"),
    (dict(run_info=[1]), TypeError, r"run_info must be a JSON-serialisable dict, got list"),
    (dict(extra_loss=3), TypeError, r"extra_loss must be a callable"),
])
def test_train_rejects_bad_new_arguments(kw, err, msg):
    with pytest.raises(err, match=msg):
        train_mqar(tiny(), [(TASK, 1)], progress=False, **kw)


def test_diverging_loss_stops_with_floating_point_error():
    model = tiny()
    with torch.no_grad():
        model.head.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="training diverged: the loss at step 1 is nan"):
        train_mqar(model, [(TASK, 2)], progress=False)


def test_extra_loss_is_added_to_the_objective():
    # extra = c · loss-independent term: with plain SGD-free AdamW the curve changes; a zero extra does not
    base = train_mqar(tiny(), [(TASK, 3)], **KW).losses
    zero = train_mqar(tiny(), [(TASK, 3)], extra_loss=lambda: torch.zeros(()), **KW).losses
    assert zero == base
    model = tiny()
    pulled = train_mqar(model, [(TASK, 3)], extra_loss=lambda: 10 * model.head.weight.square().sum(), **KW).losses
    assert pulled[0] == base[0] and pulled[1:] != base[1:]


# ---------------------------------------------------------------------------------------------
# kernels of the registry == the attention package's float64 twins


def _qkv(B=2, T=9, H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, D, generator=g, dtype=torch.float64) for _ in range(3)]


def _rows(f, x, *args):
    """Apply a naive map that takes x[n, d] to x[..., d] row by row."""
    out = f(x.reshape(-1, x.shape[-1]), *args)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _kernel(attention, options, D=8):
    model = tiny(attention, options).double()
    return kernel_modules(model)[0], model


# float64 throughout: the chunked paths and the dense twins differ by summation order only,
# ~1e-15 relative; 1e-10 leaves room for the T=9 sums and degree-4 powers.
F64 = dict(rtol=1e-10, atol=1e-10)


def test_poly_kernel_is_exact_polynomial_attention_on_scaled_inputs():
    kernel, _ = _kernel("poly", {"p": 4})
    q, k, v = _qkv()
    s = input_scale(8)
    torch.testing.assert_close(kernel(q, k, v), poly_attention_naive(q * s, k * s, v, 4, causal=True), **F64)


def test_based_kernels_are_basedsketch_features_on_the_first_dim_coordinates():
    q, k, v = _qkv()
    kernel, _ = _kernel("based", {"dim": 4})  # Taylor: its own d'^{-1/4} scaling, no D^{-1/4}
    proj = torch.eye(8, 4, dtype=torch.float64)
    want = feature_attention_naive(_rows(taylor_features_naive, q, proj), _rows(taylor_features_naive, k, proj), v)
    torch.testing.assert_close(kernel(q, k, v), want, **F64)
    assert kernel.map_q.num_features == 1 + 4 + 16
    kernel, _ = _kernel("based", {"form": "expand", "p": 3, "dim": 4, "symmetric": False})
    s = input_scale(8)
    # (P q̃ · P k̃)^3 = (first-4-coordinate dot product)^3 of the scaled inputs
    want = poly_attention_naive(q[..., :4] * s, k[..., :4] * s, v, 3, causal=True)
    torch.testing.assert_close(kernel(q, k, v), want, **F64)


def test_psf_kernel_uses_its_stored_draw_per_layer_and_head():
    kernel, model = _kernel("psf", {"p": 4, "m": 16, "seed": 3})
    q, k, v = _qkv()
    s = input_scale(8)
    weights = kernel.map_q.weights
    fq = torch.stack([_rows(psf_features_naive, q[:, :, h] * s, [w[h] for w in weights], 2) for h in range(2)],
                     dim=2)  # [B, T, H, r]: the inner degree-2 sketch of each head
    fk = torch.stack([_rows(psf_features_naive, k[:, :, h] * s, [w[h] for w in weights], 2) for h in range(2)],
                     dim=2)
    want = feature_attention_naive(fq, fk, v, non_negative=True)
    torch.testing.assert_close(kernel(q, k, v), want, **F64)
    assert kernel.map_q.num_features == 16
    assert "blocks.0.attention.attn.map_q.weights_0" in model.state_dict()  # the draw is saved with the model
    other = tiny("psf", {"p": 4, "m": 16, "seed": 3}, layers=2)
    w0, w1 = (kernel_modules(other)[i].map_q.weights_0 for i in (0, 1))
    assert not torch.equal(w0, w1)  # layers draw from seed + layer
    assert not torch.equal(w0[0], w0[1])  # heads are independent draws


@pytest.mark.parametrize("non_negative", [False, True])
def test_llops_kernel_is_llops_attention_on_scaled_inputs(non_negative):
    kernel, _ = _kernel("llops", {"p": 2, "m": 5, "rank": 2, "non_negative": non_negative, "normalize": "none"})
    q, k, v = _qkv()
    with torch.no_grad():
        kernel.theta_k.normal_(generator=torch.Generator().manual_seed(1))
    s = input_scale(8)
    want = run_llops_naive(q * s, k * s, v, kernel.theta_q, kernel.theta_k, normalize="none",
                                 non_negative=non_negative)
    torch.testing.assert_close(kernel(q, k, v), want, **F64)


@pytest.mark.parametrize("attention,options,msg", [
    ("poly", {"p": 0}, r"attention 'poly': p must be an integer >= 1, got 0"),
    ("poly", {"normalize": "max"}, r"normalize must be one of \['none', 'sum'\], got 'max'"),
    ("based", {"form": "taylor", "p": 3}, r"the Taylor map is BASED's degree-2 expansion: p must be 2, got 3"),
    ("based", {"dim": 9}, r"dim \(BASED's d'\) must be <= head_dim=8, got 9"),
    ("psf", {"p": 3}, r"non_negative=True needs an even degree p, got p=3"),
    ("psf", {"non_negative": 1}, r"attention 'psf-random': non_negative must be a bool, got 1"),
    ("llops", {"eps": -1e-6}, r"eps must be a finite number >= 0\.0, got -1e-06"),
    ("llops", {"backend": "cuda"}, r"backend must be one of \['auto', 'triton', 'torch', 'reference'\], got 'cuda'"),
    ("llops", {"degree": 2}, r"unknown attention option\(s\) \['degree'\] for attention 'llops'; it takes"),
    ("llops", {"affine": 1}, r"attention 'llops': affine must be a bool, got 1"),
    ("llops", {"affine": True, "window": 2, "local": "poly"}, r"local='poly' is the homogeneous kernel .* use local='softmax'"),
    ("softmax", {"p": 2}, r"attention 'softmax' takes no options"),
    ("nope", {}, r"attention must be one of \['based', 'based-expand', 'based-taylor', 'dpfp', 'elementwise', 'exact-poly', 'hedgehog', 'identity', 'llops', 'poly', 'psf', 'psf-learned', 'psf-random', 'silu', 'sliding-window', 'softmax', 'tensorsketch'\]"),
])
def test_attention_options_are_checked(attention, options, msg):
    with pytest.raises(ValueError, match=msg):
        tiny(attention, options)


# ---------------------------------------------------------------------------------------------
# LLoPS initialisations


def _loss(model, inputs, targets):
    with torch.no_grad():
        logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits


def _same_logits(based_model, llops_model, dtype):
    """Both models' logits and loss on one MQAR batch agree; returns ``(inputs, targets, BASED's logits, tol)``."""
    inputs, targets = mqar_batch(MQARConfig(21, 4, 16), 8, generator=torch.Generator().manual_seed(0))
    loss_b, logits_b = _loss(based_model, inputs, targets)
    loss_l, logits_l = _loss(llops_model, inputs, targets)
    # float32: the two maps compute the same features by different products and sums (Θ's
    # multiset weights vs poly_features), ~1e-7 relative per operation through 2 layers;
    # float64: the same at ~1e-16.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(logits_l, logits_b, **tol)
    torch.testing.assert_close(loss_l, loss_b, **tol)
    return inputs, targets, logits_b, tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p,m,non_negative,based", [
    (2, 10, False, {"form": "expand", "p": 2, "dim": 4, "symmetric": True}),  # C(4+1, 2) = 10 features
    (3, 27, False, {"form": "expand", "p": 3, "dim": 3, "symmetric": False}),  # 3^3 = 27, no symmetric match
    (1, 6, True, {"form": "expand", "p": 2, "dim": 6}),  # (P q · P k)^2 via φ ⊗ φ of the degree-1 map
])
def test_llops_from_based_is_based_at_step_0(dtype, p, m, non_negative, based):
    based_model = tiny("based", based, layers=2).to(dtype)
    llops_model = tiny("llops", {"p": p, "m": m, "non_negative": non_negative}, layers=2, seed=5).to(dtype)
    copy_shared_weights(based_model, llops_model)
    info = init_llops(llops_model, "based")
    assert info == {"init": "based", "dim": based["dim"], "symmetric": m == math.comb(based["dim"] + p - 1, p)}
    inputs, targets, logits_b, tol = _same_logits(based_model, llops_model, dtype)
    init_llops(llops_model, "random", seed=0)
    # the check can fail: another Θ (random) moves the logits far outside the tolerance
    assert not torch.allclose(_loss(llops_model, inputs, targets)[1], logits_b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m,based,hybrid", [
    (15, {"dim": 4, "symmetric": True}, {}),  # 1 + 4 + C(5, 2)
    (13, {"dim": 3}, {}),  # 1 + 3 + 3², no symmetric match
    (73, {"dim": 8}, {"window": 3, "sinks": 1}),  # the whole head, with the hybrid (softmax window, gate)
])
def test_affine_llops_from_based_taylor_is_based_at_step_0(dtype, m, based, hybrid):
    based_model = tiny("based", {**based, **hybrid}, layers=2).to(dtype)
    llops_model = tiny("llops", {"p": 2, "m": m, "affine": True, **hybrid}, layers=2, seed=5).to(dtype)
    copy_shared_weights(based_model, llops_model)
    info = init_llops(llops_model, "based")
    assert info == {"init": "based", "dim": based["dim"], "symmetric": based.get("symmetric", False), "form": "taylor"}
    if hybrid:  # trained gates, the same in both models (copy_shared_weights leaves the kernels' own tensors)
        for kb, kl in zip(kernel_modules(based_model), kernel_modules(llops_model)):
            with torch.no_grad():
                kb.gate.copy_(torch.tensor([0.7, -1.3]))
                kl.gate.copy_(kb.gate)
    inputs, targets, logits_b, tol = _same_logits(based_model, llops_model, dtype)
    # the constant coordinate carries the Taylor map's degree-0 and degree-1 terms: without its row the
    # map is the homogeneous u⊗u block alone, and the logits move far outside the tolerance
    with torch.no_grad():
        for kernel in kernel_modules(llops_model):
            kernel.theta_q[..., -1, :] = 0
            kernel.theta_k[..., -1, :] = 0
    assert not torch.allclose(_loss(llops_model, inputs, targets)[1], logits_b, **tol)


def test_affine_init_rules():
    assert based_init_dim(8, 2, 15, "taylor") == (4, True) and based_init_dim(8, 2, 13, "taylor") == (3, False)
    with pytest.raises(ValueError, match=r"BASED taylor map .*1 \+ d' \+ C\(d'\+1, 2\).*got m=14; valid m: \[3, 6, 7, 10"):
        based_init_dim(8, 2, 14, "taylor")
    with pytest.raises(ValueError, match=r"affine=true is BASED's Taylor map 1 \+ s \+ s²/2: it needs p=2, got p=3"):
        init_llops(tiny("llops", {"p": 3, "m": 15, "affine": True}), "based")
    with pytest.raises(ValueError, match=r"non_negative=true would square its kernel"):
        init_llops(tiny("llops", {"p": 2, "m": 15, "affine": True, "non_negative": True}), "based")


def test_based_init_rules():
    assert based_init_dim(8, 2, 10) == (4, True) and based_init_dim(8, 2, 16) == (4, False)
    with pytest.raises(ValueError, match=r"init 'based' needs m equal to .*got m=11; valid m: \[1, 3, 4, 6"):
        based_init_dim(8, 2, 11)
    with pytest.raises(ValueError, match=r"gives a rank-1 Θ .* rank=2"):
        init_llops(tiny("llops", {"p": 2, "m": 10, "rank": 2}), "based")
    with pytest.raises(ValueError, match=r"needs a model with attention 'llops', got 'softmax'"):
        init_llops(tiny(), "based")
    with pytest.raises(ValueError, match=r"init must be one of \['random', 'based', 'theta'\], got 'svd'"):
        init_llops(tiny("llops"), "svd")
    with pytest.raises(ValueError, match=r"theta_file is required for init='theta' and only for it"):
        init_llops(tiny("llops"), "theta")
    with pytest.raises(ValueError, match=r"theta_file is required for init='theta' and only for it"):
        init_llops(tiny("llops"), "based", "x.safetensors")


def test_random_init_is_seeded_and_non_negative_for_even_p():
    a, b = tiny("llops", {"p": 2, "m": 6}, layers=2), tiny("llops", {"p": 2, "m": 6}, layers=2, seed=3)
    init_llops(a, "random", seed=4)
    init_llops(b, "random", seed=4)
    for ka, kb in zip(kernel_modules(a), kernel_modules(b)):
        torch.testing.assert_close(ka.theta_q, kb.theta_q, rtol=0, atol=0)
    ka, kb = kernel_modules(a)
    assert not torch.equal(ka.theta_q, kb.theta_q)  # layers differ
    x = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    from sketchlab import llops_features

    kern = llops_features(x, ka.theta_q[0]) @ llops_features(x, ka.theta_k[0]).T  # [50, 50]
    assert float(kern.detach().min()) >= 0  # Σ_i ⟨g_i, x⟩²⟨g_i, y⟩² at step 0


def _save(path, theta, scale="sqrt-d"):
    L, H, t, p, d, m = theta.shape
    return save_theta(path, theta, 2 * theta, p=p, m=m, t=t, d=d, method="llops", scale=scale,
                      source_sha256=SHA, errors={}, sketchlab_version="test")


@pytest.mark.parametrize("scale,factor", [("sqrt-d", 1.0), ("none", 8 ** 0.25), (0.5, 0.5 * 8 ** 0.25)])
def test_theta_init_rescales_to_the_models_input_scale(tmp_path, scale, factor):
    theta = torch.randn(2, 2, 1, 2, 8, 3, generator=torch.Generator().manual_seed(0))
    path = _save(tmp_path / "t.safetensors", theta, scale)
    model = tiny("llops", {"p": 2, "m": 3, "normalize": "none"}, layers=2).double()
    info = init_llops(model, "theta", path)
    assert info["init"] == "theta" and len(info["sha256"]) == 64 and info["scale"] == str(scale)
    kernel = kernel_modules(model)[1]
    q, k, v = _qkv()
    # the file's Θ was fitted on x·c: the model (which feeds x·D^{-1/4}) must give φ_Θ(c·x)
    c = {"sqrt-d": input_scale(8), "none": 1.0}.get(scale, 0.5)
    want = run_llops_naive(q * c, k * c, v, theta[1].double(), 2 * theta[1].double(), normalize="none")
    torch.testing.assert_close(kernel(q, k, v), want, **F64)
    torch.testing.assert_close(kernel.theta_q, theta[1].double() * factor, **F64)


def test_theta_init_of_an_affine_model_adds_a_zero_constant_row(tmp_path):
    # an exported Θ fits the homogeneous kernel on D coordinates: in an affine model it starts with a zero
    # row for the constant coordinate, so step 0 is the plain model with the same file
    theta = torch.randn(2, 2, 1, 2, 8, 3, generator=torch.Generator().manual_seed(0))
    path = _save(tmp_path / "t.safetensors", theta)
    plain = tiny("llops", {"p": 2, "m": 3, "normalize": "none"}, layers=2).double()
    affine = tiny("llops", {"p": 2, "m": 3, "normalize": "none", "affine": True}, layers=2, seed=3).double()
    copy_shared_weights(plain, affine)
    init_llops(plain, "theta", path)
    init_llops(affine, "theta", path)
    for kp, ka in zip(kernel_modules(plain), kernel_modules(affine)):
        assert ka.theta_q.shape == (2, 1, 2, 9, 3)
        torch.testing.assert_close(ka.theta_q[..., :8, :], kp.theta_q, rtol=0, atol=0)
        torch.testing.assert_close(ka.theta_k[..., :8, :], kp.theta_k, rtol=0, atol=0)
        assert not ka.theta_q[..., 8, :].any() and not ka.theta_k[..., 8, :].any()
    inputs = torch.randint(0, 21, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(affine(inputs), plain(inputs), **F64)


@pytest.mark.parametrize("shape,msg", [
    ((3, 2, 1, 2, 8, 3), r"layers L: 3 in the file, 2 in the model"),
    ((2, 4, 1, 2, 8, 3), r"heads H: 4 in the file, 2 in the model"),
    ((2, 2, 1, 2, 6, 3), r"head dimension d: 6 in the file, 8 in the model"),
    ((2, 2, 1, 3, 8, 3), r"degree p: 3 in the file, 2 in the model"),
    ((2, 2, 2, 2, 8, 5), r"rank t: 2 in the file, 1 in the model; features m: 5 in the file, 3 in the model"),
])
def test_theta_of_the_wrong_shape_is_refused(tmp_path, shape, msg):
    path = _save(tmp_path / "t.safetensors", torch.ones(shape))
    with pytest.raises(ValueError, match=msg):
        init_llops(tiny("llops", {"p": 2, "m": 3}, layers=2), "theta", path)


def test_copy_shared_weights_rules():
    a, b = tiny(), tiny("llops", seed=3)
    names = copy_shared_weights(a, b)
    assert "head.weight" in names and not any(".attention.attn." in n for n in names)
    torch.testing.assert_close(b.head.weight, a.head.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"differ outside the attention kernels: only in the source \['blocks.1"):
        copy_shared_weights(tiny(layers=2), tiny())
    bigger = TransformerLM(TransformerConfig(vocab_size=22, d_model=16, n_heads=2, n_layers=1, mlp_ratio=2, short_conv=2))
    with pytest.raises(ValueError, match=r"shared weights differ in shape: embed.weight: \(21, 16\) vs \(22, 16\)"):
        copy_shared_weights(tiny(), bigger)


def test_training_through_the_triton_kernel_matches_the_torch_backend():
    # Triton under the interpreter on the CPU (TRITON_INTERPRET=1, set by conftest): a tiny model,
    # 3 steps. Both backends compute the same chunked recurrence in float32 with different
    # summation orders (~1e-7 relative per output); AdamW's first steps carry that to ~1e-6 in the
    # loss. 1e-5 is far below the step-to-step loss changes (~1e-2).
    # On a CUDA machine the kernel is compiled (conftest leaves TRITON_INTERPRET unset) and needs CUDA
    # tensors: both backends then run on the GPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    losses = {}
    for backend in ("torch", "triton"):
        model = tiny("llops", {"p": 2, "m": 6, "backend": backend})
        init_llops(model, "based")
        model.to(device)
        losses[backend] = train_mqar(model, [(TASK, 3)], **{**KW, "eval_every": 0}).losses
    assert losses["triton"] == pytest.approx(losses["torch"], rel=1e-5, abs=0)
    assert losses["torch"][0] != losses["torch"][-1]


def test_affine_llops_through_the_triton_kernel_matches_the_torch_backend():
    # Θ of D + 1 = 9 rows (the constant coordinate): the kernel pads its D block to 16; the layer's output
    # and Θ's gradient, hybrid window + sinks, under the interpreter on the CPU (a CUDA machine compiles it).
    # float32, two summation orders: ~1e-7 relative per output; 1e-5 of the scale is far below what a wrong
    # or dropped constant row moves (the last asserts)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (t.float().to(device) for t in _qkv(T=20))
    out, grads = {}, {}
    for backend in ("torch", "triton"):
        model = tiny("llops", {"p": 2, "m": 6, "affine": True, "window": 3, "sinks": 1, "backend": backend}).to(device)
        kernel = kernel_modules(model)[0]
        y = kernel(q, k, v)
        y.square().mean().backward()
        out[backend], grads[backend] = y.detach(), kernel.theta_q.grad
    scale, gscale = out["torch"].abs().max(), grads["torch"].abs().max()
    torch.testing.assert_close(out["triton"], out["torch"], rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(grads["triton"], grads["torch"], rtol=0, atol=1e-5 * gscale)
    assert grads["torch"][..., -1, :].abs().max() > 0.01 * gscale  # the constant's row is trained
    with torch.no_grad():
        kernel.theta_q[..., -1, :] = 0
        assert (kernel(q, k, v) - out["torch"]).abs().max() > 1e-2 * scale


@pytest.mark.filterwarnings("ignore:.*normalising denominator <= 0")  # odd p = 3 expand: signed features
@pytest.mark.parametrize("options,scale,local_scale", [
    ({"dim": 4}, 1.0, 4 ** -0.5),  # Taylor: the degree-2 term's own s' = d'^{-1/2}, inputs unscaled
    ({"form": "expand", "p": 3, "dim": 4, "symmetric": False}, input_scale(8), 1.0),  # D^{-1/4}-scaled inputs
])
def test_based_hybrid_poly_window_uses_the_kernels_own_scale(options, scale, local_scale):
    # local="poly": the exact window scores (s·qᵀk)^p use BASED's scale s, not the default 1/√D that
    # any other scale (or a dropped one) would give; window 2 < T mixes the window with the sketch
    from sketchlab.attention import AttentionOptions, linear_attention
    from sketchlab.featuremaps.based import ExpandMap, TaylorMap

    kernel, _ = _kernel("based", {**options, "window": 2, "local": "poly"})
    o = kernel.config_options
    proj = torch.eye(8, 4, dtype=torch.float64).expand(2, 8, 4)  # BASED on the first d' = 4 coordinates
    fmap = (TaylorMap(2, 8, proj=proj, symmetric=o["symmetric"]) if o["form"] == "taylor"
            else ExpandMap(2, 8, p=o["p"], proj=proj, symmetric=o["symmetric"]))
    q, k, v = _qkv()
    got = kernel(q, k, v)
    opts = AttentionOptions(window=2, local="poly", non_negative=False)
    want, _ = linear_attention(q * scale, k * scale, v, fmap, options=opts.replace(local_scale=local_scale),
                               gate=kernel.gate)
    torch.testing.assert_close(got, want, **F64)
    default, _ = linear_attention(q * scale, k * scale, v, fmap, options=opts, gate=kernel.gate)
    assert (got - default).abs().max() > 1e-6  # the scale matters at these sizes


def test_each_stage_reports_its_heldout_accuracy(tmp_path, capsys):
    # the single (rank-0) process prints one line per stage with the accuracy the history records
    res = train_mqar(tiny(), [(TASK, 2), (TASK, 1)], out=tmp_path, **KW)
    text = capsys.readouterr()
    lines = [ln for ln in (text.out + text.err).splitlines() if ln.startswith("stage ")]
    assert len(lines) == 2
    for si, (line, entry) in enumerate(zip(lines, res.history)):
        assert line.startswith(f"stage {si} ") and f"held-out accuracy {entry['heldout_accuracy']:.4f} after" in line
