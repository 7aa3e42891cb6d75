"""The one table of transformers model families: what capture, conversion and LoRA know about each.

A new family is one entry of :data:`FAMILY_TABLE`. Capture hooks its ``projections``
(:func:`sketchlab.capture.detect_qk_modules`), conversion finds its attention modules
(:func:`sketchlab.convert.families.attention_sites`), LoRA targets its ``lora`` regex and the loader
picks the model class by ``encoder`` (:func:`sketchlab.hf.pretrained.load_pretrained`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "FAMILY_TABLE", "Family", "config_int", "family_of_type", "supported_types"]


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
    heads: tuple = ("num_attention_heads", "n_head", "num_heads")
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


def supported_types(*, encoders: bool = True) -> str:
    """Every supported ``model_type`` (without the encoder families' unless ``encoders``), comma-separated."""
    return ", ".join(t for family in FAMILY_TABLE.values() if encoders or not family.encoder for t in family.model_types)


def family_of_type(model_type: str | None) -> str | None:
    """The :data:`FAMILY_TABLE` name whose ``model_types`` hold ``model_type``, or ``None``."""
    return next((family for family, types in FAMILIES.items() if model_type in types), None)


def config_int(cfg, names) -> int | None:
    """The first of the config attributes ``names`` that holds an int (not a bool), or ``None``."""
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
