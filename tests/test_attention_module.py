"""LLoPSAttention: the block's forward against its parts, learnable/frozen Θ, from_fit, and bad input."""

import pytest
import torch
from attention_calls import run_llops_naive

import sketchlab as sl
from sketchlab.attention import LLoPSAttention


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_forward_is_projections_then_the_op():
    block = LLoPSAttention(12, 3, p=2, m=5, rank=2, dtype=torch.float64, normalize="sum", seed=1)
    x = _rand(2, 17, 12, seed=2)
    out = block(x)
    q = block.q_proj(x).view(2, 17, 3, 4) * 4**-0.25  # scale "sqrt-d" by default
    k = block.k_proj(x).view(2, 17, 3, 4) * 4**-0.25
    v = block.v_proj(x).view(2, 17, 3, 4)
    ref = run_llops_naive(q, k, v, block.theta_q, block.theta_q, normalize="sum")  # tied
    assert torch.allclose(out, block.o_proj(ref.reshape(2, 17, 12)), atol=1e-10, rtol=0)
    # the default Θ has equal factors, so every feature is (θ·x)², ≥ 0: "sum" is safe
    assert torch.equal(block.theta_q[:, :, 0], block.theta_q[:, :, 1])


def test_learnable_and_frozen_theta():
    x = _rand(1, 9, 8, seed=3)
    block = LLoPSAttention(8, 2, m=4, dtype=torch.float64, theta_q=_rand(2, 1, 2, 4, 4, seed=4),
                           theta_k=_rand(2, 1, 2, 4, 4, seed=5), normalize="none")
    block(x).square().sum().backward()
    assert block.theta_q.grad.abs().sum() > 0 and block.theta_k.grad.abs().sum() > 0
    assert block.q_proj.weight.grad.abs().sum() > 0
    frozen = LLoPSAttention(8, 2, dtype=torch.float64, learn_theta=False, seed=0)
    assert "map_q.theta" not in dict(frozen.named_parameters()) and "map_q.theta" in dict(frozen.named_buffers())


def test_a_state_dict_saved_before_the_one_layer_core_loads():
    # Θ was saved as theta_q/theta_k (acaf206 and earlier); today it lives in map_q.theta/map_k.theta
    x = _rand(1, 9, 8, seed=3)
    for kw in (dict(theta_q=_rand(2, 1, 2, 4, 4, seed=4), theta_k=_rand(2, 1, 2, 4, 4, seed=5)), dict(seed=1)):
        block = LLoPSAttention(8, 2, m=4, dtype=torch.float64, normalize="none", **kw)
        old = {("theta_q" if k == "map_q.theta" else "theta_k" if k == "map_k.theta" else k): v
               for k, v in block.state_dict().items()}
        assert "theta_q" in old and ("theta_k" in old) == ("theta_k" in kw)
        fresh = LLoPSAttention(8, 2, m=4, dtype=torch.float64, normalize="none", seed=2,
                               **({"theta_q": kw["theta_q"] * 0, "theta_k": kw["theta_k"] * 0} if "theta_k" in kw else {}))
        fresh.load_state_dict(old)
        assert torch.equal(fresh(x), block(x))


def test_from_fit_layers_and_special_cases():
    q, k = _rand(2, 2, 40, 4, seed=6) * 4**-0.5, _rand(2, 2, 40, 4, seed=7) * 4**-0.5
    fit = sl.fit_sketch("llops", q, k, p=2, m=5)
    block = LLoPSAttention.from_fit(fit, layer=1, normalize="none")
    theta_q, theta_k = (f.theta.detach().reshape(2, 2, 1, 2, 4, 5) for f in fit.maps)  # [L·H] heads → [L, H]
    assert torch.equal(block.theta_q, theta_q[1])
    xq, xk, v = _rand(1, 11, 2, 4, seed=8), _rand(1, 11, 2, 4, seed=9), _rand(1, 11, 2, 4, seed=10)
    ref = run_llops_naive(xq, xk, v, theta_q[1], theta_k[1], normalize="none")
    assert torch.allclose(block.attend(xq, xk, v), ref, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="pass layer="):
        LLoPSAttention.from_fit(fit)
    based = sl.fit_sketch("based-expand", q[0], k[0], p=2, m=9)  # [H] batch, exact LLoPS form (m < D = 10)
    assert LLoPSAttention.from_fit(based).num_features == based.map_q.num_features
    with pytest.raises(ValueError, match="no exact LLoPS form"):
        LLoPSAttention.from_fit(sl.fit_sketch("tensorsketch", q[0], k[0], p=2, m=5))


def test_from_pretrained_rejects_bad_layers_and_scale(tmp_path):
    path = tmp_path / "t.safetensors"
    theta = _rand(2, 3, 1, 2, 4, 5, seed=11)
    sl.save_theta(path, theta, theta, p=2, m=5, t=1, d=4, method="llops", scale="1.5", source_sha256="0" * 64,
                  errors={}, sketchlab_version=sl.__version__)
    block = LLoPSAttention.from_pretrained(path, layer=-1)
    assert block.qk_scale == 1.5 and block.num_heads == 3 and torch.equal(block.theta_q, theta[1])
    with pytest.raises(ValueError, match="out of range"):
        LLoPSAttention.from_pretrained(path, layer=2)
    with pytest.raises(ValueError, match="metadata"):
        LLoPSAttention.from_pretrained(path, scale="none")
    with pytest.raises(ValueError, match="p \\(the degree\\) = 2"):
        LLoPSAttention.from_pretrained(path, p=3)


