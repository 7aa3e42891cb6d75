r"""Exact conversions of the special-case maps to LLoPS maps (:func:`as_llops`: :class:`~sketchlab.featuremaps.LLoPSMap`
with Θ ``[H, 1, p, D, M]``).

A rank-1 LLoPS feature is :math:`\phi(x)_i = \prod_{j=1}^p \langle\theta_{1,j,:,i}, x\rangle`. A
sketch converts exactly when each of its features is one product of ``p`` linear forms:

* element-wise :math:`(x\Theta)^{\circ p}` (:class:`~sketchlab.featuremaps.TiedLLoPSMap`, any rank ``t``: each term's
  ``p`` factors equal): :math:`\theta_{r,j,:,i} = \Theta_{r,:,i}` for every ``j``;
* project-then-expand :math:`\psi_p(xP)`: feature :math:`(a_1..a_p)` is
  :math:`\prod_j\langle P_{:,a_j}, x\rangle`, so :math:`\theta_{1,j,:,(a)} = P_{:,a_j}` (a
  Kronecker-structured Θ, ``m = d'^p``); the symmetric form multiplies the ``j = 1`` factor of
  multiset ``α`` by :math:`\sqrt{c_\alpha}`;
* PolySketchFormer with self-tensoring of degree 4: :math:`s_a(x) = \langle G_{1,a},x\rangle
  \langle G_{2,a},x\rangle/\sqrt r` and :math:`\phi_{(a,b)} = s_a s_b`, so
  :math:`\theta_{1,:,:,(a,b)} = (G_{1,a}/r,\; G_{2,a},\; G_{1,b},\; G_{2,b})` (``m = r²``); degree 2
  with self-tensoring (``s = xG/\sqrt r``): :math:`(G_a/\sqrt r, G_b/\sqrt r)`; the plain degree-1
  and degree-2 sketches are rank-1 too.

On the affine input :math:`\tilde x = [x, 1]` (``as_llops(fmap, affine=True)``: Θ has ``d + 1`` rows, the
last one multiplying the constant coordinate) each factor :math:`\langle\theta, \tilde x\rangle` is affine in
``x``, and BASED's Taylor map :math:`[1, u/d'^{1/4}, u\otimes u/(\sqrt2\sqrt{d'})]`, :math:`u = xP`, converts
exactly with ``p = 2``: the constant feature is :math:`\langle e, \tilde x\rangle^2`, the linear block
:math:`\langle P_{:,a}/d'^{1/4}, x\rangle\cdot\langle e, \tilde x\rangle`, the quadratic block the expand
form's Θ with its first factor divided by :math:`\sqrt2\sqrt{d'}` (``e`` the constant coordinate's unit
vector). Every homogeneous sketch converts on the affine input too, with a zero last row.

Not converted (``ValueError`` naming the reason): the BASED Taylor map on the plain input
(inhomogeneous: degrees 0, 1 and 2 in one feature vector, while every LLoPS feature of ``x`` is a
homogeneous degree-``p`` form; ``affine=True`` converts it); recursive PolySketchFormer sketches above degree 2 without self-tensoring and self-tensored ones
above degree 4 (each coordinate of an upper level is a sum over ``r`` lower-level coordinates, a CP
tensor of rank up to ``r`` per level rather than a single product); TensorSketch (each feature is a
signed sum over all index tuples hashed to one bucket: a sparse, high-rank tensor); the MLP sketch
(not a polynomial at all).
"""

from __future__ import annotations

import itertools
import math

import torch

from ..llops.maps import affine_theta
from ..polynomial import symmetric_index
from .base import FeatureMap
from .based import ExpandMap, TaylorMap
from .elementwise import TiedLLoPSMap
from .llops import LLoPSMap
from .mlp import MLPMap
from .psf_random import PSFRandomMap
from .tensorsketch import TensorSketchMap

__all__ = ["as_llops"]


