"""A user's own module joins the feature-map family in one call (:func:`sketchlab.as_feature_map`): a small
module of our own (a per-head linear map and a ReLU) and a plain callable (elu + 1), their features, their
float64 twin, the one attention op, ``fit_sketch`` and ``compare`` against the optimum once registered (also
for a module whose parameters the heads share, as fla's), the toy model and ``convert_attention``, the one
registry's fitter slot beside its builder (``fit_sketch`` takes a map's own fitter; one name, one meaning), and the
errors a wrong module gets. No flash-linear-attention here (``analysis/fla_maps.py`` runs fla's maps).

Tolerances: float64 1e-12 (the same operations in the same order, or a D-term dot product); the float32
module against its float64 twin 1e-5 (float32 round-off of a 4-term dot product, ~1e-7, with room);
the op against the dense float64 formula 1e-10 (chunked sums in another order).
"""

import pytest
import torch
from torch import nn

import sketchlab as sl
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.featuremaps import (
    FeatureMap,
    FittedMaps,
    ModuleMap,
    Option,
    as_feature_map,
    make_feature_map,
    register_feature_map,
    registry,
)
from sketchlab.tasks import TransformerConfig, TransformerLM, model

TOL64, TOL32 = 1e-12, 1e-5
H, D, M = 2, 4, 6
NAME = "test-relu-linear"


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


class ReluLinear(nn.Module):
    """Per head ``relu(x W_h)``, ``W [H, D, M]`` drawn from ``seed`` (a parameter, or a buffer with ``learn=False``)."""

    def __init__(self, heads, head_dim, m, *, seed=0, learn=True, dtype=torch.float64):
        super().__init__()
        w = (_rand(heads, head_dim, m, seed=seed) / head_dim**0.5).to(dtype)  # the same draw in every dtype
        if learn:
            self.w = nn.Parameter(w)
        else:
            self.register_buffer("w", w)

    def forward(self, x):
        return torch.einsum("bthd,hdm->bthm", x, self.w).relu()  # [B, T, H, M]


def relu_linear_loop(w):
    """The float64 twin of :class:`ReluLinear` written out: ``relu(Σ_d x_d W_{h,d,i})``, token by token."""

    def naive(x):
        B, T, Hx, Dx = x.shape
        out = torch.zeros(B, T, Hx, w.shape[-1], dtype=torch.float64)
        for b in range(B):
            for t in range(T):
                for h in range(Hx):
                    for i in range(w.shape[-1]):
                        out[b, t, h, i] = max(sum(float(x[b, t, h, d]) * float(w[h, d, i].detach()) for d in range(Dx)), 0.0)
        return out

    return naive


def _build(heads, head_dim, *, m, seed, dtype, learn, **_):
    """The registry's build of :class:`ReluLinear`: one call to :func:`as_feature_map`."""
    module = ReluLinear(heads, head_dim, m, seed=seed, learn=learn, dtype=dtype)
    return as_feature_map(module, heads=heads, head_dim=head_dim, non_negative=True)


@pytest.fixture
def registered():
    register_feature_map(NAME, _build, {"learn": Option("bool", True, doc="W as a trained parameter")})
    yield NAME
    registry._REGISTRY.pop(NAME)
    for table in (model._ATTENTION, model._OPTIONS):  # the toy model's kernel of it, where a test made one
        table.pop(NAME, None)


def test_features_are_the_modules_and_the_twin_is_float64():
    module = ReluLinear(H, D, M, seed=1, dtype=torch.float32)
    fmap = as_feature_map(module, heads=H, head_dim=D, non_negative=True)
    assert isinstance(fmap, FeatureMap) and fmap.num_features == M  # probed
    assert fmap.degree is None and fmap.non_negative and fmap.num_parameters == H * D * M
    x = _rand(2, 5, H, D, seed=2, dtype=torch.float32)
    fast = fmap.features(x)
    assert torch.equal(fast, module(x))
    twin = fmap.features_naive(x)
    assert twin.dtype == torch.float64 and module.w.dtype == torch.float32  # the module itself is not changed
    assert (twin - relu_linear_loop(module.w.double())(x.double())).abs().max() < TOL64
    assert (twin - fast.double()).abs().max() < TOL32
    assert (fmap._features_naive(x[1, :, 1].double(), 1) - twin[1, :, 1]).abs().max() == 0  # one head, as fits take it
    calls = []

    def loop(x):
        calls.append(tuple(x.shape))
        return relu_linear_loop(module.w.double())(x)

    given = as_feature_map(module, heads=H, head_dim=D, naive=loop)
    assert torch.equal(given.features_naive(x), relu_linear_loop(module.w.double())(x.double()))
    assert calls == [(2, 5, H, D)]  # the twin given is the one used


