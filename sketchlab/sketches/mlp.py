r"""The "NN" sketch of the LLoPS paper's Table 3: a two-layer MLP per side, fitted to the kernel.

.. math:: \phi_Q(x) = \sigma(x W_1^Q + b_1^Q)\, W_2^Q + b_2^Q, \qquad
          \phi_K(x) = \sigma(x W_1^K + b_1^K)\, W_2^K + b_2^K,

``d → hidden → m``, with activation :math:`\sigma` (GELU by default), fitted by minimising the
relative squared Frobenius error of :math:`\phi_Q(Q)\phi_K(K)^\top` against
:math:`(QK^\top)^{\circ p}` — :func:`~sketchlab.objective.kernel_loss` — with the optimiser and
budget of LLoPS's gradient fit :func:`~sketchlab.llops.fit_llops_adam` (Adam, ``lr = 1e-2``, 500
steps; see :mod:`sketchlab.objective`). The held-out split is :func:`sketchlab.fit_sketch`'s,
the same for every method. Weights of all heads are
stored as batched tensors ``[..., d, hidden]`` etc. and fitted together.

Parameter budget: by default ``hidden`` is the smallest width whose parameter count (both sides,
biases included, ``2(d·h + h + h·m + m)``) is at least that of an untied rank-1 LLoPS with the same
``p, d, m`` (``2·p·d·m``), so the MLP is never the smaller model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import as_float_tensor, check_degree, check_memory, check_positive_int
from ..featuremaps._common import check_batch_shape, check_dtype, make_generator
from ..objective import DEFAULT_LR, DEFAULT_STEPS, train_kernel_sketch
from ..sketch import Sketch

__all__ = ["MLPSketch", "default_hidden", "mlp_features", "mlp_features_naive"]

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
    Tensor ``[..., n, m]``
    """
    act = _activation(activation)
    hidden = act(x.to(w1.dtype) @ w1 + b1[..., None, :])  # [..., n, h]
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


