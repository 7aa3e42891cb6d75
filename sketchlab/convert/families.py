"""One small adapter per model family: where its self-attention modules are, their heads, causality.

Conversion never copies modelling code. transformers models of the LLaMA (Llama, Qwen2, Mistral,
SmolLM), GPT-2 and BERT (BERT, RoBERTa, MiniLM) families all call their attention through
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)``, so one attention function
(:func:`sketchlab.convert.sketched.hf_attention`) serves them all; an adapter only finds the
modules that make that call and reads their head counts. sketchlab's toy
:class:`~sketchlab.tasks.TransformerLM` has a pluggable kernel, replaced by :class:`ToyKernel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FAMILIES", "FAMILY_TABLE", "AttentionSite", "Family", "ToyKernel", "attention_sites", "family_of"]


@dataclass(frozen=True)
class Family:
    """What conversion, capture and LoRA need to know about one transformers model family.

    ``model_types``: its ``config.model_type`` values. Its self-attention modules: class name ending in
    ``attention_class``, with the attributes ``needs``; ``head_dim`` names their attribute holding ``D``;
    ``causal`` (``None``: the module's own ``is_causal``). ``heads``/``kv_heads``: the config attributes
    counting query and key/value heads (the first one set; no kv count: as many as query heads).
    ``rotary``: q, k rotated before the attention (capture's ``"post-rope"``). ``projections``: the
    projection modules' last name → role (``q``, ``k``, ``v``, or ``qkv`` fused into thirds), for
    capture. ``lora``: the LoRA target regex over module names (q, k, v and output projections), and
    ``lora_fan_in_fan_out`` for ``Conv1D`` weights (GPT-2). ``encoder``: loaded with ``AutoModel``
    (the loss is the teacher's hidden states) rather than ``AutoModelForCausalLM``.
    """

    model_types: tuple
    attention_class: str
    needs: tuple
    head_dim: str
    projections: dict
    lora: str
    lora_fan_in_fan_out: bool = False
    causal: bool | None = True
    rotary: bool = True
    encoder: bool = False
    heads: tuple = ("num_attention_heads", "n_head")
    kv_heads: tuple = ("num_key_value_heads",)


#: The one table of supported transformers families (a new family is one entry here).
FAMILY_TABLE = {
    "llama": Family(("llama", "qwen2", "mistral"), "Attention", ("q_proj", "o_proj"), "head_dim",
                    {"q_proj": "q", "k_proj": "k", "v_proj": "v"}, r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$"),
    "gpt2": Family(("gpt2",), "GPT2Attention", (), "head_dim", {"c_attn": "qkv"}, r".*\.attn\.(c_attn|c_proj)$",
                   lora_fan_in_fan_out=True, rotary=False),
    "bert": Family(("bert", "roberta"), "SelfAttention", ("query",), "attention_head_size",
                   {"query": "q", "key": "k", "value": "v"},
                   r".*\.attention\.(self\.(query|key|value)|output\.dense)$", causal=None, rotary=False, encoder=True),
    "opt": Family(("opt",), "Attention", ("q_proj", "out_proj"), "head_dim",
                  {"q_proj": "q", "k_proj": "k", "v_proj": "v"}, r".*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)$",
                  rotary=False),
}

#: ``config.model_type`` values of each supported transformers family (read from :data:`FAMILY_TABLE`).
FAMILIES = {name: family.model_types for name, family in FAMILY_TABLE.items()}


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


class ToyKernel(nn.Module):
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
    for family, types in FAMILIES.items():
        if model_type in types:
            return family
    supported = ", ".join(t for types in FAMILIES.values() for t in types)
    raise ValueError(f"convert_attention: {type(model).__name__} (model_type {model_type!r}) is not a supported family; "
                     f"supported: sketchlab's TransformerLM and transformers models of type {supported}")


def _int(cfg, *names) -> int:
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"the model's config states none of {names}")


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
    heads = _int(cfg, *spec.heads)
    kv_heads = next((v for v in (getattr(cfg, n, None) for n in spec.kv_heads) if v), None) or heads
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
