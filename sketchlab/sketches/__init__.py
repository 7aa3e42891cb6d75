"""Baseline sketches, each behind the :class:`~sketchlab.sketch.Sketch` interface, and their
:func:`~sketchlab.fit.fit_sketch` fitters, each in the fitter slot of its name in the one registry
(:data:`sketchlab.featuremaps.registry._BUILTINS`): ``"mlp"``,
``"based-expand"``, ``"based-taylor"``, ``"elementwise"``; and :func:`as_llops`, the exact conversions of
the special cases to LLoPS Θ.
"""

from .based import (
    BasedSketch,
    based_dim_for_budget,
    based_num_features,
    expand_features,
    expand_features_naive,
    pca_projection,
    taylor_features,
    taylor_features_naive,
)
from .convert import as_llops

__all__ = [
    "BasedSketch",
    "as_llops",
    "based_dim_for_budget",
    "based_num_features",
    "expand_features",
    "expand_features_naive",
    "pca_projection",
    "taylor_features",
    "taylor_features_naive",
]
