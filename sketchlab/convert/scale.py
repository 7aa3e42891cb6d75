r"""Making the LLoPS hybrid a sensible conversion: a non-negative far map and a far part on the window's scale.

The hybrid (DESIGN §6; its torch combine: :mod:`sketchlab.attention.ops.hybrid`) adds, for query ``i``,
the window's max-shifted softmax terms ``exp(s·qᵢᵀkⱼ − cᵢ) <= 1`` (``cᵢ`` the largest local logit) and
the far part's unshifted kernel terms ``φ(qᵢ)·φ(kⱼ)``, weighed by the per-head gate ``g = sigmoid(gate)``:

.. math::
    o_i = \frac{g\sum_{loc} e^{x_{ij}-c_i} v_j + (1-g)\sum_{far}\phi(q_i)\cdot\phi(k_j)\,v_j}
               {g\sum_{loc} e^{x_{ij}-c_i} + (1-g)\sum_{far}\phi(q_i)\cdot\phi(k_j)}.

Two things go wrong when Θ comes from the kernel fit on a real model's post-RoPE q, k
(SmolLM2: perplexity in the thousands): the fitted Θ is signed (about 11 % of the far
denominators ``<= 0``), and at ``gate = 0`` the far terms (a degree-``p`` polynomial in ``qᵀk/√D``,
not shifted) outweigh the window by orders of magnitude. This module holds the two fixes:

* :class:`TiedLLoPSMap` — the even-degree tied LLoPS map :math:`\phi(x)_i = \sum_r
  \langle\theta_{r,i}, x\rangle^p \ge 0` with one factor per feature (kept tied while it trains,
  unlike :class:`sketchlab.featuremaps.LLoPSMap` whose ``p`` factors drift apart), started from a
  fitted signed Θ by :func:`tie_theta`;
* :func:`far_mass_gate` — the per-head gate logit at which the far part's share of the hybrid's
  mass matches the teacher's softmax share beyond the window (median over queries, on recorded
  teacher inputs; the far kernel squared when self-tensored, the poly window's own terms);
  :func:`search_gate` — the least-error logit among candidates near it; :func:`calibrate_gates`
  — either, for every converted layer (what :func:`sketchlab.linearize` runs for ``gate_init``
  ``"mass"`` or ``"search"``).
"""

from __future__ import annotations

import math

import torch

from .._validation import as_float_tensor
from ..attention.ops.hybrid import local_far_masks
from ..featuremaps import TiedLLoPSMap
from .sketched import check_local_map

__all__ = ["GATE_OFFSETS", "TiedLLoPSMap", "calibrate_gates", "far_mass_gate", "search_gate", "tie_theta"]

#: Offsets added to the :func:`far_mass_gate` logit to make :func:`calibrate_gates`' ``"search"`` candidates.
GATE_OFFSETS = (-2.0, 0.0, 2.0, 4.0, 6.0, 8.0)


def tie_theta(theta: torch.Tensor) -> torch.Tensor:
    r"""The tied (non-negative) form of a degree-2 LLoPS Θ ``[..., t, 2, D, M]`` → ``[..., t, D, M]``.

    Feature ``i`` of rank term ``r`` has two factors ``a, b``; its contribution to the map is the
    quadratic form ``(xᵀa)(xᵀb) = xᵀ sym(abᵀ) x``. The tied factor ``θ`` makes ``θθᵀ`` the best
    positive-semidefinite rank-1 approximation (Frobenius) of ``sym(abᵀ) = (abᵀ + baᵀ)/2``, whose
    eigenvalues are ``(aᵀb ± ‖a‖‖b‖)/2``: ``θ = √λ₊ · u`` with ``λ₊ = (aᵀb + ‖a‖‖b‖)/2 >= 0`` and
    ``u ∝ a/‖a‖ + b/‖b‖`` (``θ = 0`` where ``λ₊ = 0``, e.g. ``b = −a``). Equal factors ``a = b``
    give ``θ = a`` exactly.
    """
    theta = as_float_tensor(theta, "theta")
    if theta.ndim < 4 or theta.shape[-3] != 2:
        raise ValueError(f"theta must have shape [..., t, p=2, D, M] (tie_theta handles degree 2), got {tuple(theta.shape)}")
    a, b = theta[..., 0, :, :], theta[..., 1, :, :]  # [..., t, D, M]
    na, nb = a.norm(dim=-2, keepdim=True), b.norm(dim=-2, keepdim=True)  # [..., t, 1, M]
    lam = ((a * b).sum(-2, keepdim=True) + na * nb).clamp_min(0) / 2  # [..., t, 1, M]
    tiny = torch.finfo(theta.dtype).tiny
    u = a / na.clamp_min(tiny) + b / nb.clamp_min(tiny)  # [..., t, D, M]
    nu = u.norm(dim=-2, keepdim=True)
    return torch.where(nu > 0, u / nu.clamp_min(tiny), torch.zeros_like(u)) * lam.sqrt()


