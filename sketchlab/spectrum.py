r"""Singular-value decay of the polynomial kernel :math:`A = (QK^\top)^{\circ p}` of a dump, per layer/head.

The spectrum is what Theorem 3.1 measures every sketch against: the floor of a size-``m`` sketch is
:math:`\mathrm{tail}(m) = \sum_{i>m}\sigma_i(A)^2`, so one factorisation gives the floor for
*every* ``m`` at once, and the relative floor

.. math:: \mathrm{floor}(m) = \sqrt{\mathrm{tail}(m)} / \|A\|_F = \sqrt{\textstyle\sum_{i>m}\sigma_i^2 / \sum_i \sigma_i^2}

is the smallest ``rel_fro`` any size-``m`` sketch reaches on those tokens.

Singular values come from the same two routes as :func:`sketchlab.optimal_sketch` (values only):
``svdvals(A)`` when ``n`` is at most the exact feature dimension ``D``, else the singular values
of the small core :math:`R_Q R_K^\top` of the thin QR factors of :math:`\psi_p(Q)`,
:math:`\psi_p(K)` (``A = Q_Q R_Q R_K^\top Q_K^\top``), padded with zeros to ``n``. Both are float64;
``tests/test_advise.py`` checks them against :func:`sketchlab.tail_bound` for every ``m``.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import torch

from ._dumpsel import select_and_scale
from ._validation import DEFAULT_MAX_BYTES, check_degree, check_fraction, check_memory
from .fit import holdout_split
from .numerics import check_float64_finite, check_poly_kernel_range
from .polynomial import num_poly_features, poly_features, poly_kernel
from .scaling import DEFAULT_SCALE

__all__ = ["DEFAULT_SIZES", "KernelSpectrum", "check_sizes", "kernel_singular_values", "kernel_spectrum"]

#: Sketch sizes tabulated when none are asked for; those beyond the singular values are left out with a note.
DEFAULT_SIZES = (8, 16, 32, 64, 128, 256)


#: :func:`sketchlab.numerics.check_float64_finite` naming this module's results.
_finite = functools.partial(check_float64_finite, where="kernel spectrum")


def kernel_singular_values(q: torch.Tensor, k: torch.Tensor, p: int, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    r"""All singular values of :math:`A = (QK^\top)^{\circ p}`, descending, float64 ``[..., min(n_q, n_k)]``.

    ``q[..., n_q, d]``, ``k[..., n_k, d]`` are used as given (no scaling). The route is the one of
    :func:`sketchlab.optimal_sketch` with ``route="auto"`` (module docstring); every allocation
    growing with ``n²`` or ``D`` is checked against ``max_bytes`` first.
    """
    p = check_degree(p)
    q, k = q.to(torch.float64), k.to(torch.float64)
    check_poly_kernel_range(q, k, p, squares=False, max_bytes=max_bytes)  # in float64: only its range matters
    batch, n_q, n_k, d = math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1]
    symmetric = num_poly_features(d, p, True) < num_poly_features(d, p, False)
    dim = num_poly_features(d, p, symmetric)
    if max(n_q, n_k) <= dim:
        check_memory(batch * n_q * n_k * 8, what=f"the kernel A of {batch} head(s), {n_q} x {n_k} float64",
                     way_out="select fewer layers/heads or tokens", max_bytes=max_bytes)
        return torch.linalg.svdvals(_finite(poly_kernel(q, k, p), "the kernel (QKᵀ)^p", p))
    check_memory(batch * max(n_q, n_k) * dim * 8, what=f"psi_p of {batch} head(s), {max(n_q, n_k)} x {dim} float64",
                 way_out="select fewer layers/heads or tokens, or a smaller p", max_bytes=max_bytes)
    _, r_q = torch.linalg.qr(poly_features(q, p, symmetric))  # ψ_Q = Q_Q R_Q, R_Q [..., min(n_q, D), D]
    _, r_k = torch.linalg.qr(poly_features(k, p, symmetric))  # ψ_K = Q_K R_K, R_K [..., min(n_k, D), D]
    s = torch.linalg.svdvals(_finite(r_q @ r_k.mT, "the core R_Q R_Kᵀ of (QKᵀ)^p", p))  # [..., r]: A = Q_Q (R_Q R_Kᵀ) Q_Kᵀ has the same non-zero σ
    n = min(n_q, n_k)
    return torch.nn.functional.pad(s, (0, max(0, n - s.shape[-1])))[..., :n]


def check_sizes(sizes, max_m: int, n_tokens: int, name: str = "sizes") -> list[int]:
    """Requested sketch sizes: ints ``>= 1``, each at most ``max_m``, the number of singular values of ``A`` on
    ``n_tokens`` tokens (no row or column is dropped in silence); ``ValueError`` naming the first beyond and
    the limit."""
    sizes = list(sizes)
    if not sizes or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in sizes):
        raise ValueError(f"{name} must be integers >= 1, got {sizes!r}")
    beyond = [m for m in sizes if m > max_m]
    if beyond:
        raise ValueError(f"{name}: {beyond[0]} exceeds the {max_m} singular values of A on these {n_tokens} tokens "
                         f"(the largest meaningful sketch size; at m >= {max_m} the floor is 0, the exact kernel): "
                         f"choose sizes <= {max_m}")
    return sizes


@dataclass
class KernelSpectrum:
    """Singular values of ``A = (QKᵀ)^∘p`` for each selected (layer, head) and the floors they imply.

    Attributes
    ----------
    singular_values : float64 Tensor ``[L', H', r]``
        Descending; ``r = min(n_q, n_k)`` of the tokens used.
    p : int
    layers, heads : list of int
        Positions in the dump.
    scale, scale_factor, scale_description : str, float, str
        The input scale applied to q and k (:mod:`sketchlab.scaling`).
    source : str
    n_tokens : int
        Tokens used (after the held-out split, when ``holdout > 0``).
    d : int
    holdout, seed : float, int
        The split that left those tokens (``holdout = 0``: every token).
    """

    singular_values: torch.Tensor
    p: int
    layers: list
    heads: list
    scale: str
    scale_factor: float
    scale_description: str
    source: str
    n_tokens: int
    d: int
    holdout: float
    seed: int

    @property
    def max_m(self) -> int:
        """The largest meaningful sketch size: the number of singular values."""
        return self.singular_values.shape[-1]

    def tail(self, m: int) -> torch.Tensor:
        """Theorem 3.1 floor :math:`\\sum_{i>m}\\sigma_i^2`, float64 ``[L', H']``; ``m`` in ``0 … max_m``."""
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= self.max_m:
            raise ValueError(f"m must be an integer in 0..{self.max_m} (the number of singular values), got {m!r}")
        return (self.singular_values[..., m:] ** 2).sum(-1)

    def _relative_energy(self) -> torch.Tensor:
        """``(σ_i/σ_1)²``, float64 ``[L', H', r]``: the ratios every floor and energy rank needs, without
        squaring σ itself (σ above 1.3e154, e.g. a dump × 1e75 at p = 2, squares to inf and the floors
        printed NaN); a head whose σ_1 is 0 keeps zeros."""
        top = self.singular_values[..., :1]
        return (self.singular_values / torch.where(top > 0, top, torch.ones_like(top))) ** 2

    def floor_curve(self) -> torch.Tensor:
        """Relative floor ``√(tail(m)/‖A‖_F²)`` for every ``m = 0 … max_m``: float64 ``[L', H', max_m + 1]``.

        Entry ``m`` is the smallest ``rel_fro`` any size-``m`` sketch reaches; entry 0 is 1.
        """
        energy = self._relative_energy()  # [L', H', r]
        tails = energy.flip(-1).cumsum(-1).flip(-1)  # [L', H', r], tails[..., m] = Σ_{i>m} σ_i² (0-based i ≥ m)
        tails = torch.cat([tails, torch.zeros_like(tails[..., :1])], -1)  # [L', H', r + 1]
        return (tails / tails[..., :1].clamp_min(torch.finfo(torch.float64).tiny)).clamp_min(0).sqrt()

    def floor_m(self, target: float) -> torch.Tensor:
        """Smallest ``m ≥ 1`` whose relative floor is ``≤ target``: int64 ``[L', H']``."""
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < 1:
            raise ValueError(f"target (a relative Frobenius error) must lie in (0, 1), got {target!r}")
        ok = self.floor_curve()[..., 1:] <= target  # [L', H', max_m]; the last entry (tail 0) is always True
        return ok.to(torch.int64).argmax(-1) + 1

    def energy_rank(self, fraction: float = 0.99) -> torch.Tensor:
        """Smallest ``m`` capturing ``fraction`` of ``‖A‖_F²``: int64 ``[L', H']``.

        ``Σ_{i≤m} σ_i² ≥ fraction·‖A‖_F²`` up to a few units of round-off of the sums (so that 4 of
        5 equal values capture exactly 0.8, which ``√(1 − 0.8)`` compared with floors would miss).
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ValueError(f"fraction (of ‖A‖_F²) must lie in (0, 1), got {fraction!r}")
        energy = self._relative_energy()  # [L', H', r]
        captured = energy.cumsum(-1)  # [L', H', r]: Σ_{i≤m} σ_i², m = 1..r
        need = fraction * energy.sum(-1, keepdim=True) * (1 - 8 * energy.shape[-1] * torch.finfo(torch.float64).eps)
        return (captured >= need).to(torch.int64).argmax(-1) + 1

    def to_markdown(self, sizes=None) -> str:
        """Per (layer, head): ``σ_1``, ``σ_m/σ_1`` and the relative floor at each ``m`` of ``sizes``.

        ``sizes``: each at most :attr:`max_m` (:func:`check_sizes`); ``None``: :data:`DEFAULT_SIZES`, those
        beyond :attr:`max_m` left out with a note saying so.
        """
        if sizes is None:
            dropped = [m for m in DEFAULT_SIZES if m > self.max_m]
            sizes = [m for m in DEFAULT_SIZES if m <= self.max_m]
        else:
            dropped, sizes = [], check_sizes(sizes, self.max_m, self.n_tokens)
        lines = [
            f"Spectrum of A = (QKᵀ)^∘{self.p}: {self.scale_description}; {self.n_tokens} tokens"
            + (f" (held out {self.holdout:g}, seed {self.seed})" if self.holdout else "")
            + f", d = {self.d}. Source: {self.source}",
            "",
            "Relative floor √(Σ_{i>m} σ_i²)/‖A‖_F: the smallest rel_fro any size-m sketch reaches (Theorem 3.1).",
            "",
        ]
        if dropped:
            lines += [f"Size(s) {', '.join(map(str, dropped))} left out: A has {self.max_m} singular values on these "
                      f"{self.n_tokens} tokens, so at m >= {self.max_m} the floor is 0 (the exact kernel).", ""]
        header = ["layer", "head", "σ_1", "m for 99% energy"] + [f"σ_{m}/σ_1" for m in sizes] + [f"floor m={m}" for m in sizes]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        curve, rank99 = self.floor_curve(), self.energy_rank(0.99)
        for a, layer in enumerate(self.layers):
            for b, head in enumerate(self.heads):
                s = self.singular_values[a, b]
                cells = [str(layer), str(head), f"{s[0]:.4g}", str(int(rank99[a, b]))]
                cells += [f"{s[m - 1] / s[0]:.2e}" for m in sizes] + [f"{curve[a, b, m]:.2e}" for m in sizes]
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def to_json(self, indent: int | None = 2) -> str:
        """``{"config": {...}, "singular_values": [[[...]]]}`` (layers × heads × r)."""
        config = {"p": self.p, "layers": self.layers, "heads": self.heads, "scale": self.scale,
                  "scale_factor": self.scale_factor, "scale_description": self.scale_description,
                  "source": self.source, "n_tokens": self.n_tokens, "d": self.d, "holdout": self.holdout,
                  "seed": self.seed}
        return json.dumps({"config": config, "singular_values": self.singular_values.tolist()}, indent=indent)


