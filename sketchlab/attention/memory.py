r"""Long-context memory for the sliding-window hybrid (DESIGN §7): a sparse exact cache of far keys,
a decaying far state, a delta-rule far state.

At each query position ``t`` (window ``w``, sinks ``s``, cache size ``K``, gate ``g = σ(gate)``):

1. *decay*: :math:`S \leftarrow \gamma_t S`, :math:`z \leftarrow \gamma_t z`;
2. *leave*: key ``j = t − w`` (a real token, ``j ≥ s``) leaves the window and is cached with the
   score :math:`e_j = \lVert v_j - r(k_j)\rVert^2` (the state's recall error for it); at
   ``t ≡ 0 (mod rescore)`` every cached key is re-scored first; with more than ``K`` cached, the
   least score (ties: the oldest) is evicted;
3. *enter*: the evicted key enters the state (additive sums, or the delta rule);
4. *read*: exact keys (window, sinks, cache) and the far state, mixed by the gate.

:func:`memory_attention_naive` is that loop, token by token over explicit key sets, in float64: the
definition. :func:`memory_attention` is the fast path (the schedule, then the far part as one
recurrence over an event stream through :mod:`sketchlab.attention.delta`, then the exact part per
query chunk; :mod:`sketchlab.attention.memory_fast`). Both carry a :class:`MemoryState`.

Layout: tokens ``[B, T, H, ·]``; the state ``[B, H, ·, ·]``. Scores and evictions are discrete
choices taken without gradient; gradients flow through every value given the choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from types import SimpleNamespace

import torch

from .._validation import check_degree, check_finite
from ._checks import check_flag, check_key_padding_mask, check_qkv, report_denominators
from .options import AttentionOptions, FarParams
from .state import state_dtype

__all__ = ["MemoryState", "check_memory_state", "empty_memory_state", "memory_attention", "memory_attention_naive"]


# ------------------------------------------------------------------------------------------------ the state
@dataclass(frozen=True)
class MemoryState:
    r"""State of memory attention after ``offset`` tokens; its size depends on ``w, s, K, M, Dv`` only.

    Attributes
    ----------
    S : Tensor ``[B, H, M, Dv]``
        The far state (additive :math:`\sum \phi(k)v^\top`, decayed; or the delta rule's).
    z : Tensor ``[B, H, M]``
        :math:`\sum \phi(k)` (decayed); zeros with the delta state.
    k_window, v_window, phi_window : Tensor ``[B, H, L_w, D | Dv | M]``
        Keys, values, features of the last ``L_w = min(w, offset)`` positions (sink positions
        among them are held here too, and counted only as sinks).
    mask_window : bool Tensor ``[B, L_w]``
        True: a real token.
    k_sink, v_sink : Tensor ``[B, H, L_s, D | Dv]``
        Positions ``0 … L_s − 1``, ``L_s = min(s, offset)``.
    mask_sink : bool Tensor ``[B, L_s]``
    k_cache, v_cache, phi_cache : Tensor ``[B, H, K, D | Dv | M]``
        The cache's slots (zeros where empty).
    score_cache : Tensor ``[B, H, K]``
        Each cached key's last score (no gradient).
    cached : bool Tensor ``[B, H, K]``
        The slot holds a key (each head fills its cache independently).
    pos_cache : int64 Tensor ``[B, H, K]``
        Each cached key's position (``-1`` where empty).
    offset : int
        Tokens seen (the position of the next token).
    """

    S: torch.Tensor
    z: torch.Tensor
    k_window: torch.Tensor
    v_window: torch.Tensor
    phi_window: torch.Tensor
    mask_window: torch.Tensor
    k_sink: torch.Tensor
    v_sink: torch.Tensor
    mask_sink: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    phi_cache: torch.Tensor
    score_cache: torch.Tensor
    cached: torch.Tensor
    pos_cache: torch.Tensor
    offset: int

    def _tensors(self):
        return [(f.name, getattr(self, f.name)) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]

    def detach(self) -> "MemoryState":
        """The same state cut from the autograd graph (truncated back-propagation, decoding)."""
        return replace(self, **{name: x.detach() for name, x in self._tensors()})

    def to(self, *args, **kwargs) -> "MemoryState":
        """``Tensor.to`` on every floating tensor; the bool and int tensors follow the device only."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        return replace(self, **{name: x.to(*args, **kwargs) if x.is_floating_point() else (
            x if device is None else x.to(device)) for name, x in self._tensors()})

    @property
    def nbytes(self) -> int:
        """Bytes held by the state's tensors (constant once ``offset ≥ max(w, s)``)."""
        return sum(x.numel() * x.element_size() for _, x in self._tensors())


