r"""Sketched attention kernels for :class:`~sketchlab.tasks.TransformerLM`, and LLoPS initialisations.

Importing this module registers, next to ``"softmax"``, the kernels below in the model's
attention registry. Each is a thin ``nn.Module`` over the attention package's functional API
(:mod:`sketchlab.attention`: chunked PyTorch on CPU, Triton on CUDA), so training runs the code
that is tested and timed there. Layout ``[B, T, H, D]`` in and out; all are causal. Options live in
``TransformerConfig.attention_options`` (validated and completed when the config is built).

Input scale: softmax attention uses logits ``qᵀk/√D``. Every polynomial kernel here sees
``x · D^{-1/4}`` (the dump-level ``"sqrt-d"`` convention), so its kernel is a polynomial in
``s = qᵀk/√D`` — except the BASED Taylor map, which scales by its own ``d'^{-1/4}`` (BASED's
convention, kernel ``1 + s' + s'²/2`` with ``s' = (Pq)ᵀ(Pk)/√d'``).

``"poly"`` — exact polynomial attention ``(s)^p`` (quadratic in T, blocked)
    options ``p`` (2), ``normalize`` ("sum"), ``eps`` (1e-6).
``"based"`` — BASED on the first ``dim`` coordinates of each head (``P = [I_{d'}; 0]``: the
    model's learned ``W_q``, ``W_k`` play the role of BASED's feature-dimension projections)
    options ``form`` ("taylor": ``[1, u/d'^{1/4}, u⊗u/(√2·√d')]``, 1 + d' + d'² features;
    "expand": the homogeneous ``ψ_p(u)``, which converts exactly to LLoPS), ``p`` (2), ``dim``
    (min(16, D)), ``symmetric`` (False for "taylor", True for "expand"), ``normalize``, ``eps``.
``"psf"`` — PolySketchFormer's random sketch, fixed (buffers), one draw per layer and head
    options ``p`` (2), ``m`` (64), ``non_negative`` (True: ``s ⊗ s``, ``⌊√m⌋²`` features),
    ``seed`` (0; layer ``i`` draws from ``seed + i``), ``normalize``, ``eps``.
``"llops"`` — learnable ``Θ_Q, Θ_K`` ``[H, t, p, D, m]`` per layer
    options ``p`` (2), ``m`` (64), ``rank`` (1), ``non_negative`` (False; True: ``φ ⊗ φ``, degree
    ``2p``, ``m²`` features), ``affine`` (False; True: Θ ``[H, t, p, D + 1, m]`` on the affine input
    ``[x · D^{-1/4}, 1]``, :func:`sketchlab.llops.affine_input`: each factor is affine in ``x``, the
    features inhomogeneous polynomials of degree ``<= p``, and BASED's Taylor map is the case ``p = 2``,
    ``m = 1 + d' + d'²`` or, symmetric, ``1 + d' + C(d'+1, 2)``), ``normalize``, ``eps``, ``backend`` ("auto").
``"hedgehog"`` — Hedgehog's learned map :class:`sketchlab.featuremaps.HedgehogMap`
    ``[softmax(xW), softmax(-xW)]`` (LoLCATs' form; non-negative features, kernel ≈ ``exp``),
    ``W [H, D, m/2]`` trained with the model
    options ``m`` (``2·D``: ``W`` starts at the identity; another even ``m`` starts at
    ``N(0, 1/D)``), ``tie`` (False: separate query and key maps, both started from the same
    ``W``, as LoLCATs; True: one map), ``seed`` (0; layer ``i`` draws from ``seed + i``),
    ``normalize``, ``eps``.
``"psf-learned"`` — PolySketchFormer's learned sketch, self-tensored:
    ``SelfTensored(PSFLearnedMap)`` (``LayerNorm → Linear → GELU → Linear`` to ``⌊√m⌋``
    features, then ``φ ⊗ φ``: ``⌊√m⌋²`` non-negative features, standing for degree ``p``),
    trained with the model
    options ``p`` (4, even: the inner sketch stands for degree ``p/2``), ``m`` (64), ``hidden``
    (``4·D``), ``tie`` (True: one sketch for queries and keys, as PolySketchFormer; False: two,
    started equal), ``seed`` (0; layer ``i`` from ``seed + i``), ``normalize``, ``eps``.

``"based"``, ``"psf"``, ``"llops"``, ``"hedgehog"`` and ``"psf-learned"`` also take the sliding-window hybrid
(:func:`sketchlab.attention.llops_attention`): ``window`` (0 = pure linear attention), ``sinks``
(0), ``local`` ("softmax" on ``qᵀk/√D``, or "poly": the kernel's exact polynomial on the same
scaled q, k) and ``gate`` (true: a learnable per-head logit, initialised to 0, so ``g = 1/2``).
Every such kernel (and every :class:`MapKernel`) also takes the long-context memory of DESIGN §7:
``cache`` (0; far keys kept exact, needs a window), ``decay`` (null; a number in (0, 1], "head" or
"input"), ``state`` ("additive" or "delta") and ``beta`` ("head" or "input"), checked by
:class:`sketchlab.attention.options.AttentionOptions` (the one set of rules). With any of them on the
kernel runs :func:`sketchlab.attention.memory.memory_attention` on its far features and holds a
:class:`~sketchlab.attention.options.FarParams` ``far`` (learned decay and β, trained in the "kernel"
parameter group); ``decay=1`` is today's hybrid bit for bit. A signed registered map (e.g.
``"identity"``, DeltaNet's φ(x) = x) is self-tensored by default under a normalised additive state and
taken as it is by the delta rule (which L2-normalises it and has no denominator).
Every kernel decodes with a state (``step``, used by :func:`sketchlab.tasks.generate`): linear
attention carries an :class:`~sketchlab.attention.AttentionState` (with memory a
:class:`~sketchlab.attention.memory.MemoryState`; constant in the context length either way),
``softmax`` and ``poly`` a KV cache.

``"hedgehog"`` and ``"psf-learned"`` see ``x · D^{-1/4}`` too (their learned weights absorb any
scale; PSF's LayerNorm removes it), so the hybrid's softmax part is ``qᵀk/√D`` as for the others;
``local="poly"`` uses the map's degree (``p`` for ``"psf-learned"``; Hedgehog has none and refuses it).
Their maps run through :func:`sketchlab.attention.featuremap_attention` (PyTorch, every device:
there is no fused kernel for them).

``normalize="sum"`` divides by ``Σ_s k(q_t, k_s) + eps``: safe for non-negative kernels (``poly`` with
even ``p``, ``psf``/``llops`` with ``non_negative``, BASED, LLoPS initialised from BASED with even
``p``); a signed kernel can make the denominator vanish (see :mod:`sketchlab.attention`).

Initialisations of the ``llops`` layers (:func:`init_llops`): ``"random"`` (the default at
construction), ``"based"`` (:func:`sketchlab.as_llops` of BASED's expand map, or with ``affine`` of its
Taylor map, so step 0 *is* that BASED model), ``"theta"`` (an exported Θ, :func:`sketchlab.io.load_theta`, rescaled from the
file's recorded input scale to ``D^{-1/4}``).
"""

