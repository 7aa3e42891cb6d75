r"""The sketched attention a converted model runs, and the state it decodes with.

:class:`SketchedAttention` holds what conversion adds to one attention module — the query and key
feature maps, the per-head gate and the far parameters, as ``nn.Parameter`` s registered on that module (so
they train and save with it) — and calls :func:`sketchlab.attention.linear_attention` through the one layer core
it subclasses (:class:`~sketchlab.attention.layer.LinearAttentionCore`; layout ``[B, T, H, D]``): pure linear attention for ``window=0``, else the sliding-window hybrid with
``sinks`` attention sinks (DESIGN §6).

Input scale: the feature maps see ``x · D^{-1/4}`` (the ``"sqrt-d"`` convention of every Θ fit and
export), so their kernel is a polynomial in ``qᵀk/√D``; the exact local part keeps the model's
own logit scale (``local_scale = scaling · √D`` on the pre-scaled q, k, i.e. the model's
``scaling · qᵀk``: ``1/√D`` for LLaMA and BERT, ``1/(√D·(ℓ+1))`` for GPT-2 with
``scale_attn_by_inverse_layer_idx``).

transformers models call :func:`hf_attention` (registered in its ``AttentionInterface`` under
:data:`ATTENTION_NAME`) with ``query [B, H, T, D]``, ``key``/``value [B, H_kv, S, D]`` after the
rotary embedding; grouped-query keys and values are repeated to the ``H`` query heads as
transformers' ``repeat_kv`` does, and every query head has its own feature maps (a layer kept exact,
:class:`~sketchlab.convert.exact.ExactAttention`, takes the ``H_kv`` heads as they are). Its mask function
(:func:`hf_mask`, the same name in ``AttentionMaskInterface``) hands on the 2-D padding mask.

Padding: the window and the sinks are positions, so a call that starts a sequence moves each row's
pads out of them before the attention and puts the outputs back afterwards (:func:`_padding_order`):
a causal row becomes [its first ``sinks`` real tokens, its pads, its other real tokens] (left
padding, how transformers batches ``generate()``, and pads between real tokens alike; pads after the
last real token stay there), a non-causal (encoder) row [its real tokens, its pads]. q and k arrive
rotated, so the move changes no phase; with the position ids transformers derives from the mask
(``generate()``; a direct forward must pass them) the result equals each row run alone unpadded, and
every causal row still ends at the same position, so the state it leaves continues as it would for
that row alone. What no reorder can make exact (a causal prompt shorter than the sinks in a call with a
cache, which would continue it; pads before real tokens in a continued sequence) is refused (see
:func:`hf_attention`).

Decoding: :class:`~sketchlab.convert.cache.SketchStateCache` (a transformers ``Cache``) keeps one
:class:`sketchlab.attention.AttentionState` per layer instead of the keys and values: its
``update`` passes the new keys and values through unchanged, and the attention continues from the
layer's state and stores the new one — memory ``O(M·Dv + (w + sinks)·D)`` per head at any context
length. ``generate()`` of a converted model uses it by default.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..attention.layer import LinearAttentionCore
from .old_keys import upgrade_keys

__all__ = ["ATTENTION_NAME", "LayerDecoder", "SketchedAttention", "forget_cache", "hf_attention", "hf_mask",
           "remember_cache"]

#: The name the converted models' attention is registered under in transformers' interfaces.
ATTENTION_NAME = "sketchlab"


def check_local_map(feature_map: nn.Module, *, window: int, local: str) -> None:
    """:func:`sketchlab.attention.functional.check_local_degree` for ``feature_map`` (its ``degree``,
    ``None`` when it has none, named by its class): where a layer is built
    (:class:`SketchedAttention`), where :func:`sketchlab.linearize` checks its conversion before
    any work, and in :func:`sketchlab.convert.scale.far_mass_gate`."""
    from ..attention.functional import check_local_degree

    check_local_degree(getattr(feature_map, "degree", None), type(feature_map).__name__, window=window, local=local)


class SketchedAttention(LinearAttentionCore):
    r"""Feature maps and gate of one converted attention layer; calls the hybrid attention: an adapter over
    :class:`~sketchlab.attention.layer.LinearAttentionCore` (the maps, options, gate and far parameters, and the
    call of the op) that adds the model's input scale, its logit scale per call, the short convolution of a
    reordered padded batch and the lean decoder.

    Parameters
    ----------
    feature_map_q, feature_map_k : FeatureMap
        :mod:`sketchlab.featuremaps` modules with ``heads`` heads of dimension ``head_dim``
        (``features(x [B, T, H, D]) -> [B, T, H, M]``), held as ``map_q`` and ``map_k``. One module passed twice
        is shared by q and k: registered once, as ``map_q`` (its parameters saved once; ``map_k`` None,
        :attr:`key_map` the map the keys go through).
    heads, head_dim : int
        Query heads ``H`` and head dimension ``D``.
    window, sinks : int >= 0
        Exact local keys and attention sinks (``window=0``: pure linear attention, no gate).
    local : {"softmax", "poly"}
        The exact local part; ``"poly"`` with a window needs maps with a polynomial ``degree``
        (:func:`sketchlab.attention.functional.check_local_degree`: refused here otherwise).
    gate : bool
        A learnable per-head gate logit ``[H]`` (initialised at 0: ``g = 1/2``); ``False``: none
        (``g = 1/2`` fixed). Ignored for ``window=0``.
    normalize : str or None
        Passed to the attention (``None``: its default).
    non_negative : bool or None
        Self-tensor the features; ``None`` (default, as :class:`~sketchlab.attention.LLoPSAttention`'s): decided for
        the maps by :meth:`AttentionOptions.resolve <sketchlab.attention.AttentionOptions.resolve>`, the op's one
        rule (:attr:`non_negative` reads the decision; the lean decoder follows it), once, when the layer is built
        (:class:`~sketchlab.attention.layer.LinearAttentionCore`), so the feature count never changes as the maps
        train; :func:`~sketchlab.convert.convert_attention` passes its own documented value, ``False`` unless asked.
    eps : float
        Added to the denominator.
    causal : bool
        The model's masking (BERT: ``False``).

    Notes
    -----
    ``forward(q, k, v, scaling=s)`` computes ``linear_attention(q·c, k·c, v, φ_Q, φ_K,
    options.replace(local_scale=s/c²))`` with ``c = D^{-1/4}``: the far part sees the ``"sqrt-d"`` inputs, the
    local part the model's own logits ``s·qᵀk``.
    """

    def __init__(self, feature_map_q: nn.Module, feature_map_k: nn.Module, *, heads: int, head_dim: int,
                 window: int, sinks: int, local: str = "softmax", gate: bool = True, normalize: str | None = None,
                 non_negative: bool | None = None, eps: float = 1e-6, causal: bool = True, cache: int = 0,
                 decay=None, state: str = "additive", beta: str = "head", qk_conv: int = 0):
        from ..attention.options import AttentionOptions

        # one validation of every option (DESIGN §7): the layer keeps the object and passes it on
        options = AttentionOptions(causal=causal, normalize=normalize, non_negative=non_negative, eps=eps,
                                   window=window, sinks=sinks, local=local, cache=cache, decay=decay,
                                   state=state, beta=beta, qk_conv=qk_conv)
        check_local_map(feature_map_q, window=window, local=local)  # before a model holds the layer
        super().__init__(feature_map_q, feature_map_k, options=options, heads=heads, dim_v=head_dim, dim=head_dim,
                         gate=gate)
        self.heads, self.head_dim = int(heads), int(head_dim)
        self.input_scale = head_dim ** -0.25
        self._cache_layer = None  # set for one call by remember_cache (not state: never saved)

    def _load_from_state_dict(self, state_dict, prefix, *args):  # conversions saved before the one layer core
        super()._load_from_state_dict(upgrade_keys(state_dict, prefix, self), prefix, *args)

    def extra_repr(self) -> str:
        o = self.options
        memory = f", cache={o.cache}, decay={o.decay!r}, state={o.state!r}" if o.memory else ""
        return (f"heads={self.heads}, head_dim={self.head_dim}, window={self.window}, sinks={self.sinks}, "
                f"local={self.local!r}, causal={self.causal}{memory}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float | None = None,
                key_padding_mask: torch.Tensor | None = None, initial_state=None, output_final_state: bool = False,
                convolved: bool = False):
        """``q, k [B, T, H, D]``, ``v [B, T, H, Dv]`` → ``[B, T, H, Dv]`` (and the state with
        ``output_final_state``). ``scaling``: the model's logit scale (default ``1/√D``); ``convolved``: q, k
        come through :meth:`convolve` already (a padded batch the attention reorders)."""
        c = self.input_scale
        scaling = 1.0 / math.sqrt(self.head_dim) if scaling is None else float(scaling)
        options = self.options.replace(local_scale=scaling / (c * c), **({"qk_conv": 0} if convolved else {}))
        out, state = self.attend(q * c, k * c, v, options=options, key_padding_mask=key_padding_mask,
                                 initial_state=initial_state, output_final_state=output_final_state)
        return (out, state) if output_final_state else out

    def decoder(self, state, scaling: float | None = None) -> LayerDecoder | None:
        """The lean decoding step of this layer continuing ``state`` (what :meth:`forward` returned with
        ``output_final_state``): :class:`LayerDecoder`, for inference (no gradient); None for a state
        of another kind (an attention substituted for this one's)."""
        from ..attention import AttentionState, MemoryState

        return LayerDecoder(self, state, scaling) if isinstance(state, (AttentionState, MemoryState)) else None

    def convolve(self, q: torch.Tensor, k: torch.Tensor, padding: torch.Tensor | None):
        """The short convolution of ``q, k [B, T, H, D]`` at the start of a sequence, pads (``padding`` False)
        as zeros: ``(q, k, (tail_q, tail_k))`` (:func:`sketchlab.attention.qk_conv.causal_conv`)."""
        from ..attention.qk_conv import causal_conv

        if padding is not None:
            keep = padding[:, :, None, None].to(q.dtype)
            q, k = q * keep, k * keep
        (q, tail_q), (k, tail_k) = causal_conv(q, self.far.conv_q), causal_conv(k, self.far.conv_k)
        c = self.input_scale  # the state carries the tails of the q, k the op convolves: q·c, k·c (forward's)
        return q, k, (tail_q * c, tail_k * c)


class LayerDecoder:
    r"""One converted layer decoding one token at a time: the short convolution of q, k where the layer has one
    (:class:`sketchlab.attention.qk_conv.ConvStep`), its maps' features once per token, then
    :class:`sketchlab.attention.recurrent.RecurrentStep` (each in place, checked once per state and per
    parameter version).

    Equal to :meth:`SketchedAttention.forward` on one token with the state (tested): the far part sees
    ``x·D^{-1/4}``, the exact part the model's logits ``s·qᵀk``; two LLoPS maps compute their features
    of ``q`` and ``k`` in one call (:func:`sketchlab.attention.ops.pair_features.llops_pair_features`),
    other maps through their ``features``; features self-tensored where the layer says so.
    """

    def __init__(self, sketch: SketchedAttention, state, scaling: float | None):
        from ..attention.qk_conv import ConvStep
        from ..attention.recurrent import RecurrentStep
        from ..featuremaps import LLoPSMap
        from ..featuremaps.hedgehog import HedgehogMap, hedgehog_pair_features
        from ..polynomial import self_tensor

        c = sketch.input_scale
        scaling = 1.0 / math.sqrt(sketch.head_dim) if scaling is None else float(scaling)
        fm_q, fm_k = sketch.map_q, sketch.key_map
        # the defaults decided as the forward's op decides them (one rule: AttentionOptions.resolve)
        options = sketch.resolved_options().replace(local_scale=scaling / (c * c))
        memory, lifted = options.memory, options.non_negative
        self.lift = self_tensor if memory and lifted else None  # a memory state's: self-tensored
        self.step_ = RecurrentStep.from_state(
            state, options=options, params=sketch.far, gate=sketch.gate, degree=getattr(fm_q, "degree", None),
            lift=lifted and not memory, non_negative=lifted or (fm_q.non_negative and fm_k.non_negative))
        self.conv = ConvStep.from_state(state, options=options, params=sketch.far) if options.qk_conv else None
        self.heads, self.c, self.B = sketch.heads, c, state.S.shape[0]
        if isinstance(fm_q, LLoPSMap) and isinstance(fm_k, LLoPSMap):
            from ..attention.ops.pair_features import llops_pair_features

            self.features = llops_pair_features(fm_q.theta, fm_k.theta, self.B)
        elif isinstance(fm_q, HedgehogMap) and isinstance(fm_k, HedgehogMap):
            self.features = hedgehog_pair_features(fm_q, fm_k, self.B)
        else:
            self.features = self._map_features
        self.fm_q, self.fm_k = fm_q, fm_k

    def _map_features(self, q: torch.Tensor, k: torch.Tensor):
        """``q, k [B·H, 1, D]`` → their maps' features ``[B·H, 1, M]`` (the maps' own fast path, inputs trusted)."""
        B, H = self.B, self.heads
        f = [m._features(x.view(B, H, 1, -1).transpose(1, 2)).transpose(1, 2).reshape(B * H, 1, -1)
             for m, x in ((self.fm_q, q), (self.fm_k, k))]
        return f[0], f[1]

    @property
    def offset(self) -> int:
        return self.step_.offset

    @property
    def nbytes(self) -> int:
        return self.step_.nbytes

    def state(self):
        """The state after the tokens so far (as :meth:`SketchedAttention.forward` returns it)."""
        state = self.step_.state()
        if self.conv is None:
            return state
        tq, tk = self.conv.tails()
        return dataclasses.replace(state, conv_q=tq, conv_k=tk)

    @torch.inference_mode()
    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``query [B, H, 1, D]``, ``key [B, H_kv, 1, D]``, ``value [B, H_kv, 1, Dv]`` (as transformers hands
        them, post-RoPE) → ``[B, 1, H, Dv]`` (an inference tensor, as :meth:`RecurrentStep.step`'s)."""
        B, H, Hk = query.shape[0], self.heads, key.shape[1]
        # grouped-query attention: kv head h // (H / H_kv) for query head h (repeat_kv), one copy each
        rep = lambda x: x[:, :, None].expand(B, Hk, H // Hk, 1, x.shape[-1])  # noqa: E731
        c = self.c
        q = (query * c).view(B * H, 1, -1)
        k = torch.mul(rep(key), c).view(B * H, 1, -1)
        v = rep(value).reshape(B * H, 1, -1)
        if self.conv is not None:
            q, k = self.conv(q, k)
        fq, fk = self.features(q, k)
        if self.lift is not None:
            fq, fk = self.lift(fq), self.lift(fk)
        return self.step_.step(q, k, v, fq, fk).view(B, H, 1, -1).transpose(1, 2)


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
    r"""transformers attention function of :data:`ATTENTION_NAME` (``AttentionInterface``).

    ``query [B, H, T, D]``, ``key [B, H_kv, S, D]``, ``value [B, H_kv, S, Dv]`` (post-RoPE) →
    ``(out [B, T, H, Dv], None)`` through ``module.sketch`` (:class:`SketchedAttention`).
    ``attention_mask``: the 2-D padding mask of :func:`hf_mask` (its last ``S`` columns are this
    call's keys). With a :class:`SketchStateCache` the call continues from the layer's state.
    Attention dropout is not applied (the converted attention has none).

    Padding. With a window (``window > 0``; pure linear attention needs none of this, its
    result is independent of where the pads lie) a call that starts a sequence (no state, or an
    empty one) runs each row whose pads lie before some real token with its tokens reordered by
    :func:`_padding_order` — causal: [its first ``sinks`` real tokens, the pads before its last
    real token, the other real tokens, the pads after it]; non-causal: [its real tokens, its
    pads] — applied to q, k, v and the mask, and the output put back in place. The real tokens'
    outputs then equal those of each row alone, unpadded, for any ``attention_mask`` (left
    padding, pads between real tokens). Right-padded and unpadded batches run as given.

    Raises
    ------
    ValueError
        An ``attention_mask`` that is not ``[B, past + S]`` (``past``: the tokens the layer's state
        holds; 0 without a cache). Padding no reorder makes exact: a causal row with pads before
        real tokens and fewer than ``sinks`` real tokens in a call with a cache (its later tokens
        would be sinks alone, but land after the pads; without a cache nothing continues and its
        outputs are exact), and a pad before a real token in a call that continues a state (no
        token can move in front of the state's; the window would count the pad as a position).

    Notes
    -----
    Why the causal reorder is exact for a row with ``P`` pads before its last real token and
    ``R >= sinks`` real tokens (left padding, the layout ``generate()`` makes, or pads between
    real tokens). q and k were rotated from the real tokens' position ids, so moving a token
    moves its phase with it; pads are masked keys. Real token ``r`` sits at position ``i = r``
    for ``r < sinks`` and ``i = r + P`` after, so the causal window ``i − w < j ≤ i`` holds,
    besides pads, the real tokens ``max(sinks, r − w + 1) … r``, and the sinks are positions
    ``0 … sinks − 1``: its local keys are the sinks and ``r − w + 1 … r`` and its far keys the
    other ``j ≤ r``, those of the row alone. Every row with a real last token still ends at
    position ``T − 1``, so the state left (the last ``w`` positions, the far sums, the sinks) is
    the row's own, and tokens appended at the end continue it exactly (:class:`SketchStateCache`,
    ``generate()``; transformers derives position ids from the mask there, a direct forward must
    pass them). Non-causal: the real tokens at positions ``0 … R − 1`` are the row alone, its
    window ``|i − j| < w`` and sinks ``j < sinks`` the same; the pads behind are masked keys.
    Pads a row ends with stay in place (exact for its outputs; a state continued after them, as
    after right padding, counts them as positions).
    """
    from .exact import ExactAttention

    sketch = getattr(module, "sketch", None)
    if not isinstance(sketch, (SketchedAttention, ExactAttention)):
        raise ValueError(f"{type(module).__name__} runs attention implementation {ATTENTION_NAME!r} but was not "
                         "converted (no .sketch); convert it with sketchlab.convert_attention")
    B, H, T, _ = query.shape
    S = key.shape[2]
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(f"{ATTENTION_NAME}: expected a 2-D padding mask [B, S], got shape {tuple(attention_mask.shape)} "
                         "(a custom 4-D mask cannot be expressed as a window and a padding mask)")
    layer = getattr(sketch, "_cache_layer", None)
    if layer is not None and T == 1 and S == 1 and sketch.causal and not torch.is_grad_enabled():
        out = _decode(sketch, layer, query, key, value, attention_mask, scaling)  # the lean step, or None
        if out is not None:
            return out, None
    offset = 0 if layer is None else layer.offset  # the tokens the state holds
    if attention_mask is not None and tuple(attention_mask.shape) != (B, offset + S):
        raise ValueError(f"{ATTENTION_NAME}: attention_mask has shape {tuple(attention_mask.shape)}, expected "
                         f"[{B}, {offset + S}]: one row per sequence and one column per key ({offset} earlier "
                         f"token(s) in the state and the {S} of this call)")
    padding = None if attention_mask is None else attention_mask[:, -S:].to(torch.bool)  # [B, S]
    if layer is None and S != T:
        raise ValueError(f"{ATTENTION_NAME}: {S} keys for {T} queries: a converted model decodes with "
                         "sketchlab.convert.cache.SketchStateCache (generate() uses it by default), not with a key/value cache")
    order = None  # [B, S] the per-row order that makes the padding exact, or None (run as given)
    if padding is not None and sketch.window:  # window 0: pure linear attention, positions never matter
        if offset:  # a causal call continuing a state: no token can move in front of the state's
            _refuse_pads_before_tokens(padding, offset)
        else:
            order = _padding_order(padding, sketch.sinks if sketch.causal else S)
            moved = (order != torch.arange(S, device=order.device)).any(1)  # [B]
            if not bool(moved.any()):
                order = None
            elif sketch.causal and layer is not None:  # without a cache its outputs are exact: nothing continues
                _refuse_short_rows(padding, moved, sketch.sinks)
    q = query.transpose(1, 2)  # [B, T, H, D]
    if isinstance(sketch, ExactAttention):  # the H_kv heads: its state keeps them, as the teacher's cache
        k, v = key.transpose(1, 2), value.transpose(1, 2)  # [B, S, H_kv, D]
    else:
        k, v = _repeat_heads(key, H), _repeat_heads(value, H)  # [B, S, H, D]
    tails = None  # the short convolution reads each token's neighbours in the row's own order: before the reorder
    if order is not None and isinstance(sketch, SketchedAttention) and sketch.options.qk_conv:
        q, k, tails = sketch.convolve(q, k, padding)
    if order is not None:
        q, k, v, padding = _take(q, order), _take(k, order), _take(v, order), padding.gather(1, order)
    convolved = {} if tails is None else {"convolved": True}
    if layer is None:
        out = sketch(q, k, v, scaling=scaling, key_padding_mask=padding, **convolved)
    else:
        out, layer.state = sketch(q, k, v, scaling=scaling, key_padding_mask=padding, initial_state=layer.state,
                                  output_final_state=True, **convolved)
        if tails is not None:  # every row ends where it did: its tail is the last inputs in its own order
            layer.state = dataclasses.replace(layer.state, conv_q=tails[0], conv_k=tails[1])
    if order is not None:
        out = _take(out, order.argsort(1))  # the inverse permutation: each output back at its token
    return out, None


def _decode(sketch, layer, query, key, value, attention_mask, scaling):
    """One decoded token through the layer's lean decoder (made from its state on the first token), or
    None where the general path must run: no state yet, or a pad as the new token (the decoders take
    real tokens). No other check per token: the decoder checked the state once."""
    if attention_mask is not None and not bool(attention_mask[:, -1].all()):
        return None
    dec = layer.decoder
    if dec is None:
        state = layer.state
        if getattr(state, "offset", 0) == 0:
            return None
        dec = sketch.decoder(state, scaling)
        if dec is None:
            return None
        layer._state, layer.decoder = None, dec
    return dec.step(query, key, value)


def _padding_order(padding: torch.Tensor, first: int) -> torch.Tensor:
    r"""The per-row order that makes a padded row's window and sinks those of the row alone.

    Parameters
    ----------
    padding : bool Tensor ``[B, T]``
        True = a real token.
    first : int >= 0
        How many real tokens go in front: the sinks (causal), or ``T`` (non-causal: all of them).

    Returns
    -------
    order : long Tensor ``[B, T]``
        ``order[b, i]`` is the token that goes to position ``i`` of row ``b``, in four groups, each
        in its original order (a stable sort): (0) the row's first ``first`` real tokens, (1) the
        pads with a real token after them, (2) the other real tokens, (3) the pads after the last
        real token. ``x.gather(1, order)`` reorders, ``y.gather(1, order.argsort(1))`` puts back.
        The real tokens past the first ``first`` thus lie side by side, and no pad lies before
        one of the first ``first``. Left padding ``[pad]·P + [x_0 … x_{R−1}]`` becomes
        ``[x_0 … x_{first−1}] + [pad]·P + [x_{first} … x_{R−1}]``; ``first >= T`` makes every row
        right-padded; a right-padded (or unpadded) row keeps the identity.
    """
    real_before = padding.cumsum(1)  # [B, T] real tokens up to and including each position
    real_after = real_before[:, -1:] - real_before  # [B, T] real tokens after each position
    group = torch.where(padding, torch.where(real_before <= first, 0, 2), torch.where(real_after > 0, 1, 3))
    return torch.sort(group.to(torch.uint8), dim=1, stable=True).indices


def _take(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x [B, T, H, D]`` with its tokens in ``order [B, T]`` (per row, along ``T``)."""
    return x.gather(1, order[:, :, None, None].expand(x.shape))


def _row(padding: torch.Tensor, which: torch.Tensor) -> str:
    """The first row of ``which [B]`` with its counts in ``padding [B, S]``, for an error message."""
    b = int(which.nonzero()[0, 0])
    pads, tokens = int((~padding[b]).sum()), padding.shape[1]
    return f"{ATTENTION_NAME}: row {b} of the batch ({pads} of its {tokens} tokens pads)"


def _refuse_short_rows(padding: torch.Tensor, moved: torch.Tensor, sinks: int) -> None:
    """Refuse a causal row that :func:`_padding_order` moves (``moved [B]``) with fewer real tokens
    than ``sinks`` in ``padding [B, S]``: its next tokens would be sinks but come after the pads.

    The remedies the message names are the ones that give each prompt its own continuation: every
    prompt at least ``sinks`` tokens, at most as many sinks as the shortest prompt has tokens, or
    the short prompt run unpadded in a batch of its own. Right padding is not one: ``generate()``
    appends the new tokens after the pads, which the window then counts as positions."""
    real = padding.sum(1)  # [B]
    short = (real < sinks) & moved  # [B]
    if bool(short.any()):
        fewest = int(real[short].min())
        raise ValueError(f"{_row(padding, short)} has pads before real tokens and fewer real tokens than the {sinks} "
                         f"attention sinks: its next tokens would be sinks but come after the pads; give every "
                         f"prompt at least {sinks} tokens, convert with at most {fewest} sinks, or generate the "
                         "short prompt alone (unpadded, in a batch of its own). Right padding does not help: "
                         "generate() appends the new tokens after the pads")


def _refuse_pads_before_tokens(padding: torch.Tensor, offset: int) -> None:
    """Refuse a row of ``padding [B, S]`` (the keys of a call continuing a state of ``offset``
    tokens) with a pad before a real token: the window would count the pad as a position."""
    rows = (padding[:, 1:] > padding[:, :-1]).any(1)  # [B] a pad right before a real token
    if bool(rows.any()):
        raise ValueError(f"{_row(padding, rows)} has a pad before a real token in attention_mask, in a call that "
                         f"continues a sequence of {offset} tokens: the window would count the pad as a position "
                         "(pads are moved out of the window only in the call that starts the sequence); put the "
                         "pads in the first call")


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
