r"""LLoPS: the learnable low-rank polynomial sketch.

:math:`\Theta \in \mathbb R^{t \times p \times d \times m}` defines
:math:`\phi(x)_i = \sum_{r=1}^t \prod_{j=1}^p \langle \theta_{r,j,:,i}, x\rangle`, i.e.
:math:`\phi(X) = \sum_r \prod_j (X\Theta_{r,j})`; it equals :math:`\psi_p(x)^\top W` where column
``i`` of ``W`` is the rank-``t`` CP tensor :math:`\sum_r \theta_{r,1,:,i}\otimes\dots\otimes\theta_{r,p,:,i}`.

Modules
-------
``maps``       the feature map and projector, their float64 twins, and their derivatives
``cp``         :func:`projector_to_theta` (CP of projector columns, tensorly)
``pair``       :func:`llops_maps` (Θ → the pair of :class:`~sketchlab.featuremaps.LLoPSMap` s every fit returns),
               :func:`llops_from_projector`
``inits``      :func:`llops_init`: svd, random, cp, based, psf, or a given sketch
``sides``      the rows a fit sees: the tokens, or at most ``D`` compressed rows with their Gram matrix
``target``     :class:`~sketchlab.llops.target.KernelTarget`: products with ``A`` without ``n × n``;
               :func:`~sketchlab.llops.target.fit_problem` picks the route
``fit_als``    :func:`fit_llops_direct`: exact block ALS, then Levenberg–Marquardt (default fit)
``fit_lm``     the Levenberg–Marquardt step (Gauss–Newton + CG, ALS blocks as preconditioner)
``fit_adam``   :func:`fit_llops_adam`: the naive Adam baseline
``fit_cp``     :func:`fit_llops_cp`: CP of the columns of ``W*``, :func:`aligned_gauge`
``dispatch``   :func:`fit_llops`, registered as ``fit_sketch("llops", ...)``

References
----------
Qin, Deng, Cong, Sun. *Learnable Low-Rank Polynomial Sketch for Effective Linear Attention*, 2026, §3.2.
"""

from .cp import projector_to_theta
from .dispatch import METHODS, fit_llops
from .fit_adam import fit_llops_adam
from .fit_als import QUALITY, fit_llops_direct
from .fit_cp import GAUGES, aligned_gauge, fit_llops_cp
from .inits import INITS, llops_init
from .maps import (
    affine_input,
    affine_theta,
    llops_features,
    llops_features_naive,
    llops_projector,
    llops_projector_naive,
)
from .pair import llops_from_projector, llops_maps
from .target import KernelTarget

__all__ = [
    "GAUGES",
    "INITS",
    "METHODS",
    "QUALITY",
    "KernelTarget",
    "affine_input",
    "affine_theta",
    "aligned_gauge",
    "fit_llops",
    "fit_llops_adam",
    "fit_llops_cp",
    "fit_llops_direct",
    "llops_features",
    "llops_features_naive",
    "llops_from_projector",
    "llops_init",
    "llops_maps",
    "llops_projector",
    "llops_projector_naive",
    "projector_to_theta",
]