def empty_memory_state(batch: int, heads: int, num_features: int, dim: int, dim_v: int, *, cache: int,
                       like: torch.Tensor, dtype: torch.dtype | None = None) -> MemoryState:
    """The state before the first token: zero ``S, z``, empty window and sinks, ``cache`` empty slots.

    ``dtype``: of every floating field (default ``state_dtype(like.dtype)``)."""
    dt = state_dtype(like.dtype) if dtype is None else dtype
    B, H, K = batch, heads, cache
    z = lambda *shape: torch.zeros(*shape, dtype=dt, device=like.device)  # noqa: E731
    no = lambda *shape: torch.zeros(*shape, dtype=torch.bool, device=like.device)  # noqa: E731
    return MemoryState(
        S=z(B, H, num_features, dim_v), z=z(B, H, num_features),
        k_window=z(B, H, 0, dim), v_window=z(B, H, 0, dim_v), phi_window=z(B, H, 0, num_features), mask_window=no(B, 0),
        k_sink=z(B, H, 0, dim), v_sink=z(B, H, 0, dim_v), mask_sink=no(B, 0),
        k_cache=z(B, H, K, dim), v_cache=z(B, H, K, dim_v), phi_cache=z(B, H, K, num_features), score_cache=z(B, H, K),
        cached=no(B, H, K), pos_cache=torch.full((B, H, K), -1, dtype=torch.long, device=like.device), offset=0)


def check_memory_state(state, *, batch: int, heads: int, num_features: int, dim: int | None, dim_v: int, window: int,
                       sinks: int, cache: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> MemoryState:
    """Validate ``initial_state`` against the call; returns it (floating fields cast to ``dtype``).

    Rules: a :class:`MemoryState`; every field's shape as the call's ``B, H, M, D, Dv`` and the
    options' ``window, sinks, cache`` give it (window ``min(w, offset)``, sinks ``min(s, offset)``,
    cache ``K``); bool masks, int64 positions; on ``like``'s device. ``dim=None``: the (empty)
    window's key width is free (``window = 0``).
    """
    if not isinstance(state, MemoryState):
        raise TypeError(f"initial_state must be a MemoryState (from output_final_state=True), got {type(state).__name__}")
    off = state.offset
    if isinstance(off, bool) or not isinstance(off, int) or off < 0:
        raise ValueError(f"initial_state.offset must be an int >= 0, got {off!r}")
    if dim is None:
        dim = state.k_window.shape[-1] if isinstance(state.k_window, torch.Tensor) and state.k_window.ndim == 4 else 0
    B, H, M, D, Dv, K = batch, heads, num_features, dim, dim_v, cache
    lw, ls = min(window, off), min(sinks, off)
    want = {"S": (B, H, M, Dv), "z": (B, H, M), "k_window": (B, H, lw, D), "v_window": (B, H, lw, Dv),
            "phi_window": (B, H, lw, M), "mask_window": (B, lw), "k_sink": (B, H, ls, D), "v_sink": (B, H, ls, Dv),
            "mask_sink": (B, ls), "k_cache": (B, H, K, D), "v_cache": (B, H, K, Dv), "phi_cache": (B, H, K, M),
            "score_cache": (B, H, K), "cached": (B, H, K), "pos_cache": (B, H, K)}
    kinds = {"mask_window": torch.bool, "mask_sink": torch.bool, "cached": torch.bool, "pos_cache": torch.long}
    for name, shape in want.items():
        x = getattr(state, name)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"initial_state.{name} must have shape {list(shape)} for this call (B={B}, H={H}, M={M}, D={D}, "
                f"Dv={Dv}, window={window}, sinks={sinks}, cache={K}, offset={off}), got {got}: was the state made "
                "by a call with other options?")
        if name in kinds and x.dtype != kinds[name]:
            raise TypeError(f"initial_state.{name} must be {kinds[name]}, got {x.dtype}")
        if name not in kinds and not x.is_floating_point():
            raise TypeError(f"initial_state.{name} must be a floating tensor, got {x.dtype}")
        if x.device != like.device:
            raise ValueError(f"initial_state.{name} is on {x.device}, the inputs on {like.device}")
    if dtype is not None and any(getattr(state, n).dtype != dtype for n in want if n not in kinds):
        state = state.to(dtype)
    return state


