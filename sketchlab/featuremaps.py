r"""The feature-map family behind one interface (layout ``[B, T, H, D]``, one map per head).

A :class:`FeatureMap` turns per-head queries or keys ``x [B, T, H, D]`` into features
``[B, T, H, M]`` whose inner products approximate (or equal) a kernel; it is the far part of the
sliding-window hybrid, a trainable attention in its own right, and what model conversion swaps in
(:func:`sketchlab.attention.featuremap_attention`). Every map has a naive float64 twin,
:meth:`FeatureMap.features_naive`, written one head and one token row at a time.

=====================  =====================================================  ==============
map                    features                                               kernel
=====================  =====================================================  ==============
:class:`LLoPSMap`      :math:`\sum_r\prod_j \langle\theta_{r,j,:,i}, x\rangle`  ≈ ``(qᵀk)^p``
:class:`ExactPolyMap`  :math:`\psi_p(x)` (``D^p`` or ``C(D+p−1, p)``)           ``(qᵀk)^p``
:class:`TaylorMap`     BASED: :math:`[1, u/d'^{1/4}, u\otimes u/\sqrt{2d'}]`     ``1 + s + s²/2``
:class:`PSFLearnedMap` PolySketchFormer's learned sketch LN→Linear→GELU→Linear  learned
:class:`HedgehogMap`   LoLCATs: :math:`[\mathrm{softmax}(xW), \mathrm{softmax}(-xW)]`  ≈ ``exp(qᵀk)``
:class:`SelfTensored`  :math:`\phi\otimes\phi` of any map                       ``(φ(q)·φ(k))² >= 0``
=====================  =====================================================  ==============

References
----------
Kacham, Mirrokni, Zhong. *PolySketchFormer*, 2024 (learned sketches, self-tensoring); Arora et al.
*BASED*, 2024 (Taylor map); Zhang et al. *LoLCATs*, 2024 and *The Hedgehog & the Porcupine*, 2024.
"""

from __future__ import annotations

import abc
import math

import torch
from torch import nn

from ._validation import as_float_tensor, check_degree, check_positive_int

__all__ = [
    "FEATURE_MAPS",
    "ExactPolyMap",
    "FeatureMap",
    "HedgehogMap",
    "LLoPSMap",
    "PSFLearnedMap",
    "SelfTensored",
    "TaylorMap",
    "make_feature_map",
]


def _check_x(x, heads: int, dim: int, name: str = "x") -> torch.Tensor:
    x = as_float_tensor(x, name)
    if x.ndim != 4 or x.shape[2] != heads or x.shape[3] != dim:
        raise ValueError(f"{name} must have layout [B, T, H={heads}, D={dim}], got shape {tuple(x.shape)}")
    return x