def test_a_plain_callable_and_dtype_promotion():
    elu1 = as_feature_map(lambda x: nn.functional.elu(x) + 1, heads=H, head_dim=D, non_negative=True)
    x = _rand(1, 3, H, D, seed=3)
    assert elu1.num_features == D and torch.equal(elu1.features(x), nn.functional.elu(x) + 1)
    module = ReluLinear(H, D, M, seed=4, dtype=torch.float32)
    fmap = as_feature_map(module, heads=H, head_dim=D)
    out = fmap.features(x)  # float64 input, float32 module: computed in float64, as the built-in maps do
    assert out.dtype == torch.float64 and (out - relu_linear_loop(module.w.double())(x)).abs().max() < TOL64
    out.sum().backward()
    assert module.w.grad is not None and module.w.grad.dtype == torch.float32


def test_in_the_op():
    fmap = as_feature_map(ReluLinear(H, D, M, seed=5), heads=H, head_dim=D, non_negative=True)
    q, k, v = _rand(1, 10, H, D, seed=6), _rand(1, 10, H, D, seed=7), _rand(1, 10, H, 3, seed=8)
    opts = sl.AttentionOptions(window=3, sinks=1, backend="torch", chunk_size=4)
    out, state = sl.linear_attention(q, k, v, fmap, options=opts, output_final_state=True)
    literal = feature_attention_naive(fmap.features_naive(q), fmap.features_naive(k), v, q=q, k=k, window=3, sinks=1)
    assert (out - literal).abs().max() < 1e-10 and state is not None
    # pure linear attention, normalised by the sum (>= 0; a query whose ReLU features are all 0 gets 0: no warning)
    plain, _ = sl.linear_attention(q, k, v, fmap, options=sl.AttentionOptions(denominator_check="off"))
    literal = feature_attention_naive(fmap.features(q), fmap.features(k), v, denominator_check="off")
    assert (plain - literal).abs().max() < 1e-10


def test_compared_against_the_optimum(registered):
    q, k = _rand(H, 40, D, seed=9) * 0.6, _rand(H, 40, D, seed=10) * 0.6
    table = sl.compare((q[None], k[None]), p=2, m=M, methods=["optimal", registered], holdout=0.0, scale="none",
                       options={registered: {"learn": False}}, progress=False)
    ratios = table.values(registered, "optimality_ratio")
    assert len(ratios) == H and min(ratios) >= 1  # no map of M features beats Theorem 3.1's optimum
    assert table.values(registered, "num_features") == [M] * H
    # by hand, head 1: the maps fit_sketch builds (seeds 0 and 1), ‖Φ_Q Φ_Kᵀ − (QKᵀ)²‖_F / √(Σ_{i>M} σ_i²)
    def features(x, seed):  # x [H, n, D] -> [n, H, M]
        fmap = make_feature_map(registered, heads=H, head_dim=D, m=M, seed=seed, dtype=x.dtype, learn=False)
        return fmap.features(x.transpose(0, 1)[None])[0]

    fq, fk = features(q, 0), features(k, 1)
    exact = (q[1] @ k[1].T) ** 2  # [n, n]
    err = torch.linalg.matrix_norm(fq[:, 1] @ fk[:, 1].T - exact)
    tail = (torch.linalg.svdvals(exact)[M:] ** 2).sum()
    assert abs(ratios[1] - float(err / tail.sqrt())) < 1e-9 * ratios[1]


def test_fit_sketch_trains_its_parameters(registered):
    q, k = _rand(H, 40, D, seed=11) * 0.6, _rand(H, 40, D, seed=12) * 0.6
    fit = sl.fit_sketch(registered, q, k, p=2, m=M, steps=40)
    start = make_feature_map(registered, heads=H, head_dim=D, m=M, seed=0, dtype=torch.float64)
    trained = fit.map_q
    assert isinstance(trained, ModuleMap) and fit.report.steps == 40
    assert not torch.equal(trained.module.w, start.module.w)  # the module's parameters were trained
    assert bool((fit.report.rel_fro < fit.report.info["init_rel_fro"]).all())  # and the kernel error fell


