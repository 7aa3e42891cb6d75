r"""Element-wise polynomial feature map :math:`\phi(x) = (x\Theta)^{\circ p}`.

The special case :math:`\Theta_1 = \dots = \Theta_p` of rank-1 LLoPS: feature ``i`` is
:math:`\langle\theta_i, x\rangle^p`. Queries and keys have their own ``Θ`` (``[d, m]`` each) unless
tied. Fitted (``fit_sketch("elementwise", ...)``) with the same relative kernel loss, optimiser and
budget as the MLP sketch and LLoPS's Adam fit (:mod:`sketchlab.objective`), from a random N(0, 1/d) start.
Even ``p`` gives non-negative features and kernel.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._validation import as_float_tensor, check_degree
from ..featuremaps._common import check_features_finite, make_generator
from ..objective import DEFAULT_LR, DEFAULT_STEPS, train_kernel_sketch
from ..sketch import Sketch

__all__ = ["ElementwiseSketch", "elementwise_features", "elementwise_features_naive"]


def elementwise_features(x: torch.Tensor, theta: torch.Tensor, p: int) -> torch.Tensor:
    """:math:`(x\\Theta)^{\\circ p}`: ``x[..., n, d]``, ``theta[..., d, m]`` → ``[..., n, m]``.

    Raises ``FloatingPointError`` when the power overflows the dtype (inputs too large for ``p``).
    """
    return check_features_finite((x.to(theta.dtype) @ theta) ** p, x, p, "element-wise sketch")


def elementwise_features_naive(x, theta, p: int) -> torch.Tensor:
    """Float64 twin for ``x[n, d]``, ``theta[d, m]``: explicit inner products, then the power."""
    x = as_float_tensor(x, "x").to(torch.float64)
    theta = as_float_tensor(theta, "theta").to(torch.float64)
    if x.ndim != 2:
        raise ValueError(f"elementwise_features_naive takes x[n, d], got shape {tuple(x.shape)}")
    if theta.ndim != 2 or theta.shape[0] != x.shape[1]:
        raise ValueError(
            f"elementwise_features_naive takes theta[d, m] with d = x.shape[1] = {x.shape[1]}, "
            f"got shape {tuple(theta.shape)}"
        )
    out = torch.zeros(x.shape[0], theta.shape[1], dtype=torch.float64)
    for i in range(theta.shape[1]):
        for a in range(x.shape[1]):
            out[:, i] += x[:, a] * theta[a, i]
    return out**p


class ElementwiseSketch(nn.Module, Sketch):
    """Element-wise polynomial sketch with learnable ``theta_q[..., d, m]`` (and ``theta_k``; ``None`` ties)."""

    def __init__(self, theta_q, p: int, theta_k=None):
        super().__init__()
        self.p = check_degree(p)
        theta_q = as_float_tensor(theta_q, "theta_q")
        if theta_q.ndim < 2 or 0 in theta_q.shape[-2:]:
            raise ValueError(f"theta_q must have shape [..., d, m] with d, m >= 1, got {tuple(theta_q.shape)}")
        self.theta_q = nn.Parameter(theta_q.detach().clone())
        if theta_k is None:
            self.theta_k = None
        else:
            theta_k = as_float_tensor(theta_k, "theta_k")
            if theta_k.shape != theta_q.shape:
                raise ValueError(f"theta_k must have the shape of theta_q {tuple(theta_q.shape)}, got {tuple(theta_k.shape)}")
            self.theta_k = nn.Parameter(theta_k.detach().clone())
        self.fit_info: dict = {}

    @property
    def degree(self) -> int:
        return self.p

    @property
    def num_features(self) -> int:
        return self.theta_q.shape[-1]

    @property
    def num_parameters(self) -> int:
        per_side = self.theta_q.shape[-2] * self.theta_q.shape[-1]
        return per_side if self.theta_k is None else 2 * per_side

    def features_q(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., n, d]`` → ``[..., n, m]``."""
        return elementwise_features(x, self.theta_q, self.p)

    def features_k(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., n, d]`` → ``[..., n, m]`` (the query map when tied)."""
        return elementwise_features(x, self.theta_q if self.theta_k is None else self.theta_k, self.p)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The approximate kernel ``[..., n_q, n_k]``."""
        return self.kernel(q, k)

    @property
    def non_negative(self) -> bool:
        return self.p % 2 == 0  # every feature (xθ)^p >= 0

    def features_naive(self, x, side: str = "q", index: tuple = ()) -> torch.Tensor:
        theta = self.theta_q if side == "q" or self.theta_k is None else self.theta_k
        return elementwise_features_naive(x, theta[index].detach(), self.p)

    def select(self, index) -> ElementwiseSketch:
        return ElementwiseSketch(self.theta_q[index], self.p, None if self.theta_k is None else self.theta_k[index])


def _fit_elementwise(q, k, *, p: int, m: int, seed: int = 0, tied: bool = False, steps: int = DEFAULT_STEPS,
                     lr: float = DEFAULT_LR) -> ElementwiseSketch:
    """``fit_sketch("elementwise", ...)``: N(0, 1/d) start from ``seed``, then Adam on the kernel loss."""
    if not isinstance(tied, bool):
        raise TypeError(f"tied must be a bool, got {tied!r}")
    gen = make_generator(seed)
    d = q.shape[-1]

    def draw():
        # Draw on the CPU generator (same seed → same start on every device), then move to q's device.
        theta = torch.randn(*q.shape[:-2], d, m, generator=gen, dtype=torch.float64) / math.sqrt(d)
        return theta.to(device=q.device, dtype=q.dtype)

    sketch = ElementwiseSketch(draw(), p, None if tied else draw())
    sketch.fit_info = train_kernel_sketch(
        list(sketch.parameters()), lambda a, b: (sketch.features_q(a), sketch.features_k(b)), q, k, p, steps=steps, lr=lr,
        what="element-wise sketch",
    )
    return sketch