def _from_columns(proj: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """Θ[..., 1, p, d, M] with Θ[..., 0, j, :, c] = proj[..., :, index[c, j]] (·weight[c] for j = 0)."""
    index = index.to(proj.device)
    factors = [proj[..., :, index[:, j]] for j in range(index.shape[1])]  # each [..., d, M]
    if weight is not None:
        factors[0] = factors[0] * weight.to(device=proj.device, dtype=proj.dtype)  # the weights live on the CPU
    return torch.stack(factors, dim=-3)[..., None, :, :, :]  # [..., 1, p, d, M]


def _elementwise(fmap: TiedLLoPSMap) -> torch.Tensor:
    """Θ ``[H, t, p, D, M]``: each of the ``t`` terms' ``p`` factors equal to the map's ``θ_r``."""
    theta = fmap.theta.detach()  # [H, t, D, M]
    return theta[:, :, None].expand(-1, -1, fmap.p, -1, -1).clone()


def _expand_theta(proj: torch.Tensor, p: int, symmetric: bool) -> torch.Tensor:
    """Θ ``[..., 1, p, d, M]`` of the project-then-expand map ``ψ_p(xP)`` on ``proj [..., d, d']``."""
    dim = proj.shape[-1]
    if symmetric:
        index, weight = symmetric_index(dim, p)  # [C, p], [C]
    else:
        index = torch.tensor(list(itertools.product(range(dim), repeat=p)), dtype=torch.long).reshape(-1, p)  # [dim^p, p]
        weight = None  # row-major tuples, as poly_features orders them
    return _from_columns(proj, index, weight)


def _taylor_theta(fmap: TaylorMap) -> torch.Tensor:
    r"""BASED's Taylor map as a rank-1, ``p = 2`` LLoPS of ``[x, 1]``: Θ ``[H, 1, 2, D + 1, 1 + d' + Q]``.

    Features in :func:`~sketchlab.featuremaps.based.taylor_features`' order: the constant
    :math:`\langle e, \tilde x\rangle^2`, the linear block :math:`\langle P_{:,a}/d'^{1/4}, x\rangle
    \langle e, \tilde x\rangle`, the quadratic block (the expand form's Θ, first factor divided by
    :math:`\sqrt2\sqrt{d'}`); ``Q = d'^2`` or ``C(d'+1, 2)`` (symmetric).
    """
    proj, dim = fmap.proj.detach(), fmap.dim  # [H, d, d']
    lead, d = proj.shape[:-2], proj.shape[-2]
    unit = proj.new_zeros(*lead, d + 1, 1)
    unit[..., d, 0] = 1.0  # e: the constant coordinate
    columns = torch.cat([proj, proj.new_zeros(*lead, 1, dim)], dim=-2)  # [..., d + 1, d']: P on x, 0 on the constant
    constant = torch.stack([unit, unit], dim=-3)  # [..., 2, d + 1, 1]
    linear = torch.stack([columns / dim**0.25, unit.expand(*lead, d + 1, dim)], dim=-3)  # [..., 2, d + 1, d']
    quadratic = affine_theta(_expand_theta(proj, 2, fmap.symmetric))[..., 0, :, :, :].clone()  # [..., 2, d + 1, Q]
    quadratic[..., 0, :, :] /= math.sqrt(2.0) * math.sqrt(dim)
    return torch.cat([constant, linear, quadratic], dim=-1)[..., None, :, :, :]  # [..., 1, 2, d + 1, M]


def _psf(fmap: PSFRandomMap) -> torch.Tensor:
    w, r = [t.detach() for t in fmap.weights], fmap.r  # each [H, in, r]
    if not fmap.non_negative and fmap.p == 1:
        return (w[0] / math.sqrt(r))[..., None, None, :, :]  # [H, 1, 1, d, r]
    if not fmap.non_negative and fmap.p == 2:
        return torch.stack([w[0] / math.sqrt(r), w[1]], dim=-3)[..., None, :, :, :]  # [H, 1, 2, d, r]
    a = torch.arange(r, device=w[0].device).repeat_interleave(r)  # coordinate (a, b) of s ⊗ s, row-major: a outer
    b = torch.arange(r, device=w[0].device).repeat(r)
    if fmap.non_negative and fmap.p == 2:
        g = w[0] / math.sqrt(r)  # s = xG/√r
        return torch.stack([g[..., :, a], g[..., :, b]], dim=-3)[..., None, :, :, :]
    if fmap.non_negative and fmap.p == 4:
        g1, g2 = w[0], w[1]  # s_a = ⟨G1_a, x⟩⟨G2_a, x⟩/√r; s_a s_b carries 1/r
        factors = [g1[..., :, a] / r, g2[..., :, a], g1[..., :, b], g2[..., :, b]]
        return torch.stack(factors, dim=-3)[..., None, :, :, :]  # [H, 1, 4, d, r²]
    kind = "self-tensored" if fmap.non_negative else "plain"
    raise ValueError(
        f"as_llops: the {kind} recursive PolySketchFormer sketch of degree p={fmap.p} has no rank-1 LLoPS "
        "form: above the bottom level each coordinate is a sum over r lower-level coordinates (a CP tensor "
        "of rank up to r per level), not one product of p linear forms. Exact conversions exist for plain "
        "p <= 2 and self-tensored p in (2, 4)"
    )


def _theta(fmap: FeatureMap, affine: bool) -> torch.Tensor:
    """Θ ``[H, t, p, D (+ 1), M]`` of one map (of ``[x, 1]`` with ``affine``), or the error saying why none."""
    if affine and isinstance(fmap, TaylorMap):
        return _taylor_theta(fmap)
    if affine:
        return affine_theta(_theta(fmap, False))
    if isinstance(fmap, LLoPSMap):
        return fmap.theta.detach()
    if isinstance(fmap, TiedLLoPSMap):
        return _elementwise(fmap)
    if isinstance(fmap, ExpandMap):
        return _expand_theta(fmap.proj.detach(), fmap.p, fmap.symmetric)
    if isinstance(fmap, TaylorMap):
        raise ValueError(
            "as_llops: the BASED Taylor map [1, u/d'^{1/4}, u⊗u/(√2·√d')] is inhomogeneous (a constant, a "
            "linear and a quadratic block), while every LLoPS feature of x is a homogeneous degree-p form; it "
            "converts exactly on the affine input [x, 1] (as_llops(fmap, affine=True)), and its homogeneous part, "
            "the expand map, on x"
        )
    if isinstance(fmap, PSFRandomMap):
        return _psf(fmap)
    if isinstance(fmap, TensorSketchMap):
        raise ValueError(
            "as_llops: TensorSketch has no exact LLoPS form: each feature is a signed sum of all monomials "
            "x_{i_1}⋯x_{i_p} whose hashes add up to one bucket mod m, a sparse tensor of high CP rank, not a "
            "product of p linear forms"
        )
    if isinstance(fmap, MLPMap):
        raise ValueError(
            "as_llops: the MLP sketch is not a polynomial map (σ(xW1 + b1)W2 + b2 with a non-polynomial "
            "activation), so no LLoPS Θ reproduces it"
        )
    raise ValueError(f"as_llops: no exact LLoPS conversion is known for {type(fmap).__name__}")


def as_llops(maps, *, affine: bool = False) -> LLoPSMap | tuple[LLoPSMap, LLoPSMap]:
    """Exact LLoPS maps of special-case maps (see the module docstring).

    Parameters
    ----------
    maps : FeatureMap or (map_q, map_k)
        One map for both sides or a pair: :class:`~sketchlab.featuremaps.TiedLLoPSMap` (element-wise),
        :class:`~sketchlab.featuremaps.ExpandMap` (BASED's expand map; :class:`~sketchlab.featuremaps.TaylorMap`
        with ``affine``), :class:`~sketchlab.featuremaps.PSFRandomMap` (plain p <= 2, or self-tensored p in
        {2, 4}), or :class:`~sketchlab.featuremaps.LLoPSMap` (returned unchanged without ``affine``).
    affine : bool
        Θ for the affine input ``[x, 1]`` (:func:`sketchlab.llops.affine_input`): ``D + 1`` rows, the
        last one the constant coordinate's. A homogeneous map gets a zero last row (the same
        features); BASED's Taylor map converts only so.

    Returns
    -------
    LLoPSMap or (LLoPSMap, LLoPSMap)
        Θ ``[H, t, p, D (+ 1), M]`` of the same heads: rank ``t = 1`` (a tied map's own rank), ``p`` the map's degree,
        the same ``num_features`` and the same features to round-off (of ``[x, 1]`` with ``affine``); one map when
        one map (or the same map twice) was given, else a pair.

    Raises
    ------
    ValueError
        For maps without an exact rank-1 LLoPS form, saying why.
    TypeError
        For objects that are neither a map nor a pair of maps.
    """
    if not isinstance(affine, bool):
        raise TypeError(f"as_llops: affine must be a bool, got {affine!r}")
    pair = (maps, maps) if isinstance(maps, FeatureMap) else maps
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(f, FeatureMap) for f in pair)):
        raise TypeError(f"as_llops takes a FeatureMap or a pair (map_q, map_k) of them, got {type(maps).__name__}")
    if not affine and all(isinstance(f, LLoPSMap) for f in pair):
        return maps if isinstance(maps, FeatureMap) else tuple(pair)

    def convert(fmap: FeatureMap) -> LLoPSMap:
        theta = _theta(fmap, affine)
        return LLoPSMap(fmap.heads, theta.shape[-2], theta=theta)

    map_q = convert(pair[0])
    return map_q if pair[1] is pair[0] else (map_q, convert(pair[1]))
