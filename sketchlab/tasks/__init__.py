"""Synthetic tasks: multi-query associative recall (MQAR) and the small causal transformer trained on it.

- :mod:`sketchlab.tasks.mqar`: the MQAR data generator (:class:`MQARConfig`, :func:`mqar_batch`).
- :mod:`sketchlab.tasks.model`: :class:`TransformerLM` with a pluggable attention kernel
  (layout ``[B, T, H, D]``, registry :func:`register_attention`; ``"softmax"`` via SDPA).
- :mod:`sketchlab.tasks.attention`: the sketched kernels ``"poly"``, ``"based"``, ``"psf"``,
  ``"llops"`` (through :mod:`sketchlab.attention`) and the LLoPS initialisations.
- :mod:`sketchlab.tasks.train`: training loop (AdamW, cosine, clipping, resumable checkpoints,
  DistributedDataParallel under ``torchrun``), held-out accuracy.
"""

from .attention import (
    LLOPS_INITS,
    BasedKernel,
    LLoPSKernel,
    PolyKernel,
    PSFKernel,
    based_init_dim,
    copy_shared_weights,
    init_llops,
    input_scale,
    kernel_modules,
)
from .model import (
    CausalSelfAttention,
    SoftmaxAttention,
    TransformerConfig,
    TransformerLM,
    apply_rope,
    attention_registry,
    causal_softmax_attention_naive,
    generate,
    register_attention,
)
from .linearize import LinearizeResult, attention_transfer_loss, linearize
from .mqar import IGNORE_INDEX, MQARConfig, mqar_accuracy, mqar_batch
from .train import (
    TrainResult,
    evaluate_mqar,
    init_distributed,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    train_mqar,
)

__all__ = [
    "IGNORE_INDEX",
    "LLOPS_INITS",
    "BasedKernel",
    "LLoPSKernel",
    "LinearizeResult",
    "PSFKernel",
    "PolyKernel",
    "based_init_dim",
    "copy_shared_weights",
    "init_llops",
    "input_scale",
    "kernel_modules",
    "CausalSelfAttention",
    "MQARConfig",
    "SoftmaxAttention",
    "TrainResult",
    "TransformerConfig",
    "TransformerLM",
    "apply_rope",
    "attention_transfer_loss",
    "attention_registry",
    "causal_softmax_attention_naive",
    "evaluate_mqar",
    "generate",
    "init_distributed",
    "latest_checkpoint",
    "linearize",
    "load_checkpoint",
    "mqar_accuracy",
    "mqar_batch",
    "register_attention",
    "save_checkpoint",
    "train_mqar",
]
