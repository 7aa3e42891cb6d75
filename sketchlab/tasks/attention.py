r"""The toy model's attention kernels: one :class:`ToyKernel` over any registered feature map, and exact
polynomial attention.

Importing this module registers, beside ``"softmax"`` (:mod:`.model`), ``"poly"`` and every name of the
feature-map registry (:func:`sketchlab.featuremaps.feature_map_names`; ``"based"`` and ``"psf"``, with a
``DeprecationWarning``, stand for ``"based-taylor"`` (``"based-expand"`` with ``form`` expand) and
``"psf-random"``). A kernel is the one layer core (:class:`~sketchlab.attention.layer.LinearAttentionCore`),
which hands its maps, :class:`~sketchlab.attention.options.AttentionOptions` and
:class:`~sketchlab.attention.options.FarParams` to :func:`sketchlab.attention.linear_attention`
(chunked PyTorch; two LLoPS maps run the fused Triton kernel on CUDA; any memory option runs
:func:`~sketchlab.attention.memory.memory_attention`), so training runs the code tested and timed there.
Layout ``[B, T, H, D]`` in and out; causal. Every kernel decodes from a state (``step``, used by
:func:`sketchlab.tasks.generate`): an :class:`~sketchlab.attention.AttentionState` or
:class:`~sketchlab.attention.memory.MemoryState`, constant in the context length; ``"poly"`` a KV cache.

Options (``TransformerConfig.attention_options``), each checked and completed by its one owner when the
config is built: the map's, as the registry declares them (layer ``i`` draws with ``seed + i``); the
attention's, every field of ``AttentionOptions`` but ``causal`` and ``local_scale`` (``normalize``
defaults to ``"sum"``); the toy's own: ``tie`` (one map for queries and keys), ``gate`` (a learnable
per-head logit of the hybrid, 0 at the start: ``g = 1/2``) and ``affine`` (the map reads
``[x · D^{-1/4}, 1]``, ``D + 1`` coordinates: each LLoPS factor is then affine in ``x`` and BASED's Taylor
map is the case ``p = 2``, :func:`~sketchlab.tasks.inits.init_llops` ``"based"``). The names older than the
registry keep their options and defaults (:func:`_spec`):

============== ============================ ====================================================
name           map options                  toy defaults
============== ============================ ====================================================
poly           ``p``                        exact ``(s)^p`` attention, quadratic in T (blocked)
llops          ``p, m, rank``               ``non_negative`` false
based-taylor,  ``p, dim, symmetric``;       ``dim`` min(16, D), ``symmetric`` for expand,
based-expand   ``form`` (the name's)        ``non_negative`` false, ``tie``
psf-random     ``p, m, seed, non_negative`` ``non_negative`` true (the map's ``s ⊗ s``), ``tie``
hedgehog       ``m, seed``                  ``m`` = 2·D (``W`` starts at the identity)
psf-learned    ``p, m, hidden, seed``       ``p`` 4, ``hidden`` 4·D, ``tie``
============== ============================ ====================================================

Input scale: softmax attention uses logits ``qᵀk/√D``; every map here sees ``x · D^{-1/4}``, so a
polynomial kernel is a polynomial in ``s = qᵀk/√D``, except BASED's Taylor map, which scales by its own
``d'^{-1/4}`` (kernel ``1 + s' + s'²/2``, ``s' = (Pq)ᵀ(Pk)/√d'``). The hybrid's exact window scores are
``qᵀk/√D`` (softmax) or the kernel's ``(s)^p`` (``local="poly"``, on the map's own scale).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from ..attention.layer import LinearAttentionCore
from ..attention.options import AttentionOptions
from ..featuremaps import Option, check_feature_map_options, feature_map_names, feature_map_options, make_feature_map
from .legacy import upgrade_keys
from .model import (
    ON_UNKNOWN_ATTENTION,
    CausalSelfAttention,
    TransformerConfig,
    TransformerLM,
    kv_cache_step,
    register_attention,
)

__all__ = ["ToyKernel", "input_scale", "kernel_modules", "register_feature_map_kernels"]

#: The option fields of AttentionOptions a kernel takes, with their defaults (``causal``, ``local_scale``: the kernel's).
_ATTENTION = {f.name: f.default for f in dataclasses.fields(AttentionOptions) if f.name not in ("causal", "local_scale")}
#: Deprecated toy names -> the name they stand for, given the options.
_RENAMED = {"psf": lambda o: "psf-random", "based": lambda o: f"based-{'expand' if o.get('form') == 'expand' else 'taylor'}"}


def input_scale(head_dim: int) -> float:
    """The factor ``D^{-1/4}`` applied to q and k before every polynomial kernel (module docstring)."""
    return head_dim ** -0.25


def kernel_modules(model: TransformerLM) -> list[nn.Module]:
    """The attention kernel of every layer (``model.blocks[i].attention.attn``), in layer order, of a
    :class:`~sketchlab.tasks.TransformerLM` or another model of its attention blocks (the kernel-only
    harness's :class:`~sketchlab.tasks.recall_kernel.RecallModel`)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not all(isinstance(getattr(b, "attention", None), CausalSelfAttention)
                                                        for b in blocks):
        raise TypeError(f"model must be a TransformerLM (or a model of its attention blocks, model.blocks[i].attention "
                        f"a CausalSelfAttention), got {type(model).__name__}")
    return [block.attention.attn for block in model.blocks]


