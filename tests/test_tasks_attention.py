"""The toy model's one kernel (:class:`sketchlab.tasks.attention.ToyKernel`): every registered name
builds it, and its call hands the kernel's own AttentionOptions and FarParams to the library's one entry
point (``linear_attention``; ``poly_attention`` for exact ``"poly"``); each option goes to its one
owner (map registry, AttentionOptions, the toy's own); the names older than the registry keep their
defaults; a tied LLoPS kernel keeps Θ_Q through ``init_llops``."""

import warnings

import pytest
import torch

import sketchlab.attention as attention
import sketchlab.attention.layer as attn_layer
from sketchlab.io import save_theta
from sketchlab.tasks import TransformerConfig, TransformerLM, attention_registry, init_llops, kernel_modules
from sketchlab.tasks.attention import ToyKernel

H, D = 2, 8


def tiny(name, options=None):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "based", "psf"
        cfg = TransformerConfig(vocab_size=11, d_model=H * D, n_heads=H, n_layers=1, mlp_ratio=2, attention=name,
                                attention_options=options or {})
    return TransformerLM(cfg).double()


@pytest.mark.parametrize("name", [n for n in attention_registry() if n not in ("softmax", "sliding-window")])
def test_every_name_runs_through_the_one_entry_point_with_its_own_options(name, monkeypatch):
    kernel = kernel_modules(tiny(name))[0]
    assert isinstance(kernel, ToyKernel)
    calls = []
    entry = "poly_attention" if name == "poly" else "linear_attention"
    where = attention if name == "poly" else attn_layer  # the op as the one layer core calls it
    real = getattr(where, entry)

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(where, entry, spy)
    q, k, v = (torch.randn(1, 5, H, D, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
               for s in range(3))
    assert torch.isfinite(kernel(q, k, v)).all()
    (kw,) = calls
    if name == "poly":
        o = kernel.options
        assert kw == {"normalize": o.normalize, "eps": o.eps} and kernel.map_q is None
    else:  # the kernel's own objects, passed through: nothing rebuilt or checked again on the way
        assert kw["options"] is kernel.options and kw["params"] is kernel.far and kw["gate"] is kernel.gate


@pytest.mark.parametrize("name, tied", [("llops", False), ("hedgehog", False), ("identity", False),
                                        ("based-taylor", True), ("based-expand", True), ("psf-random", True),
                                        ("psf-learned", True)])
def test_the_names_keep_their_tie_default(name, tied):
    kernel = kernel_modules(tiny(name))[0]
    assert kernel.config_options["tie"] is tied and (kernel.map_k is None) is tied


def test_each_option_goes_to_its_owner():
    # psf-random's non_negative is the map's (its own s ⊗ s); the attention's is left to the one rule, decided at
    # build: a signed map under a sum is self-tensored (φ ⊗ φ)
    kernel = kernel_modules(tiny("psf-random", {"p": 3, "m": 5, "non_negative": False}))[0]
    assert kernel.map_q.non_negative is False and kernel.options.non_negative is True
    assert kernel.options == kernel.options.replace(non_negative=None).resolve(False)
    # llops's non_negative is the attention's (φ ⊗ φ), with the toy's default false
    kernel = kernel_modules(tiny("llops", {"m": 5, "non_negative": True}))[0]
    assert kernel.options.non_negative is True and kernel.map_q.num_features == 5
    assert kernel_modules(tiny("llops", {"m": 5}))[0].options.non_negative is False
    with pytest.raises(ValueError, match=r"unknown attention option\(s\) \['p'\] for attention 'hedgehog'; it takes "
                                         r"\[.*'decay'.*'m'.*'tie'.*\]"):
        tiny("hedgehog", {"p": 2})


def test_a_tied_llops_kernel_keeps_theta_q(tmp_path):
    theta = torch.randn(1, H, 1, 2, D, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    path = save_theta(tmp_path / "t.safetensors", theta, 2 * theta, p=2, m=3, t=1, d=D, method="llops",
                      scale="sqrt-d", source_sha256="0" * 64, errors={}, sketchlab_version="test")
    model = tiny("llops", {"m": 3, "tie": True})
    kernel = kernel_modules(model)[0]
    assert kernel.map_k is None and "blocks.0.attention.attn.map_k.theta" not in model.state_dict()
    init_llops(model, "theta", path)
    assert torch.equal(kernel.theta_q, theta[0]) and kernel.theta_k is kernel.theta_q
