r"""The LLoPS feature map and its projector, each beside its float64 loop twin.

:math:`\Theta \in \mathbb R^{t \times p \times d \times m}` defines
:math:`\phi(x)_i = \sum_{r=1}^t \prod_{j=1}^p \langle \theta_{r,j,:,i}, x\rangle`, i.e.
:math:`\phi(X) = \sum_r \prod_j (X\Theta_{r,j})` (element-wise product over ``j``). This equals
:math:`\psi_p(x)^\top W` where column ``i`` of ``W``, reshaped to a ``d × … × d`` tensor, is the
rank-``t`` CP tensor :math:`\sum_r \theta_{r,1,:,i} \otimes \dots \otimes \theta_{r,p,:,i}`.

The derivatives the second-order fits need (:func:`feature_partials`, :func:`features_jvp`,
:func:`features_vjp`) are here too; the tests check them against ``torch.autograd``.
"""

from __future__ import annotations

import itertools

import torch

from .._validation import as_float_tensor, per_version

__all__ = [
    "affine_input",
    "affine_theta",
    "feature_partials",
    "features_jvp",
    "features_vjp",
    "llops_features",
    "llops_feature_fn",
    "llops_features_naive",
    "llops_is_non_negative",
    "llops_projector",
    "llops_projector_naive",
]


def affine_input(x: torch.Tensor) -> torch.Tensor:
    r"""The affine input :math:`\tilde x = [x, 1]`: ``x [..., d]`` → ``[..., d + 1]``.

    A LLoPS Θ with ``d + 1`` rows applied to it has factors :math:`\langle\theta_{:d}, x\rangle +
    \theta_d`, affine in ``x``: its features are inhomogeneous polynomials of degree ``<= p`` (BASED's
    Taylor map is one, :func:`sketchlab.as_llops` with ``affine=True``).

    Passing ``[q, 1]``, ``[k, 1]`` to :func:`sketchlab.attention.linear_attention` with a window: give
    ``local_scale`` explicitly (its default ``1/√D`` reads ``D + 1`` from the augmented q), and keep
    ``local="softmax"``, whose scores shift by the constant's product (a shift the softmax cancels);
    ``local="poly"`` would compute ``(s·(qᵀk + 1))^p``, not the map's kernel. The toy model's ``llops``
    attention with ``affine=true`` does both.
    """
    return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)


def affine_theta(theta: torch.Tensor) -> torch.Tensor:
    r"""Θ ``[..., d, m]`` → ``[..., d + 1, m]`` with a zero row for the constant coordinate of
    :func:`affine_input`: the same (homogeneous) features of ``[x, 1]`` as ``theta`` gives of ``x``."""
    return torch.cat([theta, theta.new_zeros(*theta.shape[:-2], 1, theta.shape[-1])], dim=-2)


def _check_theta(theta, name: str = "theta") -> torch.Tensor:
    theta = as_float_tensor(theta, name)
    if theta.ndim < 4 or 0 in theta.shape[-4:]:
        raise ValueError(f"{name} must have shape [..., t, p, d, m] with every size >= 1, got {tuple(theta.shape)}")
    return theta