from __future__ import annotations

import hashlib
import math
import numbers
from pathlib import Path

import torch
from torch import nn

from .model import TransformerConfig, TransformerLM, register_attention

__all__ = [
    "BasedKernel",
    "HedgehogKernel",
    "PSFLearnedKernel",
    "LLOPS_INITS",
    "LLoPSKernel",
    "MapKernel",
    "PSFKernel",
    "PolyKernel",
    "based_init_dim",
    "copy_shared_weights",
    "init_llops",
    "input_scale",
    "kernel_modules",
    "register_feature_map_kernels",
]

LLOPS_INITS = ("random", "based", "theta")
_NORMALIZE = ("sum", "none")
_BACKENDS = ("auto", "torch", "triton", "reference")


def input_scale(head_dim: int) -> float:
    """The factor ``D^{-1/4}`` applied to q and k before every polynomial kernel (module docstring)."""
    return head_dim ** -0.25


# ----------------------------------------------------------------------------------------------
# option checking


def _int(opts, name, default, lo=1):
    value = opts.pop(name, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"attention option {name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _bool(opts, name, default):
    value = opts.pop(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"attention option {name} must be true or false, got {value!r}")
    return value


def _choice(opts, name, default, choices):
    value = opts.pop(name, default)
    if value not in choices:
        raise ValueError(f"attention option {name} must be one of {list(choices)}, got {value!r}")
    return value


def _eps(opts):
    value = opts.pop("eps", 1e-6)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"attention option eps must be a finite number > 0, got {value!r}")
    return float(value)


def _done(kind: str, opts: dict, out: dict) -> dict:
    if opts:
        raise ValueError(
            f"unknown attention option(s) {sorted(opts)} for attention {kind!r}; it takes {sorted(out)}"
        )
    return out


def _hybrid_options(opts: dict, out: dict) -> dict:
    out["window"] = _int(opts, "window", 0, lo=0)
    out["sinks"] = _int(opts, "sinks", 0, lo=0)
    out["local"] = _choice(opts, "local", "softmax", ("softmax", "poly"))
    out["gate"] = _bool(opts, "gate", True)
    if out["sinks"] and not out["window"]:
        raise ValueError(f"attention option sinks={out['sinks']} needs window >= 1 (window 0 is pure linear attention)")
    if out["window"] and out["normalize"] != "sum":
        raise ValueError("attention option window > 0 needs normalize 'sum' (the hybrid shares one denominator)")
    # the long-context memory (DESIGN §7): checked by the one set of rules, AttentionOptions'
    memory = {name: opts.pop(name, default) for name, default in _MEMORY_DEFAULTS.items()}
    checked = _attention_options(out, memory)
    out.update({name: getattr(checked, name) for name in _MEMORY_DEFAULTS})  # completed: decay 1 -> 1.0
    return out


#: The memory options every hybrid kernel takes, and their defaults (no memory: today's hybrid).
_MEMORY_DEFAULTS = {"cache": 0, "decay": None, "state": "additive", "beta": "head"}


def _attention_options(o: dict, memory: dict | None = None, local_scale: float | None = None):
    """The :class:`~sketchlab.attention.options.AttentionOptions` of a hybrid kernel's options ``o``
    (``memory``: the cache, decay, state and β, default ``o``'s own): its ``__post_init__`` is the one
    check of every memory rule (cache needs a window, delta needs a normalised mix, ...)."""
    from ..attention.options import AttentionOptions

    memory = {name: o[name] for name in _MEMORY_DEFAULTS} if memory is None else memory
    try:
        return AttentionOptions(causal=True, normalize=o["normalize"], eps=o["eps"], window=o["window"],
                                sinks=o["sinks"], local=o["local"], local_scale=local_scale, **memory)
    except TypeError as err:  # a bool where a flag was expected: the toy's option errors are ValueErrors
        raise ValueError(f"attention option: {err}") from None


def _poly_options(opts: dict, config: TransformerConfig) -> dict:
    out = {"p": _int(opts, "p", 2), "normalize": _choice(opts, "normalize", "sum", _NORMALIZE), "eps": _eps(opts)}
    return _done("poly", opts, out)


