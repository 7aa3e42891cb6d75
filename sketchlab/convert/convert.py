r"""``convert_attention``: a pretrained model's self-attention swapped for sketched attention.

Every projection and weight stays; conversion adds per layer a
:class:`~sketchlab.convert.sketched.SketchedAttention` (query and key feature maps, a per-head
gate) registered as ``<attention module>.sketch`` — so its parameters train with the model and
save in its ``state_dict`` — and switches the model to the attention implementation
:data:`~sketchlab.convert.sketched.ATTENTION_NAME` (transformers) or replaces the kernel (toy).
The converted model takes the same inputs (``input_ids``, ``attention_mask``, ``labels``).

Saving: ``model.save_pretrained(dir)`` writes every weight, the maps included, and the config
(which carries the conversion options as ``config.sketchlab``); :func:`sketchlab.convert.saved.load_linearized`
converts a freshly loaded model with those options and restores the weights. (transformers'
``from_pretrained`` alone cannot rebuild the maps: the modelling classes do not have them.)
"""

from __future__ import annotations

import copy
import math
import numbers
import types
import warnings
from pathlib import Path

import torch
from torch import nn

from .._validation import DEFAULT_MAX_BYTES, check_int, check_memory, check_real
from ..attention._checks import check_eps
from .exact import ExactAttention
from .families import ConvertedToyKernel, attention_sites
from .sketched import ATTENTION_NAME, SketchedAttention, forget_cache, hf_attention, hf_mask, remember_cache

__all__ = ["DEFAULT_SINKS", "check_layout", "check_map_memory", "convert_attention", "converted_modules"]

#: Attention sinks of a hybrid (``window > 0``) when ``sinks=None``: the measured best for converted
#: models (DESIGN §6). Pure linear attention (``window=0``) has no exact keys and gets none.
DEFAULT_SINKS = 4


def check_layout(window, sinks, local: str = "softmax", normalize: str | None = None) -> tuple[int, int]:
    """The conversion's ``(window, sinks)``, checked with the attention's own rules before any model is touched.

    ``window``: an integer ``>= 0``. ``sinks=None``: :data:`DEFAULT_SINKS` with a window, ``0`` for
    pure linear attention (``window=0``); an explicit ``sinks > 0`` needs ``window >= 1``. ``local``
    in ``("softmax", "poly")``; ``normalize``: ``None`` (the attention's default, ``"sum"``) or one
    of :data:`sketchlab.attention._checks.NORMALIZE`, and ``"sum"`` with a window (the hybrid is
    always normalised). ``local`` and ``normalize`` are the options' own rules, through
    :func:`sketchlab.attention._checks.check_hybrid`.
    """
    from ..attention._checks import check_hybrid

    window = check_int(window, "window", 0)
    if sinks is None:
        sinks = DEFAULT_SINKS if window else 0
    sinks = check_int(sinks, "sinks", 0)
    if sinks and not window:
        raise ValueError(f"sinks={sinks} with window=0: attention sinks are exact keys, and window=0 is pure linear "
                         f"attention (none); pass window >= 1 or sinks=0 (sinks=None gives {DEFAULT_SINKS} with a "
                         "window and 0 without)")
    check_hybrid(window, sinks, local, None, None, normalize="sum" if normalize is None else normalize, heads=1,
                 dim=1, like=torch.empty(0))
    return window, sinks