def test_fit_sketch_trains_a_module_shared_by_the_heads():
    # fla's maps act on [..., D]: one module for every head, parameters without a heads axis
    def build(heads, head_dim, *, m, seed, dtype, **_):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            linear = nn.Linear(head_dim, m, bias=False).to(dtype)
        return as_feature_map(nn.Sequential(linear, nn.ReLU()), heads=heads, head_dim=head_dim, non_negative=True)

    register_feature_map("test-shared-relu", build)
    try:
        q, k = _rand(H, 40, D, seed=14) * 0.6, _rand(H, 40, D, seed=15) * 0.6
        # lr 0.3: the loss oscillates, so the heads' own best steps differ (the step kept must be one for both)
        fit = sl.fit_sketch("test-shared-relu", q, k, p=2, m=M, steps=40, lr=0.3)
        start = make_feature_map("test-shared-relu", heads=H, head_dim=D, m=M, seed=0, dtype=torch.float64)
    finally:
        registry._REGISTRY.pop("test-shared-relu")
    assert not torch.equal(fit.map_q.module[0].weight, start.module[0].weight)
    # the step kept is one step for both heads: the errors the fit kept are the report's, head by head
    assert torch.allclose(fit.report.info["rel_fro"], fit.report.rel_fro, rtol=1e-10)
    assert bool((fit.report.rel_fro < fit.report.info["init_rel_fro"]).all())


def test_in_the_toy_model_and_convert_attention(registered):
    # sketchlab.tasks was imported (its kernels made) before the map was registered
    cfg = TransformerConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1, attention=registered,
                            attention_options={"window": 2})
    assert TransformerLM(cfg)(torch.randint(0, 11, (2, 6))).shape == (2, 6, 11)
    pytest.importorskip("transformers")
    from tests.test_convert import _llama  # a tiny random LLaMA (GQA, rotary), float64

    model = _llama()
    sketches = sl.convert_attention(model, attention=registered, m=16, window=4)
    assert isinstance(sketches[0].map_q, ModuleMap) and sketches[0].map_q.num_features == 16
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 50, (2, 9))).logits).all()


def test_a_fit_sketch_method_name_is_refused():
    for name in ("optimal", "mlp"):
        with pytest.raises(ValueError, match=f"the name '{name}' is a fit_sketch method that is not this map"):
            register_feature_map(name, _build)
    with pytest.raises(TypeError, match="build must be a callable"):
        register_feature_map("not-callable", None)