def _based_options(opts: dict, config: TransformerConfig) -> dict:
    form = _choice(opts, "form", "taylor", ("taylor", "expand"))
    p = _int(opts, "p", 2)
    if form == "taylor" and p != 2:
        raise ValueError(f"attention option p must be 2 for BASED's Taylor map (1 + s + s²/2), got p={p}")
    dim = _int(opts, "dim", min(16, config.head_dim))
    if dim > config.head_dim:
        raise ValueError(f"attention option dim (BASED's d') must be <= the head dimension {config.head_dim}, got {dim}")
    out = {"form": form, "p": p, "dim": dim, "symmetric": _bool(opts, "symmetric", form == "expand"),
           "normalize": _choice(opts, "normalize", "sum", _NORMALIZE), "eps": _eps(opts)}
    return _done("based", opts, _hybrid_options(opts, out))


def _psf_options(opts: dict, config: TransformerConfig) -> dict:
    p, m = _int(opts, "p", 2), _int(opts, "m", 64)
    non_negative = _bool(opts, "non_negative", True)
    if non_negative and p % 2:
        raise ValueError(f"attention option p must be even with non_negative=true (φ = s ⊗ s, s of degree p/2), got p={p}")
    out = {"p": p, "m": m, "non_negative": non_negative, "seed": _int(opts, "seed", 0, lo=0),
           "normalize": _choice(opts, "normalize", "sum", _NORMALIZE), "eps": _eps(opts)}
    return _done("psf", opts, _hybrid_options(opts, out))


def _hedgehog_options(opts: dict, config: TransformerConfig) -> dict:
    m = _int(opts, "m", 2 * config.head_dim)
    if m % 2:
        raise ValueError(f"attention option m must be even for Hedgehog ([softmax(xW), softmax(-xW)], m/2 each), got m={m}")
    out = {"m": m, "tie": _bool(opts, "tie", False), "seed": _int(opts, "seed", 0, lo=0),
           "normalize": _choice(opts, "normalize", "sum", _NORMALIZE), "eps": _eps(opts)}
    out = _done("hedgehog", opts, _hybrid_options(opts, out))
    from ..attention.functional import check_local_degree

    # refused when the config is built: HedgehogMap's degree is None (FeatureMap's default, no polynomial)
    check_local_degree(None, "HedgehogMap (attention 'hedgehog')", window=out["window"], local=out["local"])
    return out


def _psf_learned_options(opts: dict, config: TransformerConfig) -> dict:
    p = _int(opts, "p", 4)
    if p % 2:
        raise ValueError(f"attention option p must be even for the learned PSF sketch (φ ⊗ φ of a degree-p/2 sketch), "
                         f"got p={p}")
    out = {"p": p, "m": _int(opts, "m", 64), "hidden": _int(opts, "hidden", 4 * config.head_dim),
           "tie": _bool(opts, "tie", True), "seed": _int(opts, "seed", 0, lo=0),
           "normalize": _choice(opts, "normalize", "sum", _NORMALIZE), "eps": _eps(opts)}
    return _done("psf-learned", opts, _hybrid_options(opts, out))


def _llops_options(opts: dict, config: TransformerConfig) -> dict:
    out = {"p": _int(opts, "p", 2), "m": _int(opts, "m", 64), "rank": _int(opts, "rank", 1),
           "non_negative": _bool(opts, "non_negative", False), "affine": _bool(opts, "affine", False),
           "normalize": _choice(opts, "normalize", "sum", _NORMALIZE), "eps": _eps(opts),
           "backend": _choice(opts, "backend", "auto", _BACKENDS)}
    out = _done("llops", opts, _hybrid_options(opts, out))
    if out["affine"] and out["window"] and out["local"] == "poly":
        raise ValueError("attention option local='poly' is the homogeneous kernel (s)^p, and affine=true makes the "
                         "map an inhomogeneous polynomial: use local='softmax'")
    return out


# ----------------------------------------------------------------------------------------------
# kernels