def check_map_memory(sites, attention: str, *, p: int, m: int, rank: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """Refuse, before any map is drawn, feature maps whose parameters exceed ``max_bytes``: two maps
    per layer of at most ``H·rank·p·D·m`` values (LLoPS, the largest), drawn in float64
    (:func:`sketchlab._validation.check_memory`: the size, the budget, the way out)."""
    values = 2 * sum(site.heads * site.head_dim for site in sites) * rank * p * m
    check_memory(values * 8, max_bytes=max_bytes,
                 what=f"the {attention!r} feature maps of {len(sites)} layers (two per layer, up to H·rank·p·D·m "
                      f"parameters each, drawn in float64; p={p}, m={m}, rank={rank})",
                 way_out="give a smaller m, rank or p")


def _theta_tensors(theta, layers: int):
    """``theta`` (a Θ export path or ``(theta_q, theta_k)`` of shape ``[L, H, t, p, d, m]``) as two
    float64 tensors, scaled to the ``"sqrt-d"`` input convention the maps see."""
    from ..io import load_theta
    from ..tasks.inits import _theta_factor

    if isinstance(theta, (str, Path)):
        theta_q, theta_k, meta = load_theta(Path(theta))
        scale = meta["scale"]
        where = str(theta)
    else:
        if not (isinstance(theta, (tuple, list)) and len(theta) == 2):
            raise ValueError("theta must be a Θ export file or a pair (theta_q, theta_k) of [L, H, t, p, d, m] tensors")
        theta_q, theta_k = (torch.as_tensor(t) for t in theta)
        scale, where = "sqrt-d", "theta"
    if theta_q.ndim != 6 or theta_q.shape != theta_k.shape:
        raise ValueError(f"{where}: theta_q and theta_k must both have shape [L, H, t, p, d, m], got "
                         f"{tuple(theta_q.shape)} and {tuple(theta_k.shape)}")
    if theta_q.shape[0] != layers:
        raise ValueError(f"{where}: Θ has {theta_q.shape[0]} layers, the model {layers}")
    rho = _theta_factor(scale, theta_q.shape[4], where)
    return theta_q.double() * rho, theta_k.double() * rho


def _load_theta_into(feature_map: nn.Module, theta: torch.Tensor, where: str) -> None:
    """Copy ``theta [H, t, p, d, m]`` into the one parameter of ``feature_map`` of that shape."""
    matches = [p for p in feature_map.parameters() if tuple(p.shape) == tuple(theta.shape)]
    if len(matches) != 1:
        shapes = [tuple(p.shape) for p in feature_map.parameters()]
        raise ValueError(f"{where}: Θ of shape {tuple(theta.shape)} matches {len(matches)} parameters of "
                         f"{type(feature_map).__name__} (shapes {shapes}); expected exactly one")
    with torch.no_grad():
        matches[0].copy_(theta.to(matches[0].dtype))


def _make_maps(attention: str, feature_map, layer: int, heads: int, head_dim: int, p: int, m: int, rank: int,
               seed: int, tied: bool = False, input_norm: bool = False):
    """``(map_q, map_k)`` of one layer, each wrapped in :class:`~sketchlab.featuremaps.InputNormed` with
    ``input_norm`` (one wrapper when both are one map); see :func:`_own_maps`."""
    maps = _own_maps(attention, feature_map, layer, heads, head_dim, p, m, rank, seed, tied)
    if not input_norm:
        return maps
    from ..featuremaps import InputNormed

    return (InputNormed(maps[0]),) * 2 if maps[0] is maps[1] else tuple(InputNormed(x) for x in maps)


def _own_maps(attention: str, feature_map, layer: int, heads: int, head_dim: int, p: int, m: int, rank: int,
              seed: int, tied: bool):
    """``(map_q, map_k)`` of one layer: ``feature_map(layer, heads, head_dim)`` when given (a map or a
    pair), else two :func:`sketchlab.featuremaps.make_feature_map` maps named ``attention`` (seeds
    ``seed + 2·layer`` for queries, ``+ 1`` for keys); ``tied``: LLoPS as
    :class:`~sketchlab.convert.scale.TiedLLoPSMap` started from the same draw (its equal factors are
    already tied: the first one is kept). A :class:`~sketchlab.Fit` (``fit_sketch``'s) gives a copy of its maps:
    of batch ``[L, H]``, layer ``layer``'s (:meth:`~sketchlab.Fit.layer`); else (``[H]``) the same maps at every
    layer, each layer its own copy."""
    from ..fit import Fit

    if isinstance(feature_map, Fit):
        fit = feature_map
        maps = fit.layer(layer) if len(fit.batch_shape) == 2 else copy.deepcopy(fit.maps)  # a tied pair stays tied
        if maps[0].heads != heads or maps[0].head_dim != head_dim:
            raise ValueError(f"feature_map: the fit's maps of layer {layer} have heads={maps[0].heads}, "
                             f"head_dim={maps[0].head_dim} (batch shape {list(fit.batch_shape)}); the model's attention "
                             f"has heads={heads}, head_dim={head_dim}")
        return maps
    if feature_map is not None:
        made = feature_map(layer, heads, head_dim)
        maps = tuple(made) if isinstance(made, (tuple, list)) else (made, made)
        if len(maps) != 2 or not all(isinstance(x, nn.Module) for x in maps):
            raise TypeError(f"feature_map(layer, heads, head_dim) must return a FeatureMap module or a pair of them, "
                            f"got {type(made).__name__}")
        return maps
    from ..featuremaps import make_feature_map

    maps = tuple(make_feature_map(attention, heads=heads, head_dim=head_dim, p=p, m=m, rank=rank,
                                  seed=seed + 2 * layer + side) for side in range(2))
    if tied:
        from .scale import TiedLLoPSMap

        maps = tuple(TiedLLoPSMap(heads, head_dim, x.theta.detach()[:, :, 0], p=p) for x in maps)  # [H, t, D, M]
    return maps


def _warn_teacher_window(model: nn.Module) -> None:
    """Warn (once) when a transformers model's own attention is limited to a sliding window
    (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``, on every layer or on those its
    ``layer_types`` mark ``"sliding_attention"``): the converted attention sees every earlier key,
    so it is no longer the teacher's attention past that window, whatever ``window`` is."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    span = getattr(cfg, "sliding_window", None)
    if isinstance(span, bool) or not isinstance(span, int) or span <= 0:
        return
    if getattr(cfg, "use_sliding_window", True) is False:
        return
    kinds = getattr(cfg, "layer_types", None)
    layers = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"] if kinds else None
    if layers == []:
        return
    where = "every layer" if layers is None or len(layers) == len(kinds) else f"layers {layers}"
    flag = ", config.use_sliding_window=True" if hasattr(cfg, "use_sliding_window") else ""
    warnings.warn(f"convert_attention: {type(model).__name__}'s own attention keeps only the last {span} keys on "
                  f"{where} (config.sliding_window={span}{flag}); the converted attention sees every earlier key "
                  f"(the window exact, the rest sketched), so it differs from the teacher's on sequences longer than "
                  f"{span} tokens, even with window >= T", stacklevel=3)


def _resolve_tied(tied, attention: str, feature_map, p: int, family: str, has_theta: bool) -> bool:
    """``tied=None``: the tied map for LLoPS of even degree on a transformers model (DESIGN §6), the
    untied one on the toy model; an explicit ``True`` checked against what the tied map can be."""
    if tied is None:
        return attention == "llops" and feature_map is None and p % 2 == 0 and family != "toy" \
            and (not has_theta or p == 2)
    if not isinstance(tied, bool):
        raise TypeError(f"tied must be None or a bool, got {tied!r}")
    if tied:
        if attention != "llops" or feature_map is not None:
            raise ValueError(f"tied=True makes the LLoPS map tied: it needs attention='llops' and no feature_map "
                             f"(got attention={attention!r}{', a feature_map' if feature_map is not None else ''})")
        if p % 2:
            raise ValueError(f"tied=True needs an even degree p (each feature (x·θ)^p >= 0), got p={p}")
        if has_theta and p != 2:
            raise ValueError(f"tied=True with a fitted theta needs p=2 (tie_theta ties degree-2 factors), got p={p}")
    return tied


def convert_attention(model: nn.Module, *, attention: str = "llops", p: int = 2, m: int = 64, rank: int = 1,
                      window: int = 64, sinks: int | None = None, local: str = "softmax", feature_map=None, theta=None,
                      normalize: str | None = None, non_negative: bool = False, eps: float = 1e-6, learn: bool = True,
                      gate: bool = True, gate_init: float = 0.0, tied: bool | None = None, input_norm: bool = False,
                      seed: int = 0, cache: int = 0, decay=None, state: str = "additive", beta: str = "head",
                      qk_conv: int = 0,
                      exact_layers=(), max_bytes: int = DEFAULT_MAX_BYTES) -> list[SketchedAttention]:
    r"""Swap every self-attention of ``model`` for sketched attention, in place; keep every weight.

    Parameters
    ----------
    model : nn.Module
        A transformers model of the LLaMA (Llama, Qwen2, Mistral, SmolLM: rotary, GQA), GPT-2 or
        BERT (BERT, RoBERTa, MiniLM: non-causal, padding masks) family — any head (``*Model``,
        ``*ForCausalLM``, …) — or sketchlab's :class:`~sketchlab.tasks.TransformerLM`.
    attention : str
        The feature map, by :func:`sketchlab.featuremaps.make_feature_map` name (``"llops"``,
        ``"hedgehog"``, ``"based-taylor"``, ``"psf-learned"``, ``"exact-poly"``, ``"dpfp"``, …; see
        :func:`sketchlab.featuremaps.feature_map_names`); one map for queries and one for keys per
        layer, each with the model's query heads.
    p, m, rank : int
        Degree, features and (LLoPS) CP rank of the maps.
    window : int >= 0
        Exact local keys (DESIGN §6: ``window=0`` is pure linear attention; ``window >= T`` with
        ``local="softmax"`` is exactly the model's softmax attention when the model's own attention
        is full causal (or, for encoders, bidirectional) softmax — not for a teacher that limits
        its attention to a sliding window shorter than ``T``, Mistral's ``sliding_window`` or
        Qwen2's ``use_sliding_window``: conversion warns, and its exact part then sees more keys
        than the teacher did).
    sinks : int >= 0 or None
        Attention sinks, the first tokens always kept exact. ``None`` (default):
        :data:`DEFAULT_SINKS` (4) with a window, ``0`` for ``window=0`` (which has no exact keys;
        an explicit ``sinks > 0`` there is refused). ``window=64`` and 4 sinks are the measured
        best for converted models. ``config.sketchlab`` records the resolved number.
    feature_map : callable or Fit, optional
        ``feature_map(layer, heads, head_dim)`` → a FeatureMap module (shared by q and k) or a pair
        ``(map_q, map_k)``, or a :class:`~sketchlab.Fit` (``fit_sketch``'s, batch ``[L, H]``: layer ``l``'s
        maps for layer ``l``, :meth:`~sketchlab.Fit.layer`; batch ``[H]``: its maps at every layer), instead of
        ``attention``.
    theta : str, Path or (Tensor, Tensor), optional
        ``attention="llops"`` only: a Θ export (:func:`sketchlab.export_theta`) or tensors
        ``[L, H, t, p, d, m]`` (fitted on ``"sqrt-d"``-scaled post-RoPE q, k) to start from.
    local, normalize
        As :class:`~sketchlab.attention.options.AttentionOptions`.
    non_negative : bool
        Self-tensor the features (``φ ⊗ φ``, ``M²`` features, a non-negative kernel). Fixed at
        conversion, so a map's feature count never changes while it trains; ``False`` keeps the ``M``
        features asked for (the hybrid's local part keeps its shared denominator positive; a
        signed far part is checked by the attention's denominator check).
    eps : float >= 0
        Added to the attention's denominator (relative error ``~eps`` against exact softmax, whose
        denominator is ``>= 1`` after the max shift).
    learn : bool
        Whether the new parameters (maps, gates) require gradients.
    gate : bool
        A learnable per-head gate logit (with ``window > 0``).
    gate_init : float
        Its initial value: ``g = sigmoid(gate_init)`` weighs the exact local part, ``1 − g`` the
        sketch (``0``: ``g = 1/2``; a large value starts from window + sinks alone, the sketch
        then entering as transfer trains the gate). Gates set from the teacher's attention
        (``"mass"``, ``"search"``) need recorded teacher inputs: :func:`sketchlab.linearize`
        (``gate_init=``) or :func:`sketchlab.convert.scale.calibrate_gates` after conversion.
    tied : bool or None
        LLoPS as the tied non-negative map :class:`~sketchlab.convert.scale.TiedLLoPSMap` (each
        feature ``Σ_r (x·θ_r)^p``, even ``p``; a given ``theta`` is tied by
        :func:`~sketchlab.convert.scale.tie_theta`, ``p = 2``) instead of
        :class:`~sketchlab.featuremaps.LLoPSMap`, whose signed fitted factors make the hybrid's far
        part dominate or go negative (DESIGN §6). ``None`` (default): tied for ``attention="llops"``
        with even ``p`` (and ``p = 2`` when ``theta`` is given) on transformers models, untied on
        the toy model (its equal factors stay equal under training) and for every other map.
    input_norm : bool
        Every converted layer's maps (tied or fitted LLoPS, a ``feature_map``'s too) applied to per-head
        layer-normalised q, k with a learnable per-head affine (:class:`~sketchlab.featuremaps.InputNormed`,
        trained with the maps): a bounded input, as PolySketchFormer's learned sketch has (DESIGN §6).
    seed : int
        Seeds torch's generator while the maps are built (random initialisations are reproducible).
    cache, decay, state, beta
        Long-context memory (DESIGN §7), as :class:`~sketchlab.attention.options.AttentionOptions`;
        causal models only. The new parameters (decay, β) live in each layer's ``.far`` and train with the maps.
    qk_conv : int
        A causal depthwise convolution of width ``K`` on each converted layer's q and k (0: none;
        :mod:`sketchlab.attention.qk_conv`), started as the identity so the model begins where it was;
        its weights live in ``.far`` and train with the maps. Causal models only.
    exact_layers : sequence of int
        Layers (0-based) kept exact: the teacher's softmax attention
        (:class:`~sketchlab.convert.exact.ExactAttention`), whose decoding state is a KV cache that
        grows with the context. transformers models only.
    max_bytes : int
        Memory budget of the maps' parameters (``2·L·H·rank·p·D·m`` values, drawn in float64), checked
        before any is built: a ``ValueError`` names the size, the budget and the way out (a smaller
        ``m``, ``rank`` or ``p``). Default 4 GiB.

    Returns
    -------
    list of SketchedAttention
        One per converted layer, in layer order, the exact layers left out
        (``converted_modules(model)`` finds them again).

    Notes
    -----
    transformers models switch to the attention implementation ``"sketchlab"`` (registered in
    ``AttentionInterface`` and ``AttentionMaskInterface``); their ``generate()`` decodes with a
    :class:`~sketchlab.convert.cache.SketchStateCache` (constant memory) instead of a growing KV cache.
    The options are recorded in ``model.config.sketchlab`` (saved by ``save_pretrained``). Padded
    batches (left padding, pads between real tokens, encoders alike) give each row's real tokens the
    outputs of the row alone (DESIGN §6; the layouts no reorder makes exact are refused); positions stay
    the caller's: ``generate()`` derives ``position_ids`` from the mask, but a direct ``model(ids,
    attention_mask=left_padded_mask)`` without them rotates (or, with absolute position embeddings like
    BERT's, embeds) each padded row at shifted positions, as the unconverted model's forward does.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if converted_modules(model, required=False):
        raise ValueError(f"{type(model).__name__} is already converted")
    if not isinstance(attention, str):
        raise TypeError(f"attention must be a feature-map name (str), got {type(attention).__name__}")
    p, m, rank = check_int(p, "p", 1), check_int(m, "m", 1), check_int(rank, "rank", 1)
    window, sinks = check_layout(window, sinks, local, normalize)
    eps = check_eps(eps)
    if isinstance(gate_init, str):
        raise ValueError(f"gate_init={gate_init!r}: convert_attention takes a number; gates from the teacher's "
                         "attention need its recorded inputs: use sketchlab.linearize(gate_init=...) or "
                         "sketchlab.convert.scale.calibrate_gates after conversion")
    gate_init = check_real(gate_init, "gate_init", lo=-math.inf, lo_open=True)
    for flag, name in ((learn, "learn"), (gate, "gate"), (non_negative, "non_negative"), (input_norm, "input_norm")):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if theta is not None and (attention != "llops" or feature_map is not None):
        raise ValueError(f"theta initialises LLoPS maps: it needs attention='llops' and no feature_map "
                         f"(got attention={attention!r})")
    from ..fit import Fit

    if feature_map is not None and not (callable(feature_map) or isinstance(feature_map, Fit)):
        raise TypeError("feature_map must be a sketchlab Fit (fit_sketch's) or callable: feature_map(layer, heads, "
                        "head_dim) -> FeatureMap or (map_q, map_k)")
    family, sites = attention_sites(model)
    exact = _check_exact_layers(exact_layers, len(sites), family)
    memory = _check_memory(cache, decay, state, beta, window, sinks, local, normalize,
                           causal=all(site.causal for site in sites), qk_conv=qk_conv)
    if feature_map is None:  # the maps' parameters, before any is drawn (a map of 10⁹ features: hundreds of GB)
        check_map_memory(sites, attention, p=p, m=m, rank=rank, max_bytes=max_bytes)
    tied = _resolve_tied(tied, attention, feature_map, p, family, theta is not None)
    if family != "toy":
        _warn_teacher_window(model)
    thetas = _theta_tensors(theta, len(sites)) if theta is not None else None
    if thetas is not None and tied:
        from .scale import tie_theta

        thetas = tuple(tie_theta(t) for t in thetas)  # [L, H, t, D, M]
    ref = next(model.parameters())
    sketches = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(check_int(seed, "seed", 0))
        for layer, site in enumerate(sites):
            if layer in exact:
                sketches.append(ExactAttention(heads=site.heads, head_dim=site.head_dim, causal=site.causal))
                continue
            map_q, map_k = _make_maps(attention, feature_map, layer, site.heads, site.head_dim, p, m, rank, seed, tied,
                                      input_norm)
            sketch = SketchedAttention(map_q, map_k, heads=site.heads, head_dim=site.head_dim, window=window,
                                       sinks=sinks, local=local, gate=gate, normalize=normalize,
                                       non_negative=non_negative, eps=float(eps), causal=site.causal, **memory)
            if sketch.gate is not None:
                with torch.no_grad():
                    sketch.gate.fill_(float(gate_init))
            sketch.to(device=ref.device, dtype=ref.dtype)
            if thetas is not None:  # after .to: Θ copied at the model's precision
                _load_theta_into(map_q, thetas[0][layer], f"theta layer {layer} (q)")
                _load_theta_into(map_k, thetas[1][layer], f"theta layer {layer} (k)")
            sketch.requires_grad_(learn)
            sketches.append(sketch)
    options = {"attention": attention if feature_map is None else "custom", "p": p, "m": m, "rank": rank,
               "window": window, "sinks": sinks, "local": local, "normalize": normalize, "non_negative": non_negative,
               "eps": float(eps), "gate": gate, "gate_init": float(gate_init), "tied": tied, "input_norm": input_norm,
               "seed": seed, "family": family, **memory, "exact_layers": sorted(exact)}
    if family == "toy":
        for site, sketch in zip(sites, sketches):
            site.module.attn = ConvertedToyKernel(sketch)
        model.sketchlab_conversion = options
        return sketches
    converted = [s for s in sketches if isinstance(s, SketchedAttention)]
    from ..hf.interface import register

    register(ATTENTION_NAME, hf_attention, hf_mask)
    for site, sketch in zip(sites, sketches):
        site.module.sketch = sketch
        site.module.register_forward_pre_hook(remember_cache, with_kwargs=True)
        site.module.register_forward_hook(forget_cache, with_kwargs=True)
    model.set_attn_implementation(ATTENTION_NAME)
    model.config.sketchlab = options
    if hasattr(model, "_prepare_cache_for_generation"):
        _use_state_cache(model, len(sites))
    return converted


def _check_exact_layers(exact_layers, layers: int, family: str) -> set:
    """``exact_layers``: distinct layer indices in ``[0, layers)``; none for the toy model."""
    if isinstance(exact_layers, (str, bytes)) or not hasattr(exact_layers, "__iter__"):
        raise TypeError(f"exact_layers must be a sequence of layer indices, got {exact_layers!r}")
    exact = list(exact_layers)
    for i in exact:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < layers:
            raise ValueError(f"exact_layers: {i!r} is not a layer index in [0, {layers}) of this {layers}-layer model")
    if len(set(exact)) != len(exact):
        raise ValueError(f"exact_layers lists a layer twice: {exact}")
    if exact and family == "toy":
        raise ValueError("exact_layers is for transformers models; the toy model keeps a layer exact by training "
                         "it with softmax attention (sketchlab train --attention softmax)")
    if len(exact) == layers:
        raise ValueError(f"exact_layers keeps all {layers} layers exact: nothing would be converted")
    return {int(i) for i in exact}


def _check_memory(cache, decay, state, beta, window, sinks, local, normalize, *, causal: bool,
                  qk_conv: int = 0) -> dict:
    """The far part's options (memory and the short convolution), checked by
    :class:`~sketchlab.attention.options.AttentionOptions` (the one place their rules live) against this
    conversion's layout, before the model is touched."""
    from ..attention.options import AttentionOptions

    o = AttentionOptions(causal=causal, normalize=normalize, window=window, sinks=sinks, local=local, cache=cache,
                         decay=decay, state=state, beta=beta, qk_conv=qk_conv)
    return {"cache": o.cache, "decay": o.decay, "state": o.state, "beta": o.beta, "qk_conv": o.qk_conv}


def _use_state_cache(model: nn.Module, layers: int) -> None:
    """Make ``model.generate()`` decode with a :class:`SketchStateCache` unless given another cache."""
    from .cache import SketchStateCache

    original = model._prepare_cache_for_generation

    def prepare(self, generation_config, model_kwargs, *args, **kwargs):
        if model_kwargs.get("cache") is None and model_kwargs.get("past_key_values") is None \
                and generation_config.use_cache is not False:
            model_kwargs["cache"] = SketchStateCache(layers)
        return original(generation_config, model_kwargs, *args, **kwargs)

    model._prepare_cache_for_generation = types.MethodType(prepare, model)


def converted_modules(model: nn.Module, *, required: bool = True) -> list[SketchedAttention]:
    """The :class:`SketchedAttention` of every converted layer of ``model``, in layer order."""
    found = [m for m in model.modules() if isinstance(m, SketchedAttention)]
    if required and not found:
        raise ValueError(f"{type(model).__name__} has no converted attention (run sketchlab.convert_attention)")
    return found


def _options(model: nn.Module) -> dict:
    cfg = getattr(model, "config", None)
    options = getattr(cfg, "sketchlab", None) if not hasattr(model, "sketchlab_conversion") else model.sketchlab_conversion
    if not isinstance(options, dict):
        raise ValueError(f"{type(model).__name__} carries no conversion options (convert it with sketchlab.convert_attention)")
    return options
