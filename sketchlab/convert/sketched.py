r"""The sketched attention a converted model runs, and the state it decodes with.

:class:`SketchedAttention` holds what conversion adds to one attention module — the query and key
feature maps and the per-head gate, as ``nn.Parameter`` s registered on that module (so they train
and save with it) — and calls :func:`sketchlab.attention.featuremap_attention` (layout
``[B, T, H, D]``): pure linear attention for ``window=0``, else the sliding-window hybrid with
``sinks`` attention sinks (DESIGN §6).

Input scale: the feature maps see ``x · D^{-1/4}`` (the ``"sqrt-d"`` convention of every Θ fit and
export), so their kernel is a polynomial in ``qᵀk/√D``; the exact local part keeps the model's
own logit scale (``local_scale = scaling · √D`` on the pre-scaled q, k, i.e. the model's
``scaling · qᵀk``: ``1/√D`` for LLaMA and BERT, ``1/(√D·(ℓ+1))`` for GPT-2 with
``scale_attn_by_inverse_layer_idx``).

transformers models call :func:`hf_attention` (registered in its ``AttentionInterface`` under
:data:`ATTENTION_NAME`) with ``query [B, H, T, D]``, ``key``/``value [B, H_kv, S, D]`` after the
rotary embedding; grouped-query keys and values are repeated to the ``H`` query heads as
transformers' ``repeat_kv`` does, and every query head has its own feature maps. Its mask function
(:func:`hf_mask`, the same name in ``AttentionMaskInterface``) hands on the 2-D padding mask.

Decoding: :class:`~sketchlab.convert.cache.SketchStateCache` (a transformers ``Cache``) keeps one
:class:`sketchlab.attention.AttentionState` per layer instead of the keys and values: its
``update`` passes the new keys and values through unchanged, and the attention continues from the
layer's state and stores the new one — memory ``O(M·Dv + (w + sinks)·D)`` per head at any context
length. ``generate()`` of a converted model uses it by default.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["ATTENTION_NAME", "SketchedAttention", "forget_cache", "hf_attention", "hf_mask", "remember_cache"]

#: The name the converted models' attention is registered under in transformers' interfaces.
ATTENTION_NAME = "sketchlab"
LOCALS = ("softmax", "poly")


def featuremap_attention(*args, **kwargs):
    """:func:`sketchlab.attention.featuremap_attention` (imported on first use)."""
    from ..attention import featuremap_attention as attend

    return attend(*args, **kwargs)


class SketchedAttention(nn.Module):
    r"""Feature maps and gate of one converted attention layer; calls the hybrid attention.

    Parameters
    ----------
    feature_map_q, feature_map_k : FeatureMap
        :mod:`sketchlab.featuremaps` modules with ``heads`` heads of dimension ``head_dim``
        (``features(x [B, T, H, D]) -> [B, T, H, M]``).
    heads, head_dim : int
        Query heads ``H`` and head dimension ``D``.
    window, sinks : int >= 0
        Exact local keys and attention sinks (``window=0``: pure linear attention, no gate).
    local : {"softmax", "poly"}
        The exact local part.
    gate : bool
        A learnable per-head gate logit ``[H]`` (initialised at 0: ``g = 1/2``); ``False``: none
        (``g = 1/2`` fixed). Ignored for ``window=0``.
    normalize : str or None
        Passed to the attention (``None``: its default).
    non_negative : bool
        Self-tensor the features (fixed here, never chosen per call from the maps' current signs).
    eps : float
        Added to the denominator.
    causal : bool
        The model's masking (BERT: ``False``).

    Notes
    -----
    ``forward(q, k, v, scaling=s)`` computes ``featuremap_attention(q·c, k·c, v, φ_Q, φ_K,
    local_scale=s/c²)`` with ``c = D^{-1/4}``: the far part sees the ``"sqrt-d"`` inputs, the
    local part the model's own logits ``s·qᵀk``.
    """

    def __init__(self, feature_map_q: nn.Module, feature_map_k: nn.Module, *, heads: int, head_dim: int,
                 window: int, sinks: int, local: str = "softmax", gate: bool = True, normalize: str | None = None,
                 non_negative: bool = False, eps: float = 1e-6, causal: bool = True):
        super().__init__()
        if local not in LOCALS:
            raise ValueError(f"local must be one of {list(LOCALS)}, got {local!r}")
        self.feature_map_q = feature_map_q
        self.feature_map_k = feature_map_k
        self.heads, self.head_dim = int(heads), int(head_dim)
        self.window, self.sinks, self.local = int(window), int(sinks), local
        self.normalize, self.non_negative, self.causal = normalize, bool(non_negative), bool(causal)
        self.eps = float(eps)
        self.gate = nn.Parameter(torch.zeros(heads)) if gate and window > 0 else None  # [H] logits
        self.input_scale = head_dim ** -0.25
        self._cache_layer = None  # set for one call by remember_cache (not state: never saved)

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, head_dim={self.head_dim}, window={self.window}, sinks={self.sinks}, "
                f"local={self.local!r}, causal={self.causal}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float | None = None,
                key_padding_mask: torch.Tensor | None = None, initial_state=None, output_final_state: bool = False):
        """``q, k [B, T, H, D]``, ``v [B, T, H, Dv]`` → ``[B, T, H, Dv]`` (and the state with
        ``output_final_state``). ``scaling``: the model's logit scale (default ``1/√D``)."""
        c = self.input_scale
        scaling = 1.0 / math.sqrt(self.head_dim) if scaling is None else float(scaling)
        options = dict(causal=self.causal, window=self.window, sinks=self.sinks, local=self.local,
                       local_scale=scaling / (c * c), gate=self.gate, non_negative=self.non_negative, eps=self.eps,
                       key_padding_mask=key_padding_mask,
                       initial_state=initial_state, output_final_state=output_final_state)
        if self.normalize is not None:
            options["normalize"] = self.normalize
        return featuremap_attention(q * c, k * c, v, self.feature_map_q, self.feature_map_k, **options)


# ------------------------------------------------------------------------------------------------
# transformers: the attention and mask functions, the state cache


def hf_mask(*, attention_mask=None, **kwargs):
    """Mask function of :data:`ATTENTION_NAME`: the 2-D padding mask ``[B, past + T]`` (bool, True =
    a real token) as transformers hands it, or ``None`` when every token is real. Causality and the
    window are the attention's own (``module.is_causal``)."""
    if attention_mask is None or attention_mask.ndim != 2:
        return attention_mask
    mask = attention_mask.to(torch.bool)
    return None if bool(mask.all()) else mask


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, H_kv, S, D]`` → ``[B, S, H, D]``: q head ``h`` takes kv head ``h // (H / H_kv)`` (``repeat_kv``)."""
    if heads % x.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {x.shape[1]} key/value heads")
    return x.repeat_interleave(heads // x.shape[1], dim=1).transpose(1, 2)  # [B, S, H, D]


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function of :data:`ATTENTION_NAME` (``AttentionInterface``).

    ``query [B, H, T, D]``, ``key [B, H_kv, S, D]``, ``value [B, H_kv, S, Dv]`` (post-RoPE) →
    ``(out [B, T, H, Dv], None)`` through ``module.sketch`` (:class:`SketchedAttention`).
    ``attention_mask``: the 2-D padding mask of :func:`hf_mask` (its last ``S`` columns are this
    call's keys). With a :class:`SketchStateCache` the call continues from the layer's state.
    Attention dropout is not applied (the converted attention has none).
    """
    sketch = getattr(module, "sketch", None)
    if not isinstance(sketch, SketchedAttention):
        raise ValueError(f"{type(module).__name__} runs attention implementation {ATTENTION_NAME!r} but was not "
                         "converted (no .sketch); convert it with sketchlab.convert_attention")
    B, H, T, _ = query.shape
    S = key.shape[2]
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(f"{ATTENTION_NAME}: expected a 2-D padding mask [B, S], got shape {tuple(attention_mask.shape)} "
                         "(a custom 4-D mask cannot be expressed as a window and a padding mask)")
    padding = None if attention_mask is None else attention_mask[:, -S:].to(torch.bool)  # [B, S]
    layer = getattr(sketch, "_cache_layer", None)
    offset = 0 if layer is None else getattr(layer.state, "offset", 0)  # the tokens the state holds
    if padding is not None and _pads_under_sinks(padding, sketch.sinks - offset):
        raise ValueError(f"{ATTENTION_NAME}: a left-padded batch puts the {sketch.sinks} attention sinks (the first "
                         "positions) on pad tokens, so a row's output would depend on its padding: pad on the right "
                         "(tokenizer.padding_side='right') or convert with sinks=0")
    if layer is None and S != T:
        raise ValueError(f"{ATTENTION_NAME}: {S} keys for {T} queries: a converted model decodes with "
                         "sketchlab.convert.cache.SketchStateCache (generate() uses it by default), not with a key/value cache")
    q = query.transpose(1, 2)  # [B, T, H, D]
    k, v = _repeat_heads(key, H), _repeat_heads(value, H)  # [B, S, H, D]
    if layer is None:
        return sketch(q, k, v, scaling=scaling, key_padding_mask=padding), None
    out, layer.state = sketch(q, k, v, scaling=scaling, key_padding_mask=padding, initial_state=layer.state,
                              output_final_state=True)
    return out, None


def remember_cache(module: nn.Module, args, kwargs) -> None:
    """Forward pre-hook of a converted attention module: point ``module.sketch`` at its layer of a
    :class:`~sketchlab.convert.cache.SketchStateCache` passed to this call (``cache=``), or at none."""
    from .cache import SketchStateCache

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        cache = next((a for a in args if type(a).__name__.endswith("Cache")), None)
    layer = None
    if isinstance(cache, SketchStateCache):
        layer = cache.layers[module.layer_idx]
    module.sketch._cache_layer = layer


def forget_cache(module: nn.Module, args, kwargs, output) -> None:
    """Forward hook beside :func:`remember_cache`: drop the pointer after the call."""
    module.sketch._cache_layer = None


def _pads_under_sinks(padding: torch.Tensor, first: int) -> bool:
    """Whether a row of ``padding [B, S]`` (True = a real token) has a pad among its first ``first``
    positions with a real token after it (left padding under the sinks)."""
    if first <= 0:
        return False
    head = padding[:, :first]
    real_after = padding.flip(1).cumsum(1).flip(1)[:, :first] - head.int()  # real tokens after each position
    return bool(((~head) & (real_after > 0)).any())
