r"""The lean decoding step of every mechanism (DESIGN §6, §7): one token at a time, in place.

:class:`RecurrentStep` continues an :class:`~sketchlab.attention.AttentionState` (the additive
hybrid, or pure linear attention) or a :class:`~sketchlab.attention.MemoryState` (decayed state,
delta rule and gated delta rule, sparse exact cache; each with the window and the sinks) one token
per :meth:`RecurrentStep.step`, for inference (no gradient). It computes what one
``linear_attention`` call on one token with
``initial_state`` computes (the reference step: :func:`sketchlab.attention.ops.cache.recurrent.decode` and
:func:`sketchlab.attention.ops.additive.recurrent.hybrid_decode_one`, which keep autograd and return a new
state object per token; the tests hold the two equal in float64), but:

* **checks once**: the state's fields when it is laid out (:meth:`RecurrentStep.from_state`), the
  far parameters (gate, decay, β) once per parameter version (their identity and in-place
  ``_version``: a training step between two tokens is seen, and the parameters checked again);
  nothing is checked per token;
* **preallocated, in place**: every held key is one column of ``Kt [B·H, D, N]`` (the keys), one row of
  ``Phi [B·H, N, F]`` (their features) and one of ``VS [B·H, N + M, Dv + 1]`` (``[v | 1]`` per key, then
  the far state ``[S | z]``) with ``N = sinks + window + cache``: the sinks, the window as a **ring**
  (position ``p`` in row ``sinks + p mod window``), the cache's slots. A token writes its row over
  the key that leaves the window;
* **one batched product per read**: all heads at once, the logits ``q·Kᵀ`` (plus the mask's
  ``0 / −∞`` bias) in one ``baddbmm``, and the output's numerator and denominator in one product
  of the row ``W = [g·a | (1 − g)·φ(q)]`` with ``VS``:

  .. math:: [\,n \mid d\,] = W\,VS = \Big[\,g\sum_{E} a_j v_j + (1-g)\,S^\top\phi(q)\ \Big|\ g\sum_E a_j
            + (1-g)\,z^\top\phi(q)\Big], \qquad o = n / (d + \varepsilon)

  (``a_j = e^{s\,q^\top k_j - c}``, ``c`` the maximum over the exact set ``E``; the delta rule's
  ``W = [g·a/Σa | (1 − g)·q̂]``, ``o = n``);
* the features ``φ(q_t), φ(k_t)`` come in once per token (the caller evaluates its maps once); a
  key's ``φ`` is kept in its row until it enters the far state;
* **one compiled call**: on the CPU (float32/float64 buffers) :meth:`RecurrentStep.step` hands the token,
  after the parameter check, to :func:`sketchlab.attention.ops.fused_recurrent.step`, which does all of
  the above in one pass of raw loops over the ``B·H`` lanes (a tiny torch op costs microseconds from
  Python, the step's arithmetic a few in all). The torch body of :meth:`step` is its twin: run on other
  devices, where no C++ compiler works, and under ``fused_recurrent.USE_COMPILED = False``; the tests
  hold both equal to the reference step.

:meth:`RecurrentStep.state` writes the state back out (the window in position order), so a
decoding loop can hand it to any path again. The naive float64 twin of the whole step is
:func:`sketchlab.attention.memory.memory_attention_naive` (and, for the additive hybrid,
:func:`sketchlab.attention.ops.additive.naive.feature_attention_naive`).
"""

from __future__ import annotations

import torch

from ..polynomial import self_tensor
from ._checks import denominator_counts, report_denominators
from .memory_state import MemoryState, check_far_params
from .ops import fused_recurrent as fused
from .ops.additive.recurrent import additive_enter_
from .ops.cache.recurrent import leave_cached
from .ops.decayed.recurrent import lane_decay, token_gamma
from .ops.delta.beta import unit
from .ops.delta.recurrent import delta_enter_, lane_beta
from .options import AttentionOptions
from .state import AttentionState

