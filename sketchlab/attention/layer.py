r"""``LinearAttentionCore``: the one layer core of every attention module (the toy model's kernel, a converted
model's :class:`~sketchlab.convert.sketched.SketchedAttention`, :class:`~sketchlab.attention.LLoPSAttention`).

It holds what one layer's linear attention learns and decides — the query and key feature maps, the
:class:`~sketchlab.attention.AttentionOptions`, the hybrid's gate and the far parameters
(:class:`~sketchlab.attention.FarParams`: decay, β, the short convolution's taps) — and calls the one op,

.. math:: o, S = \mathrm{linear\_attention}(q, k, v, \phi_Q, \phi_K;\ \text{options}, \text{far}, g),

on per-head ``q, k [B, T, H, D]``, ``v [B, T, H, Dv]`` (already scaled as the adapter's maps expect). The
defaults the options leave open (``normalize``, ``non_negative``) are decided here, by
:meth:`AttentionOptions.resolve <sketchlab.attention.AttentionOptions.resolve>` for this layer's maps, and
nowhere else: the adapters read :meth:`LinearAttentionCore.resolved_options`. The adapters subclass it, so the
parameters keep their names (``map_q.*``, ``map_k.*``, ``gate``, ``far.*``) in every saved file.
"""

from __future__ import annotations

import torch
from torch import nn

from .functional import linear_attention
from .options import AttentionOptions, FarParams

__all__ = ["LinearAttentionCore"]


class LinearAttentionCore(nn.Module):
    r"""One layer's feature maps, options, gate and far parameters, run through :func:`linear_attention`.

    Parameters
    ----------
    map_q : FeatureMap or None
        The query map (``heads = H``, ``head_dim = D``). ``None``: the layer has no feature map (an exact
        kernel that attends by itself, the toy model's ``"poly"``); the core then holds its options only.
    map_k : FeatureMap or None
        The key map; ``None`` (or ``map_q`` itself) ties it to the query map, registered once (as ``map_q``).
    options : AttentionOptions
        Every option, checked once by its constructor and kept as given (``local_scale`` included), but for the
        defaults it leaves open (``normalize``, ``non_negative`` None): decided here, once, for these maps
        (:meth:`resolved_options`), so the feature count a layer trains with never changes under it (a LLoPS
        map whose factors drift apart as it trains turns signed; decided per call, it would be self-tensored
        from then on).
    heads, dim_v : int
        ``H`` and the value width ``Dv`` (data-dependent decay and β read the value vector).
    dim : int or None
        ``D``, the q/k width the short convolution acts on (``options.qk_conv``).
    gate : bool
        A learnable per-head gate logit ``[H]`` (0 at the start: ``g = 1/2``) when ``options.window > 0``;
        ``False``: ``g = 1/2`` fixed.
    dtype, device
        Of the gate and the far parameters.

    Attributes
    ----------
    map_q, map_k : FeatureMap or None
        ``map_k`` None: tied (:attr:`key_map` is the map the keys go through).
    options : AttentionOptions
    gate : Parameter ``[H]`` or None
    far : FarParams or None
        The decay's, β's and the convolution's tensors (memory options or ``qk_conv`` only).
    """

    def __init__(self, map_q: nn.Module | None, map_k: nn.Module | None = None, *, options: AttentionOptions,
                 heads: int, dim_v: int, dim: int | None = None, gate: bool = True, dtype: torch.dtype | None = None,
                 device=None):
        super().__init__()
        if not isinstance(options, AttentionOptions):
            raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
        self.options = options
        self.map_q = map_q
        self.map_k = None if map_k is map_q else map_k  # a shared map is registered (and saved) once
        self.gate = (nn.Parameter(torch.zeros(heads, dtype=dtype, device=device))
                     if map_q is not None and gate and options.window else None)
        self.far = (FarParams(options, heads, dim_v, gate=False, dim=dim).to(dtype=dtype, device=device)
                    if map_q is not None and (options.memory or options.qk_conv) else None)
        self.options = self.resolved_options()  # the open defaults decided once, for these maps

    # the options by their attribute names (read-only: the options object is the one record)
    causal = property(lambda self: self.options.causal)
    normalize = property(lambda self: self.options.normalize)
    eps = property(lambda self: self.options.eps)
    backend = property(lambda self: self.options.backend)
    chunk_size = property(lambda self: self.options.chunk_size)
    window = property(lambda self: self.options.window)
    sinks = property(lambda self: self.options.sinks)
    local = property(lambda self: self.options.local)
    local_scale = property(lambda self: self.options.local_scale)

    @property
    def key_map(self) -> nn.Module | None:
        """The map the keys go through: ``map_k``, or ``map_q`` when tied."""
        return self.map_q if self.map_k is None else self.map_k

    def resolved_options(self) -> AttentionOptions:
        """:attr:`options` with ``normalize`` and ``non_negative`` decided for this layer's maps, the one rule
        (:meth:`AttentionOptions.resolve <sketchlab.attention.AttentionOptions.resolve>`) the op applies on each
        call; a layer without a map has nothing to self-tensor."""
        fq, fk = self.map_q, self.key_map
        return self.options.resolve(True if fq is None else lambda: fq.non_negative and fk.non_negative)

    @property
    def non_negative(self) -> bool:
        """The features are self-tensored (``φ ⊗ φ``): the given ``non_negative`` or the default's decision."""
        return self.resolved_options().non_negative

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, options: AttentionOptions | None = None,
               segments=None, key_padding_mask=None, initial_state=None, output_final_state: bool = False):
        """``q, k [B, T, H, D]``, ``v [B, T, H, Dv]`` → ``(o [B, T, H, Dv], state or None)`` through
        :func:`linear_attention` with this layer's maps, gate and far parameters; ``options`` (default
        :attr:`options`) replaces what a call changes (a converted model's logit scale)."""
        return linear_attention(q, k, v, self.map_q, self.map_k, options=self.options if options is None else options,
                                params=self.far, gate=self.gate, segments=segments, key_padding_mask=key_padding_mask,
                                initial_state=initial_state, output_final_state=output_final_state)
