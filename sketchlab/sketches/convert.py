r"""Exact conversions of special-case sketches to LLoPS parameters Θ (``as_llops``).

A rank-1 LLoPS feature is :math:`\phi(x)_i = \prod_{j=1}^p \langle\theta_{1,j,:,i}, x\rangle`. A
sketch converts exactly when each of its features is one product of ``p`` linear forms:

* element-wise :math:`(x\Theta)^{\circ p}`: :math:`\theta_{1,j,:,i} = \Theta_{:,i}` for every ``j``;
* project-then-expand :math:`\psi_p(xP)`: feature :math:`(a_1..a_p)` is
  :math:`\prod_j\langle P_{:,a_j}, x\rangle`, so :math:`\theta_{1,j,:,(a)} = P_{:,a_j}` (a
  Kronecker-structured Θ, ``m = d'^p``); the symmetric form multiplies the ``j = 1`` factor of
  multiset ``α`` by :math:`\sqrt{c_\alpha}`;
* PolySketchFormer with self-tensoring of degree 4: :math:`s_a(x) = \langle G_{1,a},x\rangle
  \langle G_{2,a},x\rangle/\sqrt r` and :math:`\phi_{(a,b)} = s_a s_b`, so
  :math:`\theta_{1,:,:,(a,b)} = (G_{1,a}/r,\; G_{2,a},\; G_{1,b},\; G_{2,b})` (``m = r²``); degree 2
  with self-tensoring (``s = xG/\sqrt r``): :math:`(G_a/\sqrt r, G_b/\sqrt r)`; the plain degree-1
  and degree-2 sketches are rank-1 too.

On the affine input :math:`\tilde x = [x, 1]` (``as_llops(sketch, affine=True)``: Θ has ``d + 1`` rows, the
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

from ..featuremaps.elementwise import TiedLLoPSMap
from ..featuremaps.mlp import MLPMap
from ..featuremaps.polysketch import PolySketchMap
from ..featuremaps.tensorsketch import TensorSketchMap
from ..llops.maps import affine_theta
from ..llops.module import LLoPS
from ..polynomial import symmetric_index
from .based import BasedSketch

__all__ = ["as_llops"]


def _from_columns(proj: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """Θ[..., 1, p, d, M] with Θ[..., 0, j, :, c] = proj[..., :, index[c, j]] (·weight[c] for j = 0)."""
    index = index.to(proj.device)
    factors = [proj[..., :, index[:, j]] for j in range(index.shape[1])]  # each [..., d, M]
    if weight is not None:
        factors[0] = factors[0] * weight.to(device=proj.device, dtype=proj.dtype)  # the weights live on the CPU
    return torch.stack(factors, dim=-3)[..., None, :, :, :]  # [..., 1, p, d, M]


def _elementwise(map_q: TiedLLoPSMap, map_k: TiedLLoPSMap | None = None) -> LLoPS:
    def expand(fmap: TiedLLoPSMap) -> torch.Tensor:
        theta = fmap.theta.detach()  # [H, t, D, M]: every term's p factors equal
        return theta[:, :, None].expand(-1, -1, fmap.p, -1, -1).clone()  # [H, t, p, D, M]

    return LLoPS(expand(map_q), None if map_k is None or map_k is map_q else expand(map_k))


def _based(sketch: BasedSketch) -> LLoPS:
    if sketch.form == "taylor":
        raise ValueError(
            "as_llops: the BASED Taylor map [1, u/d'^{1/4}, u⊗u/(√2·√d')] is inhomogeneous (a constant, a "
            "linear and a quadratic block), while every LLoPS feature of x is a homogeneous degree-p form; it "
            "converts exactly on the affine input [x, 1] (as_llops(sketch, affine=True)), and its homogeneous part, "
            "form='expand', on x"
        )
    dim, p = sketch.dim, sketch.p
    if sketch.symmetric:
        index, weight = symmetric_index(dim, p)  # [C, p], [C]
    else:
        index = torch.tensor(list(itertools.product(range(dim), repeat=p)), dtype=torch.long).reshape(-1, p)  # [dim^p, p]
        weight = None  # row-major tuples, as poly_features orders them
    return LLoPS(_from_columns(sketch.proj, index, weight))


def _pad_affine(llops: LLoPS) -> LLoPS:
    """The same features on ``[x, 1]``: a zero row for the constant coordinate, ``[..., t, p, d + 1, m]``."""
    theta_k = None if llops.theta_k is None else affine_theta(llops.theta_k.detach())
    return LLoPS(affine_theta(llops.theta_q.detach()), theta_k)


def _based_taylor(sketch: BasedSketch) -> LLoPS:
    r"""BASED's Taylor map as a rank-1, ``p = 2`` LLoPS of ``[x, 1]``: Θ ``[..., 1, 2, d + 1, 1 + d' + Q]``.

    Features in :func:`~sketchlab.sketches.based.taylor_features`' order: the constant
    :math:`\langle e, \tilde x\rangle^2`, the linear block :math:`\langle P_{:,a}/d'^{1/4}, x\rangle
    \langle e, \tilde x\rangle`, the quadratic block (the expand form's Θ, first factor divided by
    :math:`\sqrt2\sqrt{d'}`); ``Q = d'^2`` or ``C(d'+1, 2)`` (symmetric).
    """
    proj, dim = sketch.proj.detach(), sketch.dim  # [..., d, d']
    lead, d = proj.shape[:-2], proj.shape[-2]
    unit = proj.new_zeros(*lead, d + 1, 1)
    unit[..., d, 0] = 1.0  # e: the constant coordinate
    columns = torch.cat([proj, proj.new_zeros(*lead, 1, dim)], dim=-2)  # [..., d + 1, d']: P on x, 0 on the constant
    constant = torch.stack([unit, unit], dim=-3)  # [..., 2, d + 1, 1]
    linear = torch.stack([columns / dim**0.25, unit.expand(*lead, d + 1, dim)], dim=-3)  # [..., 2, d + 1, d']
    quadratic = _pad_affine(_based(BasedSketch(proj, 2, form="expand", symmetric=sketch.symmetric))).theta_q.detach()
    quadratic = quadratic[..., 0, :, :, :].clone()  # [..., 2, d + 1, Q]
    quadratic[..., 0, :, :] /= math.sqrt(2.0) * math.sqrt(dim)
    return LLoPS(torch.cat([constant, linear, quadratic], dim=-1)[..., None, :, :, :])  # [..., 1, 2, d + 1, M]


def _psf(sketch: PolySketchMap) -> LLoPS:
    w, r = sketch.weights, sketch.r
    if not sketch.non_negative and sketch.p == 1:
        theta = (w[0] / math.sqrt(r))[..., None, None, :, :]  # [..., 1, 1, d, r]
        return LLoPS(theta)
    if not sketch.non_negative and sketch.p == 2:
        return LLoPS(torch.stack([w[0] / math.sqrt(r), w[1]], dim=-3)[..., None, :, :, :])  # [..., 1, 2, d, r]
    a = torch.arange(r, device=w[0].device).repeat_interleave(r)  # coordinate (a, b) of s ⊗ s, row-major: a outer
    b = torch.arange(r, device=w[0].device).repeat(r)
    if sketch.non_negative and sketch.p == 2:
        g = w[0] / math.sqrt(r)  # s = xG/√r
        return LLoPS(torch.stack([g[..., :, a], g[..., :, b]], dim=-3)[..., None, :, :, :])
    if sketch.non_negative and sketch.p == 4:
        g1, g2 = w[0], w[1]  # s_a = ⟨G1_a, x⟩⟨G2_a, x⟩/√r; s_a s_b carries 1/r
        factors = [g1[..., :, a] / r, g2[..., :, a], g1[..., :, b], g2[..., :, b]]
        return LLoPS(torch.stack(factors, dim=-3)[..., None, :, :, :])  # [..., 1, 4, d, r²]
    kind = "self-tensored" if sketch.non_negative else "plain"
    raise ValueError(
        f"as_llops: the {kind} recursive PolySketchFormer sketch of degree p={sketch.p} has no rank-1 LLoPS "
        "form: above the bottom level each coordinate is a sum over r lower-level coordinates (a CP tensor "
        "of rank up to r per level), not one product of p linear forms. Exact conversions exist for plain "
        "p <= 2 and self-tensored p in (2, 4)"
    )


def as_llops(sketch, *, affine: bool = False) -> LLoPS:
    """Exact LLoPS parameters of a special-case sketch (see the module docstring).

    Parameters
    ----------
    sketch : ElementwiseSketch, BasedSketch (form "expand"; "taylor" with ``affine``), PolySketch
        (plain p <= 2, or self-tensored p in {2, 4}), or LLoPS (returned unchanged without ``affine``)
    affine : bool
        Θ for the affine input ``[x, 1]`` (:func:`sketchlab.llops.affine_input`): ``d + 1`` rows, the
        last one the constant coordinate's. A homogeneous sketch gets a zero last row (the same
        features); BASED's Taylor map converts only so.

    Returns
    -------
    LLoPS
        Rank ``t = 1``, ``p`` = the sketch's degree, same ``num_features`` and the same features to
        round-off (of ``[x, 1]`` with ``affine``); tied (one Θ) when the sketch uses one map for both sides.

    Raises
    ------
    ValueError
        For sketches without an exact rank-1 LLoPS form, saying why.
    TypeError
        For objects that are not sketches.
    """
    if not isinstance(affine, bool):
        raise TypeError(f"as_llops: affine must be a bool, got {affine!r}")
    if affine:
        if isinstance(sketch, BasedSketch) and sketch.form == "taylor":
            return _based_taylor(sketch)
        return _pad_affine(as_llops(sketch))
    if isinstance(sketch, LLoPS):
        return sketch
    if isinstance(sketch, TiedLLoPSMap):
        return _elementwise(sketch)
    if isinstance(sketch, tuple) and len(sketch) == 2 and all(isinstance(f, TiedLLoPSMap) for f in sketch):
        return _elementwise(*sketch)
    if isinstance(sketch, BasedSketch):
        return _based(sketch)
    if isinstance(sketch, PolySketchMap):
        return _psf(sketch)
    if isinstance(sketch, TensorSketchMap):
        raise ValueError(
            "as_llops: TensorSketch has no exact LLoPS form: each feature is a signed sum of all monomials "
            "x_{i_1}⋯x_{i_p} whose hashes add up to one bucket mod m, a sparse tensor of high CP rank, not a "
            "product of p linear forms"
        )
    if isinstance(sketch, MLPMap):
        raise ValueError(
            "as_llops: the MLP sketch is not a polynomial map (σ(xW1 + b1)W2 + b2 with a non-polynomial "
            "activation), so no LLoPS Θ reproduces it"
        )
    from ..sketch import Sketch

    if isinstance(sketch, Sketch):
        raise ValueError(f"as_llops: no exact LLoPS conversion is known for {type(sketch).__name__}")
    raise TypeError(f"as_llops takes a Sketch, got {type(sketch).__name__}")
