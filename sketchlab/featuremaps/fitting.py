"""Any registered feature map as a ``fit_sketch`` method: its maps fitted to the kernel by Adam.

``fit_sketch(name, q, k, p=, m=)`` for a map of the registry whose fitter slot is empty (no fitter of its
own: :func:`~sketchlab.featuremaps.registry.own_fitter` is ``None``; ``hedgehog``, ``psf-learned``, a user's map)
builds a query and a key map of ``H = prod(batch)`` heads (:func:`make_feature_map`, seeds ``seed`` and
``seed + 1``; ``tied=True``: one map), trains their parameters with the relative kernel loss, optimiser
and budget every learned sketch shares (:func:`sketchlab.objective.train_kernel_sketch`), and returns
them as :class:`~sketchlab.featuremaps.FittedMaps` (one map twice when tied) with the fit's ``info`` (each head's best step kept, or the heads'
best step together where a map's parameters may be shared between heads: ``FeatureMap.per_head_parameters``). A
map without trained parameters (exact, DPFP) is returned as built (``steps = 0``).
"""

from __future__ import annotations

import math

from ..objective import DEFAULT_LR, DEFAULT_STEPS, train_kernel_sketch
from .base import FeatureMap, FittedMaps
from .heads import batch_features
from .registry import make_feature_map

__all__ = ["feature_map_fitter"]


def feature_map_fitter(name: str):
    """The ``fit_sketch`` fitter of the registered map ``name``."""

    def fit(q, k, *, p: int, m: int, seed: int = 0, steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR,
            tied: bool = False, **options) -> FittedMaps:
        if not isinstance(tied, bool):
            raise TypeError(f"tied must be a bool, got {tied!r}")
        batch, d = tuple(q.shape[:-2]), q.shape[-1]
        heads = math.prod(batch)

        def make(s):
            return make_feature_map(name, heads=heads, head_dim=d, p=p, m=m, seed=s, dtype=q.dtype, **options)

        map_q = make(seed).to(q.device)
        map_k = map_q if tied else make(seed + 1).to(q.device)
        sides = [map_q] if tied else [map_q, map_k]
        params = [t for fmap in sides for t in fmap.parameters() if t.requires_grad]
        if not params:
            return FittedMaps(map_q, map_k, {"steps": 0, "converged": True})
        flat_q, flat_k = q.reshape(heads, *q.shape[-2:]), k.reshape(heads, *k.shape[-2:])  # [H, n, d]
        per_head = all(f.per_head_parameters for side in sides for f in side.modules() if isinstance(f, FeatureMap))
        info = train_kernel_sketch(params, lambda a, b: (batch_features(map_q, a), batch_features(map_k, b)),
                                   flat_q, flat_k, p, steps=steps, lr=lr, what=f"feature map {name!r}",
                                   per_head=per_head)
        for key in ("init_rel_fro", "rel_fro"):
            info[key] = info[key].reshape(batch)
        return FittedMaps(map_q, map_k, info)

    fit.__name__ = f"fit_{name.replace('-', '_')}"
    return fit