@torch.no_grad()
def far_mass_gate(sketch, io, attention_mask: torch.Tensor, index) -> torch.Tensor:
    r"""Per-head gate logits ``[H]`` at which the far part carries the teacher's share of far softmax mass.

    For every query ``i`` with far keys (causal: ``i − j >= window``, ``j >= sinks``; non-causal,
    an encoder's: ``|i − j| >= window``, ``j >= sinks``) on the valid tokens of sequences ``index``
    (the teacher's q, k of ``io``, a :class:`LayerIO`), with the model's logits ``xᵢⱼ = s·qᵢᵀkⱼ``
    and ``cᵢ`` their largest value over the window and the sinks (the hybrid's own shift):

    * ``Fᵢ = Σ_far κ(qᵢ, kⱼ)``, the sketch's far kernel as the attention forms it (inputs scaled by
      ``D^{-1/4}``): ``κ = φ(q)·φ(k)``, or ``(φ(q)·φ(k))² = (φ⊗φ)(q)·(φ⊗φ)(k)`` when the sketch
      is self-tensored (``non_negative``);
    * ``Pᵢ = Σ_{window ∪ sinks} aᵢⱼ``, the hybrid's local terms: ``exp(xᵢⱼ − cᵢ)``
      (``local="softmax"``) or ``xᵢⱼ^p`` (``local="poly"``, ``p`` the map's degree);
    * ``Lᵢ = Σ_{window ∪ sinks} exp(xᵢⱼ − cᵢ)`` and ``Sᵢ = Σ_far exp(xᵢⱼ − cᵢ)``, the teacher's
      softmax terms inside and beyond the window.

    With weights ``g = sigmoid(gate)`` on the window and ``1 − g`` on the far part, the far
    share of the hybrid's denominator, ``(1 − g)Fᵢ / (g·Pᵢ + (1 − g)Fᵢ)``, equals the teacher's
    far softmax share ``Sᵢ / (Lᵢ + Sᵢ)`` when ``(1 − g)/g · Fᵢ·Lᵢ = Sᵢ·Pᵢ``, i.e.

    .. math:: \mathrm{gate}_i = \log F_i - \log S_i + \log L_i - \log P_i

    (``Pᵢ = Lᵢ`` for the softmax window: ``log Fᵢ − log Sᵢ``). The logit returned is the median
    over the queries (queries with ``Fᵢ <= 0``, ``Pᵢ <= 0`` or ``Sᵢ = 0`` are left out; a head with
    none gets 0). Dense ``O(T²)`` per head and sequence.
    """
    if sketch.window <= 0:
        raise ValueError("far_mass_gate: the sketch has no window (window=0: pure linear attention has no gate)")
    w, ns = sketch.window, sketch.sinks
    check_local_map(sketch.map_q, window=w, local=sketch.local)
    degree = sketch.map_q.degree if sketch.local == "poly" else None
    c = sketch.input_scale
    idx = torch.arange(attention_mask.shape[0])[index]
    logs: list[list[torch.Tensor]] = [[] for _ in range(sketch.heads)]
    for n in idx.tolist():
        q, k, _ = io.inputs(torch.tensor([n]))  # [1, T, H, D]
        valid = attention_mask[n].to(torch.bool)  # [T]
        q, k = q[:, valid].double(), k[:, valid].double()
        T = q.shape[1]
        fq = sketch.map_q.features(q * c).double()[0].transpose(0, 1)  # [H, T, M]
        fk = sketch.key_map.features(k * c).double()[0].transpose(0, 1)
        kern = fq @ fk.mT  # [H, T, T]
        if sketch.non_negative:
            kern = kern.square()  # the attention's self-tensored kernel: self_tensor(φq)·self_tensor(φk)
        x = io.scaling * (q[0].transpose(0, 1) @ k[0].transpose(0, 1).mT)  # [H, T, T] the model's logits
        pos = torch.arange(T)
        near, far = local_far_masks(pos, pos, pos, window=w, sinks=ns, causal=sketch.causal)  # [T, T]
        cmax = torch.where(near, x, -math.inf).amax(-1, keepdim=True)  # [H, T, 1]
        soft = torch.exp(x - cmax)  # [H, T, T]
        S = torch.where(far, soft, 0.0).sum(-1)  # [H, T]
        F = torch.where(far, kern, 0.0).sum(-1)
        L = torch.where(near, soft, 0.0).sum(-1)  # >= 1: the largest term is exp(0)
        P = L if degree is None else torch.where(near, x**degree, 0.0).sum(-1)
        ok = far.any(-1)[None] & (F > 0) & (S > 0) & (P > 0)  # [H, T]
        for h in range(sketch.heads):
            o = ok[h]
            logs[h].append(F[h][o].log() - S[h][o].log() + L[h][o].log() - P[h][o].log())
    gate = torch.zeros(sketch.heads, dtype=torch.float64)
    for h in range(sketch.heads):
        vals = torch.cat(logs[h]) if logs[h] else torch.zeros(0, dtype=torch.float64)
        if vals.numel():
            gate[h] = vals.median()
    return gate


