"""sketchlab: polynomial-kernel sketches for linear attention.

Exact polynomial features, the Theorem 3.1 optimal sketch and its tail bound, LLoPS fits and their
Theorem 3.4 spectral residuals, the baseline sketches, Q/K dumps (load, save, capture) and a
comparison of every sketch against the optimum on them.
"""

__version__ = "0.1.0"

from . import sketches  # noqa: F401  (registers the baseline sketches with fit_sketch)
from .capture import capture_qk
from .compare import DEFAULT_METHODS, ComparisonRow, ComparisonTable, compare
from .fit import Fit, FitReport, available_sketches, fit_sketch, holdout_split, register_sketch, sketch_fitter
from .io import QKDump, load_qk, load_theta, save_qk, save_theta
from .llops import (
    LLoPS,
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
from .objective import kernel_loss, train_kernel_sketch
from .metrics import (
    attention_error,
    causal_attention,
    kernel_errors,
    kernel_sq_norm,
    optimality_ratio,
    ratio_to_tail,
    rel_fro,
    rel_mae,
)
from .optimal import OptimalSketch, max_sketch_size, min_norm_sketch, optimal_sketch, tail_bound
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
    "feature_bound",
    "fit_llops",
    "fit_llops_adam",
    "fit_llops_cp",
    "fit_llops_direct",
    "fit_sketch",
    "full_to_symmetric",
    "holdout_split",
    "kernel_errors",
    "kernel_loss",
    "kernel_sq_norm",
    "llops_features",
    "llops_features_naive",
    "llops_init",
    "llops_projector",
    "llops_projector_naive",
    "load_qk",
    "load_theta",
    "max_sketch_size",
    "min_norm_sketch",
    "num_poly_features",
    "optimal_sketch",
    "optimality_ratio",
    "poly_features",
    "poly_features_naive",
    "poly_kernel",
    "projector_to_theta",
    "rank1_residuals",
    "ratio_to_tail",
    "register_sketch",
    "rel_fro",
    "rel_mae",
    "save_qk",
    "save_theta",
    "sketch_fitter",
    "spectral_norm",
    "symmetric_index",
    "symmetric_to_full",
    "tail_bound",
    "train_kernel_sketch",
]
