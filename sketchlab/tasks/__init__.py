"""Synthetic tasks: multi-query associative recall (MQAR) and the small causal transformer trained on it.

- :mod:`sketchlab.tasks.mqar`: the MQAR data generator (:class:`MQARConfig`, :func:`mqar_batch`),
  compact or Zoology's layout, and Zoology's training mixture (:class:`MQARMixture`).
- :mod:`sketchlab.tasks.zoology`: logits at the query positions only, per-slice evaluation.
- :mod:`sketchlab.tasks.text`: byte-level LM on Shakespeare, the exact BASED → LLoPS conversion.
- :mod:`sketchlab.tasks.model`: :class:`TransformerLM` with a pluggable attention kernel
  (layout ``[B, T, H, D]``, registry :func:`register_attention`; ``"softmax"`` via SDPA).
- :mod:`sketchlab.tasks.attention`: the kernels ``"poly"`` and one per feature-map registry name
  (:class:`ToyKernel`, through :mod:`sketchlab.attention`).
- :mod:`sketchlab.tasks.inits`: weights copied from another model, the LLoPS initialisations.
- :mod:`sketchlab.tasks.train`: the one training loop (MQAR and text), DDP under ``torchrun``, held-out
  accuracy; :mod:`sketchlab.tasks.checkpoint`: resumable checkpoints and model directories.
- :mod:`sketchlab.tasks.frontier`: Zoology's recall frontier (accuracy against state bytes per layer; the grid,
  its cached runs, the report); :mod:`sketchlab.tasks.state_size`: state bytes per layer of any mechanism;
  :mod:`sketchlab.tasks.mixers`: the ``"sliding-window"`` kernel and DeltaNet's ``"silu"`` map (imported here, so
  the registries hold them whenever this package is imported).
"""

from . import mixers  # noqa: F401  (registers "sliding-window" and "silu")
from .attention import ToyKernel, input_scale, kernel_modules
from .inits import LLOPS_INITS, based_init_dim, copy_shared_weights, init_llops
from .model import (
    CausalSelfAttention,
    SoftmaxAttention,
    TransformerConfig,
    TransformerLM,
    apply_rope,
    attention_registry,
    generate,
    register_attention,
)
from .mqar import IGNORE_INDEX, MQARConfig, MQARMixture, mqar_accuracy, mqar_batch, zoology_mixture, zoology_tests
from .text import based_to_llops, conversion_error, evaluate_lm, lm_batch, shakespeare_text, train_lm
from .train import (
    TrainResult,
    evaluate_mqar,
    init_distributed,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    train_mqar,
)
from .zoology import QueryLogits, evaluate_slices

__all__ = [
    "IGNORE_INDEX",
    "LLOPS_INITS",
    "ToyKernel",
    "based_init_dim",
    "copy_shared_weights",
    "init_llops",
    "input_scale",
    "kernel_modules",
    "CausalSelfAttention",
    "MQARConfig",
    "MQARMixture",
    "QueryLogits",
    "based_to_llops",
    "conversion_error",
    "evaluate_lm",
    "evaluate_slices",
    "lm_batch",
    "shakespeare_text",
    "train_lm",
    "zoology_mixture",
    "zoology_tests",
    "SoftmaxAttention",
    "TrainResult",
    "TransformerConfig",
    "TransformerLM",
    "apply_rope",
    "attention_registry",
    "evaluate_mqar",
    "generate",
    "init_distributed",
    "latest_checkpoint",
    "load_checkpoint",
    "mqar_accuracy",
    "mqar_batch",
    "register_attention",
    "save_checkpoint",
    "train_mqar",
]