class PolyKernel(nn.Module):
    """Exact causal polynomial attention ``(qᵀk/√D)^p`` through :func:`sketchlab.attention.poly_attention`."""

    def __init__(self, config: TransformerConfig, layer: int):
        super().__init__()
        self.options = dict(config.attention_options)
        self.scale = input_scale(config.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q, k, v [B, T, H, D]`` → ``[B, T, H, D]``."""
        from ..attention import poly_attention

        o = self.options
        return poly_attention(q * self.scale, k * self.scale, v, o["p"], causal=True, normalize=o["normalize"],
                              eps=o["eps"])

    def step(self, q, k, v, state):
        """``n`` new tokens against a KV cache (:func:`sketchlab.tasks.model.kv_cache_step`)."""
        from .model import kv_cache_step

        o = self.options

        def attend(q, k, v, allowed):
            scores = torch.einsum("bthd,bshd->bhts", q * self.scale, k * self.scale) ** o["p"]  # [B, H, n, S]
            scores = scores.masked_fill(~allowed, 0.0)
            out = torch.einsum("bhts,bshd->bthd", scores, v)
            if o["normalize"] == "sum":
                out = out / (scores.sum(-1).transpose(1, 2)[..., None] + o["eps"])
            return out

        return kv_cache_step(q, k, v, state, attend)


class _HybridMixin:
    """The window/sinks/local/gate options of a sketched kernel, its memory (``cache``, ``decay``,
    ``state``, ``beta``: DESIGN §7) and its decoding step.

    ``attention_options`` (an :class:`~sketchlab.attention.options.AttentionOptions`) holds the
    hybrid's and the memory's options; when its ``memory`` is on (a cache, a decay other than
    ``None``/``1.0``, the delta state) the kernel runs
    :func:`sketchlab.attention.memory.memory_attention` on its far features (:meth:`_far_features`)
    with ``far`` (a :class:`~sketchlab.attention.options.FarParams`: the learned decay and β; the gate
    stays ``gate``, where checkpoints have it), else its own hybrid path (``decay=1.0`` is that path,
    bit for bit). ``far``'s parameters live under ``.attention.attn.``: the training loop's "kernel" group.
    Each kernel defines ``_far_features(q, k)`` → ``(φ(q), φ(k) [B, T, H, M], q, k as the exact part
    sees them, degree)``: the features its own path uses (self-tensored where it self-tensors).
    """

    def _init_hybrid(self, config: TransformerConfig, local_scale):
        from ..attention.options import FarParams

        o = self.options
        self.gate = nn.Parameter(torch.zeros(config.n_heads)) if o["window"] and o["gate"] else None
        self.local_scale = local_scale
        self.attention_options = _attention_options(o, local_scale=float(local_scale))
        memory = self.attention_options.memory
        self.far = FarParams(self.attention_options, config.n_heads, config.head_dim, gate=False) if memory else None

    def _hybrid(self) -> dict:
        o = self.options
        return {"window": o["window"], "sinks": o["sinks"], "local": o["local"],
                "local_scale": self.local_scale, "gate": self.gate}

    def step(self, q, k, v, state):
        """``n`` new tokens given the state of the earlier ones (``None`` at the start) → ``(out, state)``:
        an :class:`~sketchlab.attention.AttentionState`, or with memory a
        :class:`~sketchlab.attention.memory.MemoryState` (constant in the context length either way)."""
        return self._run(q, k, v, initial_state=state, output_final_state=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q, k, v [B, T, H, D]`` → ``[B, T, H, D]``."""
        return self._run(q, k, v)

    def _run(self, q, k, v, **state):
        if self.attention_options.memory:
            return self._memory(q, k, v, **state)
        return self._attend(q, k, v, **state)

    def _memory(self, q, k, v, **state):
        """:func:`~sketchlab.attention.memory.memory_attention` on the far features of :meth:`_far_features`."""
        from ..attention.memory import memory_attention

        fq, fk, ql, kl, degree = self._far_features(q, k)
        out = memory_attention(fq.to(v.dtype), fk.to(v.dtype), v, ql.to(v.dtype), kl.to(v.dtype),
                               options=self.attention_options, params=self.far, gate=self.gate, degree=degree,
                               **state)
        if state.get("output_final_state"):
            return out[0].to(v.dtype), out[1]
        return out.to(v.dtype)


def _sketch_features(sketch, q, k):
    """A :class:`sketchlab.Sketch`'s features of ``q, k [B, T, H, D]`` → ``[B, T, H, M]`` each."""
    return (sketch.features_q(q.transpose(1, 2)).transpose(1, 2),
            sketch.features_k(k.transpose(1, 2)).transpose(1, 2))


def _slice_projection(head_dim: int, dim: int, heads: int) -> torch.Tensor:
    """``P = [I_{d'}; 0]`` per head: ``[H, D, d']`` (the first ``d'`` coordinates)."""
    return torch.eye(head_dim, dim).expand(heads, head_dim, dim).contiguous()  # [H, D, d']


class BasedKernel(_HybridMixin, nn.Module):
    """BASED (Taylor or expand form) on the first ``dim`` head coordinates, through
    :func:`sketchlab.attention.sketch_attention` with a :class:`sketchlab.BasedSketch`."""

    def __init__(self, config: TransformerConfig, layer: int):
        super().__init__()
        self.options = dict(config.attention_options)
        # fixed by the config, so not stored in checkpoints
        self.register_buffer("proj", _slice_projection(config.head_dim, self.options["dim"], config.n_heads),
                             persistent=False)  # [H, D, d']
        self.scale = 1.0 if self.options["form"] == "taylor" else input_scale(config.head_dim)
        # local scores on the scaled q, k: softmax wants qᵀk/√D; "poly" the kernel's own scale (s'
        # for Taylor's degree-2 term, BASED's 1/√d', or 1 on the D^{-1/4}-scaled expand inputs)
        taylor = self.options["form"] == "taylor"
        poly_scale = self.options["dim"] ** -0.5 if taylor else 1.0
        self._init_hybrid(config, (config.head_dim ** -0.5 / self.scale**2) if self.options["local"] == "softmax"
                          else poly_scale)

    def sketch(self):
        from ..sketches import BasedSketch

        o = self.options
        return BasedSketch(self.proj, o["p"], form=o["form"], symmetric=o["symmetric"])

    def _attend(self, q, k, v, **state):
        from ..attention import sketch_attention

        o = self.options
        return sketch_attention(q * self.scale, k * self.scale, v, self.sketch(), causal=True,
                                normalize=o["normalize"], eps=o["eps"], **self._hybrid(), **state)

    def _far_features(self, q, k):
        q, k, sketch = q * self.scale, k * self.scale, self.sketch()
        return (*_sketch_features(sketch, q, k), q, k, sketch.degree)


class PSFKernel(_HybridMixin, nn.Module):
    """PolySketchFormer's fixed random sketch (one draw per head, buffers ``weight_i [H, in, r]``),
    through :func:`sketchlab.attention.sketch_attention`."""

    def __init__(self, config: TransformerConfig, layer: int):
        super().__init__()
        from ..sketches import PolySketch

        self.options = o = dict(config.attention_options)
        drawn = PolySketch.draw(config.head_dim, o["p"], o["m"], non_negative=o["non_negative"],
                                seed=o["seed"] + layer, batch_shape=(config.n_heads,))
        self.count = len(drawn.weights)
        for i, w in enumerate(drawn.weights):
            self.register_buffer(f"weight_{i}", w)  # [H, in, r]
        self.scale = input_scale(config.head_dim)
        self._init_hybrid(config, 1.0)  # q, k scaled by D^{-1/4}: qᵀk/√D for softmax, the kernel's base for poly

    def sketch(self):
        from ..sketches import PolySketch

        o = self.options
        return PolySketch([getattr(self, f"weight_{i}") for i in range(self.count)], o["p"],
                          non_negative=o["non_negative"])

    def _attend(self, q, k, v, **state):
        from ..attention import sketch_attention

        o = self.options
        return sketch_attention(q * self.scale, k * self.scale, v, self.sketch(), causal=True,
                                normalize=o["normalize"], eps=o["eps"], **self._hybrid(), **state)

    def _far_features(self, q, k):  # the sketch self-tensors itself (non_negative)
        q, k, sketch = q * self.scale, k * self.scale, self.sketch()
        return (*_sketch_features(sketch, q, k), q, k, sketch.degree)


class LLoPSKernel(_HybridMixin, nn.Module):
    r"""Learnable LLoPS attention: parameters ``theta_q``, ``theta_k`` ``[H, t, p, D, m]`` (``[H, t, p, D + 1, m]``
    with ``affine``: the last row multiplies the constant coordinate of ``[x · D^{-1/4}, 1]``), through
    :func:`sketchlab.attention.llops_attention`.

    At construction Θ is the ``"random"`` initialisation (:func:`init_llops`) drawn from
    ``torch``'s global generator (seed it before building the model).
    """

    def __init__(self, config: TransformerConfig, layer: int):
        super().__init__()
        self.options = o = dict(config.attention_options)
        shape = (config.n_heads, o["rank"], o["p"], config.head_dim + o["affine"], o["m"])  # [H, t, p, D (+ 1), m]
        self.theta_q = nn.Parameter(torch.empty(shape))
        self.theta_k = nn.Parameter(torch.empty(shape))
        self.scale = input_scale(config.head_dim)
        self._init_hybrid(config, 1.0)  # q, k scaled by D^{-1/4}: qᵀk/√D for softmax, the kernel's base for poly
        with torch.no_grad():
            _random_theta(self, None)

    def _attend(self, q, k, v, **state):
        from ..attention import llops_attention
        from ..llops import affine_input

        o = self.options
        q, k = q * self.scale, k * self.scale
        if o["affine"]:  # [x · D^{-1/4}, 1]: the local softmax's scores shift by the constant's 1, which cancels
            q, k = affine_input(q), affine_input(k)
        out = llops_attention(q, k, v, self.theta_q, self.theta_k, causal=True,
                              normalize=o["normalize"], non_negative=o["non_negative"], eps=o["eps"],
                              backend=o["backend"], **self._hybrid(), **state)
        if state.get("output_final_state"):  # backend "reference" returns float64: back to the model's dtype
            return out[0].to(v.dtype), out[1]
        return out.to(v.dtype)

    def _far_features(self, q, k):
        from ..attention import self_tensor
        from ..llops import affine_input
        from ..llops.maps import llops_feature_fn

        o = self.options
        q, k = q * self.scale, k * self.scale
        if o["affine"]:
            q, k = affine_input(q), affine_input(k)
        fq = llops_feature_fn(self.theta_q)(q.transpose(1, 2)).transpose(1, 2)  # [B, T, H, m]
        fk = llops_feature_fn(self.theta_k)(k.transpose(1, 2)).transpose(1, 2)
        if o["non_negative"]:  # φ ⊗ φ, as llops_attention's non_negative: m² features
            fq, fk = self_tensor(fq), self_tensor(fk)
        return fq, fk, q, k, o["p"]


class _FeatureMapKernel(_HybridMixin, nn.Module):
    """A learned :class:`sketchlab.featuremaps.FeatureMap` per side (``map_q``; ``map_k``, or
    ``None`` when tied), through :func:`sketchlab.attention.featuremap_attention` on ``x · D^{-1/4}``."""

    def _init_maps(self, config: TransformerConfig, make):
        self.scale = input_scale(config.head_dim)
        self.map_q = make()
        self.map_k = None if self.options["tie"] else make()  # the same draw: both sides start equal
        self._init_hybrid(config, 1.0)  # q, k scaled by D^{-1/4}: qᵀk/√D for softmax, the map's base for poly

    def _attend(self, q, k, v, **state):
        from ..attention import featuremap_attention

        o = self.options
        # the maps are non-negative (softmax features; φ ⊗ φ), so "sum" divides by a positive sum
        # without self-tensoring again; backend "torch": there is no fused kernel for these maps
        return featuremap_attention(q * self.scale, k * self.scale, v, self.map_q, self.map_k, causal=True,
                                    normalize=o["normalize"], non_negative=False, eps=o["eps"], backend="torch",
                                    **self._hybrid(), **state)

    def _lift(self) -> bool:
        """Whether the memory path self-tensors the maps' features (these maps: never, as ``_attend``)."""
        return False

    def _far_features(self, q, k):
        from ..attention import self_tensor

        q, k = q * self.scale, k * self.scale
        map_k = self.map_q if self.map_k is None else self.map_k
        fq, fk = self.map_q.features(q), map_k.features(k)
        if self._lift():
            fq, fk = self_tensor(fq), self_tensor(fk)
        return fq, fk, q, k, self.map_q.degree


class HedgehogKernel(_FeatureMapKernel):
    """Hedgehog: :class:`sketchlab.featuremaps.HedgehogMap` (parameters ``map_q.weight``,
    ``map_k.weight`` ``[H, D, m/2]``), drawn with ``seed + layer``."""

    def __init__(self, config: TransformerConfig, layer: int):
        super().__init__()
        from ..featuremaps import HedgehogMap

        self.options = o = dict(config.attention_options)
        self._init_maps(config, lambda: HedgehogMap(config.n_heads, config.head_dim, m=o["m"], seed=o["seed"] + layer))


class PSFLearnedKernel(_FeatureMapKernel):
    """PolySketchFormer's learned sketch: ``SelfTensored(PSFLearnedMap(m=⌊√m⌋, hidden, degree=p/2))``
    (:func:`sketchlab.featuremaps.make_feature_map` ``"psf"``), drawn with ``seed + layer``."""

    def __init__(self, config: TransformerConfig, layer: int):
        super().__init__()
        from ..featuremaps import make_feature_map

        self.options = o = dict(config.attention_options)
        self._init_maps(config, lambda: make_feature_map("psf-learned", heads=config.n_heads, head_dim=config.head_dim, p=o["p"],
                                                         m=o["m"], seed=o["seed"] + layer, hidden=o["hidden"]))


class MapKernel(_FeatureMapKernel):
    """Any map of the feature-map registry (:func:`sketchlab.featuremaps.make_feature_map` ``name``,
    its options as the registry declares them), drawn with ``seed + layer``; ``tie`` (False) as Hedgehog's."""

    def __init__(self, config: TransformerConfig, layer: int, name: str):
        super().__init__()
        from ..featuremaps import feature_map_options, make_feature_map

        self.options = o = dict(config.attention_options)
        mapped = {key: o[key] for key in o if key in feature_map_options(name)}
        mapped["seed"] = mapped.get("seed", 0) + layer
        self._init_maps(config, lambda: make_feature_map(name, heads=config.n_heads, head_dim=config.head_dim,
                                                         **mapped))

    def _attend(self, q, k, v, **state):
        from ..attention import featuremap_attention

        o = self.options
        return featuremap_attention(q * self.scale, k * self.scale, v, self.map_q, self.map_k, causal=True,
                                    normalize=o["normalize"], non_negative=o["non_negative"], eps=o["eps"],
                                    backend="torch", **self._hybrid(), **state)

    def _lift(self) -> bool:
        """``non_negative``, or when null: self-tensor a signed map under a normalised additive far state
        (``featuremap_attention``'s rule: never divide by a signed sum); the delta state has no
        denominator and takes the map's features as they are (DeltaNet's ``φ(x) = x``: ``"identity"``)."""
        o = self.options
        if o["non_negative"] is not None:
            return o["non_negative"]
        map_k = self.map_q if self.map_k is None else self.map_k
        signed = not (self.map_q.non_negative and map_k.non_negative)
        return o["state"] != "delta" and o["normalize"] == "sum" and signed


def _map_options(name: str):
    """The toy's options of the registered map ``name``: the map's own (checked by the registry, the
    one check), ``tie``, ``non_negative`` (None: the attention decides), ``normalize``, ``eps`` and the hybrid's."""

    def check(opts: dict, config: TransformerConfig) -> dict:
        from ..attention.functional import check_local_degree
        from ..featuremaps import check_feature_map_options, feature_map_options, make_feature_map

        out = {"tie": _bool(opts, "tie", False), "normalize": _choice(opts, "normalize", "sum", _NORMALIZE),
               "eps": _eps(opts)}
        value = opts.pop("non_negative", None)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"attention option non_negative must be true, false or null, got {value!r}")
        out["non_negative"] = value
        out = _hybrid_options(opts, out)
        mine = {key: opts.pop(key) for key in list(opts) if key in feature_map_options(name)}
        _done(name, opts, {**out, **feature_map_options(name)})
        given = check_feature_map_options(name, mine, where=f"attention {name!r}")
        out.update({key: given[key] for key in mine})  # completed options stay valid input (a resumed run)
        probe = make_feature_map(name, heads=config.n_heads, head_dim=config.head_dim, **mine)
        check_local_degree(probe.degree, f"{type(probe).__name__} (attention {name!r})", window=out["window"],
                           local=out["local"])
        return out

    return check


