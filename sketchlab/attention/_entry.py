r"""What every backend of the op shares below :func:`~sketchlab.attention.linear_attention`: the gate of a call
without memory (:func:`far_gate`), the memory mechanisms on features (:func:`memory_call`) and a call cut into
independent segments (:func:`by_segments`). The options arrive built, checked and resolved (DESIGN §7).
"""

from __future__ import annotations

import torch

__all__ = ["by_segments", "far_gate", "memory_call"]


def far_gate(where: str, gate, params):
    """The gate logits of a non-memory call: ``gate`` or ``params.gate`` (not both); ``params`` may hold
    nothing else (its decay/β tensors belong to memory options)."""
    if params is None:
        return gate
    extra = [name for name in ("decay_bias", "decay_weight", "beta_bias", "beta_weight")
             if getattr(params, name) is not None]
    if extra:
        raise ValueError(f"{where}: params.{extra[0]} is set but the options have no memory mechanism (no cache, "
                         "decay or delta state): were the params built for other options?")
    if gate is not None and params.gate is not None:
        raise ValueError(f"{where}: gate= and params.gate are both set: pass the gate logits once")
    return params.gate if gate is None else gate


def memory_call(fq, fk, v, q, k, *, options, params, gate, degree, key_padding_mask, initial_state,
                output_final_state: bool):
    r"""Memory attention (DESIGN §7) on features ``fq, fk [B, T, H, M]`` (self-tensored here when the resolved
    ``options.non_negative``) and raw ``q, k`` for the exact part, checked by the op
    (:func:`~sketchlab.attention.linear_attention`: ``q, k, v`` and the mask): the chunked mechanisms
    (:func:`~sketchlab.attention.memory_fast.run`, after the checks of the features, params and state), or
    :func:`~sketchlab.attention.memory.memory_attention_naive` (float64) with ``options.backend == "reference"``."""
    from ..polynomial import self_tensor
    from .memory import memory_attention_naive
    from .memory_fast import run
    from .memory_state import check_memory_call

    if options.backend == "triton":
        raise ValueError("linear_attention: the memory mechanisms (cache, decay, delta state) have no fused kernel: "
                         "backend='torch' (or 'auto') or 'reference'")
    if options.non_negative:
        fq, fk = self_tensor(fq), self_tensor(fk)  # [B, T, H, M²]
    q, k = (q, k) if options.window else (None, None)
    if options.backend == "reference":
        return memory_attention_naive(fq.double(), fk.double(), v.double(),
                                      *(None if x is None else x.double() for x in (q, k)), options=options,
                                      params=params, gate=gate, degree=degree, key_padding_mask=key_padding_mask,
                                      initial_state=initial_state, output_final_state=output_final_state)
    return run(check_memory_call(fq, fk, v, q, k, options, params, degree, key_padding_mask, initial_state,
                                 output_final_state, gate, raw_checked=True))


def by_segments(fn, segments, *tensors, mask=None):
    """Run ``fn(*tensors, mask)`` on each segment of the token axis (axis 1; ``T == S``) and join
    the outputs (``mask``: a key-padding mask ``[B, S]``, cut with the keys)."""
    if segments is None:
        return fn(*tensors, mask)
    lengths = {x.shape[1] for x in tensors}
    if len(lengths) != 1:
        raise ValueError(f"segments need as many queries as keys (T == S), got token axes {sorted(lengths)}")
    from ._checks import check_segments

    segs = check_segments(segments, tensors[0].shape[1])
    outs, start = [], 0
    for length in segs:
        stop = start + length
        outs.append(fn(*(x[:, start:stop] for x in tensors), None if mask is None else mask[:, start:stop]))
        start = stop
    return torch.cat(outs, 1)
