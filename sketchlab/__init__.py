"""sketchlab: polynomial-kernel sketches for linear attention.

Exact polynomial features, the Theorem 3.1 optimal sketch and its tail bound, LLoPS fits, the
baseline sketches, and a comparison of all of them on Q/K tensors captured from real models.
"""

__version__ = "0.1.0"

from .fit import Fit, FitReport, available_sketches, fit_sketch, holdout_split, register_sketch
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

__all__ = [
    "Fit",
    "FitReport",
    "OptimalSketch",
    "Sketch",
    "__version__",
    "attention_error",
    "available_sketches",
    "causal_attention",
    "fit_sketch",
    "full_to_symmetric",
    "holdout_split",
    "num_poly_features",
    "optimal_sketch",
    "optimality_ratio",
    "poly_features",
    "poly_features_naive",
    "poly_kernel",
    "register_sketch",
    "rel_fro",
    "rel_mae",
    "symmetric_index",
    "symmetric_to_full",
    "tail_bound",
]
