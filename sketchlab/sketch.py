"""The one interface every sketch implements (DESIGN.md §2).

A sketch is a pair of feature maps ``φ_Q, φ_K : R^d → R^m`` approximating the polynomial kernel
``(qᵀk)^p`` by ``φ_Q(q)ᵀ φ_K(k)``. Fitted sketches may carry a batch of independent maps (one per
layer and head): their parameters then have leading dimensions ``[L, H]`` and the inputs
``x[L, H, n, d]`` are mapped head by head.
"""

from __future__ import annotations

import abc

import torch

__all__ = ["Sketch"]


class Sketch(abc.ABC):
    """Abstract polynomial-kernel sketch.

    Subclasses implement :meth:`features_q`, :meth:`features_k`, the three size properties, the float64
    twin :meth:`features_naive` and :meth:`select` (what attention and conversion need of a fitted sketch).
    :meth:`kernel` is ``features_q(q) @ features_k(k).mT`` unless a subclass has a faster route.
    """

    @abc.abstractmethod
    def features_q(self, x: torch.Tensor) -> torch.Tensor:
        """Query features ``φ_Q(x)``: ``x[..., n, d]`` → ``[..., n, num_features]``."""

    @abc.abstractmethod
    def features_k(self, x: torch.Tensor) -> torch.Tensor:
        """Key features ``φ_K(x)``: ``x[..., n, d]`` → ``[..., n, num_features]``."""

    def kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Approximate kernel ``Â = φ_Q(q) φ_K(k)ᵀ``: ``[..., n_q, d] × [..., n_k, d]`` → ``[..., n_q, n_k]``."""
        return self.features_q(q) @ self.features_k(k).mT

    @property
    @abc.abstractmethod
    def degree(self) -> int:
        """Polynomial degree ``p`` of the kernel this sketch approximates."""

    @property
    @abc.abstractmethod
    def num_features(self) -> int:
        """Output size ``m`` of each feature map."""

    @property
    @abc.abstractmethod
    def num_parameters(self) -> int:
        """Number of stored numbers that define one (per-head) pair of maps, both sides counted."""

    #: Whether ``φ_Q(q)·φ_K(k) >= 0`` for every input (so ``normalize="sum"`` is safe): ``False`` unless the
    #: sketch proves it (a property or an attribute of the subclass); the family's one name for it
    #: (:attr:`sketchlab.featuremaps.FeatureMap.non_negative`).
    non_negative: bool = False

    @abc.abstractmethod
    def features_naive(self, x: torch.Tensor, side: str = "q", index: tuple = ()) -> torch.Tensor:
        """Float64 twin of one side's map (``side`` ``"q"`` or ``"k"``) for one head: ``x[n, d]`` →
        ``[n, num_features]``, the head ``index`` into the batch shape (``()`` when unbatched)."""

    @abc.abstractmethod
    def select(self, index) -> Sketch:
        """The same sketch restricted to ``index`` of its batch shape (e.g. one layer ``l`` of an
        ``[L, H]`` fit: ``[H]``)."""
