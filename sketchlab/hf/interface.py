"""transformers glue: its attention and mask interfaces, the attention implementation switch.

transformers (>= 4.48; 5.x here) dispatches every self-attention of the LLaMA, Qwen2, Mistral,
GPT-2 and BERT families through ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)``:
the function receives ``(module, query [B, H, T, D], key [B, H_kv, S, D], value [B, H_kv, S, Dv],
attention_mask, scaling=, dropout=, **kwargs)`` — q and k *after* the rotary embedding, GQA
keys and values not yet repeated — and returns ``(out [B, T, H, Dv], weights or None)``.
The mask handed to it is built by the function registered under the same name in
``ALL_MASK_ATTENTION_FUNCTIONS`` (an implementation without one gets no mask at all). This module
registers sketchlab's functions under their names and switches a model between implementations;
no modelling code is copied.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

from torch import nn

__all__ = ["attention_implementation", "is_rotary", "original_attention", "original_mask", "register", "supports_interface"]


def _transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as err:  # the optional extra
        raise ImportError("this needs transformers: pip install 'sketchlab[capture]'") from err
    from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel

    return AttentionInterface, AttentionMaskInterface, PreTrainedModel


def register(name: str, attention: Callable, mask: Callable) -> None:
    """Register ``attention`` and ``mask`` under ``name`` in transformers' two interfaces (idempotent)."""
    attention_interface, mask_interface, _ = _transformers()
    attention_interface.register(name, attention)
    mask_interface.register(name, mask)


def supports_interface(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model whose attention goes through the attention interface."""
    try:
        _, _, pretrained = _transformers()
    except ImportError:
        return False
    return isinstance(model, pretrained) and bool(model._can_set_attn_implementation())


def is_rotary(model: nn.Module) -> bool:
    """Whether ``model`` applies a rotary position embedding inside attention (a ``*RotaryEmbedding``
    submodule, as every rotary transformers model has, or RoPE parameters in its config)."""
    if any(type(m).__name__.endswith("RotaryEmbedding") for m in model.modules()):
        return True
    cfg = getattr(model, "config", None)
    return cfg is not None and any(getattr(cfg, a, None) is not None for a in ("rope_theta", "rope_parameters"))


def original_attention(module: nn.Module, name: str) -> Callable:
    """The attention function ``name`` stands for, as ``module``'s modelling code would call it.

    ``"eager"`` is not in the interface: each modelling file has its own ``eager_attention_forward``
    (the default its attention passes to ``get_interface``), taken from the module's file.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name != "eager" and name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__}: its modelling file has no eager_attention_forward and the "
                         f"attention implementation {name!r} is not registered")
    return eager


def original_mask(name: str) -> Callable:
    """The mask function of the attention implementation ``name``."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS[name]


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str):
    """Switch ``model`` (and its sub-models) to the attention implementation ``name``; restore it after.

    Yields the implementation that was set before.
    """
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield before
    finally:
        model.set_attn_implementation(before)