__all__ = ["RecurrentStep"]

#: Sorts after every position: a slot not in the running for "the oldest".
_NEVER = torch.iinfo(torch.long).max


class RecurrentStep:
    r"""Decode one token at a time from a state, in place (inference only; see the module's notes).

    Build it with :meth:`from_state`; call :meth:`step` per token; :meth:`state` writes the state out.

    Parameters (of :meth:`from_state`)
    ----------
    state : AttentionState or MemoryState
        What a call with ``output_final_state=True`` returned (checked here, once).
    options : AttentionOptions
        The options of that call (``normalize`` ``None`` is ``"sum"``; ``local_scale`` ``None`` is
        ``1/√D``).
    params : FarParams or None
        The far parameters of a memory state (decay, β).
    gate : Tensor ``[H]`` or None
        The gate logits as the call took them (``None``: ``g = 1/2``).
    degree : int or None
        ``p`` of ``local="poly"``.
    lift : bool
        An :class:`AttentionState` of ``non_negative=True``: its window holds ``φ`` and its far state
        sums of ``φ ⊗ φ``; the step self-tensors a key's features when it enters, and ``φ(q)``.
    non_negative : bool
        The features are known to be ``>= 0`` (a non-negative map, e.g. :attr:`FeatureMap.non_negative`
        or rank-1 LLoPS of equal factors): the normalised read's denominators cannot be ``<= 0`` and
        are not checked per token (the reference checks them every call).

    Notes
    -----
    :meth:`step` takes ``q, k [B, H, 1, D]``, ``v [B, H, 1, Dv]`` and the features ``phi_q, phi_k
    [B, H, 1, F]`` as the reference call's far part takes them (a memory state's: already
    self-tensored where the layer says so), all real tokens (a padded token takes the reference
    path), and returns ``o [B, H, 1, Dv]``. Buffers, with ``BH = B·H`` and ``N = s + w + K`` held keys:
    ``Kt [BH, D, N]`` (the keys as columns: the logits are one ``[1, D]·[D, N]`` product per head),
    ``Phi [BH, N, F]``, ``VS [BH, N + M, Dv + 1]``, the read's row ``W [BH, 1, N + M]`` and the
    logits' bias ``[BH, 1, N]``. Cost per token ``O(H·((s + w + K)·(D + Dv) + M·Dv))``, the same
    at every context length.
    """

    def __init__(self):  # use from_state
        raise TypeError("build a RecurrentStep with RecurrentStep.from_state(state, options=...)")

    # ------------------------------------------------------------------------------------------ layout
    @classmethod
    @torch.no_grad()
    def from_state(cls, state, *, options: AttentionOptions, params=None, gate=None, degree=None,
                   lift: bool = False, non_negative: bool = False) -> RecurrentStep:
        from .memory_state import check_memory_state
        from .state import check_state

        if not isinstance(options, AttentionOptions):
            raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
        if not options.causal:
            raise ValueError("a decoding step needs options.causal=True")
        memory = isinstance(state, MemoryState)
        if not memory and not isinstance(state, AttentionState):
            raise TypeError(f"state must be an AttentionState or a MemoryState, got {type(state).__name__}")
        if memory != options.memory:
            raise ValueError(f"a {type(state).__name__} for options with memory={options.memory}: was the state made "
                             "by a call with other options?")
        if lift and memory:
            raise ValueError("lift=True is for an AttentionState (a MemoryState's features are already self-tensored)")
        self = object.__new__(cls)
        o, S = options, state.S
        B, H, M2, Dv = S.shape
        w, s, K = o.window, o.sinks, o.cache
        F = state.phi_window.shape[-1]
        D = state.k_window.shape[-1] if w else 0
        work, dev = S.dtype, S.device
        if memory:
            state = check_memory_state(state, batch=B, heads=H, num_features=M2, dim=D if w else None, dim_v=Dv,
                                       window=w, sinks=s, cache=K, like=S, dtype=work)
        else:
            state = check_state(state, batch=B, heads=H, num_features=M2, dim=D if w else None, dim_v=Dv,
                                feature_dim=F, window=w, sinks=s, like=S, dtype=work)
            if (F * F if lift else F) != M2:
                raise ValueError(f"the state's window features ({F}) and far state ({M2}) do not match lift={lift}")
        self.o, self.memory, self.lift, self.degree = o, memory, bool(lift), degree
        self.delta, self.normalize = o.state == "delta", o.normalize or "sum"
        # a normalised read of features not known to be >= 0: its denominators are checked as the reference does
        self.check_den = (self.normalize == "sum" and o.denominator_check != "off" and not self.delta
                          and not (lift or non_negative))
        self.B, self.H, self.D, self.Dv, self.F, self.M2, self.w, self.s, self.K = B, H, D, Dv, F, M2, w, s, K
        self.scale = (D ** -0.5 if D else 1.0) if o.local_scale is None else o.local_scale
        self.offset, self.work = state.offset, work
        N, BH = s + w + K, B * H
        self.N, self.BH = N, BH
        kw = dict(dtype=work, device=dev)
        heads = lambda x: x.reshape(BH, *x.shape[2:])  # noqa: E731  [B, H, ...] -> [BH, ...]
        per_row = lambda m: m[:, None].expand(B, H, m.shape[-1]).reshape(BH, -1)  # noqa: E731  [B, L] -> [BH, L]
        self.Kt = torch.zeros(BH, D, N, **kw)  # the held keys as columns
        self.Phi = torch.zeros(BH, N, F, **kw)  # their features (the sinks': unused)
        self.VS = torch.zeros(BH, N + M2, Dv + 1, **kw)  # [v | 1] per held key, then [S | z]
        self.VS[:, :N, Dv] = 1.0
        self.Sz, self.S, self.V = self.VS[:, N:], self.VS[:, N:, :Dv], self.VS[:, :N, :Dv]  # views
        self.W = torch.zeros(BH, 1, N + M2, **kw)  # the read's row [g·a | (1 − g)·φ(q)]
        self.Wa, self.Wf = self.W[..., :N], self.W[..., N:]
        self.v1 = torch.ones(BH, 1, Dv + 1, **kw)  # pure linear attention: the token's [v | 1]
        self.ok = torch.zeros(BH, 1, N, dtype=torch.bool, device=dev)  # the rows that are exact keys now
        self.real = torch.ones(BH, N, dtype=torch.bool, device=dev)  # rows of real tokens (pads: False)
        P = state.offset
        Ls, Lw = state.k_sink.shape[2], state.k_window.shape[2]
        self.masked = state.mask_window is not None or state.mask_sink is not None  # masks to write out
        ms = torch.ones(B, Ls, dtype=torch.bool, device=dev) if state.mask_sink is None else state.mask_sink
        mw = torch.ones(B, Lw, dtype=torch.bool, device=dev) if state.mask_window is None else state.mask_window
        if Ls:
            self.Kt[:, :, :Ls], self.VS[:, :Ls, :Dv] = heads(state.k_sink).mT, heads(state.v_sink)
            self.ok[:, 0, :Ls] = per_row(ms)
        if Lw:
            rows = self.window_rows(P - Lw, P)
            self.Kt[:, :, rows], self.Phi[:, rows] = heads(state.k_window).mT, heads(state.phi_window)
            self.VS[:, rows, :Dv] = heads(state.v_window)
            self.real[:, rows] = per_row(mw)
            self.ok[:, 0, rows] = per_row(mw & (torch.arange(P - Lw, P, device=dev) >= s))
        if memory:
            c = slice(s + w, N)
            self.Kt[:, :, c], self.Phi[:, c], self.VS[:, c, :Dv] = (heads(state.k_cache).mT, heads(state.phi_cache),
                                                                     heads(state.v_cache))
            self.ok[:, 0, c] = heads(state.cached)
            own = dict(copy=True, memory_format=torch.contiguous_format)  # buffers of its own, written in place
            self.score64, self.cached, self.pos_cache = (heads(state.score_cache).to(torch.float64, **own),
                                                         heads(state.cached).to(**own), heads(state.pos_cache).to(**own))
            self.cache_full = bool(state.cached.all())
            self.slots = torch.arange(s + w, N, device=dev)  # the cache's rows
            self.K_, self.never = torch.tensor(K, device=dev), torch.tensor(_NEVER, device=dev)
        self.S.copy_(heads(S))
        if not self.delta:
            self.VS[:, N:, Dv] = heads(state.z)
        # window rows that are not (all) exact keys of real tokens: filled as tokens come
        self.holes = {int(r) + s for r in (~self.ok[:, 0, s:s + w].all(0)).nonzero().flatten()}
        self.bias = torch.zeros(BH, 1, N, **kw)
        self._masks_changed()
        self.gate, self.params, self._version = gate, params, None
        # the compiled step (ops/fused_recurrent.py) for CPU buffers of float32/float64; elsewhere the torch twin
        self.fused = dev.type == "cpu" and work in (torch.float32, torch.float64)
        self._parameters()
        return self

    def window_rows(self, a: int, b: int) -> list[int]:
        """The rows of positions ``a … b − 1`` in the window's ring."""
        return [self.s + p % self.w for p in range(a, b)]

    def _masks_changed(self) -> None:
        """The logits' bias from :attr:`ok`: ``0`` on an exact key, ``−∞`` elsewhere (poly: a 0/1 weight)."""
        self.bias.copy_(self.ok)
        if self.o.local == "softmax":
            self.bias.log_()  # log 1 = 0, log 0 = −∞

    # ------------------------------------------------------------------------------------------ parameters
    def _parameters(self) -> None:
        """The far parameters' derived values (``log g``, ``1 − g``, γ's and β's), computed and checked once
        per parameter version: the tensors' identity and in-place ``_version`` (an optimiser's step bumps it)."""
        p = self.params
        ts = [self.gate] + (list(p._parameters.values()) if p is not None else [])  # (no Module.__getattr__)
        try:
            key = tuple((id(t), t._version) for t in ts if t is not None)
        except RuntimeError:  # inference tensors have no version: derived again every token
            key = None
        if key is not None and key == self._version:
            return
        o, work, B, H = self.o, self.work, self.B, self.H
        dev = self.VS.device
        with torch.no_grad():
            if self.memory:
                far = check_far_params(p, o, H, self.Dv, self.VS, gate=self.gate)
            else:
                far = {"gate": self.gate}
                if self.gate is not None and not bool(torch.isfinite(self.gate).all()):
                    raise ValueError("the gate logits hold a value that is not finite")
            rows = lambda x: x.detach().to(work).repeat(B, *([1] * (x.ndim - 1)))  # noqa: E731  [H, ·] -> [BH, ·]
            g = torch.full((H,), 0.5, dtype=work, device=dev) if far["gate"] is None else torch.sigmoid(
                far["gate"].detach().to(work))
            g = rows(g).view(-1, 1, 1)  # [BH, 1, 1]
            self.g, self.log_g, self.one_g = g, g.log(), 1 - g
            self.decay = lane_decay(o.decay, far, rows, self.BH, work, dev) if self.memory else None
            if self.delta:
                self.beta = lane_beta(far, rows)
            self.lane, self.flags = fused.lane_params(self)  # the same values packed for the compiled step
        self._version = key

    # ------------------------------------------------------------------------------------------ the step
    def _enter(self, f: torch.Tensor, v1: torch.Tensor, real: torch.Tensor | None) -> None:
        """Add keys (features ``f [BH, 1, F]``, ``v1 = [v | 1] [BH, 1, Dv + 1]``; ``real [BH, 1, 1]`` or None
        for all) to the far state in place, by the mechanism's write: the delta rule's
        (:func:`~sketchlab.attention.ops.delta.recurrent.delta_enter_`) or the additive one
        (:func:`~sketchlab.attention.ops.additive.recurrent.additive_enter_`)."""
        if self.delta:
            delta_enter_(self.S, f, v1[..., :self.Dv], self.beta, real)
        else:
            additive_enter_(self.Sz, self_tensor(f) if self.lift else f, v1, real)

    @torch.inference_mode()
    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi_q: torch.Tensor,
             phi_k: torch.Tensor) -> torch.Tensor:
        """One real token at position :attr:`offset`: ``q, k [B, H, 1, D]``, ``v [B, H, 1, Dv]``, ``phi_q,
        phi_k [B, H, 1, F]`` (or each ``[B·H, 1, ·]``) → ``o`` ``[B·H, 1, Dv]`` in the inputs' dtype; the
        buffers move on by one token. Runs under ``torch.inference_mode`` (measured: 10–20 % less time per
        token than ``no_grad``), so ``o`` is an inference tensor: for use without autograd."""
        self._parameters()
        if self.fused and fused.available():  # the whole step in one compiled call
            return fused.step(self, q, k, v, phi_q, phi_k)
        in_dtype, work, BH = v.dtype, self.work, self.BH
        if in_dtype != work:
            q, k, v, phi_q, phi_k = (x.to(work) for x in (q, k, v, phi_q, phi_k))
        q, k, v, phi_q, phi_k = (x.reshape(BH, 1, x.shape[-1]) for x in (q, k, v, phi_q, phi_k))
        P, w, s, K, Dv = self.offset, self.w, self.s, self.K, self.Dv
        i = s + P % w if w else None  # the ring row of positions P and P − w
        gamma = token_gamma(self.decay, v)
        entering = leave_cached(self, P, i, gamma) if K else None  # the cache's choice reads the state before γ
        # 1. decay
        if gamma is not None:
            self.Sz.mul_(gamma)
        # 2.-3. leave and enter: the key at position P − w, if past the sinks (a cache: the key it pushed out)
        if K:
            if entering is not None:
                self._enter(*entering)
        elif P - w >= s:
            if w:
                self._enter(self.Phi[:, i:i + 1], self.VS[:, i:i + 1], self.real[:, i, None, None] if i in self.holes
                            else None)
            else:  # pure linear attention: the token itself enters
                self.v1[..., :Dv] = v
                self._enter(phi_k, self.v1, None)
        if w:  # the new token's row (its sink row too, while P < sinks)
            self.Kt.select(2, i).copy_(k.view(BH, -1))
            self.Phi.select(1, i).copy_(phi_k.view(BH, -1))
            self.V.select(1, i).copy_(v.view(BH, -1))
            if P < s:
                self.Kt.select(2, P).copy_(k.view(BH, -1))
                self.V.select(1, P).copy_(v.view(BH, -1))
                self.ok[:, 0, P] = True
            if i in self.holes or P < s:
                self.real[:, i] = True
                self.ok[:, 0, i] = P >= s
                if P >= s:
                    self.holes.discard(i)
                self._masks_changed()
        self.offset = P + 1
        # 4. read
        fq = self_tensor(phi_q) if self.lift else phi_q
        if self.delta:
            fq = unit(fq)
        if not w:
            r = torch.bmm(fq, self.Sz)  # [BH, 1, Dv + 1]
            out = r[..., :Dv] if self.delta or self.normalize != "sum" else self._normalised(r)
            return out if out.dtype == in_dtype else out.to(in_dtype)
        a = self.Wa
        poly = self.o.local == "poly"
        logits = torch.baddbmm(self.bias, q, self.Kt, beta=0.0 if poly else 1.0, alpha=self.scale)  # [BH, 1, N]
        if poly:
            torch.mul(logits.pow_(self.degree), self.bias, out=a)
            a.mul_(self.g / a.sum(-1, keepdim=True) if self.delta else self.g)
        elif self.delta:
            torch.exp(logits.sub_(logits.amax(-1, keepdim=True)), out=a)
            a.mul_(self.g / a.sum(-1, keepdim=True))
        else:
            torch.exp(logits.sub_(logits.amax(-1, keepdim=True) - self.log_g), out=a)  # g·e^{l − c}
        torch.mul(fq, self.one_g, out=self.Wf)
        # [BH, 1, Dv + 1]: [Σ g·a·v + (1 − g)·Sᵀφ(q) | Σ g·a + (1 − g)·zᵀφ(q)]
        r = torch.bmm(self.W, self.VS)
        out = r[..., :Dv] if self.delta else self._normalised(r)
        return out if out.dtype == in_dtype else out.to(in_dtype)

    def _normalised(self, r: torch.Tensor) -> torch.Tensor:
        """``r = [n | d]`` ``[BH, 1, Dv + 1]`` → ``n / (d + ε)``; denominators ``<= 0`` reported as the reference
        does, unless the features are known non-negative (then they cannot occur)."""
        Dv = self.Dv
        if self.check_den:
            den = r[..., Dv:]
            if bool((den <= 0).any()):
                report_denominators(denominator_counts(den), self.BH, "linear_attention",
                                    self.o.denominator_check)
        return r[..., :Dv] / r[..., Dv:].add(self.o.eps)

    def _cache_filled(self) -> None:
        """The exact keys' mask after slots were taken (only while the cache is not yet full)."""
        if not self.cache_full:
            self.ok[:, 0, self.s + self.w:] = self.cached
            self.cache_full = bool(self.cached.all())
            self._masks_changed()

    # ------------------------------------------------------------------------------------------ out
    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (constant in the context length)."""
        extra = (self.score64, self.cached, self.pos_cache) if self.memory else ()
        return sum(x.numel() * x.element_size() for x in (self.Kt, self.Phi, self.VS, self.W, self.v1, self.ok,
                                                          self.real, self.bias, *extra))

    def state(self):
        """The state after the tokens so far, as the reference call returns it (new tensors, ``[B, H, ·, ·]``)."""
        P, w, s, Dv, N, B, H = self.offset, self.w, self.s, self.Dv, self.N, self.B, self.H
        Ls, Lw = min(s, P), min(w, P)
        rows = self.window_rows(P - Lw, P) if w else []
        bh = lambda x: x.reshape(B, H, *x.shape[1:]).clone()  # noqa: E731  [BH, ...] -> [B, H, ...]
        keys = self.Kt.mT  # [BH, N, D]
        fields = dict(S=bh(self.S), z=bh(torch.zeros_like(self.Sz[..., Dv]) if self.delta else self.Sz[..., Dv]),
                      k_window=bh(keys[:, rows]), v_window=bh(self.VS[:, rows, :Dv]), phi_window=bh(self.Phi[:, rows]),
                      k_sink=bh(keys[:, :Ls]), v_sink=bh(self.VS[:, :Ls, :Dv]), offset=P)
        m_win, m_snk = self.real.view(B, H, N)[:, 0, rows], self.ok.view(B, H, N)[:, 0, :Ls]
        if not self.memory:
            return AttentionState(**fields, mask_window=m_win.clone() if self.masked else None,
                                  mask_sink=m_snk.clone() if self.masked else None)
        c = slice(s + w, N)
        return MemoryState(**fields, mask_window=m_win.clone(), mask_sink=m_snk.clone(), k_cache=bh(keys[:, c]),
                           v_cache=bh(self.VS[:, c, :Dv]), phi_cache=bh(self.Phi[:, c]),
                           score_cache=bh(self.score64).to(self.work),
                           cached=bh(self.cached), pos_cache=bh(self.pos_cache))