def test_one_registry_a_fitter_slot_beside_the_builder(registered):
    # the builder slot alone: fit_sketch fits the map by Adam
    assert registry.own_fitter(registered) is None and registered in registry.feature_map_names()
    assert registered not in registry.fitter_names() and registered in sl.fit.accepted_methods()
    q, k = _rand(H, 40, D, seed=16) * 0.6, _rand(H, 40, D, seed=17) * 0.6
    adam = sl.fit_sketch(registered, q, k, p=2, m=M, steps=3)
    assert adam.report.steps == 3 and "own" not in adam.report.info
    calls = []

    def fit(q, k, *, p, m, seed=0, **options):
        """The map's own fitter: its maps as built, untrained (the registered map, not another method)."""
        calls.append((p, m, seed, options))
        maps = [make_feature_map(registered, heads=H, head_dim=D, m=m, seed=s, dtype=q.dtype, learn=False)
                for s in (seed, seed + 1)]
        return FittedMaps(*maps, {"steps": 0, "converged": True, "own": True})

    registry.register_fitter(registered, fit)  # the fitter slot of the map's own name
    registry.register_fitter(registered, fit)  # the same fitter again: nothing changes
    assert registry.own_fitter(registered) is fit and sl.sketch_fitter(registered) is fit
    assert registered in registry.fitter_names() and registered in sl.available_sketches()
    assert registered in registry.feature_map_names()  # one name, both slots
    own = sl.fit_sketch(registered, q, k, p=2, m=M, seed=3, steps=3)  # steps: an option the fitter gets
    assert calls == [(2, M, 3, {"steps": 3})] and own.report.info["own"] and own.report.steps == 0
    assert isinstance(own.map_q, ModuleMap) and not own.map_q.module.w.requires_grad
    # no slot is filled twice: another fitter, another map
    with pytest.raises(ValueError, match=f"a fit_sketch method named '{registered}' is already registered"):
        registry.register_fitter(registered, lambda q, k, **_: None)
    with pytest.raises(ValueError, match=f"a feature map named '{registered}' is already registered"):
        register_feature_map(registered, _build)
    assert registry.own_fitter(registered) is fit
    # a fit method of its own (register_sketch: the fitter slot alone) is no map, and no map may take its name
    sl.register_sketch("test-fit-only")(fit)
    try:
        assert "test-fit-only" in sl.available_sketches() and "test-fit-only" not in registry.feature_map_names()
        with pytest.raises(ValueError, match="the name 'test-fit-only' is a fit_sketch method that is not this map"):
            register_feature_map("test-fit-only", _build)
        with pytest.raises(ValueError, match="feature map name must be one of"):
            make_feature_map("test-fit-only", heads=H, head_dim=D)
    finally:
        registry._REGISTRY.pop("test-fit-only")
    # a deprecated map name means its successor: no fitter may take it
    with pytest.raises(ValueError, match="the name 'taylor' is a deprecated feature map name .*'based-taylor'"):
        registry.register_fitter("taylor", fit)
    with pytest.raises(TypeError, match="fit must be a callable"):
        registry.register_fitter("test-not-callable", 3)


def _wrap(fn, **kw):
    return as_feature_map(fn, heads=H, head_dim=D, **kw)


def test_bad_modules_get_clear_errors():
    x = _rand(2, 3, H, D, seed=13)
    with pytest.raises(TypeError, match="module must be an nn.Module or a callable .* got int"):
        _wrap(3)
    with pytest.raises(TypeError, match=r"module tuple_out must return a floating tensor \[B, T, H, M\] .* got tuple"):
        def tuple_out(x):
            return (x, x)
        _wrap(tuple_out)
    with pytest.raises(TypeError, match=r"module int_out must return a floating tensor .* got a torch.int64 tensor"):
        def int_out(x):
            return x.long()
        _wrap(int_out)
    with pytest.raises(ValueError, match=r"module flat must keep the layout \[B, T, H\] of its input: it must map "
                                         r"x \[B, T, H, D\] = \[1, 1, 2, 4\] to \[B, T, H, M\] = \[1, 1, 2, M\], "
                                         r"got shape \[1, 1, 8\]"):
        def flat(x):
            return x.flatten(2)
        _wrap(flat)
    with pytest.raises(ValueError, match=r"module mixes_heads must keep the layout .* got shape \[1, 1, 1, 4\]"):
        def mixes_heads(x):
            return x.sum(2, keepdim=True)
        _wrap(mixes_heads)
    with pytest.raises(ValueError, match=r"module ReluLinear num_features \(M\) must stay the one probed or given: .* "
                                         r"to \[B, T, H, M\] = \[2, 3, 2, 5\], got shape \[2, 3, 2, 6\]"):
        _wrap(ReluLinear(H, D, M), num_features=5).features(x)
    with pytest.raises(FloatingPointError, match=r"module log must return finite features: \d+ of 48 are not, the "
                                                 r"first at \[0, 0, 0, \d\]: nan"):
        def log(x):
            return x.log()
        _wrap(log).features(x)
    def down(x):
        return x.float()

    with pytest.raises(TypeError, match="naive down must return torch.float64 features, got torch.float32"):
        _wrap(torch.relu, naive=down).features_naive(x)
    with pytest.raises(TypeError, match=r"the float64 twin of module down \(its forward on float64 copies of its "
                                        r"tensors; else pass naive=\) must return torch.float64 features"):
        _wrap(down).features_naive(x)
    with pytest.raises(TypeError, match="non_negative must be a bool, got 1"):
        _wrap(torch.relu, non_negative=1)
    with pytest.raises(ValueError, match=r"x must have layout \[B, T, H=2, D=4\], got shape \(2, 3, 2, 5\)"):
        _wrap(torch.relu).features(_rand(2, 3, H, 5))