class MLPSketch(nn.Module, Sketch):
    """A two-layer MLP per side (``nn.Module``; the weights are its learnable parameters).

    Parameters
    ----------
    weights_q, weights_k : tuple ``(w1[..., d, h], b1[..., h], w2[..., h, m], b2[..., m])``
        Query and key MLPs (same shapes).
    p : int
        Degree of the kernel the MLPs were fitted to (the maps themselves are not polynomials).
    activation : {"gelu", "relu", "tanh"}
    """

    def __init__(self, weights_q, weights_k, p: int, *, activation: str = "gelu"):
        super().__init__()
        self.p = check_degree(p)
        _activation(activation)
        self.activation = activation
        names = ("w1", "b1", "w2", "b2")
        shapes = []
        for side, weights in (("q", weights_q), ("k", weights_k)):
            if not isinstance(weights, (tuple, list)) or len(weights) != 4:
                raise TypeError(f"weights_{side} must be a tuple (w1, b1, w2, b2)")
            tensors = [as_float_tensor(t, f"weights_{side}.{n}") for t, n in zip(weights, names)]
            w1, b1, w2, b2 = tensors
            ok = (w1.ndim >= 2 and b1.shape == w1.shape[:-2] + w1.shape[-1:] and w2.ndim == w1.ndim
                  and w2.shape[:-2] == w1.shape[:-2] and w2.shape[-2] == w1.shape[-1]
                  and b2.shape == w2.shape[:-2] + w2.shape[-1:])
            if not ok:
                raise ValueError(
                    f"weights_{side} must be w1[..., d, h], b1[..., h], w2[..., h, m], b2[..., m]; got "
                    + ", ".join(str(tuple(t.shape)) for t in tensors)
                )
            shapes.append(tuple(t.shape for t in tensors))
            for t, n in zip(tensors, names):
                setattr(self, f"{n}_{side}", nn.Parameter(t.detach().clone()))
        if shapes[0] != shapes[1]:
            raise ValueError(f"weights_q and weights_k must have the same shapes, got {shapes[0]} and {shapes[1]}")
        self.fit_info: dict = {}

    @classmethod
    def init_random(cls, d: int, p: int, m: int, hidden: int, *, seed: int | None = None,
                    generator: torch.Generator | None = None, batch_shape: tuple[int, ...] = (),
                    dtype: torch.dtype = torch.float32, activation: str = "gelu",
                    device: torch.device | str | None = None) -> MLPSketch:
        """He/LeCun-style initialisation: ``W1 ~ N(0, 1/d)``, ``W2 ~ N(0, 1/h)``, zero biases.

        Drawn on the CPU ``generator`` in float64 (a seed gives the same start on every device), then
        cast to ``dtype`` and moved to ``device`` (default: CPU).
        """
        d, m, hidden = (check_positive_int(v, n) for v, n in ((d, "d"), (m, "m (the sketch size)"), (hidden, "hidden")))
        batch_shape = check_batch_shape(batch_shape)
        dtype = check_dtype(dtype)
        gen = make_generator(seed, generator)

        def side():
            w1 = torch.randn(*batch_shape, d, hidden, generator=gen, dtype=torch.float64) / math.sqrt(d)
            w2 = torch.randn(*batch_shape, hidden, m, generator=gen, dtype=torch.float64) / math.sqrt(hidden)
            b1 = torch.zeros(*batch_shape, hidden, dtype=torch.float64)
            b2 = torch.zeros(*batch_shape, m, dtype=torch.float64)
            return tuple(t.to(device=device, dtype=dtype) for t in (w1, b1, w2, b2))

        return cls(side(), side(), p, activation=activation)

    def _side(self, side: str):
        return tuple(getattr(self, f"{n}_{side}") for n in ("w1", "b1", "w2", "b2"))

    @property
    def hidden(self) -> int:
        return self.w1_q.shape[-1]

    @property
    def degree(self) -> int:
        return self.p

    @property
    def num_features(self) -> int:
        return self.w2_q.shape[-1]

    @property
    def num_parameters(self) -> int:
        d, h, m = self.w1_q.shape[-2], self.hidden, self.num_features
        return 2 * (d * h + h + h * m + m)

    def features_q(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., n, d]`` → ``[..., n, m]``."""
        return mlp_features(x, *self._side("q"), self.activation)

    def features_k(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., n, d]`` → ``[..., n, m]``."""
        return mlp_features(x, *self._side("k"), self.activation)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The approximate kernel ``[..., n_q, n_k]``."""
        return self.kernel(q, k)

    def features_naive(self, x, side: str = "q", index: tuple = ()) -> torch.Tensor:
        return mlp_features_naive(x, *(t[index].detach() for t in self._side(side)), self.activation)

    def select(self, index) -> MLPSketch:
        return MLPSketch(tuple(t[index] for t in self._side("q")), tuple(t[index] for t in self._side("k")), self.p,
                         activation=self.activation)




def _fit_mlp(q, k, *, p: int, m: int, seed: int = 0, hidden: int | None = None, activation: str = "gelu",
             steps: int = DEFAULT_STEPS, lr: float = DEFAULT_LR) -> MLPSketch:
    """``fit_sketch("mlp", ...)``: random init from ``seed``, then Adam on the relative kernel loss
    (``steps``/``lr`` default to those of ``fit_llops_adam``).

    ``hidden=None`` uses :func:`default_hidden` (at least the parameters of rank-1 untied LLoPS).
    All heads (leading axes of ``q``) are fitted at once with batched weights.
    """
    d = q.shape[-1]
    hidden = default_hidden(d, p, m) if hidden is None else check_positive_int(hidden, "hidden")
    n_max = max(q.shape[-2], k.shape[-2])
    check_memory(  # the largest activation: the hidden layer of every token, kept for backward
        math.prod(q.shape[:-2]) * n_max * hidden * q.element_size(),
        what=f"the MLP sketch's hidden activations ({n_max} tokens x hidden={hidden}, batch {tuple(q.shape[:-2])})",
        way_out="pass a smaller hidden width (option 'hidden'), a smaller p or m, or fewer tokens",
    )
    sketch = MLPSketch.init_random(d, p, m, hidden, seed=seed, batch_shape=q.shape[:-2], dtype=q.dtype,
                                   activation=activation, device=q.device)
    info = train_kernel_sketch(list(sketch.parameters()), lambda a, b: (sketch.features_q(a), sketch.features_k(b)),
                               q, k, p, steps=steps, lr=lr, what="MLP sketch")
    sketch.fit_info = {**info, "hidden": hidden}
    return sketch
