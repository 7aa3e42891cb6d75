"""One small adapter per model family: where its self-attention modules are, their heads, causality.

Conversion never copies modelling code. transformers models of the LLaMA (Llama, Qwen2, Mistral,
SmolLM), GPT-2 and BERT (BERT, RoBERTa, MiniLM) families all call their attention through
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)``, so one attention function
(:func:`sketchlab.convert.sketched.hf_attention`) serves them all; an adapter only finds the
modules that make that call and reads their head counts. sketchlab's toy
:class:`~sketchlab.tasks.TransformerLM` has a pluggable kernel, replaced by :class:`ConvertedToyKernel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..hf.families import FAMILIES, FAMILY_TABLE, Family, config_int, family_of_type, supported_types

__all__ = ["FAMILIES", "FAMILY_TABLE", "AttentionSite", "Family", "ConvertedToyKernel", "attention_sites", "family_of"]


@dataclass
class AttentionSite:
    """A self-attention module to convert: its name, the module, ``H`` query heads, ``H_kv`` key/value
    heads, head dimension ``D``, and whether it is causal."""

    name: str
    module: nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool


class ConvertedToyKernel(nn.Module):
    """The kernel of a converted toy :class:`~sketchlab.tasks.TransformerLM` layer: ``q, k, v [B, T, H, D]``
    (post-RoPE) → :class:`~sketchlab.convert.sketched.SketchedAttention` with the toy's ``1/√D`` logits."""

    def __init__(self, sketch: nn.Module):
        super().__init__()
        self.sketch = sketch

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.sketch(q, k, v)

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state):
        """``n`` new tokens given the :class:`~sketchlab.attention.AttentionState` of the earlier ones
        (``None`` at the start) → ``(out, state)`` (the toy model's decoding protocol,
        :meth:`~sketchlab.tasks.TransformerLM.forward_step`)."""
        return self.sketch(q, k, v, initial_state=state, output_final_state=True)


def family_of(model: nn.Module) -> str:
    """``"toy"`` or a name of :data:`FAMILY_TABLE`; ``ValueError`` naming the supported ones otherwise."""
    from ..tasks.model import TransformerLM

    if isinstance(model, TransformerLM):
        return "toy"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = family_of_type(model_type)
    if family is None:
        raise ValueError(f"convert_attention: {type(model).__name__} (model_type {model_type!r}) is not a supported "
                         f"family; supported: sketchlab's TransformerLM and transformers models of type "
                         f"{supported_types()}")
    return family


def _refuse_cross_attention(model: nn.Module) -> None:
    """Refuse a transformers model with cross-attention (a GPT-2 or BERT decoder built with
    ``add_cross_attention=True``): its attention implementation is one per model, so the switch
    to :data:`~sketchlab.convert.sketched.ATTENTION_NAME` would route the cross-attention (queries
    over an encoder's states, which has no sketched form here) through it too."""
    for name, module in model.named_modules():
        if getattr(module, "is_cross_attention", False) is True or "CrossAttention" in type(module).__name__:
            flag = getattr(model.config, "add_cross_attention", None)
            raise ValueError(f"convert_attention: {type(model).__name__} has cross-attention ({name}, "
                             f"{type(module).__name__}; config.add_cross_attention={flag!r}): the attention "
                             "implementation is switched for the whole model, and cross-attention has no sketched "
                             "form; convert a model built without cross-attention")


def attention_sites(model: nn.Module) -> tuple[str, list[AttentionSite]]:
    """``(family, sites)``: every self-attention module of ``model`` in layer order.

    ``ValueError`` for a model with cross-attention (:func:`_refuse_cross_attention`) or without
    a self-attention module of its family."""
    family = family_of(model)
    if family == "toy":
        cfg = model.config
        return family, [AttentionSite(f"blocks.{i}.attention", block.attention, cfg.n_heads, cfg.n_heads, cfg.head_dim, True)
                        for i, block in enumerate(model.blocks)]
    _refuse_cross_attention(model)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    spec = FAMILY_TABLE[family]
    heads = config_int(cfg, spec.heads)
    if heads is None:
        raise ValueError(f"the model's config states none of {spec.heads}")
    kv_heads = config_int(cfg, spec.kv_heads) or heads
    sites = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not kind.endswith(spec.attention_class) or not all(hasattr(module, a) for a in spec.needs):
            continue  # (a decoder's cross-attention was refused above)
        causal = bool(module.is_causal) if spec.causal is None else spec.causal
        site = AttentionSite(name, module, heads, kv_heads, getattr(module, spec.head_dim), causal)
        if not isinstance(getattr(module, "layer_idx", None), int):
            raise ValueError(f"{name} ({kind}) has no integer layer_idx; cannot index its decoding state")
        sites.append(site)
    if not sites:
        raise ValueError(f"convert_attention: found no self-attention module in {type(model).__name__} ({family} family)")
    sites.sort(key=lambda s: s.module.layer_idx)
    if [s.module.layer_idx for s in sites] != list(range(len(sites))):
        raise ValueError(f"{type(model).__name__}: attention layer_idx {[s.module.layer_idx for s in sites]} "
                         f"are not 0 … {len(sites) - 1}")
    return family, sites