def llops_features(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    r"""LLoPS features :math:`\phi(X) = \sum_r \prod_j X\Theta_{r,j}`.

    Parameters
    ----------
    x : Tensor ``[..., n, d]``
    theta : Tensor ``[..., t, p, d, m]``
        Leading axes broadcast against those of ``x`` (e.g. ``[L, H]`` for one map per head).

    Returns
    -------
    Tensor ``[..., n, m]``. Cost ``O(n d m t p)``.
    """
    proj = x[..., None, None, :, :] @ theta  # [..., t, p, n, m] = ⟨θ_{r,j,:,i}, x⟩
    return proj.prod(dim=-3).sum(dim=-3)  # ∏ over j, then Σ over r


def llops_features_naive(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Float64 twin of :func:`llops_features` for ``x[n, d]``, ``theta[t, p, d, m]``: loops over r, j."""
    x = as_float_tensor(x, "x").to(torch.float64)
    theta = _check_theta(theta).to(torch.float64)
    if x.ndim != 2 or theta.ndim != 4 or x.shape[-1] != theta.shape[-2]:
        raise ValueError(f"llops_features_naive takes x[n, d] and theta[t, p, d, m], got {tuple(x.shape)}, {tuple(theta.shape)}")
    t, p, _, m = theta.shape
    out = torch.zeros(x.shape[0], m, dtype=torch.float64)
    for r in range(t):
        term = torch.ones(x.shape[0], m, dtype=torch.float64)
        for j in range(p):
            term = term * (x @ theta[r, j])  # [n, m]
        out = out + term
    return out


def llops_projector(theta: torch.Tensor) -> torch.Tensor:
    r"""The projector ``W`` with :math:`\phi(x) = \psi_p(x)^\top W`, in the full ``d**p`` basis.

    Parameters
    ----------
    theta : Tensor ``[..., t, p, d, m]``

    Returns
    -------
    Tensor ``[..., d**p, m]``; column ``i`` is
    :math:`\mathrm{vec}\big(\sum_r \theta_{r,1,:,i}\otimes\dots\otimes\theta_{r,p,:,i}\big)` in the
    row-major tuple order of :func:`sketchlab.poly_features`. Memory ``d**p · m`` per head: for
    small ``d`` (tests and theory).
    """
    theta = _check_theta(theta)
    *batch, t, p, d, m = theta.shape
    out = theta[..., 0, :, :]  # [..., t, d, m]
    for j in range(1, p):
        out = out[..., :, None, :] * theta[..., j, None, :, :]  # [..., t, d^j, d, m]
        out = out.reshape(*batch, t, d ** (j + 1), m)  # [..., t, d^(j+1), m]
    return out.sum(-3)  # Σ_r: [..., d^p, m]


def llops_projector_naive(theta: torch.Tensor) -> torch.Tensor:
    """Float64 twin of :func:`llops_projector` for ``theta[t, p, d, m]``: one loop per index tuple."""
    theta = _check_theta(theta).to(torch.float64)
    if theta.ndim != 4:
        raise ValueError(f"llops_projector_naive takes theta[t, p, d, m], got {tuple(theta.shape)}")
    t, p, d, m = theta.shape
    out = torch.zeros(d**p, m, dtype=torch.float64)
    for row, idx in enumerate(itertools.product(range(d), repeat=p)):
        for i in range(m):
            for r in range(t):
                value = 1.0
                for j, a in enumerate(idx):
                    value *= float(theta[r, j, a, i])
                out[row, i] += value
    return out


def feature_partials(x: torch.Tensor, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Features and the partial products :math:`O_{r,j} = \prod_{l\ne j} X\Theta_{r,l}`.

    :math:`\partial\phi_i / \partial\theta_{r,j,:,i} = O_{r,j,:,i}\,x`, so every first-order
    quantity of a fit is a contraction with ``O`` (prefix and suffix products: no division, exact
    when a factor is 0).

    Parameters
    ----------
    x : Tensor ``[B, n, d]``
    theta : Tensor ``[B, t, p, d, m]``

    Returns
    -------
    features : Tensor ``[B, n, m]``
    others : Tensor ``[B, t, p, n, m]``
    """
    proj = torch.einsum("bnd,btpdm->btpnm", x, theta)  # [B, t, p, n, m] = ⟨θ_{r,j,:,i}, x_n⟩
    p = theta.shape[2]
    prefix = [torch.ones_like(proj[:, :, 0])]  # prefix[j] = ∏_{l<j}
    for j in range(p - 1):
        prefix.append(prefix[-1] * proj[:, :, j])
    suffix = [torch.ones_like(proj[:, :, 0])]  # built from the end: ∏_{l>j}
    for j in range(p - 1, 0, -1):
        suffix.append(suffix[-1] * proj[:, :, j])
    suffix = suffix[::-1]
    others = torch.stack([prefix[j] * suffix[j] for j in range(p)], 2)  # [B, t, p, n, m]
    features = (proj[:, :, 0] * others[:, :, 0]).sum(1)  # Σ_r ∏_j: [B, n, m]
    return features, others


def features_jvp(x: torch.Tensor, others: torch.Tensor, d_theta: torch.Tensor) -> torch.Tensor:
    r"""Directional derivative :math:`\delta\Phi = \sum_{r,j} (X\,\delta\Theta_{r,j}) \odot O_{r,j}`.

    ``x[B, n, d]``, ``others[B, t, p, n, m]`` (:func:`feature_partials`), ``d_theta[B, t, p, d, m]`` → ``[B, n, m]``.
    """
    return (torch.einsum("bnd,btpdm->btpnm", x, d_theta) * others).sum((1, 2))


def features_vjp(x: torch.Tensor, others: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    r"""Pull-back of a feature gradient ``grad[B, n, m]`` to Θ: :math:`X^\top (G \odot O_{r,j})`, ``[B, t, p, d, m]``."""
    return torch.einsum("bnd,btpnm->btpdm", x, others * grad[:, None, None])


#: ``Θ_flat`` per Θ tensor that builds no graph (:func:`sketchlab._validation.per_version`): a decoding
#: loop passes the same Θ every token; its copy is made once, and again after any in-place change.
_FLAT: dict[int, tuple] = {}


def _flat(theta: torch.Tensor) -> torch.Tensor:
    """``Θ [H, t, p, D, M]`` as ``[H, D, t·p·M]`` (a copy), cached while no gradient reaches Θ."""
    H, t, p, D, M = theta.shape
    flat = lambda: theta.permute(0, 3, 1, 2, 4).reshape(H, D, t * p * M)  # noqa: E731
    if (theta.requires_grad and torch.is_grad_enabled()) or torch.is_inference_mode_enabled():
        return flat()  # a graph to Θ, or an inference tensor: made per call
    return per_version(_FLAT, theta, lambda: flat().detach())


def llops_feature_fn(theta: torch.Tensor):
    r"""A function ``x[B, H, n, D] → φ(x)[B, H, n, M]`` for per-head Θ ``[H, t, p, D, M]``.

    Same map as :func:`sketchlab.llops_features` (tested against it), computed as one batched
    matmul ``x @ Θ_flat`` with ``Θ_flat = [H, D, t·p·M]`` followed by ``p - 1`` products and
    ``t - 1`` sums of ``[B, H, n, M]`` slices (the broadcast form would copy ``x`` ``t·p`` times).
    """
    H, t, p, D, M = theta.shape
    flat = _flat(theta)  # [H, D, t·p·M]

    def features(x: torch.Tensor) -> torch.Tensor:
        B, _, n, _ = x.shape
        # tokens folded into the rows of one matmul per head, [H, B·n, D] @ [H, D, t·p·M]: broadcasting
        # x [B, H, n, D] @ flat would batch over B, and the backward would form Θ's gradient as B
        # products [D, t·p·M] and then sum them (analysis/results/parallel.md §2, forward + backward at
        # B = 64: folded 1.1-1.7x faster at T = 16-32, even with broadcasting at T = 64 within the noise)
        xh = x.transpose(0, 1).reshape(H, B * n, D)  # [H, B·n, D]
        proj = torch.bmm(xh, flat).view(H, B, n, t * p * M).transpose(0, 1)  # [B, H, n, t·p·M]
        # one split into the t·p factors [B, H, n, M]: a slice per factor would zero-fill a full-size
        # gradient for each of them in the backward
        factors = proj.split_with_sizes([M] * (t * p), dim=-1)  # t·p tensors [B, H, n, M], rank-major
        out = None
        for r in range(t):
            term = factors[r * p]
            for j in range(1, p):
                term = term * factors[r * p + j]  # [B, H, n, M]
            out = term if out is None else out + term
        return out

    return features


#: llops_is_non_negative's answers per Θ tensor and in-place version.
_NON_NEGATIVE: dict = {}


def llops_is_non_negative(theta: torch.Tensor) -> bool:
    r"""Whether the LLoPS map of ``theta [..., t, p, D, M]`` is non-negative for every input.

    True when it is rank 1 (``t = 1``), of even degree and every feature's ``p`` factors are
    equal: then :math:`\phi(x)_i = \langle\theta_i, x\rangle^p \ge 0`, and a kernel of two such
    maps is a sum of non-negative products. Otherwise the map can be signed (a sufficient test:
    a signed-capable Θ may still happen to be non-negative on the data).
    """
    t, p = theta.shape[-4], theta.shape[-3]
    if t != 1 or p % 2:
        return False

    def equal_factors():
        with torch.no_grad():
            return bool((theta == theta[..., :1, :, :]).all())

    return per_version(_NON_NEGATIVE, theta, equal_factors)  # once per tensor and in-place version (decoding)
