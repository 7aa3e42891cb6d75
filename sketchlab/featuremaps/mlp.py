r"""The "NN" sketch of the LLoPS paper's Table 3: a two-layer MLP per side and head, fitted to the kernel
(:class:`MLPMap`, the ``fit_sketch`` method ``"mlp"``: a pair of maps); on layer-normalised input it is
PolySketchFormer's learned sketch (:func:`~sketchlab.featuremaps.psf.psf_learned_map`, ``"psf-learned"``).

.. math:: \phi_Q(x) = \sigma(x W_1^Q + b_1^Q)\, W_2^Q + b_2^Q, \qquad
          \phi_K(x) = \sigma(x W_1^K + b_1^K)\, W_2^K + b_2^K,

``d → hidden → m``, with activation :math:`\sigma` (GELU by default), fitted by minimising the
relative squared Frobenius error of :math:`\phi_Q(Q)\phi_K(K)^\top` against
:math:`(QK^\top)^{\circ p}` — :func:`~sketchlab.objective.kernel_loss` — with the optimiser and
budget of LLoPS's gradient fit :func:`~sketchlab.llops.fit_llops_adam` (Adam, ``lr = 1e-2``, 500
steps; see :mod:`sketchlab.objective`). The held-out split is :func:`sketchlab.fit_sketch`'s,
the same for every method. Weights of all heads are
stored as tensors ``[H, d, hidden]`` etc. (one map per side) and fitted together.

Parameter budget: by default ``hidden`` is the smallest width whose parameter count (both sides,
biases included, ``2(d·h + h + h·m + m)``) is at least that of an untied rank-1 LLoPS with the same
``p, d, m`` (``2·p·d·m``), so the MLP is never the smaller model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import as_float_tensor, check_degree, check_memory, check_positive_int
from ..objective import DEFAULT_LR, DEFAULT_STEPS, train_kernel_sketch
from ._common import check_dtype, make_generator
from .base import FeatureMap, FittedMaps
from .heads import batch_features

__all__ = ["MLPMap", "default_hidden", "mlp_features", "mlp_features_naive"]

_ACTIVATIONS = {
    "gelu": torch.nn.functional.gelu,
    "relu": torch.relu,
    "tanh": torch.tanh,
}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {name!r}")
    return _ACTIVATIONS[name]


def default_hidden(d: int, p: int, m: int) -> int:
    """Smallest hidden width ``h`` with ``2(d·h + h + h·m + m) >= 2·p·d·m`` (rank-1 untied LLoPS)."""
    d = check_positive_int(d, "d")
    p = check_degree(p)
    m = check_positive_int(m, "m (the sketch size)")
    return max(1, math.ceil((p * d * m - m) / (d + m + 1)))


def mlp_features(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                 activation: str = "gelu") -> torch.Tensor:
    r"""Two-layer MLP features :math:`\sigma(xW_1 + b_1)W_2 + b_2`.

    Parameters
    ----------
    x : Tensor ``[..., n, d]``
    w1 : Tensor ``[..., d, h]``; b1 : Tensor ``[..., h]``
    w2 : Tensor ``[..., h, m]``; b2 : Tensor ``[..., m]``
        Leading axes broadcast against ``x``'s (one MLP per head).
    activation : {"gelu", "relu", "tanh"}

    Returns
    -------
    Tensor ``[..., n, m]``, in ``x``'s dtype promoted with the weights'.
    """
    act = _activation(activation)
    dtype = torch.promote_types(x.dtype, w1.dtype)
    w1, b1, w2, b2 = (t.to(dtype) for t in (w1, b1, w2, b2))
    hidden = act(x.to(dtype) @ w1 + b1[..., None, :])  # [..., n, h]
    return hidden @ w2 + b2[..., None, :]  # [..., n, m]


def mlp_features_naive(x, w1, b1, w2, b2, activation: str = "gelu") -> torch.Tensor:
    """Float64 twin for ``x[n, d]`` and unbatched weights: one loop per hidden unit and output."""
    act = _activation(activation)
    x, w1, b1, w2, b2 = (as_float_tensor(t, name).to(torch.float64)
                         for t, name in ((x, "x"), (w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2")))
    if x.ndim != 2 or w1.ndim != 2 or w2.ndim != 2:
        raise ValueError("mlp_features_naive takes x[n, d] and unbatched weights")
    n, h, m = x.shape[0], w1.shape[1], w2.shape[1]
    hidden = torch.empty(n, h, dtype=torch.float64)
    for j in range(h):
        hidden[:, j] = act(sum(x[:, i] * w1[i, j] for i in range(x.shape[1])) + b1[j])
    out = torch.empty(n, m, dtype=torch.float64)
    for c in range(m):
        out[:, c] = sum(hidden[:, j] * w2[j, c] for j in range(h)) + b2[c]
    return out


class MLPMap(FeatureMap):
    """A two-layer MLP per head, :func:`mlp_features` (one side of the ``"mlp"`` method: the query and the key
    side are two maps).

    Parameters
    ----------
    w1, b1, w2, b2 : Tensor ``[H, D, h]``, ``[H, h]``, ``[H, h, M]``, ``[H, M]``
        The weights of each head (learnable parameters, :attr:`per_head_parameters`).
    p : int
        Degree of the kernel the MLP was fitted to (the map itself is not a polynomial).
    activation : {"gelu", "relu", "tanh"}
    """

    def __init__(self, w1, b1, w2, b2, p: int, *, activation: str = "gelu"):
        super().__init__()
        self.p = check_degree(p)
        _activation(activation)
        self.activation = activation
        tensors = [as_float_tensor(t, n) for t, n in zip((w1, b1, w2, b2), ("w1", "b1", "w2", "b2"))]
        w1, b1, w2, b2 = tensors
        ok = (w1.ndim == 3 and b1.shape == w1.shape[:1] + w1.shape[-1:] and w2.ndim == 3
              and w2.shape[0] == w1.shape[0] and w2.shape[-2] == w1.shape[-1] and b2.shape == w2.shape[:1] + w2.shape[-1:])
        if not ok:
            raise ValueError("the MLP's weights must be w1[H, D, h], b1[H, h], w2[H, h, M], b2[H, M]; got "
                             + ", ".join(str(tuple(t.shape)) for t in tensors))
        self.heads, self.head_dim = w1.shape[0], w1.shape[1]
        for t, n in zip(tensors, ("w1", "b1", "w2", "b2")):
            setattr(self, n, nn.Parameter(t.detach().clone()))

    @classmethod
    def init_random(cls, heads: int, head_dim: int, *, p: int, m: int, hidden: int, seed: int | None = None,
                    generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
                    activation: str = "gelu", device: torch.device | str | None = None) -> MLPMap:
        """He/LeCun-style initialisation: ``W1 ~ N(0, 1/D)``, ``W2 ~ N(0, 1/h)``, zero biases.

        Drawn on the CPU ``generator`` in float64 (a seed gives the same start on every device), then
        cast to ``dtype`` and moved to ``device`` (default: CPU).
        """
        heads, d, m, hidden = (check_positive_int(v, n) for v, n in ((heads, "heads"), (head_dim, "d"),
                                                                     (m, "m (the sketch size)"), (hidden, "hidden")))
        dtype = check_dtype(dtype)
        gen = make_generator(seed, generator)
        w1 = torch.randn(heads, d, hidden, generator=gen, dtype=torch.float64) / math.sqrt(d)
        w2 = torch.randn(heads, hidden, m, generator=gen, dtype=torch.float64) / math.sqrt(hidden)
        b1 = torch.zeros(heads, hidden, dtype=torch.float64)
        b2 = torch.zeros(heads, m, dtype=torch.float64)
        return cls(*(t.to(device=device, dtype=dtype) for t in (w1, b1, w2, b2)), p, activation=activation)

    @property
    def hidden(self) -> int:
        return self.w1.shape[-1]

    @property
    def num_features(self) -> int:
        return self.w2.shape[-1]

    @property
    def degree(self) -> int:
        return self.p

    def _features(self, x):
        return mlp_features(x.transpose(1, 2), self.w1, self.b1, self.w2, self.b2, self.activation).transpose(1, 2)

    def _features_naive(self, x, head):
        return mlp_features_naive(x, *(t[head].detach() for t in (self.w1, self.b1, self.w2, self.b2)),
                                  self.activation)


def _fit_mlp(q, k, *, p: int, m: int, seed: int = 0, hidden: int | None = None, activation: str = "gelu",
             steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR) -> FittedMaps:
    """``fit_sketch("mlp", ...)``: random init from ``seed`` (the query side drawn first), then Adam on the
    relative kernel loss (``steps``/``lr`` default to those of ``fit_llops_adam``).

    ``hidden=None`` uses :func:`default_hidden` (at least the parameters of rank-1 untied LLoPS).
    All ``prod(batch)`` heads are fitted at once.
    """
    d = q.shape[-1]
    hidden = default_hidden(d, p, m) if hidden is None else check_positive_int(hidden, "hidden")
    heads = math.prod(q.shape[:-2])
    n_max = max(q.shape[-2], k.shape[-2])
    check_memory(  # the largest activation: the hidden layer of every token, kept for backward
        heads * n_max * hidden * q.element_size(),
        what=f"the MLP sketch's hidden activations ({n_max} tokens x hidden={hidden}, batch {tuple(q.shape[:-2])})",
        way_out="pass a smaller hidden width (option 'hidden'), a smaller p or m, or fewer tokens",
    )
    gen = make_generator(seed)
    map_q, map_k = (MLPMap.init_random(heads, d, p=p, m=m, hidden=hidden, generator=gen, dtype=q.dtype,
                                       activation=activation, device=q.device) for _ in range(2))
    flat_q, flat_k = q.reshape(heads, *q.shape[-2:]), k.reshape(heads, *k.shape[-2:])  # [H, n, d]
    info = train_kernel_sketch([*map_q.parameters(), *map_k.parameters()],
                               lambda a, b: (batch_features(map_q, a), batch_features(map_k, b)),
                               flat_q, flat_k, p, steps=steps, lr=lr, what="MLP sketch")
    info.update({key: info[key].reshape(q.shape[:-2]) for key in ("init_rel_fro", "rel_fro") if key in info})
    return FittedMaps(map_q, map_k, {**info, "hidden": hidden})
