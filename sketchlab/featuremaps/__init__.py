r"""The feature-map family behind one interface and one name registry (layout ``[B, T, H, D]``).

A :class:`FeatureMap` (:mod:`.base`) turns per-head queries or keys ``x [B, T, H, D]`` into features
``[B, T, H, M]`` whose inner products approximate (or equal) a kernel; it is the far part of the
sliding-window hybrid, a trainable attention in its own right, and what model conversion swaps in
(:func:`sketchlab.attention.linear_attention`). Every map has a naive float64 twin,
:meth:`FeatureMap.features_naive`. One module per map, with its pure feature functions and, where it has
one, its ``fit_sketch`` fitter (which returns :class:`FittedMaps`: the pair ``(map_q, map_k)`` and the fit's ``info``); :mod:`.registry`
names them (:func:`make_feature_map`, :func:`register_feature_map`, :func:`feature_map_names`), beside each
map's fitter slot (:func:`register_fitter`, :func:`own_fitter`, :func:`fitter_names`: one vocabulary for
maps and fit methods); a user's own module joins in one call, :func:`as_feature_map` (:mod:`.custom`); the
special cases convert exactly to LLoPS maps, :func:`~sketchlab.featuremaps.to_llops.as_llops`; a batch of
problems ``[L, H, n, D]`` meets a map's heads in one place, :func:`batch_features` (:mod:`.heads`).

========================  ===================================================  ========================
map (name)                features                                             kernel
========================  ===================================================  ========================
:class:`LLoPSMap`         :math:`\sum_r\prod_j \langle\theta_{r,j,:,i}, x\rangle`  ≈ ``(qᵀk)^p``
(``llops``)
:class:`TiedLLoPSMap`     :math:`\sum_r \langle\theta_{r,:,i}, x\rangle^p`       ≥ 0 for even ``p``
(``elementwise``)
:class:`ExactPolyMap`     :math:`\psi_p(x)` (``D^p`` or ``C(D+p−1, p)``)         ``(qᵀk)^p``
(``exact-poly``)
:class:`TaylorMap`        BASED: :math:`[1, u/d'^{1/4}, u\otimes u/\sqrt{2d'}]`   ``1 + s + s²/2``
(``based-taylor``)
:class:`ExpandMap`        BASED: :math:`\psi_p(xP)`                             ``(qᵀPPᵀk)^p``
(``based-expand``)
:func:`psf_learned_map`   PolySketchFormer's learned sketch LN→Linear→GELU→Linear  learned
(``psf-learned``,         (``InputNormed(MLPMap)``)
self-tensored)
:class:`PSFRandomMap`     PolySketchFormer's random sketch (fixed Gaussians)   ≈ ``(qᵀk)^p``; ≥ 0 self-tensored
(``psf-random``)
:class:`TensorSketchMap`  TensorSketch: CountSketches multiplied by FFT        ≈ ``(qᵀk)^p``, unbiased
(``tensorsketch``)
:class:`MLPMap`           a two-layer MLP :math:`\sigma(xW_1 + b_1)W_2 + b_2`    fitted
(the ``mlp`` method, one map per side)
:class:`HedgehogMap`      LoLCATs: :math:`[\mathrm{softmax}(xW), \mathrm{softmax}(-xW)]`  ≈ ``exp(qᵀk)``
(``hedgehog``)
:class:`SelfTensored`     :math:`\phi\otimes\phi` of any map                     ``(φ(q)·φ(k))² >= 0``
:class:`InputNormed`      :math:`\phi(\mathrm{LN}(x))` of any map, per-head affine  φ's, of LN(q), LN(k)
(``input_norm=True``)
:class:`IdentityMap`      :math:`x` (``M = D``; DeltaNet's, :mod:`.identity`)    ``qᵀk``
(``identity``)
:class:`ModuleMap`        a user's module ``[B, T, H, D] → [B, T, H, M]``        the module's
(:func:`as_feature_map`, registered under any name)
========================  ===================================================  ========================

References
----------
Kacham, Mirrokni, Zhong. *PolySketchFormer*, 2024 (learned sketches, self-tensoring); Arora et al.
*BASED*, 2024 (Taylor map); Zhang et al. *LoLCATs*, 2024 and *The Hedgehog & the Porcupine*, 2024.
"""

from .base import FeatureMap
from .based import ExpandMap, TaylorMap
from .custom import ModuleMap, as_feature_map
from .elementwise import TiedLLoPSMap
from .exact import ExactPolyMap
from .heads import batch_features, pair_features
from .hedgehog import HedgehogMap
from .llops import LLoPSMap
from .mlp import MLPMap
from .normed import InputNormed
from .psf import psf_learned_map
from .psf_random import PSFRandomMap
from .registry import (
    COMMON_OPTIONS,
    DEPRECATED_METHODS,
    DEPRECATED_NAMES,
    FittedMaps,
    Option,
    check_feature_map_options,
    feature_map_names,
    feature_map_options,
    fitter_names,
    make_feature_map,
    own_fitter,
    register_feature_map,
    register_fitter,
    resolve_name,
)
from .selftensored import SelfTensored
from .tensorsketch import TensorSketchMap

#: The built-in names of :func:`make_feature_map` (:func:`feature_map_names` adds any registered later).
FEATURE_MAPS = ("based-expand", "based-taylor", "elementwise", "exact-poly", "hedgehog", "llops", "psf-learned",
                "psf-random", "tensorsketch")

__all__ = [
    "COMMON_OPTIONS",
    "DEPRECATED_METHODS",
    "DEPRECATED_NAMES",
    "FEATURE_MAPS",
    "ExactPolyMap",
    "ExpandMap",
    "FeatureMap",
    "FittedMaps",
    "HedgehogMap",
    "InputNormed",
    "LLoPSMap",
    "MLPMap",
    "ModuleMap",
    "Option",
    "PSFRandomMap",
    "SelfTensored",
    "TaylorMap",
    "TensorSketchMap",
    "TiedLLoPSMap",
    "as_feature_map",
    "batch_features",
    "check_feature_map_options",
    "feature_map_names",
    "feature_map_options",
    "fitter_names",
    "make_feature_map",
    "own_fitter",
    "pair_features",
    "psf_learned_map",
    "register_feature_map",
    "register_fitter",
    "resolve_name",
]
