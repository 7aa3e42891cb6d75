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
definition (checked here, written out in :mod:`sketchlab.attention.ops.cache.naive`). :func:`memory_attention` is the fast path (the schedule, then the far part as one
recurrence over an event stream through :mod:`sketchlab.attention.ops.decayed` or :mod:`~sketchlab.attention.ops.delta`, then the exact part per
query chunk; :mod:`sketchlab.attention.memory_fast`). Both carry a :class:`MemoryState`.

Layout: tokens ``[B, T, H, ·]``; the state ``[B, H, ·, ·]``. Scores and evictions are discrete
choices taken without gradient; gradients flow through every value given the choices.
"""

from __future__ import annotations

from .memory_fast import run
from .memory_state import MemoryState, check_memory_call, check_memory_state, empty_memory_state
from .ops.cache.naive import memory_naive

__all__ = ["MemoryState", "check_memory_state", "empty_memory_state", "memory_attention", "memory_attention_naive"]


# ------------------------------------------------------------------------------------------------ the definition
def memory_attention_naive(phi_q, phi_k, v, q=None, k=None, *, options, params=None, gate=None, degree=None,
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
    gate : Tensor ``[H]`` or None
        The gate logits of a module that keeps them outside its FarParams (a converted layer keeps
        ``gate`` where saved conversions have it); refused together with ``params.gate``.
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
    c = check_memory_call(phi_q, phi_k, v, q, k, options, params, degree, key_padding_mask, initial_state, output_final_state,
                    gate)
    return memory_naive(c)


def memory_attention(phi_q, phi_k, v, q=None, k=None, *, options, params=None, gate=None, degree=None,
                     key_padding_mask=None, initial_state=None, output_final_state=False):
    r"""Memory attention, the fast path (DESIGN §7): same arguments and result as :func:`memory_attention_naive`.

    A no-grad schedule over ``[B, H]`` decides which key enters the state at each step and when
    each cached key leaves the cache; the far part is one recurrence over that event stream
    (:func:`sketchlab.attention.ops.decayed.chunk.decayed_linear_chunked` or
    :func:`~sketchlab.attention.ops.delta.chunk.delta_rule_chunked`), the exact
    part is gathered per query chunk (window band, sinks, keys cached during the chunk, masked by
    their cached interval). float32 and float64; half inputs run in float32 (the state in float32,
    the output in the inputs' dtype). Cost ``O(T·(w + s + K + C)·D + T·M·Dv)``.

    Returns
    -------
    Tensor ``[B, T, H, Dv]``, or ``(o, MemoryState)`` with ``output_final_state=True``.
    """
    c = check_memory_call(phi_q, phi_k, v, q, k, options, params, degree, key_padding_mask, initial_state, output_final_state,
                    gate)
    return run(c)
