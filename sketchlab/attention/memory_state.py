r"""The state and the argument checks of memory attention (DESIGN §7), shared by the definition
(:mod:`sketchlab.attention.memory`), the fast path (:mod:`sketchlab.attention.memory_fast`) and its
schedule (:mod:`sketchlab.attention.ops.cache.schedule`): :class:`MemoryState` and the entry checks. The
formulas every path uses live with their mechanism: the decay in :mod:`sketchlab.attention.ops.decayed.decay`,
β and the unit keys in :mod:`sketchlab.attention.ops.delta.beta`, the cache's score in
:mod:`sketchlab.attention.ops.cache.score`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .._validation import check_degree
from ._checks import check_all_finite, check_finite_once, check_flag, check_key_padding_mask, check_qkv
from .options import AttentionOptions, FarParams
from .state import TensorState, state_dtype

__all__ = ["check_far_params", "check_memory_call", "check_memory_state", "empty_memory_state", "MemoryState"]


# ------------------------------------------------------------------------------------------------ the state
@dataclass(frozen=True)
class MemoryState(TensorState):
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
    conv_q, conv_k : Tensor ``[B, K_c − 1, H, D]`` or None
        The short convolution's tails (``options.qk_conv = K_c``): the last ``K_c − 1`` raw q, k.
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
    conv_q: torch.Tensor | None = None
    conv_k: torch.Tensor | None = None

    def map_tensors(self, fn) -> MemoryState:
        """A new state with ``fn`` on every tensor field and on the decoding step's layout of them, kept
        beside the fields as ``_rows`` (``(rows, first window row, [S | z])``,
        :func:`sketchlab.attention.ops.cache.recurrent.decode`), so the next step need not lay it out again.
        Not the check's mark: the new object is checked in full (:func:`check_memory_state`)."""
        new = super().map_tensors(fn)
        if "_rows" in self.__dict__:
            rows, row0, Sz = self._rows
            object.__setattr__(new, "_rows", (None if rows is None else fn(rows), row0, None if Sz is None else fn(Sz)))
        return new


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

    Checked once per state object and call signature (these arguments): a state that passed, and the
    state a decoding step makes from it (:func:`vouch`), are not checked again by a call of the same
    signature — a decoding loop checks its state once, not every token. Every way to a new state
    (``dataclasses.replace``, ``.to``, ``.detach``, building one) makes a new object, checked in full;
    the fields cannot be reassigned (frozen), and no operation of this library resizes their tensors.
    """
    if not isinstance(state, MemoryState):
        raise TypeError(f"initial_state must be a MemoryState (from output_final_state=True), got {type(state).__name__}")
    sig = (batch, heads, num_features, dim, dim_v, window, sinks, cache, like.device, dtype)
    if state.__dict__.get("_checked") == sig:
        return state
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
    return vouch(state, sig)


def vouch(state: MemoryState, sig: tuple) -> MemoryState:
    """Mark ``state`` as valid for calls of signature ``sig`` (:func:`check_memory_state`'s arguments);
    returns it. For a state that passed the check, or one a step made from such a state by that call."""
    object.__setattr__(state, "_checked", sig)
    return state


# ------------------------------------------------------------------------------------------------ checks
_PARAMS = ("gate", "decay_bias", "decay_weight", "beta_bias", "beta_weight")


def _needs(options: AttentionOptions) -> dict:
    """Which FarParams tensors the options use: name → True (needed), False (unused), None (optional)."""
    delta = options.state == "delta"
    return {"gate": None if options.window else False, "decay_bias": options.learned_decay,
            "decay_weight": options.decay == "input", "beta_bias": delta, "beta_weight": delta and options.beta == "input"}


def check_far_params(params, options: AttentionOptions, heads: int, dim_v: int, like: torch.Tensor,
                     gate: torch.Tensor | None = None) -> dict:
    """The FarParams tensors as a dict (None where absent), checked against the options.

    Parameters
    ----------
    params : FarParams or None
    options : AttentionOptions
    heads, dim_v : int
    like : Tensor
        The inputs' device.
    gate : Tensor ``[H]`` or None
        A module that keeps its gate logits outside its FarParams: they stand for ``params.gate``.

    Returns
    -------
    dict
        ``{"gate", "decay_bias", "decay_weight", "beta_bias", "beta_weight"}`` → Tensor or None.
    """
    if params is not None and not isinstance(params, FarParams):
        raise TypeError(f"params must be a FarParams (or None), got {type(params).__name__}")
    if gate is not None and getattr(params, "gate", None) is not None:
        raise ValueError("gate= and params.gate are both set: pass the gate logits once")
    out = {}
    for name, need in _needs(options).items():
        x = getattr(params, name, None) if params is not None else None
        if name == "gate" and gate is not None:
            x = gate
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
            check_finite_once(x, f"params.{name}")  # once per tensor and in-place version (decoding)
        out[name] = x
    return out


def check_memory_call(phi_q, phi_k, v, q, k, options, params, degree, key_padding_mask, initial_state, output_final_state,
                      gate=None, raw_checked=False):
    """Every argument of a memory call, checked once; returns a namespace the internals trust.

    Parameters
    ----------
    phi_q, phi_k, v, q, k, options, params, degree, key_padding_mask, initial_state, output_final_state, gate
        As in :func:`sketchlab.attention.memory.memory_attention`.
    raw_checked : bool
        ``q, k, v`` are an entry point's checked tensors (:func:`check_qkv`: shapes, dtype, device, finite): only
        the features, params and state are checked here.

    Returns
    -------
    types.SimpleNamespace
        The checked tensors, ``o`` (the options), ``far`` (:func:`check_far_params`), the mask, the state and the
        sizes.
    """
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
    if not options.causal:
        raise ValueError("memory attention is causal only (its steps are a recurrence over the token order): "
                         "options.causal must be True")
    check_flag(output_final_state, "output_final_state")
    phi_q, phi_k, v = check_qkv(phi_q, phi_k, v, causal=True, names=("phi_q", "phi_k", "v"), finite=False)
    B, T, H, M = phi_q.shape
    Dv, w = v.shape[-1], options.window
    if w:
        if q is None or k is None:
            raise ValueError(f"window={w} > 0 needs the raw q and k for the exact part, got "
                             f"{'q=None' if q is None else 'k=None'}")
        if not raw_checked:
            q, k, _ = check_qkv(q, k, v, causal=True, finite=False)
        if tuple(q.shape[:3]) != (B, T, H) or q.dtype != phi_q.dtype or q.device != phi_q.device:
            raise ValueError(f"q {tuple(q.shape)} ({q.dtype}) must match phi_q {tuple(phi_q.shape)} ({phi_q.dtype}) "
                             "in [B, T, H], dtype and device")
        D = q.shape[-1]
    else:
        q = k = None  # pure linear attention: no exact part
        D = 0
    check_all_finite(*(((phi_q, "phi_q"), (phi_k, "phi_k")) + (() if raw_checked else ((v, "v"),) + (
        ((q, "q"), (k, "k")) if w else ()))))
    if w and options.local == "poly":
        degree = check_degree(degree)
    mask = check_key_padding_mask(key_padding_mask, B, T, phi_q.device)
    work = state_dtype(phi_q.dtype)
    far = check_far_params(params, options, H, Dv, phi_q, gate)
    far = {name: (x.to(work) if x is not None else None) for name, x in far.items()}
    state, sig = None, (B, H, M, D if w else None, Dv, w, options.sinks, options.cache, phi_q.device, work)
    if initial_state is not None:
        state = check_memory_state(initial_state, batch=B, heads=H, num_features=M, dim=D if w else None, dim_v=Dv,
                                   window=w, sinks=options.sinks, cache=options.cache, like=phi_q, dtype=work)
    scale = (D ** -0.5 if D else 1.0) if options.local_scale is None else options.local_scale
    return SimpleNamespace(phi_q=phi_q, phi_k=phi_k, v=v, q=q, k=k, o=options, far=far, degree=degree, mask=mask,
                           state=state, sig=sig, final=output_final_state, B=B, T=T, H=H, M=M, D=D, Dv=Dv, w=w, s=options.sinks,
                           K=options.cache, scale=scale, work=work, in_dtype=phi_q.dtype,
                           normalize=options.normalize or "sum", delta=options.state == "delta")