class FeatureMap(nn.Module, abc.ABC):
    """One feature map per head: ``features(x [B, T, H, D]) -> [B, T, H, M]``.

    Subclasses set ``heads``, ``head_dim``, implement :meth:`_features` (on validated input) and
    :meth:`_features_naive` (one head ``x [n, D]`` in float64 → ``[n, M]``) and the properties
    :attr:`num_features`, :attr:`degree` (the polynomial degree of the kernel, ``None`` when it is
    not a polynomial: the hybrid's ``local="poly"`` needs it) and :attr:`non_negative` (whether
    the kernel ``φ(q)·φ'(k)`` is provably ``>= 0`` for every input, ``φ'`` this map or another
    non-negative one of its kind, so ``normalize="sum"`` is safe).
    """

    heads: int
    head_dim: int

    @property
    @abc.abstractmethod
    def num_features(self) -> int:
        """``M``, the number of features per head."""

    @property
    def degree(self) -> int | None:
        return None

    @property
    def non_negative(self) -> bool:
        return False

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, H, D]`` → features ``[B, T, H, M]`` (the map's parameters' dtype promoted with ``x``'s)."""
        return self._features(_check_x(x, self.heads, self.head_dim))

    def features_naive(self, x: torch.Tensor) -> torch.Tensor:
        """Float64 twin of :meth:`features`, head by head and token by token."""
        x = _check_x(x, self.heads, self.head_dim).to(torch.float64)
        B, T, H, _ = x.shape
        return torch.stack([torch.stack([self._features_naive(x[b, :, h], h) for h in range(H)], 1)
                            for b in range(B)])  # [B, T, H, M]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)

    @abc.abstractmethod
    def _features(self, x):
        """The map on checked ``x [B, T, H, D]`` → ``[B, T, H, M]``."""

    @abc.abstractmethod
    def _features_naive(self, x, head: int):
        """The float64 twin on one head's tokens ``x [T, D]`` → ``[T, M]``."""


def _init_heads(module: FeatureMap, heads, head_dim):
    module.heads = check_positive_int(heads, "heads")
    module.head_dim = check_positive_int(head_dim, "head_dim")


def _store(module: nn.Module, name: str, tensor: torch.Tensor, learn: bool) -> None:
    """``module.<name> = tensor`` as a trained parameter (``learn``) or a fixed buffer (saved either way)."""
    if learn:
        setattr(module, name, nn.Parameter(tensor))
    else:
        module.register_buffer(name, tensor)


class LLoPSMap(FeatureMap):
    r"""The LLoPS map per head, :math:`\phi(x)_i = \sum_r \prod_j \langle\theta_{r,j,:,i}, x\rangle`.

    Parameters
    ----------
    heads, head_dim : int
    p, m, rank : int
        Degree, features ``M`` and CP rank ``t`` of a fresh Θ ``[H, t, p, D, M]``: equal factors
        :math:`\theta_{r,1} = \dots = \theta_{r,p} \sim N(0, 1/D)` (non-negative for even ``p``).
    theta : Tensor ``[H, t, p, D, M]`` or None
        A given Θ (e.g. an export's layer) instead; ``p, m, rank`` must then match it or be left at None.
    learn : bool
        Θ as a parameter (trained) or a buffer.
    seed : int
    """

    def __init__(self, heads: int, head_dim: int, *, p: int | None = None, m: int | None = None,
                 rank: int | None = None, theta=None, learn: bool = True, seed: int = 0, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        if theta is None:
            p, m, rank = check_degree(2 if p is None else p), check_positive_int(64 if m is None else m, "m"), \
                check_positive_int(1 if rank is None else rank, "rank")
            gen = torch.Generator().manual_seed(seed)
            base = torch.randn(self.heads, rank, 1, self.head_dim, m, generator=gen, dtype=torch.float64)
            theta = (base / math.sqrt(self.head_dim)).expand(-1, -1, p, -1, -1).to(dtype)
        theta = as_float_tensor(theta, "theta").detach().clone()
        if theta.ndim != 5 or theta.shape[0] != self.heads or theta.shape[3] != self.head_dim:
            raise ValueError(f"theta must have shape [H={self.heads}, t, p, D={self.head_dim}, M], got {tuple(theta.shape)}")
        for name, want, axis in (("p", p, 2), ("m", m, 4), ("rank", rank, 1)):
            if want is not None and want != theta.shape[axis]:
                raise ValueError(f"theta has {name}={theta.shape[axis]} (axis {axis} of [H, t, p, D, M]) but {name}={want}")
        _store(self, "theta", theta, learn)

    @property
    def num_features(self) -> int:
        return self.theta.shape[-1]

    @property
    def degree(self) -> int:
        return self.theta.shape[2]

    @property
    def non_negative(self) -> bool:
        from .llops.maps import llops_is_non_negative

        return llops_is_non_negative(self.theta)

    def _features(self, x):
        from .llops.maps import llops_feature_fn

        dtype = torch.promote_types(x.dtype, self.theta.dtype)
        out = llops_feature_fn(self.theta.to(dtype))(x.to(dtype).transpose(1, 2))  # [B, H, T, M]
        return out.transpose(1, 2)  # [B, T, H, M]

    def _features_naive(self, x, head):
        from .llops import llops_features_naive

        return llops_features_naive(x, self.theta[head].detach())


class ExactPolyMap(FeatureMap):
    r"""The exact degree-``p`` features :math:`\psi_p(x)` of :func:`sketchlab.poly_features` (the
    same for every head): ``D^p`` coordinates, or ``C(D+p−1, p)`` with ``symmetric`` — for small ``D``."""

    def __init__(self, heads: int, head_dim: int, *, p: int = 2, symmetric: bool = True):
        super().__init__()
        _init_heads(self, heads, head_dim)
        self.p = check_degree(p)
        if not isinstance(symmetric, bool):
            raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
        self.symmetric = symmetric

    @property
    def num_features(self) -> int:
        from .polynomial import num_poly_features

        return num_poly_features(self.head_dim, self.p, self.symmetric)

    @property
    def degree(self) -> int:
        return self.p

    @property
    def non_negative(self) -> bool:
        return self.p % 2 == 0  # features are signed; the kernel (qᵀk)^p is >= 0 for even p

    def _features(self, x):
        from .polynomial import poly_features

        return poly_features(x, self.p, self.symmetric)

    def _features_naive(self, x, head):
        from .polynomial import poly_features_naive

        return poly_features_naive(x, self.p, self.symmetric)


class TaylorMap(FeatureMap):
    r"""BASED's Taylor map on ``d'`` projected coordinates :math:`u = xP_h`:
    :math:`[1, u/d'^{1/4}, u\otimes u/(\sqrt2\sqrt{d'})]`, kernel :math:`1 + s + s^2/2 > 0`
    with :math:`s = u_q^\top u_k/\sqrt{d'}` (:func:`sketchlab.sketches.based.taylor_features`).

    ``proj [H, D, d']`` defaults to the first ``dim`` coordinates (``[I; 0]``); ``learn=True``
    trains it (BASED's feature-dimension projection).
    """

    def __init__(self, heads: int, head_dim: int, *, dim: int | None = None, proj=None, symmetric: bool = False,
                 learn: bool = False, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        if proj is None:
            dim = check_positive_int(min(16, self.head_dim) if dim is None else dim, "dim")
            if dim > self.head_dim:
                raise ValueError(f"dim (BASED's d') must be <= head_dim={self.head_dim}, got {dim}")
            proj = torch.eye(self.head_dim, dim, dtype=dtype).expand(self.heads, -1, -1)
        proj = as_float_tensor(proj, "proj").detach().clone()
        if proj.ndim != 3 or proj.shape[:2] != (self.heads, self.head_dim):
            raise ValueError(f"proj must have shape [H={self.heads}, D={self.head_dim}, d'], got {tuple(proj.shape)}")
        self.symmetric = symmetric
        _store(self, "proj", proj, learn)

    @property
    def num_features(self) -> int:
        from .sketches.based import based_num_features

        return based_num_features(self.proj.shape[-1], 2, "taylor", self.symmetric)

    @property
    def degree(self) -> int:
        return 2

    @property
    def non_negative(self) -> bool:
        return True  # the kernel 1 + s + s²/2 = ((1 + s)² + 1)/2 > 0 (features signed, every product positive)

    def _features(self, x):
        from .sketches.based import taylor_features

        return taylor_features(x.transpose(1, 2), self.proj, self.symmetric).transpose(1, 2)  # [B, T, H, M]

    def _features_naive(self, x, head):
        from .sketches.based import taylor_features_naive

        return taylor_features_naive(x, self.proj[head].detach(), self.symmetric)


class PSFLearnedMap(FeatureMap):
    r"""PolySketchFormer's learned sketch per head: ``LayerNorm(D) → Linear(D, hidden) → GELU →
    Linear(hidden, m)`` (signed features; wrap in :class:`SelfTensored` for PSF's non-negative
    degree-``2·degree`` form, as :func:`make_feature_map` does).

    ``degree`` is the degree the sketch stands for before self-tensoring (PSF learns the degree
    ``p/2`` sketch); it only sets the hybrid's ``local="poly"`` degree.
    """

    def __init__(self, heads: int, head_dim: int, *, m: int = 8, hidden: int | None = None, degree: int = 1,
                 seed: int = 0, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        m = check_positive_int(m, "m")
        hidden = check_positive_int(4 * self.head_dim if hidden is None else hidden, "hidden")
        self._degree = check_degree(degree)
        gen = torch.Generator().manual_seed(seed)
        H, D = self.heads, self.head_dim

        def uniform(*shape, fan_in):  # nn.Linear's default range, from our generator
            return ((torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(fan_in)).to(dtype)

        self.ln_weight = nn.Parameter(torch.ones(H, D, dtype=dtype))
        self.ln_bias = nn.Parameter(torch.zeros(H, D, dtype=dtype))
        self.w1 = nn.Parameter(uniform(H, D, hidden, fan_in=D))  # [H, D, hidden]
        self.b1 = nn.Parameter(uniform(H, hidden, fan_in=D))
        self.w2 = nn.Parameter(uniform(H, hidden, m, fan_in=hidden))  # [H, hidden, m]
        self.b2 = nn.Parameter(uniform(H, m, fan_in=hidden))
        self.ln_eps = 1e-5

    @property
    def num_features(self) -> int:
        return self.w2.shape[-1]

    @property
    def degree(self) -> int:
        return self._degree

    def _features(self, x):
        dtype = torch.promote_types(x.dtype, self.w1.dtype)
        x = torch.nn.functional.layer_norm(x.to(dtype), (self.head_dim,), eps=self.ln_eps)  # [B, T, H, D]
        x = x * self.ln_weight.to(dtype) + self.ln_bias.to(dtype)  # per-head affine
        h = torch.nn.functional.gelu(torch.einsum("bthd,hde->bthe", x, self.w1.to(dtype)) + self.b1.to(dtype))
        return torch.einsum("bthe,hem->bthm", h, self.w2.to(dtype)) + self.b2.to(dtype)  # [B, T, H, M]

    def _features_naive(self, x, head):
        f64 = torch.float64
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(var + self.ln_eps) * self.ln_weight[head].detach().to(f64) + \
            self.ln_bias[head].detach().to(f64)
        pre = y @ self.w1[head].detach().to(f64) + self.b1[head].detach().to(f64)
        h = 0.5 * pre * (1 + torch.erf(pre / math.sqrt(2)))  # exact GELU
        return h @ self.w2[head].detach().to(f64) + self.b2[head].detach().to(f64)


class HedgehogMap(FeatureMap):
    r"""Hedgehog (as in LoLCATs): :math:`[\mathrm{softmax}(xW_h), \mathrm{softmax}(-xW_h)]` over
    the ``m/2`` projected features, learnable ``W_h [D, m/2]`` per head (initialised to the
    identity where ``m/2 = D``, else ``N(0, 1/D)``). Non-negative features (``m`` of them)."""

    def __init__(self, heads: int, head_dim: int, *, m: int = 64, seed: int = 0, dtype=torch.float32):
        super().__init__()
        _init_heads(self, heads, head_dim)
        m = check_positive_int(m, "m")
        if m % 2:
            raise ValueError(f"m must be even for Hedgehog ([softmax(xW), softmax(-xW)], m/2 each), got {m}")
        half = m // 2
        if half == self.head_dim:
            w = torch.eye(self.head_dim, dtype=torch.float64).expand(self.heads, -1, -1)
        else:
            gen = torch.Generator().manual_seed(seed)
            w = torch.randn(self.heads, self.head_dim, half, generator=gen, dtype=torch.float64) / math.sqrt(self.head_dim)
        self.weight = nn.Parameter(w.to(dtype).clone())  # [H, D, m/2]

    @property
    def num_features(self) -> int:
        return 2 * self.weight.shape[-1]

    @property
    def non_negative(self) -> bool:
        return True

    def _features(self, x):
        dtype = torch.promote_types(x.dtype, self.weight.dtype)
        u = torch.einsum("bthd,hde->bthe", x.to(dtype), self.weight.to(dtype))  # [B, T, H, m/2]
        return torch.cat([u.softmax(-1), (-u).softmax(-1)], -1)  # [B, T, H, m]

    def _features_naive(self, x, head):
        u = x @ self.weight[head].detach().to(torch.float64)  # [n, m/2]
        pos = torch.exp(u - u.max(-1, keepdim=True).values)
        neg = torch.exp(-u - (-u).max(-1, keepdim=True).values)
        return torch.cat([pos / pos.sum(-1, keepdim=True), neg / neg.sum(-1, keepdim=True)], -1)


class SelfTensored(FeatureMap):
    r"""The self-tensored form :math:`\phi\otimes\phi` of any map: ``M²`` features, kernel
    :math:`(\phi(q)\cdot\phi(k))^2 \ge 0` of degree ``2·degree`` (PolySketchFormer's non-negativity)."""

    def __init__(self, inner: FeatureMap):
        super().__init__()
        if not isinstance(inner, FeatureMap):
            raise TypeError(f"SelfTensored wraps a FeatureMap, got {type(inner).__name__}")
        self.inner = inner
        self.heads, self.head_dim = inner.heads, inner.head_dim

    @property
    def num_features(self) -> int:
        return self.inner.num_features ** 2

    @property
    def degree(self) -> int | None:
        return None if self.inner.degree is None else 2 * self.inner.degree

    @property
    def non_negative(self) -> bool:
        return True

    def _features(self, x):
        f = self.inner._features(x)
        return (f[..., :, None] * f[..., None, :]).flatten(-2)  # [B, T, H, M, M] -> [B, T, H, M²]

    def _features_naive(self, x, head):
        f = self.inner._features_naive(x, head)  # [n, M]
        n, M = f.shape
        out = torch.empty(n, M * M, dtype=torch.float64)
        for a in range(M):
            for b in range(M):
                out[:, a * M + b] = f[:, a] * f[:, b]
        return out


#: Names accepted by :func:`make_feature_map`.
FEATURE_MAPS = ("llops", "exact", "taylor", "psf", "hedgehog")


def make_feature_map(name: str, *, heads: int, head_dim: int, p: int = 2, m: int = 64, rank: int = 1,
                     self_tensored: bool = False, seed: int = 0, dtype=torch.float32, **kwargs) -> FeatureMap:
    """A feature map by name, sized by ``m`` (features) where the map allows it.

    ``"llops"``: :class:`LLoPSMap` (``p, m, rank``); ``"exact"``: :class:`ExactPolyMap` (``p``;
    ``m`` is ignored: ``C(D+p−1, p)`` features); ``"taylor"``: :class:`TaylorMap` (``p`` must be 2;
    ``dim`` from kwargs, default the largest ``d'`` with at most ``m`` features); ``"psf"``:
    ``SelfTensored(PSFLearnedMap(m=⌊√m⌋, degree=p/2))`` (``p`` even, ``m ≥ 1`` features after
    the square); ``"hedgehog"``: :class:`HedgehogMap` (``m`` even). ``self_tensored=True`` wraps
    the result in :class:`SelfTensored` (not for ``"psf"``, already self-tensored). Other
    keyword arguments go to the map's constructor.
    """
    if not isinstance(name, str) or name not in FEATURE_MAPS:
        raise ValueError(f"feature map name must be one of {FEATURE_MAPS}, got {name!r}")
    p, m = check_degree(p), check_positive_int(m, "m")
    if name == "llops":
        fmap = LLoPSMap(heads, head_dim, p=p, m=m, rank=rank, seed=seed, dtype=dtype, **kwargs)
    elif name == "exact":
        fmap = ExactPolyMap(heads, head_dim, p=p, **kwargs)
    elif name == "taylor":
        if p != 2:
            raise ValueError(f"the Taylor map is BASED's degree-2 expansion: p must be 2, got {p}")
        if "dim" not in kwargs and "proj" not in kwargs:
            from .sketches.based import based_num_features

            fits = [d for d in range(1, head_dim + 1) if based_num_features(d, 2, "taylor", False) <= m]
            if not fits:
                raise ValueError(f"m={m} is below the smallest Taylor map (d'=1 has 3 features)")
            kwargs["dim"] = fits[-1]
        fmap = TaylorMap(heads, head_dim, dtype=dtype, **kwargs)
    elif name == "psf":
        if p % 2:
            raise ValueError(f"PolySketchFormer's map is self-tensored (degree 2·(p/2)): p must be even, got {p}")
        if self_tensored:
            raise ValueError("the 'psf' map is already self-tensored; drop self_tensored=True")
        return SelfTensored(PSFLearnedMap(heads, head_dim, m=max(1, math.isqrt(m)), degree=p // 2, seed=seed,
                                          dtype=dtype, **kwargs))
    else:
        fmap = HedgehogMap(heads, head_dim, m=m, seed=seed, dtype=dtype, **kwargs)
    return SelfTensored(fmap) if self_tensored else fmap