def _deprecated(old: str, new: str, options):
    """The options of ``options`` behind a ``DeprecationWarning`` naming ``new`` (the name ``old`` still builds,
    so checkpoints that store it load)."""

    def check(opts: dict, config: TransformerConfig) -> dict:
        import warnings

        warnings.warn(f"attention {old!r} is deprecated, use {new}", DeprecationWarning, stacklevel=4)
        return options(opts, config)

    return check


def _form(form: str, options):
    def check(opts: dict, config: TransformerConfig) -> dict:
        if opts.setdefault("form", form) != form:
            raise ValueError(f"attention option form is {form!r} for attention 'based-{form}', got {opts['form']!r}")
        return options(opts, config)

    return check


register_attention("poly", options=_poly_options)(PolyKernel)
register_attention("based-taylor", options=_form("taylor", _based_options))(BasedKernel)
register_attention("based-expand", options=_form("expand", _based_options))(BasedKernel)
register_attention("psf-random", options=_psf_options)(PSFKernel)
register_attention("llops", options=_llops_options)(LLoPSKernel)
register_attention("hedgehog", options=_hedgehog_options)(HedgehogKernel)
register_attention("psf-learned", options=_psf_learned_options)(PSFLearnedKernel)
register_attention("based", options=_deprecated("based", "'based-taylor' (or 'based-expand' for form expand)",
                                                 _based_options))(BasedKernel)
