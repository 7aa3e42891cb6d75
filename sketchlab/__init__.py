"""sketchlab: polynomial-kernel sketches for linear attention.

Exact polynomial features, the Theorem 3.1 optimal sketch and its tail bound, LLoPS fits and their
Theorem 3.4 spectral residuals, the baseline sketches, Q/K dumps (load, save, capture) and a
comparison of every sketch against the optimum on them; attention through any sketch (naive
float64 twins, a chunked PyTorch path, a fused Triton kernel) and the Θ export that feeds
:class:`LLoPSAttention`.
"""

__version__ = "0.1.0"

from . import sketches  # noqa: F401  (registers the baseline sketches with fit_sketch)
from .capture import capture_qk
from .compare import DEFAULT_METHODS, ComparisonRow, ComparisonTable, compare
from .fit import Fit, FitReport, available_sketches, fit_sketch, holdout_split, register_sketch, sketch_fitter
from .io import QKDump, load_qk, load_theta, save_qk, save_theta
from .llops import (
    LLoPS,
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
from .attention import (
    LLoPSAttention,
    dump_segments,
    feature_attention,
    feature_attention_naive,
    kernel_attention_naive,
    llops_attention,
    llops_attention_naive,
    poly_attention,
    poly_attention_naive,
    sketch_attention,
    softmax_attention,
    softmax_attention_naive,
)
from .export import export_theta
from .objective import kernel_loss, train_kernel_sketch
from .metrics import attention_error, causal_attention, optimality_ratio, rel_fro, rel_mae
from .optimal import OptimalSketch, optimal_sketch, tail_bound
from .polynomial import (
    full_to_symmetric,
    num_poly_features,
    poly_features,
    poly_features_naive,
    poly_kernel,
    symmetric_index,
    symmetric_to_full,
)
from .sketch import Sketch
from .sketches import BasedSketch, ElementwiseSketch, MLPSketch, PolySketch, TensorSketch, as_llops
from .spectral import deflate, feature_bound, rank1_residuals, spectral_norm

__all__ = [
    "DEFAULT_METHODS",
    "BasedSketch",
    "ComparisonRow",
    "ComparisonTable",
    "ElementwiseSketch",
    "Fit",
    "FitReport",
    "LLoPS",
    "LLoPSAttention",
    "MLPSketch",
    "OptimalSketch",
    "PolySketch",
    "QKDump",
    "Sketch",
    "TensorSketch",
    "__version__",
    "as_llops",
    "attention_error",
    "available_sketches",
    "capture_qk",
    "causal_attention",
    "compare",
    "deflate",
    "dump_segments",
    "export_theta",
    "feature_attention",
    "feature_attention_naive",
    "feature_bound",
    "fit_llops_adam",
    "fit_llops_cp",
    "fit_llops_direct",
    "fit_sketch",
    "full_to_symmetric",
    "holdout_split",
    "kernel_attention_naive",
    "kernel_loss",
    "llops_attention",
    "llops_attention_naive",
    "llops_features",
    "llops_features_naive",
    "llops_init",
    "llops_projector",
    "llops_projector_naive",
    "load_qk",
    "load_theta",
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
    "register_sketch",
    "rel_fro",
    "rel_mae",
    "save_qk",
    "save_theta",
    "sketch_attention",
    "sketch_fitter",
    "softmax_attention",
    "softmax_attention_naive",
    "spectral_norm",
    "symmetric_index",
    "symmetric_to_full",
    "tail_bound",
    "train_kernel_sketch",
]
