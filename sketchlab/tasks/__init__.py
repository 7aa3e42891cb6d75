"""Synthetic tasks: multi-query associative recall (MQAR) and the small causal transformer trained on it.

- :mod:`sketchlab.tasks.mqar`: the MQAR data generator (:class:`MQARConfig`, :func:`mqar_batch`).
- :mod:`sketchlab.tasks.model`: :class:`TransformerLM` with a pluggable attention kernel
  (layout ``[B, T, H, D]``, registry :func:`register_attention`; ``"softmax"`` via SDPA).
- :mod:`sketchlab.tasks.train`: CPU training loop, held-out accuracy, safetensors checkpoints.
"""

from .model import (
    CausalSelfAttention,
    SoftmaxAttention,
    TransformerConfig,
    TransformerLM,
    apply_rope,
    attention_registry,
    causal_softmax_attention_naive,
    register_attention,
)
from .mqar import IGNORE_INDEX, MQARConfig, mqar_accuracy, mqar_batch
from .train import TrainResult, evaluate_mqar, load_checkpoint, save_checkpoint, train_mqar

__all__ = [
    "IGNORE_INDEX",
    "CausalSelfAttention",
    "MQARConfig",
    "SoftmaxAttention",
    "TrainResult",
    "TransformerConfig",
    "TransformerLM",
    "apply_rope",
    "attention_registry",
    "causal_softmax_attention_naive",
    "evaluate_mqar",
    "load_checkpoint",
    "mqar_accuracy",
    "mqar_batch",
    "register_attention",
    "save_checkpoint",
    "train_mqar",
]
