r"""Layers kept exact in a converted model: the teacher's softmax attention, and which layers to keep.

Hybrid models keep a few full-attention layers for recall that a fixed-size state cannot give
(DESIGN §7). ``convert_attention(..., exact_layers=[...])`` puts an :class:`ExactAttention` on those
layers instead of a :class:`~sketchlab.convert.sketched.SketchedAttention`: causal (or bidirectional)
softmax attention over every key, whose decoding state :class:`KVState` is a KV cache that grows
with the context — so a model with exact layers no longer decodes in constant memory, and
``SketchStateCache.state_bytes()`` counts that cache. :func:`sketchlab.convert.ranking.rank_exact_layers`
ranks layers by what keeping each one exact gains on given text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..attention.softmax import _softmax_attention
from ..attention.state import TensorState

__all__ = ["ExactAttention", "KVDecoder", "KVState"]


@dataclass(frozen=True)
class KVState(TensorState):
    """The decoding state of an exact layer: every key and value so far (a growing KV cache).

    It holds the model's ``H_kv`` key/value heads (not the query heads they serve), so its bytes are
    the teacher's KV cache's for the same tokens and dtype (plus the mask under padding).

    Attributes
    ----------
    k : Tensor ``[B, H_kv, S, D]``
    v : Tensor ``[B, H_kv, S, Dv]``
    mask : Tensor ``[B, S]`` bool or None
        ``True`` = a real token; ``None``: all real.
    offset : int
        Tokens seen (``S``).
    """

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    offset: int


class KVDecoder:
    """An exact layer decoding one token at a time: its keys and values in a preallocated buffer that grows
    by a quarter (at least 256 tokens) when full, so a token costs a write and one softmax attention
    (:func:`sketchlab.attention.softmax_attention`'s trusted core: no per-token checks) over the held keys
    (grouped-query heads read in place, ``enable_gqa``), not a copy of the whole cache (as ``torch.cat`` would, and :meth:`ExactAttention.forward`
    does). Equal to :meth:`ExactAttention.forward` on one token with the state (tested); inference only."""

    def __init__(self, state: KVState, heads: int, scaling: float | None):
        B, H_kv, n, D = state.k.shape
        self.heads, self.n, self.scaling = heads, n, (1.0 / math.sqrt(D) if scaling is None else float(scaling))
        cap = n + max(256, n // 4)
        self.k = state.k.new_empty(B, H_kv, cap, D)
        self.v = state.v.new_empty(B, H_kv, cap, state.v.shape[-1])
        self.k[:, :, :n], self.v[:, :, :n] = state.k, state.v
        self.mask = None  # [B, cap] bool, only when the prompt held pads
        if state.mask is not None and not bool(state.mask.all()):
            self.mask = torch.ones(B, cap, dtype=torch.bool, device=state.k.device)
            self.mask[:, :n] = state.mask

    @property
    def offset(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.k, self.v, self.mask) if x is not None)

    def _grow(self) -> None:
        """Room for another quarter of the tokens held (at least 256): one copy per growth, amortised O(1)."""
        n, extra = self.n, max(256, self.n // 4)
        self.k, self.v = (torch.cat([x[:, :, :n], x.new_empty(*x.shape[:2], extra, x.shape[3])], 2)
                          for x in (self.k, self.v))
        if self.mask is not None:
            self.mask = torch.cat([self.mask[:, :n], self.mask.new_ones(self.mask.shape[0], extra)], 1)

    def state(self) -> KVState:
        n = self.n
        return KVState(k=self.k[:, :, :n].clone(), v=self.v[:, :, :n].clone(),
                       mask=None if self.mask is None else self.mask[:, :n].clone(), offset=n)

    @torch.inference_mode()
    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``query [B, H, 1, D]``, ``key [B, H_kv, 1, D]``, ``value [B, H_kv, 1, Dv]`` → ``[B, 1, H, Dv]``."""
        n = self.n
        if n == self.k.shape[2]:
            self._grow()
        self.k[:, :, n], self.v[:, :, n] = key[:, :, 0], value[:, :, 0]
        self.n = n + 1
        k, v = (x[:, :, :n + 1].to(query.dtype).transpose(1, 2) for x in (self.k, self.v))  # [B, n + 1, H_kv, ·] views
        # the one new query is the last position: it sees every held key (no causal mask), GQA read in place
        return _softmax_attention(query.transpose(1, 2), k, v, causal=True, scale=self.scaling,
                                  key_padding_mask=None if self.mask is None else self.mask[:, :n + 1])


class ExactAttention(nn.Module):
    r"""Softmax attention for a layer kept exact: ``o_t = Σ_{j ∈ M(t)} e^{s q_tᵀk_j} v_j / Σ_{j ∈ M(t)} e^{s q_tᵀk_j}``.

    ``M(t)``: keys ``j ≤ offset + t`` (causal; every key for an encoder) that are real tokens, and
    always the query's own position (so a padded query's output stays finite; real queries never
    see pads). Grouped-query attention: query head ``h`` reads key/value head ``h // (H / H_kv)``
    (transformers' ``repeat_kv``), repeated only inside the product, so the state keeps ``H_kv`` heads.
    Holds no parameters. ``window = sinks = 0`` tells the transformers adapter that
    positions need no reordering under padding (a key mask is exact in any order).

    Parameters
    ----------
    heads, head_dim : int
        Query heads ``H`` and head dimension ``D``.
    causal : bool
    """

    window = 0
    sinks = 0

    def __init__(self, *, heads: int, head_dim: int, causal: bool = True):
        super().__init__()
        self.heads, self.head_dim, self.causal = int(heads), int(head_dim), bool(causal)

    def decoder(self, state: KVState, scaling: float | None = None) -> KVDecoder | None:
        """The lean decoding step of this layer continuing ``state`` (:class:`KVDecoder`; None for a state
        of another kind)."""
        return KVDecoder(state, self.heads, scaling) if isinstance(state, KVState) else None

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, causal={self.causal}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float | None = None,
                key_padding_mask: torch.Tensor | None = None, initial_state: KVState | None = None,
                output_final_state: bool = False):
        """``q [B, T, H, D]``, ``k [B, T, H_kv, D]``, ``v [B, T, H_kv, Dv]`` → ``[B, T, H, Dv]`` (and the
        :class:`KVState` with ``output_final_state``), continuing ``initial_state``'s keys. ``H_kv``: the
        model's key/value heads, a divisor of ``H`` (``H`` without grouped-query attention)."""
        scaling = 1.0 / math.sqrt(self.head_dim) if scaling is None else float(scaling)
        (B, T, H), H_kv = q.shape[:3], k.shape[2]
        if H % H_kv:
            raise ValueError(f"{H} query heads (q {tuple(q.shape)}) are not a multiple of {H_kv} key/value heads "
                             f"(k {tuple(k.shape)})")
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, T, ·]
        new_mask, offset = key_padding_mask, 0
        if initial_state is not None:
            if not isinstance(initial_state, KVState):
                raise TypeError(f"initial_state of an exact layer must be a KVState, got {type(initial_state).__name__}")
            offset = initial_state.offset
            kh, vh = torch.cat([initial_state.k, kh], 2), torch.cat([initial_state.v, vh], 2)
            if initial_state.mask is not None or key_padding_mask is not None:
                ones = lambda n: torch.ones(B, n, dtype=torch.bool, device=q.device)  # noqa: E731
                new_mask = torch.cat([ones(offset) if initial_state.mask is None else initial_state.mask,
                                      ones(T) if key_padding_mask is None else key_padding_mask], 1)  # [B, S]
        q_pos, k_pos = torch.arange(offset, offset + T, device=q.device)[:, None], torch.arange(kh.shape[2], device=q.device)
        allowed = (k_pos <= q_pos) | (not self.causal)  # [T, S]
        if new_mask is not None:
            allowed = allowed & new_mask[:, None, None, :]  # [B, 1, T, S]
        allowed = allowed | (k_pos == q_pos)  # own position: finite for pads
        kq, vq = (x.to(q.dtype).repeat_interleave(H // H_kv, 1) for x in (kh, vh))  # [B, H, S, ·] repeat_kv
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kq, vq, attn_mask=allowed,
                                                         scale=scaling)  # [B, H, T, Dv]
        out = out.transpose(1, 2)
        if not output_final_state:
            return out
        return out, KVState(k=kh.detach(), v=vh.detach(), mask=new_mask, offset=offset + T)
