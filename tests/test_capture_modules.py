"""capture_qk through explicit ``attention`` modules (called as ``f(q, k, v)`` with ``[B, T, H, D]``), and
the refusal of a hooked producer whose output is not ``[B, T, features]`` (issue 21, mutation round 4)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from sketchlab.capture import capture_qk

B, T, H, D = 2, 5, 3, 4


class _Kernel(nn.Module):
    """An attention kernel: plain softmax attention on ``[B, T, H, D]`` inputs."""

    def forward(self, q, k, v):
        logits = torch.einsum("bthd,bshd->bhts", q, k) / D**0.5
        return torch.einsum("bhts,bshd->bthd", logits.softmax(-1), v)


class _Layers(nn.Module):
    """Two layers, each projecting x to q, k, v ([B, T, H, D]) and calling its own kernel module."""

    def __init__(self):
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(H * D, 3 * H * D) for _ in range(2))
        self.kernel = nn.ModuleList(_Kernel() for _ in range(2))
        self.seen = []

    def forward(self, x):
        self.seen = []
        for proj, kernel in zip(self.proj, self.kernel):
            q, k, v = proj(x).reshape(B, T, 3, H, D).unbind(2)  # each [B, T, H, D]
            self.seen.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
            x = x + kernel(q, k, v).reshape(B, T, H * D)
        return x


def test_explicit_attention_modules_capture_what_each_kernel_receives():
    """Each layer's (q, k, v) are the kernel's own arguments, in the dump's [L, H, n, D] layout (the valid
    tokens of every sequence in batch order), and the dump says it captured the attention inputs."""
    torch.manual_seed(0)
    model = _Layers()
    x = torch.randn(B, T, H * D)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    dump = capture_qk(model, x, modules={"attention": ["kernel.0", model.kernel[1]]},
                      attention_mask=mask)
    assert dump.meta["captured"] == "attention-inputs"
    assert dump.meta["tokens"] == "[5, 3]"
    assert dump.q.shape == (2, H, 8, D) and dump.v.shape == (2, H, 8, D)
    valid = mask.bool()
    for layer, (q, k, v) in enumerate(model.seen):
        for got, want in ((dump.q, q), (dump.k, k), (dump.v, v)):
            torch.testing.assert_close(got[layer], want[valid].transpose(0, 1), rtol=0, atol=0)  # [H, n, D]


def test_explicit_projection_modules_record_projections():
    torch.manual_seed(1)
    model = _Layers()
    dump = capture_qk(model, torch.randn(B, T, H * D), modules={"qkv": ["proj.0", "proj.1"]}, num_heads=H)
    assert dump.meta["captured"] == "projections"
    for layer, (q, k, v) in enumerate(model.seen):  # the fused projection's q, k, v thirds, every token
        for got, want in ((dump.q, q), (dump.k, k), (dump.v, v)):
            torch.testing.assert_close(got[layer], want.reshape(B * T, H, D).transpose(0, 1), rtol=0, atol=0)


class _Flat(nn.Module):
    """Projections whose outputs are flattened over batch and tokens: [B·T, features]."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        flat = x.reshape(-1, 6)  # [B·T, 6]
        return self.q(flat) @ self.k(flat).T


def test_a_producer_without_batch_and_token_axes_is_refused_with_its_shape():
    with pytest.raises(ValueError, match=re.escape("q (q): expected a [B, T, features] output, got shape (10, 6)")):
        capture_qk(_Flat(), torch.randn(B, T, 6), modules={"q": ["q"], "k": ["k"]}, num_heads=2)