@torch.no_grad()
def search_gate(sketch, io, attention_mask: torch.Tensor, index, candidates: torch.Tensor) -> torch.Tensor:
    r"""Per-head gate logits ``[H]``: for each head the candidate with the least attention-output error.

    ``candidates [K, H]``: ``K`` gate settings (e.g. :func:`far_mass_gate` plus offsets). Each is put
    in ``sketch.gate`` in turn and the sketch run on the teacher's q, k, v of sequences ``index``
    (``io``, a :class:`LayerIO`); head ``h`` takes the candidate ``k`` with the least
    ``Σ ‖o_h − o_teacher,h‖²`` over the valid tokens (heads do not interact: head ``h``'s output
    depends only on its own gate). ``sketch.gate`` is left at the returned logits.
    """
    if sketch.gate is None:
        raise ValueError("search_gate: the sketch has no gate (window=0 or gate=False)")
    candidates = torch.as_tensor(candidates, dtype=torch.float64)
    if candidates.ndim != 2 or candidates.shape[1] != sketch.heads or candidates.shape[0] < 1:
        raise ValueError(f"candidates must have shape [K >= 1, H={sketch.heads}], got {tuple(candidates.shape)}")
    if not bool(torch.isfinite(candidates).all()):
        raise ValueError("candidates must be finite gate logits")
    idx = torch.arange(attention_mask.shape[0])[index]
    errors = torch.zeros(candidates.shape[0], sketch.heads, dtype=torch.float64)  # [K, H]
    for j, cand in enumerate(candidates):
        sketch.gate.copy_(cand.to(sketch.gate.dtype))
        for n in idx.tolist():
            sel = torch.tensor([n])
            q, k, v = io.inputs(sel)
            valid = attention_mask[n].to(torch.bool)
            o = sketch(q[:, valid], k[:, valid], v[:, valid], scaling=io.scaling)  # [1, T', H, Dv]
            errors[j] += ((o - io.out[sel][:, valid]).double() ** 2).sum((0, 1, 3))
    best = errors.argmin(0)  # [H]
    gate = candidates[best, torch.arange(sketch.heads)]
    sketch.gate.copy_(gate.to(sketch.gate.dtype))
    return gate


@torch.no_grad()
def calibrate_gates(sketches, layers, attention_mask: torch.Tensor, index, how: str = "search",
                    offsets=GATE_OFFSETS) -> list[torch.Tensor]:
    r"""Set every converted layer's gate from the teacher's recorded attention; returns the logits ``[H]`` per layer.

    Parameters
    ----------
    sketches : list of SketchedAttention
        The converted layers (each with a gate: ``window > 0`` and ``gate=True``).
    layers : list of LayerIO
        The teacher's q, k, v and output of the same layers
        (:func:`sketchlab.convert.linearize.teacher_attention`), on sequences ``[N, T]``.
    attention_mask : Tensor ``[N, T]``
        Their valid tokens.
    index
        The sequences to calibrate on (training sequences, never the held-out ones).
    how : {"mass", "search"}
        ``"mass"``: :func:`far_mass_gate` (the far part's mass matched to the teacher's softmax mass
        beyond the window); ``"search"``: :func:`search_gate` over the candidates
        ``mass + offset`` for each of ``offsets`` (the least attention-output error per head).
    offsets : sequence of float
        The search's offsets (non-empty, finite).
    """
    if how not in ("mass", "search"):
        raise ValueError(f"how must be 'mass' or 'search', got {how!r}")
    if len(sketches) != len(layers):
        raise ValueError(f"{len(sketches)} converted layers but {len(layers)} recorded teacher layers")
    offsets = torch.as_tensor(offsets, dtype=torch.float64).reshape(-1)
    if how == "search" and (offsets.numel() == 0 or not bool(torch.isfinite(offsets).all())):
        raise ValueError(f"offsets must be a non-empty sequence of finite numbers, got {offsets.tolist()}")
    gates = []
    for layer, (sketch, io) in enumerate(zip(sketches, layers)):
        if sketch.gate is None:
            raise ValueError(f"layer {layer}: the converted attention has no gate (window=0 or gate=False)")
        mass = far_mass_gate(sketch, io, attention_mask, index)
        if how == "search":
            gates.append(search_gate(sketch, io, attention_mask, index, mass[None] + offsets[:, None]))
        else:
            sketch.gate.copy_(mass.to(sketch.gate.dtype))
            gates.append(mass)
    return gates