register_attention("psf", options=_deprecated("psf", "'psf-random'", _psf_options))(PSFKernel)


def register_feature_map_kernels() -> list[str]:
    """Register a :class:`MapKernel` for every map of the feature-map registry the toy model has no
    kernel for yet (done on import; call again after registering a map of your own). Returns the new names."""
    from ..featuremaps import feature_map_names
    from .model import attention_registry

    added = []
    for name in feature_map_names():
        if name not in attention_registry():
            register_attention(name, options=_map_options(name))(lambda config, layer, _name=name:
                                                                 MapKernel(config, layer, _name))
            added.append(name)
    return added


register_feature_map_kernels()


# ----------------------------------------------------------------------------------------------
# LLoPS initialisations


def kernel_modules(model: TransformerLM) -> list[nn.Module]:
    """The attention kernel of every layer (``model.blocks[i].attention.attn``), in layer order."""
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")
    return [block.attention.attn for block in model.blocks]


def _llops_layers(model: TransformerLM) -> list[LLoPSKernel]:
    layers = kernel_modules(model)
    if model.config.attention != "llops":
        raise ValueError(f"init_llops needs a model with attention 'llops', got {model.config.attention!r}")
    return layers


def _random_theta(kernel: LLoPSKernel, generator: torch.Generator | None) -> None:
    r"""Element-wise start ``θ_{r,j} = G_r`` for every factor ``j`` and both sides, ``G`` i.i.d. N(0, 1/d)
    with ``d`` Θ's row count (``D``, or ``D + 1`` with ``affine``, the constant's row drawn alike).

    Every feature is then ``Σ_r ⟨g_r, x⟩^p``: for even ``p`` the kernel ``φ(q)·φ(k)`` is a sum of
    products of non-negative numbers at step 0, so ``normalize="sum"`` starts from a non-negative
    kernel. The two sides separate as training proceeds; the ``p`` factors of a side get equal
    gradients and stay equal (docs/DESIGN.md §6), so the map stays element-wise and non-negative.
    """
    H, t, p, D, m = kernel.theta_q.shape
    g = torch.randn(H, t, 1, D, m, generator=generator, dtype=torch.float64) / math.sqrt(D)
    g = g.expand(H, t, p, D, m).to(kernel.theta_q.dtype)
    kernel.theta_q.copy_(g)
    kernel.theta_k.copy_(g)