# ------------------------------------------------------------------------------------------------ checks
_PARAMS = ("gate", "decay_bias", "decay_weight", "beta_bias", "beta_weight")


def _needs(options: AttentionOptions) -> dict:
    """Which FarParams tensors the options use: name → True (needed), False (unused), None (optional)."""
    delta = options.state == "delta"
    return {"gate": None if options.window else False, "decay_bias": options.learned_decay,
            "decay_weight": options.decay == "input", "beta_bias": delta, "beta_weight": delta and options.beta == "input"}


def _check_params(params, options: AttentionOptions, heads: int, dim_v: int, like: torch.Tensor) -> dict:
    """The FarParams tensors as a dict (None where absent), checked against the options."""
    if params is not None and not isinstance(params, FarParams):
        raise TypeError(f"params must be a FarParams (or None), got {type(params).__name__}")
    out = {}
    for name, need in _needs(options).items():
        x = getattr(params, name, None) if params is not None else None
        if x is None:
            if need:
                why = f"decay={options.decay!r}" if name.startswith("decay") else f"state='delta', beta={options.beta!r}"
                raise ValueError(f"params.{name} is needed by {why}, got " + ("params=None" if params is None else
                                 "None") + ": build the params with FarParams(options, heads, dim_v)")
        elif need is False:
            raise ValueError(f"params.{name} is set but these options do not use it (window={options.window}, "
                             f"decay={options.decay!r}, state={options.state!r}, beta={options.beta!r}): were the "
                             "params built for other options?")
        else:
            shape = (heads, dim_v) if name.endswith("weight") else (heads,)
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or tuple(x.shape) != shape:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"params.{name} must be a floating tensor of shape {list(shape)} (H={heads}, "
                                 f"Dv={dim_v}), got {got}")
            if x.device != like.device:
                raise ValueError(f"params.{name} must be on the device of the inputs ({like.device}), got {x.device}")
            with torch.no_grad():
                check_finite(x.detach(), f"params.{name}")
        out[name] = x
    return out