@pytest.mark.parametrize("kwargs, match", [
    ({"embed_dim": 10, "num_heads": 3}, "divisible"),
    ({"embed_dim": 0, "num_heads": 1}, r"^embed_dim must be an integer >= 1, got 0"),
    ({"embed_dim": 8, "num_heads": 0}, r"^num_heads must be an integer >= 1, got 0"),
    ({"embed_dim": 8, "num_heads": 2, "theta_q": torch.ones(3, 1, 2, 4, 4)}, "one map per head"),
    ({"embed_dim": 8, "num_heads": 2, "theta_q": torch.ones(2, 1, 2, 5, 4)}, "head dimension"),
    ({"embed_dim": 8, "num_heads": 2, "theta_q": torch.ones(2, 1, 2, 4, 4), "m": 5}, "features per map"),
    ({"embed_dim": 8, "num_heads": 2, "theta_q": torch.full((2, 1, 2, 4, 4), float("inf"))}, "finite"),
    ({"embed_dim": 8, "num_heads": 2, "normalize": "softmax"}, "normalize"),
    ({"embed_dim": 8, "num_heads": 2, "backend": "gpu"}, "backend"),
    ({"embed_dim": 8, "num_heads": 2, "scale": "sqrt"}, "scale"),
])
def test_bad_construction(kwargs, match):
    embed_dim, heads = kwargs.pop("embed_dim"), kwargs.pop("num_heads")
    with pytest.raises((ValueError, TypeError), match=match):
        LLoPSAttention(embed_dim, heads, **kwargs)


def test_bad_forward_input():
    block = LLoPSAttention(8, 2)
    with pytest.raises(ValueError, match=r"\[B, T, E=8\]"):
        block(torch.ones(2, 3, 6))


def test_from_pretrained_on_a_signed_theta_never_divides_by_a_signed_sum(tmp_path):
    """On the shipped dump: a fitted LLoPS Θ is signed; from_pretrained's default self-tensors it, so
    every output row is a convex combination of the values (|o| <= max |v|) and no denominator is
    <= 0, while the explicit signed "sum" meets denominators <= 0 (and warns)."""
    import warnings
    from pathlib import Path

    from sketchlab.attention import dump_segments
    from sketchlab.llops.maps import llops_is_non_negative

    dump = sl.load_qk(Path(__file__).resolve().parents[1] / "data" / "mqar_softmax_qk.safetensors", layers=[0])
    factor = dump.q.shape[-1] ** -0.25
    fit = sl.fit_sketch("llops", dump.q * factor, dump.k * factor, p=2, m=16, seed=0)
    path = sl.export_theta(fit, tmp_path / "theta.safetensors", dump=dump, scale="sqrt-d")
    q, k, v = (x.transpose(1, 2).double() for x in (dump.q, dump.k, dump.v))  # [1, n, H, d]
    segments = dump_segments(dump)
    block = LLoPSAttention.from_pretrained(path, layer=0, dtype=torch.float64)
    assert not llops_is_non_negative(block.theta_q) and block.non_negative and block.normalize == "sum"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # the default raises no denominator warning
        out = block.attend(q, k, v, segments=segments)
    assert out.abs().max() <= v.abs().max() * (1 + 1e-9)
    signed = LLoPSAttention.from_pretrained(path, layer=0, dtype=torch.float64, non_negative=False)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="denominator <= 0"):
        signed.attend(q, k, v, segments=segments)


def test_reference_backend_in_a_float32_block_returns_float32():
    # backend "reference" computes in float64; the block hands o_proj its own dtype again (the
    # float64 output once reached the float32 o_proj and failed), in forward and in step, and in
    # the toy model's llops layer. Both backends compute the same function: fp32 round-off apart.
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    ref = LLoPSAttention(16, 2, m=4, backend="reference", window=3, sinks=1)
    fast = LLoPSAttention(16, 2, m=4, backend="torch", window=3, sinks=1)
    fast.load_state_dict(ref.state_dict())
    y = ref(x)
    assert y.dtype == torch.float32 and torch.allclose(y, fast(x), atol=1e-5, rtol=0)
    y_t, _ = ref.step(x[:, 0])
    assert y_t.dtype == torch.float32 and torch.allclose(y_t, y[:, 0], atol=1e-5, rtol=0)
    from sketchlab.tasks import TransformerConfig, TransformerLM
    cfg = dict(vocab_size=11, d_model=16, n_heads=2, n_layers=1, attention="llops")
    toy_ref = TransformerLM(TransformerConfig(**cfg, attention_options={"backend": "reference", "m": 4}))
    toy = TransformerLM(TransformerConfig(**cfg, attention_options={"backend": "torch", "m": 4}))
    toy.load_state_dict(toy_ref.state_dict())
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    logits = toy_ref(ids)
    assert logits.dtype == torch.float32 and torch.allclose(logits, toy(ids), atol=1e-4, rtol=0)