def based_init_dim(head_dim: int, p: int, m: int, form: str = "expand") -> tuple[int, bool]:
    """``(d', symmetric)`` of the BASED map of ``form`` with exactly ``m`` features for degree ``p``.

    ``form="expand"``: ``C(d'+p-1, p)`` (symmetric) or ``d'^p`` features; ``form="taylor"`` (``p`` must
    be 2): ``1 + d' + C(d'+1, 2)`` or ``1 + d' + d'²``. The symmetric form is tried first, then the full
    one; ``ValueError`` lists the valid sizes when neither matches.
    """
    from ..sketches.based import based_num_features

    if form == "taylor" and p != 2:
        raise ValueError(f"init 'based' with affine=true is BASED's Taylor map 1 + s + s²/2: it needs p=2, got p={p}")
    for symmetric in (True, False):
        for dim in range(1, head_dim + 1):
            if based_num_features(dim, p, form, symmetric) == m:
                return dim, symmetric
    valid = sorted({based_num_features(dim, p, form, s) for dim in range(1, head_dim + 1) for s in (True, False)})
    counts = "C(d'+p-1, p) or d'^p" if form == "expand" else "1 + d' + C(d'+1, 2) or 1 + d' + d'^2"
    raise ValueError(
        f"init 'based' needs m equal to the feature count of a BASED {form} map of degree p={p} on d' <= "
        f"{head_dim} coordinates ({counts}), got m={m}; valid m: {valid}"
    )


def _theta_factor(scale_label: str, head_dim: int, where: str) -> float:
    """Factor turning a Θ fitted on ``x · c`` (the file's ``scale``) into one applied to ``x · D^{-1/4}``.

    Each of the ``p`` factors of a LLoPS feature is linear in ``x``, so ``φ_Θ(c x) = φ_{ρΘ}(D^{-1/4} x)``
    with ``ρ = c / D^{-1/4}``.
    """
    if scale_label == "none":
        c = 1.0
    elif scale_label == "sqrt-d":
        c = input_scale(head_dim)
    else:
        try:
            c = float(scale_label)
        except ValueError:
            raise ValueError(f"{where}: metadata scale must be 'none', 'sqrt-d' or a number, got {scale_label!r}") from None
        if not (math.isfinite(c) and c > 0):
            raise ValueError(f"{where}: metadata scale must be a positive finite number, got {scale_label!r}")
    return c / input_scale(head_dim)