def _check_call(phi_q, phi_k, v, q, k, options, params, degree, key_padding_mask, initial_state, output_final_state):
    """Every argument of a memory call, checked once; returns a namespace the internals trust."""
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
    if not options.causal:
        raise ValueError("memory attention is causal only (its steps are a recurrence over the token order): "
                         "options.causal must be True")
    check_flag(output_final_state, "output_final_state")
    phi_q, phi_k, v = check_qkv(phi_q, phi_k, v, causal=True, names=("phi_q", "phi_k", "v"))
    B, T, H, M = phi_q.shape
    Dv, w = v.shape[-1], options.window
    if w:
        if q is None or k is None:
            raise ValueError(f"window={w} > 0 needs the raw q and k for the exact part, got "
                             f"{'q=None' if q is None else 'k=None'}")
        q, k, _ = check_qkv(q, k, v, causal=True)
        if tuple(q.shape[:3]) != (B, T, H) or q.dtype != phi_q.dtype or q.device != phi_q.device:
            raise ValueError(f"q {tuple(q.shape)} ({q.dtype}) must match phi_q {tuple(phi_q.shape)} ({phi_q.dtype}) "
                             "in [B, T, H], dtype and device")
        D = q.shape[-1]
    else:
        q = k = None  # pure linear attention: no exact part
        D = 0
    if w and options.local == "poly":
        degree = check_degree(degree)
    mask = check_key_padding_mask(key_padding_mask, B, T, phi_q.device)
    work = state_dtype(phi_q.dtype)
    far = _check_params(params, options, H, Dv, phi_q)
    far = {name: (x.to(work) if x is not None else None) for name, x in far.items()}
    state = None
    if initial_state is not None:
        state = check_memory_state(initial_state, batch=B, heads=H, num_features=M, dim=D if w else None, dim_v=Dv,
                                   window=w, sinks=options.sinks, cache=options.cache, like=phi_q, dtype=work)
    scale = (D ** -0.5 if D else 1.0) if options.local_scale is None else options.local_scale
    return SimpleNamespace(phi_q=phi_q, phi_k=phi_k, v=v, q=q, k=k, o=options, far=far, degree=degree, mask=mask,
                           state=state, final=output_final_state, B=B, T=T, H=H, M=M, D=D, Dv=Dv, w=w, s=options.sinks,
                           K=options.cache, scale=scale, work=work, in_dtype=phi_q.dtype,
                           normalize=options.normalize or "sum", delta=options.state == "delta")


def _gate(call, dtype) -> torch.Tensor:
    """``g [H]``: σ(gate), or 1/2 without one."""
    g = call.far["gate"]
    return torch.full((call.H,), 0.5, dtype=dtype, device=call.phi_q.device) if g is None else torch.sigmoid(g.to(dtype))


