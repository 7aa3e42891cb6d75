r"""The recurrent state of causal (hybrid) linear attention, carried from one call to the next.

Causal linear attention is a recurrence: :math:`S_t = S_{t-1} + \phi(k_t)^\top v_t`,
:math:`z_t = z_{t-1} + \phi(k_t)`. In the sliding-window hybrid a key enters ``S, z`` only once it
has left the window (sink tokens never do), so the state also holds the last ``w`` keys and values
(with their features, to add them to ``S, z`` when they leave) and the sink tokens'. Every backend
takes it as ``initial_state`` and returns it with ``output_final_state=True`` (fla's names);
splitting a sequence anywhere and passing the state gives the output of the whole sequence.

Layout: internal ``[B, H, ·, ·]`` (heads before tokens), as fla's states.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

__all__ = ["AttentionState", "TensorState", "state_dtype", "state_in"]


class TensorState:
    """What every decoding state (a frozen dataclass of tensors and ints) does to its tensor fields: cut
    them from the graph, move or cast them, count their bytes. :class:`AttentionState`,
    :class:`~sketchlab.attention.MemoryState` and the exact layers' ``KVState`` share it."""

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(f.name, x) for f in fields(self) if isinstance(x := getattr(self, f.name), torch.Tensor)]

    def map_tensors(self, fn):
        """A new state with ``fn`` on every tensor field (batch reordering in a cache, casts, detaching)."""
        return replace(self, **{name: fn(x) for name, x in self._tensors()})

    def detach(self):
        """The same state cut from the autograd graph (truncated back-propagation, decoding)."""
        return self.map_tensors(torch.Tensor.detach)

    def to(self, *args, **kwargs):
        """``Tensor.to`` on every floating tensor; the bool and integer tensors follow the device only."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        return self.map_tensors(lambda x: x.to(*args, **kwargs) if x.is_floating_point() else (
            x if device is None else x.to(device)))

    @property
    def nbytes(self) -> int:
        """Bytes held by the state's tensors."""
        return sum(x.numel() * x.element_size() for _, x in self._tensors())


@dataclass(frozen=True)
class AttentionState(TensorState):
    r"""State of causal (hybrid) linear attention after ``offset`` tokens.

    Attributes
    ----------
    S : Tensor ``[B, H, M, Dv]``
        :math:`\sum_j \phi(k_j)^\top v_j` over the far keys so far (``M`` is ``M²`` with
        ``non_negative=True``: the self-tensored features).
    z : Tensor ``[B, H, M]``
        :math:`\sum_j \phi(k_j)` over the same keys.
    k_window : Tensor ``[B, H, L_w, D]``
        The keys of the last ``L_w = min(window, offset)`` positions ``offset − L_w … offset − 1``
        (``L_w = 0`` for pure linear attention). Positions below ``sinks`` are held here too but
        counted only as sinks.
    v_window : Tensor ``[B, H, L_w, Dv]``
    phi_window : Tensor ``[B, H, L_w, M]``
        The window keys' features (before self-tensoring): each enters ``S, z`` when it leaves.
    k_sink : Tensor ``[B, H, L_s, D]``
        Keys of positions ``0 … L_s − 1``, ``L_s = min(sinks, offset)``.
    v_sink : Tensor ``[B, H, L_s, Dv]``
    offset : int
        Tokens seen so far (the position of the next token).
    mask_window : Tensor ``[B, L_w]`` bool or None
        ``True`` for real (not padded) window keys; ``None``: all real.
    mask_sink : Tensor ``[B, L_s]`` bool or None
        The same for the sink keys.
    conv_q, conv_k : Tensor ``[B, K − 1, H, D]`` or None
        The short convolution's tails (``options.qk_conv = K``): the last ``K − 1`` raw q, k.
    """

    S: torch.Tensor
    z: torch.Tensor
    k_window: torch.Tensor
    v_window: torch.Tensor
    phi_window: torch.Tensor
    k_sink: torch.Tensor
    v_sink: torch.Tensor
    offset: int
    mask_window: torch.Tensor | None = None
    mask_sink: torch.Tensor | None = None
    conv_q: torch.Tensor | None = None
    conv_k: torch.Tensor | None = None


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype every backend computes the sums in and holds every floating field of the state in
    (``S, z``, the window's and sinks' keys, values and features), for inputs of ``dtype``.

    float32 for float16/bfloat16 inputs (``S, z`` are sums over the whole prefix, which half
    precision would round away; the held keys and values, cast up, keep the inputs' values
    exactly); the inputs' own dtype otherwise (float32; float64 on the torch path). The torch and
    Triton paths both call it, for the state they return and to cast an ``initial_state``
    (:func:`check_state`), so a state either returns continues on the other unchanged.
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def empty_state(batch: int, heads: int, num_features: int, dim: int, dim_v: int, feature_dim: int, *,
                like: torch.Tensor, dtype: torch.dtype | None = None) -> AttentionState:
    """A state before the first token: zero ``S, z``, empty window and sinks.

    ``num_features`` is the size of ``S``'s feature axis (``M²`` when self-tensored),
    ``feature_dim`` the window features' ``M``; ``dtype`` of ``S, z`` (default ``like``'s).
    """
    dt = like.dtype if dtype is None else dtype
    kw = {"dtype": like.dtype, "device": like.device}
    return AttentionState(
        S=torch.zeros(batch, heads, num_features, dim_v, dtype=dt, device=like.device),
        z=torch.zeros(batch, heads, num_features, dtype=dt, device=like.device),
        k_window=torch.zeros(batch, heads, 0, dim, **kw), v_window=torch.zeros(batch, heads, 0, dim_v, **kw),
        phi_window=torch.zeros(batch, heads, 0, feature_dim, **kw),
        k_sink=torch.zeros(batch, heads, 0, dim, **kw), v_sink=torch.zeros(batch, heads, 0, dim_v, **kw), offset=0)