def init_llops(model: TransformerLM, init: str = "random", theta_file=None, *, seed: int = 0) -> dict:
    r"""Initialise the Θ of every ``llops`` layer of ``model`` in place.

    Parameters
    ----------
    model : TransformerLM
        With ``config.attention == "llops"``.
    init : {"random", "based", "theta"}
        ``"random"``: :func:`_random_theta` from a generator seeded with ``seed`` (layer ``i`` from
        ``seed + i``). ``"based"``: ``Θ_Q = Θ_K = as_llops(BasedSketch(P, p, form="expand"))``
        with ``P = [I_{d'}; 0]`` and ``(d', symmetric)`` from :func:`based_init_dim` (``m`` must be
        a BASED feature count, ``rank`` 1): the model then computes exactly the ``"based"``
        attention with ``form="expand"``, degree ``p`` (``2p`` with ``non_negative``; the same
        kernel ``(s')^{2p}`` as BASED expand of degree ``2p``); with ``affine``, ``as_llops`` of
        BASED's Taylor map (``p = 2``, ``m = 1 + d' + d'²`` or ``1 + d' + C(d'+1, 2)``, not
        ``non_negative``), its ``x`` rows times ``D^{1/4}`` (the Taylor map sees the unscaled q, k):
        the ``"based"`` attention with ``form="taylor"``. ``"theta"``: ``theta_file``, a
        :func:`sketchlab.io.save_theta` export of shape ``[L, H, t, p, D, m]`` matching the model,
        rescaled by :func:`_theta_factor` from its recorded ``scale`` (with ``affine``, a zero row
        for the constant coordinate: the same homogeneous features at step 0).
    theta_file : str or Path
        Required for (and only for) ``init="theta"``.
    seed : int >= 0
        For ``"random"``.

    Returns
    -------
    dict
        A JSON description of the initialisation (stored in the run's identity): ``init`` and,
        for ``"based"``, ``dim`` and ``symmetric`` (and ``form: "taylor"`` with ``affine``); for
        ``"theta"``, the file and its SHA-256.
    """
    from ..llops import affine_theta
    from ..sketches import BasedSketch, as_llops

    layers = _llops_layers(model)
    if init not in LLOPS_INITS:
        raise ValueError(f"init must be one of {list(LLOPS_INITS)}, got {init!r}")
    if (theta_file is None) != (init != "theta"):
        raise ValueError(f"theta_file is required for init='theta' and only for it, got init={init!r}, "
                         f"theta_file={theta_file!r}")
    cfg, o = model.config, model.config.attention_options
    H, D = cfg.n_heads, cfg.head_dim
    if init == "random":
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        with torch.no_grad():
            for i, layer in enumerate(layers):
                _random_theta(layer, torch.Generator().manual_seed(int(seed) + i))
        return {"init": "random", "seed": int(seed)}
    if init == "based":
        if o["rank"] != 1:
            raise ValueError(f"init 'based' gives a rank-1 Θ (BASED is one product per feature); the model has "
                             f"rank={o['rank']}: use rank 1")
        form = "taylor" if o["affine"] else "expand"
        if o["affine"] and o["non_negative"]:
            raise ValueError("init 'based' with affine=true is BASED's Taylor map, and non_negative=true would square "
                             "its kernel ((1 + s + s²/2)² is no BASED model): use non_negative=false")
        dim, symmetric = based_init_dim(D, o["p"], o["m"], form)
        proj = _slice_projection(D, dim, H).to(torch.float64)  # [H, D, d']
        sketch = BasedSketch(proj, o["p"], form=form, symmetric=symmetric)
        theta = as_llops(sketch, affine=o["affine"]).theta_q.detach()  # [H, 1, p, D (+ 1), m]
        if o["affine"]:  # the Taylor map takes the unscaled q, k; the layer gives Θ x · D^{-1/4}
            theta[..., :D, :] *= D**0.25
        with torch.no_grad():
            for layer in layers:
                layer.theta_q.copy_(theta)
                layer.theta_k.copy_(theta)
        return {"init": "based", "dim": dim, "symmetric": symmetric, **({"form": form} if o["affine"] else {})}
    from ..io import load_theta

    path = Path(theta_file)
    theta_q, theta_k, meta = load_theta(path)  # [L, H, t, p, d, m]
    expect = (cfg.n_layers, H, o["rank"], o["p"], D, o["m"])
    if tuple(theta_q.shape) != expect:
        names = ("layers L", "heads H", "rank t", "degree p", "head dimension d", "features m")
        diff = [f"{n}: {a} in the file, {b} in the model" for n, a, b in zip(names, theta_q.shape, expect) if a != b]
        raise ValueError(f"{path}: Θ of shape [L, H, t, p, d, m] = {list(theta_q.shape)} does not match the model "
                         f"{list(expect)} ({'; '.join(diff)})")
    rho = _theta_factor(meta["scale"], D, str(path))
    if o["affine"]:  # the constant coordinate's row: zero, so step 0 has the file's homogeneous features
        theta_q, theta_k = affine_theta(theta_q), affine_theta(theta_k)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.theta_q.copy_(theta_q[i].to(layer.theta_q.dtype) * rho)
            layer.theta_k.copy_(theta_k[i].to(layer.theta_k.dtype) * rho)
    return {"init": "theta", "file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "scale": meta["scale"]}


def copy_shared_weights(source: TransformerLM, target: TransformerLM) -> list[str]:
    """Copy every weight of ``source`` into ``target`` except the attention kernels' own tensors.

    Embeddings, projections, convolutions, norms, MLPs and the head must exist in both with the
    same shapes (the same model with another attention); the kernels' parameters and buffers
    (``blocks.i.attention.attn.*``) are left as ``target`` has them. Returns the copied names.
    """
    if not isinstance(source, TransformerLM) or not isinstance(target, TransformerLM):
        raise TypeError("copy_shared_weights takes two TransformerLM models")
    src = {k: v for k, v in source.state_dict().items() if ".attention.attn." not in k}
    dst = {k: v for k, v in target.state_dict().items() if ".attention.attn." not in k}
    if set(src) != set(dst):
        raise ValueError(
            f"the models differ outside the attention kernels: only in the source {sorted(set(src) - set(dst))}, "
            f"only in the target {sorted(set(dst) - set(src))}"
        )
    bad = [f"{k}: {tuple(src[k].shape)} vs {tuple(dst[k].shape)}" for k in src if src[k].shape != dst[k].shape]
    if bad:
        raise ValueError(f"the models' shared weights differ in shape: {'; '.join(bad)}")
    with torch.no_grad():
        for k, v in dst.items():
            v.copy_(src[k])
    return sorted(src)
