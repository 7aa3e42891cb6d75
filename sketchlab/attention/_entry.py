r"""The options object at the attention entry points (DESIGN §7; issue 33's one entry point).

The op :func:`~sketchlab.attention.linear_attention` takes one ``options: AttentionOptions`` and uses it
as given. The keyword-style internal entry points (:func:`~sketchlab.attention.functional.llops_attention`,
:func:`~sketchlab.attention.chunked.feature_attention`)
take ``options: AttentionOptions | None`` and ``params: FarParams | None`` beside their keyword options;
:func:`call_options` turns either into one
:class:`AttentionOptions` (so each rule is checked once, in its ``__post_init__``); a call whose
options have ``.memory`` runs :func:`memory_call` (:func:`~sketchlab.attention.memory.memory_attention`
or its float64 twin).
"""

from __future__ import annotations

import inspect

import torch

from .options import AttentionOptions, FarParams

__all__ = ["OPTION_KEYWORDS", "by_segments", "call_options", "far_gate", "keyword_defaults", "memory_call"]

#: The keyword arguments of the entry points that are fields of :class:`AttentionOptions`.
OPTION_KEYWORDS = ("causal", "normalize", "non_negative", "eps", "backend", "chunk_size", "window", "sinks", "local",
                   "local_scale", "denominator_check")


def keyword_defaults(fn) -> dict:
    """The defaults of ``fn``'s option keywords (:data:`OPTION_KEYWORDS` it has)."""
    params = inspect.signature(fn).parameters
    return {name: params[name].default for name in OPTION_KEYWORDS if name in params}


def _is_default(value, default) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def call_options(where: str, options, params, keywords: dict, defaults: dict) -> AttentionOptions:
    """One :class:`AttentionOptions` for a call: ``options`` itself (then every keyword of
    ``keywords`` must be at its default in ``defaults``: passing one too is refused, naming it), or
    one built from ``keywords`` (its checks are the rules). ``params``: None or a :class:`FarParams`."""
    if params is not None and not isinstance(params, FarParams):
        raise TypeError(f"{where}: params must be a FarParams (or None), got {type(params).__name__}")
    if options is None:
        return AttentionOptions(**keywords)
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"{where}: options must be an AttentionOptions (or None), got {type(options).__name__}")
    for name, value in keywords.items():
        if not _is_default(value, defaults[name]):
            raise ValueError(f"{where}: options= supplies every option, and {name}={value!r} was passed too: leave "
                             f"{name} at its default ({defaults[name]!r}) or set it in the options "
                             f"(options.replace({name}=...))")
    return options


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


def memory_call(fq, fk, v, q, k, *, where: str, options: AttentionOptions, params, gate, degree, non_negative: bool,
                key_padding_mask, initial_state, output_final_state: bool, qkv_checked: bool):
    r"""Memory attention (DESIGN §7) on features ``fq, fk [B, T, H, M]`` (self-tensored here when
    ``non_negative``) and raw ``q, k`` for the exact part: :func:`memory_attention`, or
    :func:`memory_attention_naive` (float64) with ``options.backend == "reference"``. ``qkv_checked``: the
    caller checked ``q, k, v`` (:func:`check_qkv`, finite) and the mask, so the fast path checks the rest
    only (the features, params, state: :func:`memory_attention`'s checks, less those)."""
    from ..polynomial import self_tensor
    from .memory import memory_attention, memory_attention_naive
    from .memory_fast import run
    from .memory_state import check_memory_call

    if options.backend == "triton":
        raise ValueError(f"{where}: the memory mechanisms (cache, decay, delta state) have no fused kernel: "
                         "backend='torch' (or 'auto') or 'reference'")
    if non_negative:
        fq, fk = self_tensor(fq), self_tensor(fk)  # [B, T, H, M²]
    kw = dict(options=options, params=params, gate=gate, degree=degree, key_padding_mask=key_padding_mask,
              initial_state=initial_state, output_final_state=output_final_state)
    q, k = (q, k) if options.window else (None, None)
    if options.backend == "reference":
        return memory_attention_naive(fq.double(), fk.double(), v.double(),
                                      *(None if x is None else x.double() for x in (q, k)), **kw)
    if not qkv_checked:
        return memory_attention(fq, fk, v, q, k, **kw)
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
