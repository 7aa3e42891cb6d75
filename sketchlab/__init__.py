"""sketchlab: polynomial-kernel sketches for linear attention.

Exact polynomial features, the Theorem 3.1 optimal sketch and its tail bound, LLoPS fits and their
Theorem 3.4 spectral residuals, the baseline sketches, Q/K dumps (load, save, capture), a
comparison of every sketch against the optimum on them, and the researcher's tools on a dump:
``verify`` (every theorem check), ``advise`` (the sketch size a target error needs) and
``kernel_spectrum``. Every fitted sketch is a pair of :class:`FeatureMap` s (``fit_sketch(...).maps``),
the one family that the metrics, the comparison and attention take (naive float64 twins, a chunked
PyTorch path, a fused Triton kernel); the Θ export feeds :class:`LLoPSAttention`.
"""

from ._version import __version__
from .advise import Advice, HeadAdvice, advise
from .attention import (
    AttentionOptions,
    AttentionState,
    FarParams,
    LLoPSAttention,
    MemoryState,
    dump_segments,
    linear_attention,
    poly_attention,
    poly_attention_naive,
    softmax_attention,
    softmax_attention_naive,
)
from .attention.errors import attention_error, causal_attention
from .capture import capture_qk
from .compare import DEFAULT_METHODS, ComparisonRow, ComparisonTable, compare
from .convert import convert_attention, linearize, load_linearized, save_linearized
from .evaluate import CopyRecall, PasskeyResult, copy_recall, format_recall, passkey_accuracy, passkey_prompt
from .export import export_theta
from .featuremaps import (
    ExactPolyMap,
    ExpandMap,
    FeatureMap,
    HedgehogMap,
    LLoPSMap,
    MLPMap,
    PSFRandomMap,
    SelfTensored,
    TaylorMap,
    TensorSketchMap,
    TiedLLoPSMap,
    as_feature_map,
    make_feature_map,
    psf_learned_map,
)
from .featuremaps.to_llops import as_llops
from .fit import Fit, FitReport, available_sketches, fit_sketch, holdout_split, register_sketch, sketch_fitter
from .io import QKDump, load_qk, load_theta, save_qk, save_theta
from .llops import (
    fit_llops,
    fit_llops_adam,
    fit_llops_cp,
    fit_llops_direct,
    llops_features,
    llops_features_naive,
    llops_init,
    llops_projector,
    llops_projector_naive,
    projector_to_theta,
)
from .metrics import (
    kernel_errors,
    kernel_sq_norm,
    optimality_ratio,
    ratio_to_tail,
    rel_fro,
    rel_mae,
)
from .numerics import KernelRangeError
from .objective import kernel_loss, train_kernel_sketch
from .optimal import OptimalMap, Optimum, max_sketch_size, min_norm_sketch, optimal_sketch, tail_bound
from .polynomial import (
    feature_gram_root,
    full_to_symmetric,
    num_poly_features,
    poly_features,
    poly_features_naive,
    poly_kernel,
    symmetric_index,
    symmetric_to_full,
)
from .scaling import describe_scale, resolve_scale
from .spectral import deflate, feature_bound, rank1_residuals, spectral_norm
from .spectrum import KernelSpectrum, kernel_spectrum
from .verify import Check, Verification, verify

__all__ = [
    "Advice",
    "AttentionOptions",
    "AttentionState",
    "ExactPolyMap",
    "ExpandMap",
    "FarParams",
    "FeatureMap",
    "HedgehogMap",
    "LLoPSMap",
    "MLPMap",
    "PSFRandomMap",
    "SelfTensored",
    "TaylorMap",
    "TensorSketchMap",
    "TiedLLoPSMap",
    "as_feature_map",
    "linear_attention",
    "make_feature_map",
    "psf_learned_map",
    "Check",
    "ComparisonRow",
    "ComparisonTable",
    "DEFAULT_METHODS",
    "Fit",
    "FitReport",
    "HeadAdvice",
    "KernelRangeError",
    "KernelSpectrum",
    "LLoPSAttention",
    "MemoryState",
    "OptimalMap",
    "Optimum",
    "QKDump",
    "Verification",
    "__version__",
    "advise",
    "as_llops",
    "attention_error",
    "available_sketches",
    "capture_qk",
    "causal_attention",
    "compare",
    "copy_recall",
    "CopyRecall",
    "PasskeyResult",
    "format_recall",
    "passkey_accuracy",
    "passkey_prompt",
    "convert_attention",
    "deflate",
    "describe_scale",
    "dump_segments",
    "export_theta",
    "feature_bound",
    "fit_llops",
    "fit_llops_adam",
    "fit_llops_cp",
    "fit_llops_direct",
    "fit_sketch",
    "feature_gram_root",
    "full_to_symmetric",
    "holdout_split",
    "kernel_errors",
    "kernel_loss",
    "kernel_spectrum",
    "kernel_sq_norm",
    "linearize",
    "llops_features",
    "llops_features_naive",
    "llops_init",
    "llops_projector",
    "llops_projector_naive",
    "load_linearized",
    "load_qk",
    "load_theta",
    "max_sketch_size",
    "min_norm_sketch",
    "num_poly_features",
    "optimal_sketch",
    "optimality_ratio",
    "poly_attention",
    "poly_attention_naive",
    "poly_features",
    "poly_features_naive",
    "poly_kernel",
    "projector_to_theta",
    "rank1_residuals",
    "ratio_to_tail",
    "register_sketch",
    "rel_fro",
    "rel_mae",
    "resolve_scale",
    "save_linearized",
    "save_qk",
    "save_theta",
    "sketch_fitter",
    "softmax_attention",
    "softmax_attention_naive",
    "spectral_norm",
    "symmetric_index",
    "symmetric_to_full",
    "tail_bound",
    "train_kernel_sketch",
    "verify",
]
