r"""The lean decoding step of every mechanism (DESIGN §6, §7): one token at a time, in place.

:class:`RecurrentStep` continues an :class:`~sketchlab.attention.AttentionState` (the additive
hybrid, or pure linear attention) or a :class:`~sketchlab.attention.MemoryState` (decayed state,
delta rule and gated delta rule, sparse exact cache; each with the window and the sinks) one token
per :meth:`RecurrentStep.step`, for inference (no gradient). It computes what one
``llops_attention``/``featuremap_attention``/``memory_attention`` call on one token with
``initial_state`` computes (the reference step: :func:`sketchlab.attention.memory_decode.decode` and
:func:`sketchlab.attention.hybrid_chunked._hybrid_decode_one`, which keep autograd and return a new
state object per token; the tests hold the two equal in float64), but:

* **checks once**: the state's fields when it is laid out (:meth:`RecurrentStep.from_state`), the
  far parameters (gate, decay, β) once per parameter version (their identity and in-place
  ``_version``: a training step between two tokens is seen, and the parameters checked again);
  nothing is checked per token;
* **preallocated, in place**: every held key is one row of one buffer — ``KF [B, H, N, D + F]``
  (``[k | φ]``) and ``VS [B, H, N + M, Dv + 1]`` (``[v | 1]`` per key, then the far state
  ``[S | z]``) with ``N = sinks + window + cache`` rows: the sinks, the window as a **ring**
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
  key's ``φ`` is kept in its row until it enters the far state.

:meth:`RecurrentStep.state` writes the state back out (the window in position order), so a
decoding loop can hand it to any path again. The naive float64 twin of the whole step is
:func:`sketchlab.attention.memory.memory_attention_naive` (and, for the additive hybrid,
:func:`sketchlab.attention.reference.feature_attention_naive`).
"""

from __future__ import annotations

import math

import torch

from ._checks import report_denominators
from .memory_state import MemoryState, _check_params, unit
from .options import AttentionOptions
from .reference import self_tensor
from .state import AttentionState

__all__ = ["RecurrentStep"]

#: Sorts after every position: a slot not in the running for "the oldest".
_NEVER = torch.iinfo(torch.long).max


def recall_score(S64: torch.Tensor, scale: torch.Tensor | None, phi: torch.Tensor, v: torch.Tensor, *, delta: bool,
                 eps: float) -> torch.Tensor:
    r"""The cache's score :math:`\lVert v - r\rVert^2` of keys (``phi [B, H, n, M]``, ``v [B, H, n, Dv]``)
    against the float64 far state ``scale·S64`` (``S64 [B, H, M, Dv (+ 1)]``: ``S``, with ``z`` as one
    more column when additive; ``scale [B, H, 1, 1]`` or None for 1), as the schedule computes it: one
    product for the read and its denominator, then the scale; additive :math:`r = S^\top\phi/(z\cdot\phi
    + \varepsilon)` (0 where that denominator is 0), delta :math:`r = S^\top\hat k` → ``[B, H, n]`` float64."""
    r = (unit(phi) if delta else phi).double() @ S64  # [B, H, n, Dv (+ 1)]
    if scale is not None:
        r = r * scale
    if not delta:
        den = r[..., -1:] + eps
        r = r[..., :-1] / den.masked_fill_(den == 0, 1.0)
    return (v.double() - r).square().sum(-1)


