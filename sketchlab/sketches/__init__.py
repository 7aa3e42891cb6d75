"""Baseline sketches, each behind the :class:`~sketchlab.sketch.Sketch` interface and registered for
:func:`~sketchlab.fit.fit_sketch`: ``"psf"``, ``"tensorsketch"``, ``"mlp"``, ``"based"``,
``"elementwise"``; and :func:`as_llops`, the exact conversions of the special cases to LLoPS Θ.
"""

from .psf import PolySketch, psf_features, psf_features_naive, psf_weight_shapes

__all__ = ["PolySketch", "psf_features", "psf_features_naive", "psf_weight_shapes"]