def check_state(state, *, batch: int, heads: int, num_features: int, dim: int | None, dim_v: int, feature_dim: int,
                window: int, sinks: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> AttentionState:
    """Validate ``initial_state`` against the call (shapes, window and sink lengths, device).

    Rules: an :class:`AttentionState`; ``S [B, H, M, Dv]``, ``z [B, H, M]`` with the call's
    ``B, H, Dv`` and feature count; the window holds ``min(window, offset)`` keys and the sinks
    ``min(sinks, offset)`` (a state made with other ``window``/``sinks`` is rejected); on ``q``'s device.
    With ``dtype`` (the dtype the backend computes in), a state of another floating dtype is returned
    cast to it (a float64 reference state, or ``state.to(torch.bfloat16)`` kept to save memory).
    """
    if not isinstance(state, AttentionState):
        raise TypeError(f"initial_state must be an AttentionState (from output_final_state=True), got {type(state).__name__}")
    if dim is None:  # pure linear attention: the (empty) window's key width is free
        dim = state.k_window.shape[-1] if isinstance(state.k_window, torch.Tensor) else 0
    off = state.offset
    if isinstance(off, bool) or not isinstance(off, int) or off < 0:
        raise ValueError(f"initial_state.offset must be an int >= 0, got {off!r}")
    lw, ls = min(window, off), min(sinks, off)
    want = {"S": (batch, heads, num_features, dim_v), "z": (batch, heads, num_features),
            "k_window": (batch, heads, lw, dim), "v_window": (batch, heads, lw, dim_v),
            "phi_window": (batch, heads, lw, feature_dim), "k_sink": (batch, heads, ls, dim),
            "v_sink": (batch, heads, ls, dim_v)}
    for name, shape in want.items():
        x = getattr(state, name)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"initial_state.{name} must have shape {list(shape)} for this call (B={batch}, H={heads}, "
                f"features={num_features}, D={dim}, Dv={dim_v}, window={window}, sinks={sinks}, offset={off}), "
                f"got {got}: was the state made by a call with other options?")
        if x.device != like.device:
            raise ValueError(f"initial_state.{name} is on {x.device}, the inputs on {like.device}")
    for name, n in (("mask_window", lw), ("mask_sink", ls)):
        m = getattr(state, name)
        if m is not None and (not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != (batch, n)):
            raise ValueError(f"initial_state.{name} must be None or a bool tensor [{batch}, {n}], got "
                             f"{tuple(m.shape) if isinstance(m, torch.Tensor) else m!r}")
        if m is not None and m.device != like.device:
            raise ValueError(f"initial_state.{name} is on {m.device}, the inputs on {like.device}")
    return state if dtype is None else state_in(state, dtype)


def state_in(state: AttentionState, dtype: torch.dtype) -> AttentionState:
    """``state`` with its floating tensors in ``dtype``, the dtype a backend computes in (a float64 reference
    state, or one kept in bfloat16 to save memory); itself, no operation run, when they already are."""
    tensors = (state.S, state.z, state.k_window, state.v_window, state.phi_window, state.k_sink, state.v_sink)
    return state if all(x.dtype == dtype for x in tensors) else state.to(dtype)