def _log_decay(call, v: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor | None:
    """``log γ_t`` ``[B, T, H]`` from the values ``v [B, T, H, Dv]`` (0 at pads: a pad does not decay
    the state); None without decay."""
    o, f = call.o, call.far
    if o.decay is None or o.decay == 1.0:
        return None
    if o.decay == "head":
        lg = torch.nn.functional.logsigmoid(f["decay_bias"].to(v.dtype)).expand(v.shape[0], v.shape[1], -1)
    elif o.decay == "input":
        lg = torch.nn.functional.logsigmoid(f["decay_bias"].to(v.dtype) + (v * f["decay_weight"].to(v.dtype)).sum(-1))
    else:
        lg = torch.full(v.shape[:3], math.log(o.decay), dtype=v.dtype, device=v.device)
    return lg if real is None else torch.where(real[:, :, None], lg, lg.new_zeros(()))


def _beta(call, v: torch.Tensor) -> torch.Tensor:
    """The delta rule's ``β`` of keys with values ``v [..., H, Dv]`` → ``[..., H]``."""
    f = call.far
    x = f["beta_bias"].to(v.dtype).expand(v.shape[:-1])
    if f["beta_weight"] is not None:
        x = x + (v * f["beta_weight"].to(v.dtype)).sum(-1)
    return torch.sigmoid(x)


def unit(x: torch.Tensor) -> torch.Tensor:
    r"""``x / ‖x‖`` along the last axis, 0 where ``x = 0`` (a null event): the delta rule's ``k̂, q̂``."""
    n = x.norm(dim=-1, keepdim=True)
    return x / torch.where(n > 0, n, torch.ones((), dtype=x.dtype, device=x.device))


def recall_error(S, z, phi, v, *, delta: bool, eps: float) -> torch.Tensor:
    r"""The cache score :math:`\lVert v - r(k)\rVert^2` of keys (``phi [..., M]``, ``v [..., Dv]``)
    against the state ``S [..., M, Dv]``, ``z [..., M]`` (leading axes broadcast): additive
    :math:`r = S^\top\phi/(z\cdot\phi + \varepsilon)` (0 where that denominator is 0: an empty state with
    ``eps = 0``), delta :math:`r = S^\top\hat k`. No gradient."""
    with torch.no_grad():
        if delta:
            r = (unit(phi)[..., None, :] @ S)[..., 0, :]  # [..., Dv]
        else:
            den = (phi * z).sum(-1, keepdim=True) + eps
            r = (phi[..., None, :] @ S)[..., 0, :] / torch.where(den == 0, 1.0, den)  # an empty state (eps = 0): r = 0
        return (v - r).square().sum(-1)


# ------------------------------------------------------------------------------------------------ the definition
def memory_attention_naive(phi_q, phi_k, v, q=None, k=None, *, options, params=None, degree=None,
                           key_padding_mask=None, initial_state=None, output_final_state=False):
    r"""Memory attention, token by token over explicit key sets, in float64: the definition (DESIGN §7).

    Parameters
    ----------
    phi_q, phi_k : Tensor ``[B, T, H, M]``
        The far part's features, as the state uses them (already self-tensored by the caller).
    v : Tensor ``[B, T, H, Dv]``
    q, k : Tensor ``[B, T, H, D]`` or None
        Raw queries and keys for the exact part (needed when ``options.window > 0``).
    options : AttentionOptions
        Causal; ``window, sinks, local, local_scale, eps, normalize`` as the hybrid, and the memory
        fields ``cache, decay, state, beta, rescore``.
    params : FarParams or None
        ``gate`` (None: ``g = 1/2``), ``decay_bias/weight``, ``beta_bias/weight`` as the options ask.
    degree : int or None
        ``p`` of ``local="poly"``.
    key_padding_mask : bool Tensor ``[B, T]`` or None
        True: a real token. A pad is never an exact key, never cached, never enters the state, does
        not decay it, but occupies its position.
    initial_state : MemoryState or None
    output_final_state : bool

    Returns
    -------
    Tensor ``[B, T, H, Dv]`` float64, or ``(o, MemoryState)`` (float64).

    Notes
    -----
    The four steps of the module docstring, literally, per (batch, head) and position. Read:
    additive :math:`o = (g\sum_E a_jv_j + (1-g)S^\top\phi(q))/(g\sum_E a_j + (1-g)z\cdot\phi(q) + \varepsilon)`;
    delta :math:`o = g\sum_E a_jv_j/\sum_E a_j + (1-g)S^\top\hat q` (the exact term is 0 when ``E`` holds
    no real key: only a pad query). ``window = 0``: the far term alone (additive: normalised as
    ``normalize`` says).
    """
    c = _check_call(phi_q, phi_k, v, q, k, options, params, degree, key_padding_mask, initial_state, output_final_state)
    f64, dev = torch.float64, c.phi_q.device
    B, T, H, M, D, Dv, w, s, K = c.B, c.T, c.H, c.M, c.D, c.Dv, c.w, c.s, c.K
    st = c.state if c.state is not None else empty_memory_state(B, H, M, D, Dv, cache=K, like=c.phi_q)
    st = st.to(f64)
    P0 = st.offset
    fq, fk, vv = (x.to(f64) for x in (c.phi_q, c.phi_k, c.v))
    qq, kk = (c.q.to(f64), c.k.to(f64)) if w else (None, None)
    real = torch.ones(B, T, dtype=torch.bool, device=dev) if c.mask is None else c.mask
    lg = _log_decay(c, vv, real)  # [B, T, H] or None
    g = _gate(c, f64)
    zero_k = torch.zeros(D, dtype=f64, device=dev)
    outs_list = [[None] * H for _ in range(B)]
    finals, bad = [[None] * H for _ in range(B)], 0
    for b in range(B):
        for h in range(H):
            # every position this call can read: the held sinks, the held window, the new tokens
            tok = {}  # position -> (k [D], v [Dv], φ [M] or None, real)
            for i in range(st.k_sink.shape[2]):
                tok[i] = (st.k_sink[b, h, i], st.v_sink[b, h, i], None, bool(st.mask_sink[b, i]))
            Lw = st.k_window.shape[2]
            for i in range(Lw):
                tok[P0 - Lw + i] = (st.k_window[b, h, i], st.v_window[b, h, i], st.phi_window[b, h, i],
                                    bool(st.mask_window[b, i]))
            for t in range(T):
                tok[P0 + t] = (kk[b, t, h] if w else zero_k, vv[b, t, h], fk[b, t, h], bool(real[b, t]))
            slots = [None] * K  # each: dict(pos, k, v, phi, score)
            for i in range(K):
                if st.cached[b, h, i]:
                    slots[i] = dict(pos=int(st.pos_cache[b, h, i]), k=st.k_cache[b, h, i], v=st.v_cache[b, h, i],
                                    phi=st.phi_cache[b, h, i], score=float(st.score_cache[b, h, i]))
            S, z = st.S[b, h], st.z[b, h]
            row = []
            for t in range(T):
                pos = P0 + t
                # 1. decay (not at a pad)
                if lg is not None:
                    gamma = lg[b, t, h].exp()
                    S, z = gamma * S, gamma * z
                # 2. leave: rescore, cache the leaving key, evict the least score (ties: the oldest)
                if pos % options.rescore == 0:
                    for e in slots:
                        if e is not None:
                            e["score"] = float(recall_error(S, z, e["phi"], e["v"], delta=c.delta, eps=options.eps))
                j, evicted = pos - w, None
                if j >= s and j >= 0 and tok[j][3]:
                    kj, vj, fj, _ = tok[j]
                    cand = dict(pos=j, k=kj, v=vj, phi=fj,
                                score=float(recall_error(S, z, fj, vj, delta=c.delta, eps=options.eps)))
                    held = [e for e in slots if e is not None]
                    if len(held) + 1 > K:
                        evicted = min(held + [cand], key=lambda e: (e["score"], e["pos"]))
                        if evicted is not cand:
                            slots[next(i for i, e in enumerate(slots) if e is evicted)] = cand
                    else:
                        slots[slots.index(None)] = cand
                # 3. enter
                if evicted is not None:
                    fj, vj = evicted["phi"], evicted["v"]
                    if c.delta:
                        kh, beta = unit(fj), _beta_one(c, vj, h)
                        S = S + beta * kh[:, None] * (vj - kh @ S)[None, :]
                    else:
                        S, z = S + fj[:, None] * vj[None, :], z + fj
                # 4. read
                ex_num, ex_den, n_exact = torch.zeros(Dv, dtype=f64, device=dev), torch.zeros((), dtype=f64), 0
                if w:
                    E = [j for j in range(max(0, pos - w + 1), pos + 1) if j >= s and tok[j][3]]
                    E += [j for j in range(min(s, pos + 1)) if tok[j][3]]
                    keys = [tok[j][0] for j in E] + [e["k"] for e in slots if e is not None]
                    vals = [tok[j][1] for j in E] + [e["v"] for e in slots if e is not None]
                    n_exact = len(keys)
                    if keys:
                        logits = c.scale * (torch.stack(keys) @ qq[b, t, h])  # [n]
                        a = (logits - logits.amax()).exp() if options.local == "softmax" else logits ** c.degree
                        ex_num, ex_den = a @ torch.stack(vals), a.sum()
                if c.delta:
                    far = unit(fq[b, t, h]) @ S  # [Dv]
                    if w:
                        exact = ex_num / ex_den if n_exact else ex_num
                        o = g[h] * exact + (1 - g[h]) * far
                    else:
                        o = far
                else:
                    num, den = fq[b, t, h] @ S, fq[b, t, h] @ z
                    if w:
                        num, den = g[h] * ex_num + (1 - g[h]) * num, g[h] * ex_den + (1 - g[h]) * den
                    if c.normalize == "sum":
                        bad += int(bool(den <= 0) and bool(real[b, t]))
                        o = num / (den + options.eps)
                    else:
                        o = num
                row.append(o)
            outs_list[b][h] = torch.stack(row) if row else torch.zeros(0, Dv, dtype=f64, device=dev)
            finals[b][h] = (S, z, tok, slots)
    outs = torch.stack([torch.stack(outs_list[b], 1) for b in range(B)])  # [B, T, H, Dv]
    if not c.delta and c.normalize == "sum":
        report_denominators(bad, B * H * T, "memory_attention_naive", options.denominator_check)
    if not output_final_state:
        return outs
    return outs, _naive_final(c, finals, P0 + T, f64)


def _beta_one(c, vj: torch.Tensor, h: int) -> torch.Tensor:
    """``β`` of one key of head ``h`` with value ``vj [Dv]``."""
    x = c.far["beta_bias"][h].to(vj.dtype)
    if c.far["beta_weight"] is not None:
        x = x + vj @ c.far["beta_weight"][h].to(vj.dtype)
    return torch.sigmoid(x)


def _naive_final(c, finals, end: int, f64) -> MemoryState:
    """Assemble the per-(batch, head) final states of the naive loop into a :class:`MemoryState`."""
    B, H, M, D, Dv, K, dev = c.B, c.H, c.M, c.D, c.Dv, c.K, c.phi_q.device
    win = range(max(0, end - c.w), end)
    snk = range(min(c.s, end))

    def per(fn):  # stack fn(b, h) over [B, H]
        return torch.stack([torch.stack([fn(b, h) for h in range(H)]) for b in range(B)])

    def seq(positions, field, width):
        return per(lambda b, h: torch.stack([finals[b][h][2][p][field] for p in positions]) if len(positions)
                   else torch.zeros(0, width, dtype=f64, device=dev))

    def slot(b, h, i, key, width):
        e = finals[b][h][3][i]
        return e[key] if e is not None else torch.zeros(width, dtype=f64, device=dev)

    def slots(key, width):
        return per(lambda b, h: torch.stack([slot(b, h, i, key, width) for i in range(K)]) if K
                   else torch.zeros(0, width, dtype=f64, device=dev))

    info = lambda key, dt, empty: torch.tensor(  # noqa: E731
        [[[finals[b][h][3][i][key] if finals[b][h][3][i] is not None else empty for i in range(K)] for h in range(H)]
         for b in range(B)], dtype=dt, device=dev).reshape(B, H, K)
    mask = lambda positions: torch.tensor([[finals[b][0][2][p][3] for p in positions] for b in range(B)],  # noqa: E731
                                          dtype=torch.bool, device=dev).reshape(B, len(positions))
    return MemoryState(
        S=per(lambda b, h: finals[b][h][0]), z=per(lambda b, h: finals[b][h][1]),
        k_window=seq(win, 0, D), v_window=seq(win, 1, Dv), phi_window=seq(win, 2, M), mask_window=mask(win),
        k_sink=seq(snk, 0, D), v_sink=seq(snk, 1, Dv), mask_sink=mask(snk),
        k_cache=slots("k", D), v_cache=slots("v", Dv), phi_cache=slots("phi", M),
        score_cache=info("score", f64, 0.0), cached=info("pos", torch.long, -1) >= 0, pos_cache=info("pos", torch.long, -1),
        offset=end)


def memory_attention(phi_q, phi_k, v, q=None, k=None, *, options, params=None, degree=None, key_padding_mask=None,
                     initial_state=None, output_final_state=False):
    r"""Memory attention, the fast path (DESIGN §7): same arguments and result as :func:`memory_attention_naive`.

    A no-grad schedule over ``[B, H]`` decides which key enters the state at each step and when
    each cached key leaves the cache; the far part is one recurrence over that event stream
    (:func:`sketchlab.attention.delta.decayed_linear_chunked` or ``delta_rule_chunked``), the exact
    part is gathered per query chunk (window band, sinks, keys cached during the chunk, masked by
    their cached interval). float32 and float64; half inputs run in float32 (the state in float32,
    the output in the inputs' dtype). Cost ``O(T·(w + s + K + C)·D + T·M·Dv)``.

    Returns
    -------
    Tensor ``[B, T, H, Dv]``, or ``(o, MemoryState)`` with ``output_final_state=True``.
    """
    from .memory_fast import run

    c = _check_call(phi_q, phi_k, v, q, k, options, params, degree, key_padding_mask, initial_state, output_final_state)
    return run(c)