def kernel_spectrum(dump_or_qk, *, p: int, layers=None, heads=None, scale=DEFAULT_SCALE, holdout: float = 0.0,
                    seed: int = 0, max_bytes: int = DEFAULT_MAX_BYTES) -> KernelSpectrum:
    r"""Singular values of :math:`A = (QK^\top)^{\circ p}` for every selected layer and head of a dump.

    Parameters
    ----------
    dump_or_qk, layers, heads, scale
        The dump (``[L, H, n, d]``, also ``[H, n, d]``, ``[n, d]``), the positions (``None``: all) and
        the input scale, as in :func:`sketchlab.compare`.
    p : int
        Degree.
    holdout, seed : float in ``[0, 1)``, int
        Use only the fitting tokens of :func:`sketchlab.holdout_split` ``(n, holdout, seed)`` — the
        tokens :func:`sketchlab.compare` fits on with the same arguments (default: all tokens).
    max_bytes : int
        Memory budget of :func:`kernel_singular_values`.

    Returns
    -------
    KernelSpectrum
    """
    p = check_degree(p)
    holdout = check_fraction(holdout, "holdout")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    sel = select_and_scale(dump_or_qk, layers=layers, heads=heads, scale=scale)
    return spectrum_of_selection(sel, p, holdout=holdout, seed=seed, max_bytes=max_bytes)


def spectrum_of_selection(sel, p: int, *, holdout: float, seed: int, max_bytes: int = DEFAULT_MAX_BYTES) -> KernelSpectrum:
    """:func:`kernel_spectrum` of an already loaded, selected and scaled :class:`sketchlab._dumpsel.Selection`."""
    fit, _ = holdout_split(sel.q.shape[-2], holdout, seed)
    q, k = sel.q[..., fit, :].double(), sel.k[..., fit, :].double()  # [L', H', n_fit, d]
    check_poly_kernel_range(q, k, p, where=sel.label, squares=False)
    s = kernel_singular_values(q, k, p, max_bytes=max_bytes)
    return KernelSpectrum(singular_values=s, p=p, layers=sel.layers, heads=sel.heads, scale=sel.scale,
                          scale_factor=sel.scale_factor, scale_description=sel.scale_description, source=sel.source,
                          n_tokens=q.shape[-2], d=q.shape[-1], holdout=holdout, seed=seed)