def _spec(name: str, head_dim: int):
    """``(map, takes, own, defaults)`` of the toy name ``name``: the registry map (None: exact polynomial
    attention), the map options it takes (None: all the registry declares), the toy's own options
    (name -> :class:`~sketchlab.featuremaps.Option`) and the toy's defaults of any option."""
    own = {"tie": Option("bool", False), "gate": Option("bool", True), "affine": Option("bool", False)}
    if name == "poly":
        return None, ("p",), {}, {}
    if name in ("based-taylor", "based-expand"):
        form = name.removeprefix("based-")
        return name, ("p", "dim", "symmetric"), {**own, "form": Option("str", form, choices=(form,))}, \
            {"dim": min(16, head_dim), "symmetric": form == "expand", "non_negative": False, "tie": True}
    takes, defaults = {"llops": (("p", "m", "rank"), {"non_negative": False}),
                       "psf-random": (("p", "m", "seed", "non_negative"), {"non_negative": True, "tie": True}),
                       "hedgehog": (("m", "seed"), {"m": 2 * head_dim}),
                       "psf-learned": (("p", "m", "hidden", "seed"), {"p": 4, "hidden": 4 * head_dim, "tie": True}),
                       }.get(name, (None, {}))
    return name, takes, own, defaults


def _split(name: str, opts: dict, head_dim: int):
    """``(map, map options, own options, attention options)`` of ``opts`` for the toy name ``name``, the
    toy's defaults filled in (own: name -> ``(Option, value)``); an option none of them takes is refused,
    naming what the kernel takes."""
    fmap, takes, own, defaults = _spec(name, head_dim)
    declared = feature_map_options(fmap or "exact-poly")
    names = tuple(declared) if takes is None else takes
    attention = ("normalize", "eps") if fmap is None else tuple(k for k in _ATTENTION if k not in names)
    unknown = sorted(set(opts) - {*names, *own, *attention})
    if unknown:
        raise ValueError(f"unknown attention option(s) {unknown} for attention {name!r}; it takes "
                         f"{sorted({*names, *own, *attention})}")
    opts = {"normalize": "sum", **{k: declared[k].default for k in takes or ()}, **defaults, **opts}
    return (fmap, {k: opts[k] for k in names if k in opts}, {k: (opt, opts.get(k, opt.default)) for k, opt in own.items()},
            {k: opts.get(k, _ATTENTION[k]) for k in attention})


def _checker(toy_name: str):
    """The options check of the toy name ``toy_name`` (``register_attention``'s ``options``): each option
    checked by its owner (the map registry, AttentionOptions, the toy's :class:`~sketchlab.featuremaps.Option`)."""

    def check(opts: dict, config: TransformerConfig) -> dict:
        from ..attention.functional import check_local_degree

        name = _RENAMED.get(toy_name, lambda o: toy_name)(opts)
        if name != toy_name:
            warnings.warn(f"attention {toy_name!r} is deprecated, use {name!r}", DeprecationWarning, stacklevel=4)
        where = f"attention {name!r}"
        fmap, maps, own, attention = _split(name, opts, config.head_dim)
        try:
            checked = check_feature_map_options(fmap or "exact-poly", maps, where=where)
            out = {**{k: checked[k] for k in maps}, **{k: opt.check(k, value, where) for k, (opt, value) in own.items()}}
            o = AttentionOptions(**attention)
        except TypeError as err:  # a non-bool where a flag was expected: the config's errors are ValueErrors
            raise ValueError(str(err)) from None
        out.update({k: getattr(o, k) for k in attention})  # completed: decay 1 -> 1.0
        if fmap is not None:  # the map's own rules at build (a probe), and the hybrid's local="poly" on it
            probe = make_feature_map(fmap, heads=config.n_heads, head_dim=config.head_dim + out["affine"], **maps)
            check_local_degree(probe.degree, f"{type(probe).__name__} ({where})", window=o.window, local=o.local)
            if out["affine"] and o.window and o.local == "poly":
                raise ValueError("attention option local='poly' is the homogeneous kernel (s)^p, and affine=true "
                                 "makes the map an inhomogeneous polynomial: use local='softmax'")
        return out

    return check