class RecurrentStep:
    r"""Decode one token at a time from a state, in place (inference only; see the module's notes).

    Build it with :meth:`from_state`; call :meth:`step` per token; :meth:`state` writes the state out.

    Parameters (of :meth:`from_state`)
    ----------
    state : AttentionState or MemoryState
        What a call with ``output_final_state=True`` returned (checked here, once).
    options : AttentionOptions
        The options of that call (``normalize`` resolved: ``None`` is ``"sum"``; ``local_scale``
        ``None`` is ``1/√D``).
    params : FarParams or None
        The far parameters of a memory state (decay, β); ``gate``: the gate logits ``[H]`` (or None:
        ``g = 1/2``), as the call took them.
    degree : int or None
        ``p`` of ``local="poly"``.
    lift : bool
        An :class:`AttentionState` with ``non_negative=True``: its window holds ``φ`` and its far
        state ``φ ⊗ φ`` sums; the step self-tensors a key's features when it enters, and ``φ(q)``.

    Notes
    -----
    :meth:`step` takes ``q, k [B, H, 1, D]``, ``v [B, H, 1, Dv]`` and the features ``phi_q, phi_k
    [B, H, 1, F]`` as the reference call's far part uses them (a memory state: already self-tensored
    when the layer says so), all real tokens (a padded token takes the reference path), and returns
    ``o [B, H, 1, Dv]``. Cost per token ``O(H·((s + w + K)·(D + Dv) + M·Dv))``, the same at every
    context length; the buffers are ``O(H·((s + w + K)·(D + Dv + F) + M·Dv))``.
    """

    def __init__(self):  # use from_state
        raise TypeError("build a RecurrentStep with RecurrentStep.from_state(state, options=...)")

    # ------------------------------------------------------------------------------------------ layout
    @classmethod
    @torch.no_grad()
    def from_state(cls, state, *, options: AttentionOptions, params=None, gate=None, degree=None,
                   lift: bool = False) -> "RecurrentStep":
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
        from .memory_state import check_memory_state
        from .state import check_state

        if memory:
            state = check_memory_state(state, batch=B, heads=H, num_features=M2, dim=D if w else None, dim_v=Dv,
                                       window=w, sinks=s, cache=K, like=S, dtype=work)
        else:
            state = check_state(state, batch=B, heads=H, num_features=M2, dim=D if w else None, dim_v=Dv,
                                feature_dim=F, window=w, sinks=s, like=S, dtype=work)
            if (F * F if lift else F) != M2:
                raise ValueError(f"the state's window features ({F}) and far state ({M2}) do not match lift={lift}")
        self.o, self.memory, self.lift, self.degree = o, memory, bool(lift), degree
        self.delta = o.state == "delta"
        self.normalize = o.normalize or "sum"
        self.B, self.H, self.D, self.Dv, self.F, self.M2, self.w, self.s, self.K = B, H, D, Dv, F, M2, w, s, K
        self.scale = (D ** -0.5 if D else 1.0) if o.local_scale is None else o.local_scale
        self.offset, self.work = state.offset, work
        N = s + w + K
        self.N = N
        kw = dict(dtype=work, device=dev)
        self.KF = torch.zeros(B, H, N, D + F, **kw)  # [k | φ] per held key
        self.VS = torch.zeros(B, H, N + M2, Dv + 1, **kw)  # [v | 1] per held key, then [S | z]
        self.VS[:, :, :N, Dv] = 1.0
        self.W = torch.zeros(B, H, 1, N + M2, **kw)  # the read's row [g·a | (1 − g)·φ(q)]
        self.v1 = torch.ones(B, H, 1, Dv + 1, **kw)  # pure linear attention: the token's [v | 1]
        self.ok = torch.zeros(B, H, 1, N, dtype=torch.bool, device=dev)  # the rows that are exact keys now
        self.real = torch.ones(B, H, N, dtype=torch.bool, device=dev)  # rows of real tokens (pads: False)
        P = state.offset
        Ls, Lw = state.k_sink.shape[2], state.k_window.shape[2]
        ms = state.mask_sink if state.mask_sink is not None else torch.ones(B, Ls, dtype=torch.bool, device=dev)
        mw = state.mask_window if state.mask_window is not None else torch.ones(B, Lw, dtype=torch.bool, device=dev)
        self.masked = state.mask_window is not None or state.mask_sink is not None  # export masks (AttentionState)
        self.KF[:, :, :Ls, :D], self.VS[:, :, :Ls, :Dv] = state.k_sink, state.v_sink
        self.ok[:, :, 0, :Ls] = ms[:, None]
        if Lw:
            rows = self.window_rows(P - Lw, P)
            self.KF[:, :, rows, :D], self.KF[:, :, rows, D:] = state.k_window, state.phi_window
            self.VS[:, :, rows, :Dv] = state.v_window
            self.real[:, :, rows] = mw[:, None]
            self.ok[:, :, 0, rows] = (mw & (torch.arange(P - Lw, P, device=dev) >= s))[:, None]
        if memory:
            c = slice(s + w, N)
            self.KF[:, :, c, :D], self.KF[:, :, c, D:], self.VS[:, :, c, :Dv] = (state.k_cache, state.phi_cache,
                                                                                 state.v_cache)
            self.ok[:, :, 0, c] = state.cached
            self.score, self.cached, self.pos_cache = (state.score_cache.clone(), state.cached.clone(),
                                                       state.pos_cache.clone())
            self.cache_full = bool(state.cached.all())
        self.VS[:, :, N:, :Dv] = S
        if not self.delta:
            self.VS[:, :, N:, Dv] = state.z
        self.holes = {int(i) for i in (~self.ok[:, :, 0, s:s + w].all(1).all(0)).nonzero().flatten() + s}
        self.bias = torch.zeros(B, H, 1, N, **kw)
        self._masks_changed()
        self.gate, self.params, self._version = gate, params, None
        self._parameters()
        return self

    def window_rows(self, a: int, b: int) -> list[int]:
        """The rows of positions ``a … b − 1`` in the window's ring."""
        return [self.s + p % self.w for p in range(a, b)]

    def _masks_changed(self) -> None:
        """The logits' bias from :attr:`ok` (``0`` on an exact key, ``−∞`` elsewhere; poly: a 0/1 weight)."""
        if self.o.local == "softmax":
            self.bias.copy_(self.ok).log_()  # log 1 = 0, log 0 = −∞
        else:
            self.bias.copy_(self.ok)

    # ------------------------------------------------------------------------------------------ parameters
    def _tensors(self) -> list:
        p = self.params
        return [self.gate] + ([getattr(p, n) for n in ("decay_bias", "decay_weight", "beta_bias", "beta_weight")]
                              if p is not None else [])

    def _parameters(self) -> None:
        """The far parameters' derived values (``log g``, ``1 − g``, ``log γ`` or its bias and weights, β's),
        computed and checked once per parameter version (the tensors' identity and ``_version``)."""
        ts = self._tensors()
        key = tuple((id(t), getattr(t, "_version", None)) for t in ts if t is not None)
        if key == self._version and all(k[1] is not None for k in key):
            return
        o, work, H = self.o, self.work, self.H
        with torch.no_grad():
            if self.memory:
                far = _check_params(self.params, o, H, self.Dv, self.VS, gate=self.gate)
            else:
                far = {"gate": self.gate}
                if self.gate is not None and not bool(torch.isfinite(self.gate).all()):
                    raise ValueError("the gate logits hold a value that is not finite")
            far = {n: (None if x is None else x.detach().to(work)) for n, x in far.items()}
            g = torch.full((H,), 0.5, dtype=work, device=self.VS.device) if far["gate"] is None else torch.sigmoid(
                far["gate"])
            self.log_g, self.one_g = g.log().view(1, H, 1, 1), (1 - g).view(1, H, 1, 1)
            self.g = g.view(1, H, 1, 1)
            self.decay = None  # log γ [1, H, 1, 1] (fixed, per head), or ("input", bias [1, H], weight [H, Dv])
            if self.memory and o.decay is not None and o.decay != 1.0:
                if o.decay == "head":
                    self.decay = torch.nn.functional.logsigmoid(far["decay_bias"]).view(1, H, 1, 1)
                elif o.decay == "input":
                    self.decay = ("input", far["decay_bias"].view(1, H), far["decay_weight"])
                else:
                    self.decay = torch.full((1, H, 1, 1), math.log(o.decay), dtype=work, device=self.VS.device)
            if self.delta:
                self.beta = (far["beta_bias"].view(1, H), far["beta_weight"])
        self._version = key

    # ------------------------------------------------------------------------------------------ the step
    def _gamma(self, v: torch.Tensor) -> torch.Tensor | None:
        """``γ [B, H, 1, 1]`` of the token with value ``v [B, H, 1, Dv]`` (None: no decay)."""
        d = self.decay
        if d is None:
            return None
        if isinstance(d, tuple):  # σ(b + w·v), as exp(log σ) like the reference
            _, bias, weight = d
            return torch.nn.functional.logsigmoid(bias + (v[:, :, 0] * weight).sum(-1)).exp()[..., None, None]
        return d.exp()

    def _enter(self, kf: torch.Tensor, v1: torch.Tensor, real: torch.Tensor | None) -> None:
        """Add keys (rows ``kf [B, H, 1, D + F]``, ``v1 = [v | 1] [B, H, 1, Dv + 1]``; ``real [B, H, 1]`` or
        None for all) to the far state in place: additive ``[S | z] += φ [v | 1]``; delta
        ``S += β k̂ (v − k̂ᵀS)ᵀ``."""
        D, Dv, N = self.D, self.Dv, self.N
        f = kf[..., D:]
        Sz = self.VS[:, :, N:]
        if self.delta:
            kh, ve = unit(f), v1[..., :Dv]
            bias, weight = self.beta
            x = bias[..., None, None] if weight is None else (bias + (ve[:, :, 0] * weight).sum(-1))[..., None, None]
            beta = torch.sigmoid(x)  # [B|1, H, 1, 1]
            if real is not None:
                beta = beta * real[..., None]
            S = Sz[..., :Dv]
            S.addcmul_(kh.mT * beta, ve - kh @ S)
        else:
            if self.lift:
                f = self_tensor(f)
            if real is not None:
                f = f * real[..., None]
            Sz.addcmul_(f.mT, v1)

    @torch.no_grad()
    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, phi_q: torch.Tensor,
             phi_k: torch.Tensor) -> torch.Tensor:
        """One real token at position :attr:`offset`: ``q, k [B, H, 1, D]``, ``v [B, H, 1, Dv]``, ``phi_q,
        phi_k [B, H, 1, F]`` → ``o [B, H, 1, Dv]`` (the inputs' dtype); the buffers move on by one token."""
        self._parameters()
        in_dtype, work = v.dtype, self.work
        if in_dtype != work:
            q, k, v, phi_q, phi_k = (x.to(work) for x in (q, k, v, phi_q, phi_k))
        P, w, s, K, D, Dv, N = self.offset, self.w, self.s, self.K, self.D, self.Dv, self.N
        KF, VS, W = self.KF, self.VS, self.W
        Sz = VS[:, :, N:]
        # 1. decay (a cache's scores read the state before it, times γ)
        gamma = self._gamma(v)
        S0 = Sz.clone() if K and gamma is not None else Sz
        if gamma is not None:
            Sz.mul_(gamma)
        # 2. leave: the key at position j = P − w (ring row i, where the new token goes), if it is past the sinks
        i = s + P % w if w else None
        j = P - w
        if K:
            self._leave_cached(P, i, j, S0, gamma)
        elif j >= s:
            if w:
                self._enter(KF[:, :, i:i + 1], VS[:, :, i:i + 1], self.real[:, :, i:i + 1] if i in self.holes else None)
            else:  # pure linear attention: the token itself enters
                self.v1[..., :Dv] = v
                self._enter(phi_k, self.v1, None)
        # the new token's row (its sink row too, while P < sinks)
        if w:
            KF[:, :, i, :D], KF[:, :, i, D:], VS[:, :, i, :Dv] = k[:, :, 0], phi_k[:, :, 0], v[:, :, 0]
            if P < s:
                KF[:, :, P, :D], VS[:, :, P, :Dv] = k[:, :, 0], v[:, :, 0]
                self.ok[:, :, 0, P] = True
            if i in self.holes or P < s:
                self.real[:, :, i] = True
                self.ok[:, :, 0, i] = P >= s
                if P >= s:
                    self.holes.discard(i)
                self._masks_changed()
        self.offset = P + 1
        # 4. read
        fq = self_tensor(phi_q) if self.lift else phi_q
        if not w:
            if self.delta:
                return (unit(fq) @ Sz[..., :Dv]).to(in_dtype)
            r = fq @ Sz  # [B, H, 1, Dv + 1]
            if self.normalize != "sum":
                return r[..., :Dv].to(in_dtype)
            return self._normalised(r).to(in_dtype)
        B, H = self.B, self.H
        logits = torch.baddbmm(self.bias.view(B * H, 1, N), q.reshape(B * H, 1, D),
                               KF.view(B * H, N, -1)[..., :D].mT, beta=0.0 if self.o.local == "poly" else 1.0,
                               alpha=self.scale).view(B, H, 1, N)
        a = W[..., :N]
        if self.o.local == "softmax":
            c = logits.amax(-1, keepdim=True)
            if self.delta:
                torch.exp(logits.sub_(c), out=a)
                a.mul_(self.g / a.sum(-1, keepdim=True))
            else:
                torch.exp(logits.sub_(c - self.log_g), out=a)  # g·e^{l − c}
        else:
            torch.mul(logits.pow_(self.degree), self.bias, out=a)
            a.mul_(self.g / a.sum(-1, keepdim=True) if self.delta else self.g)
        torch.mul(unit(fq) if self.delta else fq, self.one_g, out=W[..., N:])
        r = W @ VS  # [B, H, 1, Dv + 1]: [Σ g·a·v + (1 − g)·Sᵀφ(q) | Σ g·a + (1 − g)·zᵀφ(q)]
        return (r[..., :Dv] if self.delta else self._normalised(r)).to(in_dtype)

    def _normalised(self, r: torch.Tensor) -> torch.Tensor:
        """``r [..., Dv + 1]`` = ``[n | d]`` → ``n / (d + ε)`` (the denominators checked as the reference does)."""
        den = r[..., self.Dv:]
        o = self.o
        if self.normalize == "sum" and o.denominator_check != "off" and bool((den <= 0).any()):
            report_denominators(int((den <= 0).sum()), self.B * self.H,
                                "memory_attention" if self.memory else "llops_attention", o.denominator_check)
        return r[..., :self.Dv] / (den + o.eps)

    def _leave_cached(self, P: int, i: int, j: int, S0: torch.Tensor, gamma) -> None:
        """Step 2 with a cache (DESIGN §7): re-score the cache every ``rescore`` positions; the key leaving the
        window (row ``i``, position ``j``) is scored; it takes the least-scored slot (ties: the oldest; an empty
        slot first) unless it scores below all of them; the key so pushed out (or itself) enters the state."""
        w, s, K, D, Dv, N = self.w, self.s, self.K, self.D, self.Dv, self.N
        KF, VS = self.KF, self.VS
        leaves = j >= s and P >= w
        rescore = P % self.o.rescore == 0
        if not (leaves or rescore):
            return
        B, H = self.B, self.H
        c0 = s + w
        S64 = (S0[..., :Dv] if self.delta else S0).double()
        scale = None if gamma is None else gamma.double()
        score64 = self.score.double()
        if rescore and bool(self.cached.any()):
            score64 = torch.where(self.cached, recall_score(S64, scale, KF[:, :, c0:, D:], VS[:, :, c0:N, :Dv],
                                                            delta=self.delta, eps=self.o.eps), score64)
        if not leaves:
            self.score.copy_(score64)
            return
        cand = self.real[:, :, i:i + 1]  # [B, H, 1]
        sj = recall_score(S64, scale, KF[:, :, i:i + 1, D:], VS[:, :, i:i + 1, :Dv], delta=self.delta, eps=self.o.eps)
        ranked = torch.where(self.cached, score64, float("-inf"))
        least = ranked.amin(-1, keepdim=True)  # [B, H, 1]
        target = torch.where(sj < least, K, torch.where(ranked == least, self.pos_cache, _NEVER).argmin(-1, keepdim=True))
        place = cand & (target < K)
        enters = cand & (least > float("-inf"))
        at = torch.where(place, target + c0, i)  # [B, H, 1]: the row that enters the state (and takes the candidate)
        put = torch.arange(c0, N, device=at.device) == at  # [B, H, K]
        er_kf = KF.gather(2, at[..., None].expand(B, H, 1, KF.shape[3]))  # [B, H, 1, D + F] (copies)
        er_v = VS.gather(2, at[..., None].expand(B, H, 1, Dv + 1))  # [B, H, 1, Dv + 1]
        KF.scatter_(2, at[..., None].expand(B, H, 1, KF.shape[3]), KF[:, :, i:i + 1].clone())
        VS[:, :, :N].scatter_(2, at[..., None].expand(B, H, 1, Dv + 1), VS[:, :, i:i + 1].clone())
        self.score.copy_(torch.where(put, sj, score64))
        self.pos_cache.masked_fill_(put, j)
        self.cached |= put
        self._enter(er_kf, er_v, enters)
        if not self.cache_full:
            self.ok[:, :, 0, c0:] = self.cached
            self.cache_full = bool(self.cached.all())
            self._masks_changed()

    # ------------------------------------------------------------------------------------------ out
    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (constant in the context length)."""
        extra = (self.score, self.cached, self.pos_cache) if self.memory else ()
        return sum(x.numel() * x.element_size() for x in (self.KF, self.VS, self.W, self.ok, self.real, self.bias,
                                                          *extra))

    def state(self):
        """The state after the tokens so far, as the reference call returns it (new tensors)."""
        P, w, s, K, D, Dv, N = self.offset, self.w, self.s, self.K, self.D, self.Dv, self.N
        B, H = self.B, self.H
        Ls, Lw = min(s, P), min(w, P)
        rows = self.window_rows(P - Lw, P) if w else []
        KF, VS = self.KF, self.VS
        win_kf, win_v = KF[:, :, rows], VS[:, :, rows, :Dv]
        m_win = self.real[:, 0, rows] if rows else self.real.new_zeros(B, 0)
        m_snk = self.ok[:, 0, 0, :Ls]
        Sz = VS[:, :, N:]
        S = Sz[..., :Dv].clone()
        z = torch.zeros_like(Sz[..., Dv]) if self.delta else Sz[..., Dv].clone()
        fields = dict(S=S, z=z, k_window=win_kf[..., :D], v_window=win_v, phi_window=win_kf[..., D:],
                      k_sink=KF[:, :, :Ls, :D].clone(), v_sink=VS[:, :, :Ls, :Dv].clone(), offset=P)
        if not self.memory:
            masked = self.masked
            return AttentionState(**fields, mask_window=m_win.clone() if masked else None,
                                  mask_sink=m_snk.clone() if masked else None)
        c = slice(s + w, N)
        return MemoryState(**fields, mask_window=m_win.clone(), mask_sink=m_snk.clone(), k_cache=KF[:, :, c, :D].clone(),
                           v_cache=VS[:, :, c, :Dv].clone(), phi_cache=KF[:, :, c, D:].clone(),
                           score_cache=self.score.clone(), cached=self.cached.clone(), pos_cache=self.pos_cache.clone())
