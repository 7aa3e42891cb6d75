"""Toy checkpoints written before ToyKernel (tests/data/old_toy_checkpoints, one per attention kind of the old
registry) load with today's load_checkpoint and give the logits the old code gave."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sketchlab.tasks import legacy, load_checkpoint

OLD = Path(__file__).resolve().parent / "data" / "old_toy_checkpoints"
CASES = sorted(p.name for p in OLD.iterdir() if p.is_dir())
DEPRECATED = {"based": "based-taylor", "psf": "psf-random"}
#: Keys only the old kernels wrote (so the fixtures exercise the rename table, legacy.OLD_KEYS).
OLD_ONLY = {"llops": {"theta_q", "theta_k"}, "llops-affine": {"theta_q", "theta_k"}, "psf": {"weight_0"},
            "psf-random": {"weight_0", "weight_1"}}


def _logits(model, extra) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model(torch.tensor([extra["tokens"]]))[0], torch.tensor(extra["logits"])  # [T, V] each


def test_every_old_attention_kind_has_a_fixture():
    names = {json.loads((OLD / c / "config.json").read_text())["config"]["attention"] for c in CASES}
    assert names == {"poly", "based", "based-taylor", "based-expand", "psf", "psf-random", "llops", "hedgehog",
                     "psf-learned", "dpfp", "elementwise", "exact-poly", "identity", "tensorsketch"}


@pytest.mark.parametrize("case", CASES)
def test_old_checkpoint_loads_with_its_logits(case):
    kernel_keys = {k.removeprefix("blocks.0.attention.attn.") for k in load_file(OLD / case / "model.safetensors")
                   if ".attention.attn." in k}
    assert OLD_ONLY.get(case, set()) <= kernel_keys  # the file is of the old format
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, extra = load_checkpoint(OLD / case)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    if case in DEPRECATED:
        assert deprecations == [f"attention {case!r} is deprecated, use {DEPRECATED[case]!r}"]
    else:
        assert deprecations == []
    out, expected = _logits(model, extra)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # float32; measured: <= 1e-6


def test_old_keys_load_through_load_state_dict_too():
    model, extra = load_checkpoint(OLD / "llops")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(load_file(OLD / "llops" / "model.safetensors"))  # the kernel's hook renames
    torch.testing.assert_close(*_logits(model, extra), rtol=1e-5, atol=1e-6)


def test_fixtures_tell_a_wrong_rename(monkeypatch):
    """Θ_Q and Θ_K differ in the fixture: a table mapping theta_q to map_k gives other logits."""
    monkeypatch.setitem(legacy.OLD_KEYS, "llops", (("theta_q", "map_k.theta"), ("theta_k", "map_q.theta")))
    model, extra = load_checkpoint(OLD / "llops")
    out, expected = _logits(model, extra)
    assert not torch.allclose(out, expected, rtol=1e-3, atol=1e-4)