class ToyKernel(LinearAttentionCore):
    r"""The attention kernel ``name`` of one layer (module docstring): an adapter over
    :class:`~sketchlab.attention.layer.LinearAttentionCore` (the maps, options, gate and far parameters, and
    the call of the op) that adds the toy's input scale and ``affine`` coordinate, and exact ``"poly"``.

    Attributes
    ----------
    config_options : dict
        The completed options (``config.attention_options``).
    options : AttentionOptions
        What the attention is called with (``local_scale`` set to the scale of the q, k it receives).
    map_q, map_k : FeatureMap or None
        The query and key maps (``map_k`` None: tied); both None for ``"poly"``.
    gate : Parameter ``[H]`` or None
        The hybrid's gate logits (a window and ``gate``).
    far : FarParams or None
        The learned decay, β and short convolution the options call for (none otherwise).
    """

    def __init__(self, config: TransformerConfig, layer: int, name: str):
        o = dict(config.attention_options)
        H, D = config.n_heads, config.head_dim
        fmap, maps, _, attention = _split(_RENAMED.get(name, lambda o: name)(o), o, D)
        scale = 1.0 if fmap == "based-taylor" else input_scale(D)
        map_q = map_k = None
        if fmap is None:
            options = AttentionOptions(**attention)
        else:
            local_scale = D ** -0.5 / scale**2 if o["local"] == "softmax" else o["dim"] ** -0.5 if \
                fmap == "based-taylor" else 1.0  # poly: the kernel's own scale (Taylor's s' = qᵀk/√d')
            options = AttentionOptions(**attention, local_scale=local_scale)
            seed = maps.get("seed", 0) + layer
            map_q = make_feature_map(fmap, heads=H, head_dim=D + o["affine"], **{**maps, "seed": seed})
            if not o["tie"]:  # the same draw: both sides start equal
                map_k = make_feature_map(fmap, heads=H, head_dim=D + o["affine"], **{**maps, "seed": seed})
        affine = o.get("affine", False)  # the convolution sees the map's input
        super().__init__(map_q, map_k, options=options, heads=H, dim_v=D, dim=D + affine, gate=o.get("gate", False))
        self.config_options = o
        self.scale, self.map_name = scale, fmap

    def _load_from_state_dict(self, state_dict, prefix, *args):  # older toy checkpoints' keys: tasks/legacy.py
        super()._load_from_state_dict(upgrade_keys(self, state_dict, prefix), prefix, *args)

    @property
    def theta_q(self) -> nn.Parameter:
        """LLoPS's ``Θ_Q [H, t, p, D (+ 1), m]`` (``map_q.theta``)."""
        return self.map_q.theta

    @property
    def theta_k(self) -> nn.Parameter:
        """LLoPS's ``Θ_K`` (``map_k.theta``; ``Θ_Q`` when tied)."""
        return self.key_map.theta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q, k, v [B, T, H, D]`` → ``[B, T, H, D]``."""
        if self.map_q is None:
            from ..attention import poly_attention

            o = self.resolved_options()  # normalize=None is "sum" (the one rule; no map to self-tensor)
            return poly_attention(q * self.scale, k * self.scale, v, self.config_options["p"], normalize=o.normalize,
                                  eps=o.eps)
        return self._attend(q, k, v)[0]

    def step(self, q, k, v, state):
        """``n`` new tokens given the state of the earlier ones (``None`` at the start) → ``(out, state)``."""
        if self.map_q is None:
            return kv_cache_step(q * self.scale, k * self.scale, v, state, self._poly_step)
        return self._attend(q, k, v, initial_state=state, output_final_state=True)

    def _poly_step(self, q, k, v, allowed):
        """Exact ``(qᵀk)^p`` attention of scaled ``q [B, n, H, D]`` on the keys ``allowed [n, S]``."""
        o = self.options
        scores = (torch.einsum("bthd,bshd->bhts", q, k) ** self.config_options["p"]).masked_fill(~allowed, 0.0)
        out = torch.einsum("bhts,bshd->bthd", scores, v)  # scores [B, H, n, S]
        return out if o.normalize == "none" else out / (scores.sum(-1).transpose(1, 2)[..., None] + o.eps)

    def _attend(self, q, k, v, **state):
        from ..llops import affine_input

        q, k = q * self.scale, k * self.scale
        if self.config_options["affine"]:  # [x · D^{-1/4}, 1]: the local softmax's scores shift by the constant's 1, which cancels
            q, k = affine_input(q), affine_input(k)
        out, final = self.attend(q, k, v, **state)
        return out.to(v.dtype), final  # backend "reference" computes in float64: back to the model's dtype


def register_feature_map_kernels() -> list[str]:
    """Register a :class:`ToyKernel` for ``"poly"``, the deprecated ``"based"``, ``"psf"`` and every map of
    the feature-map registry the toy model has no kernel for yet (done on import, and by
    :class:`~sketchlab.tasks.TransformerConfig` for a name it does not know yet: a map registered later).
    Returns the new names."""
    from .model import attention_registry

    added = [name for name in ("poly", *_RENAMED, *feature_map_names()) if name not in attention_registry()]
    for name in added:
        register_attention(name, options=_checker(name))(lambda config, layer, _name=name: ToyKernel(config, layer, _name))
    return added


register_feature_map_kernels()
ON_UNKNOWN_ATTENTION.append(register_feature_map_kernels)
