r"""The attention op (layout ``[B, T, H, D]``): :func:`linear_attention` on feature maps, and the exact attentions.

:func:`linear_attention` checks its arguments once, decides the open options for the map
(:meth:`AttentionOptions.resolve`) and runs one backend, as ``options.backend`` says:

``"triton"``
    the fused kernel :func:`sketchlab.attention.triton.llops_attention_triton` (two LLoPS maps; CUDA, or the
    Triton interpreter on the CPU when ``TRITON_INTERPRET=1``);
``"torch"``
    the chunked PyTorch path (:func:`sketchlab.attention.ops.additive.chunk.chunk_attention`; LLoPS maps computed
    block by block), or the memory mechanisms' (:func:`sketchlab.attention.memory.memory_attention`);
``"reference"``
    the float64 twins (:meth:`~sketchlab.featuremaps.FeatureMap.features_naive`, then
    :func:`~sketchlab.attention.ops.additive.naive.feature_attention_naive` or
    :func:`~sketchlab.attention.memory.memory_attention_naive`);
``"auto"``
    Triton for LLoPS maps when ``q`` is on CUDA and ``triton`` imports, otherwise torch.

Normalisation semantics are the same in every backend (see :mod:`sketchlab.attention.reference`).
"""

from __future__ import annotations

import importlib.util

import torch

from ..llops.maps import llops_feature_fn
from ..numerics import check_llops_kernel_range
from ._checks import (
    check_all_finite,
    check_backend_name,
    check_flag,
    check_gate,
    check_key_padding_mask,
    check_qkv,
    check_segments,
    check_theta,
    check_window_lengths,
)
from ._entry import by_segments, far_gate, memory_call
from .ops.additive.chunk import TokenRanges, chunk_attention
from .ops.additive.naive import feature_attention_naive
from .options import BACKENDS, AttentionOptions, FarParams
from .poly import poly_attention  # re-exported: blocked exact polynomial attention
from .qk_conv import with_qk_conv
from .softmax import softmax_attention  # re-exported: the exact softmax attention

__all__ = ["BACKENDS", "check_local_degree", "dump_segments", "linear_attention", "poly_attention", "resolve_backend",
           "softmax_attention"]


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The backend actually used for ``backend`` on ``device`` (``"auto"`` resolved).

    ``"auto"`` is the Triton kernel for CUDA tensors of a dtype it takes (fp32, fp16, bf16) when
    triton is importable, and the chunked PyTorch path otherwise (CPU, float64).
    """
    check_backend_name(backend)
    if backend == "auto":
        fused = device.type == "cuda" and dtype != torch.float64 and _triton_importable()
        return "triton" if fused else "torch"
    if backend == "triton" and not _triton_importable():
        raise ValueError("backend='triton' needs the triton package, which is not importable here; "
                         "install triton or use backend='torch'")
    return backend


def _unfused_backend(backend, q: torch.Tensor, what: str) -> str:
    """The backend for a map the Triton kernel does not fuse: ``"auto"`` is the chunked torch path
    on every device; an explicit ``"triton"`` is refused."""
    resolved = resolve_backend(backend, q.device, q.dtype)
    if resolved != "triton":
        return resolved
    if backend == "auto":
        return "torch"
    raise ValueError(f"backend='triton' fuses only LLoPS maps; {what} runs with backend='torch' "
                     "(its features through the chunked path) or 'reference'")


def dump_segments(dump) -> list[int] | None:
    """Segment lengths of the sequences a Q/K dump joins, from its metadata key ``tokens``.

    :func:`sketchlab.capture_qk` records ``tokens`` (a JSON list: valid tokens per captured
    sequence, joined in order along the token axis); the shipped dump has ``[256, 256]``. Returns
    ``None`` when the key is absent (one sequence). Raises ``ValueError`` when it does not sum to
    the dump's ``n``.
    """
    import json

    raw = (getattr(dump, "meta", None) or {}).get("tokens")
    if raw is None:
        return None
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"dump metadata tokens must be a JSON list of ints, got {raw[:80]!r} ({err})") from err
    return check_segments(values, dump.q.shape[-2])


def check_local_degree(degree, what: str, *, window, local) -> None:
    """The one rule for the hybrid's ``local="poly"`` and a far feature map: its exact window scores
    ``(s·qᵀk)^p`` with ``p`` the map's polynomial ``degree``, so a map without one (``degree=None``:
    Hedgehog, whose kernel ≈ exp is no polynomial) is refused, naming it (``what``). Checked by
    :func:`linear_attention` on every call and where such a hybrid is built
    (:class:`sketchlab.convert.sketched.SketchedAttention`, the toy model's ``"hedgehog"`` options).
    """
    if window and local == "poly" and degree is None:
        raise ValueError(f"local='poly' needs a polynomial degree (its exact window scores are (s·qᵀk)^p), "
                         f"and {what} has none (it is not a polynomial kernel): use local='softmax'")


def linear_attention(q, k, v, feature_map, feature_map_k=None, *, options: AttentionOptions | None = None,
                     params: FarParams | None = None, gate=None, segments=None, key_padding_mask=None,
                     initial_state=None, output_final_state: bool = False):
    r"""The attention op: causal (or not) linear attention through a feature map, with the hybrid's
    exact keys, the memory mechanisms and a carried state, as ``options`` say (fla's ``(o, state)``).

    Parameters
    ----------
    q : Tensor ``[B, T, H, D]``
    k : Tensor ``[B, S, H, D]``
    v : Tensor ``[B, S, H, Dv]``
        One dtype and one device for all three (``causal``: ``T == S``).
    feature_map : FeatureMap
        The query map (``heads = H``, ``head_dim = D``); also the key map unless ``feature_map_k``.
        Two :class:`~sketchlab.featuremaps.LLoPSMap` run the fused Triton kernel (``backend``
        ``"auto"`` on CUDA, or ``"triton"``); every other map runs its ``features`` through the
        chunked PyTorch path (``features_naive`` and the float64 twin with ``backend="reference"``).
    feature_map_k : FeatureMap or None
        The key map (same kind and number of features).
    options : AttentionOptions or None
        Every option (:class:`AttentionOptions`; None: its defaults), built and checked by the caller
        once and used as given. ``normalize=None`` is ``"sum"``; ``non_negative=None`` self-tensors a
        map that can be signed when a sum divides (:meth:`AttentionOptions.resolve`, the one rule).
        ``local="poly"`` scores ``(s·qᵀk)^p`` with the map's ``degree``. ``backend="reference"`` runs the float64
        twins: gradients reach ``q, k, v``, the gate, the far parameters and an LLoPS map's Θ; the other maps'
        twins read their parameters detached (they are for checking values).
    params : FarParams or None
        The learnable tensors the options call for (decay, β; the gate unless ``gate`` holds it).
    gate : Tensor ``[H]`` or None
        Logits of ``g = sigmoid(gate)`` weighting local against far; ``None``: ``g = 1/2``.
    segments : sequence of int or None
        Lengths of independent sequences joined along the token axis (``T == S``): no query attends
        across a boundary (:func:`dump_segments`); positions (window, sinks) restart in each.
    key_padding_mask : bool Tensor ``[B, S]`` or None
        ``True`` = a real token (as transformers passes for padded batches).
    initial_state : AttentionState, MemoryState or None
        The state returned by an earlier call on the preceding tokens (causal only).
    output_final_state : bool
        Return the final state (else ``None`` in its place).

    Returns
    -------
    o : Tensor ``[B, T, H, Dv]``
        :math:`o_t = \sum_s a_{ts} v_s\,[/(\sum_s a_{ts} + \varepsilon)]`,
        :math:`a_{ts} = \phi_Q(q_t)\cdot\phi_K(k_s)`; the hybrid's formula is
        :func:`~sketchlab.attention.ops.additive.naive.feature_attention_naive`'s, the memory mechanisms'
        :func:`~sketchlab.attention.memory.memory_attention_naive`'s. Float64 with
        ``backend="reference"``.
    state : AttentionState, MemoryState or None
        The final state when ``output_final_state`` (a :class:`MemoryState` with memory options).
    """
    if options is None:
        options = AttentionOptions()
    elif not isinstance(options, AttentionOptions):
        raise TypeError(f"linear_attention: options must be an AttentionOptions (or None), got "
                        f"{type(options).__name__}")
    if params is not None and not isinstance(params, FarParams):
        raise TypeError(f"linear_attention: params must be a FarParams (or None), got {type(params).__name__}")
    check_flag(output_final_state, "output_final_state")
    out = _featuremap(q, k, v, feature_map, feature_map_k, options, params, gate, segments, key_padding_mask,
                      initial_state, output_final_state)
    return out if output_final_state else (out, None)


def _featuremap(q, k, v, feature_map, feature_map_k, o: AttentionOptions, params, gate, segments, key_padding_mask,
                initial_state, output_final_state: bool):
    """:func:`linear_attention` with its options and flags checked: the maps, q, k, v, then the route."""
    from ..featuremaps import FeatureMap

    fk_map = feature_map if feature_map_k is None else feature_map_k
    for m, name in ((feature_map, "feature_map"), (fk_map, "feature_map_k")):
        if not isinstance(m, FeatureMap):
            raise TypeError(f"{name} must be a sketchlab.featuremaps.FeatureMap, got {type(m).__name__}")
    if type(feature_map) is not type(fk_map) or feature_map.num_features != fk_map.num_features:
        raise ValueError(f"feature_map and feature_map_k must be of one kind with one number of features, got "
                         f"{type(feature_map).__name__}({feature_map.num_features}) and "
                         f"{type(fk_map).__name__}({fk_map.num_features})")
    q, k, v = check_qkv(q, k, v, causal=o.causal)
    for m, name in ((feature_map, "feature_map"), (fk_map, "feature_map_k")):
        if (m.heads, m.head_dim) != (q.shape[2], q.shape[3]):
            raise ValueError(f"{name} has heads={m.heads}, head_dim={m.head_dim} but q has H={q.shape[2]}, "
                             f"D={q.shape[3]}")
    o = o.resolve(lambda: feature_map.non_negative and fk_map.non_negative)
    return with_qk_conv(lambda qs, ks, vs: _route(qs, ks, vs, feature_map, fk_map, o, params, gate, segments,
                                                     key_padding_mask, initial_state, output_final_state),
                           q, k, v, options=o, params=params, initial_state=initial_state,
                           output_final_state=output_final_state, key_padding_mask=key_padding_mask, segments=segments)


def _check_attention_state(initial_state, output_final_state: bool, o: AttentionOptions, *, batch: int, heads: int,
                           dim: int, dim_v: int, num_features: int, like: torch.Tensor) -> None:
    """The state rules of a call without memory, checked once for every backend (the chunked path, the fused kernel
    and the float64 twin read the state as given): a state needs ``causal=True`` and ``initial_state`` must fit the
    call (:func:`~sketchlab.attention.state.check_state`; ``M²`` features when self-tensored)."""
    from .state import check_state

    if (initial_state is not None or output_final_state) and not o.causal:
        raise ValueError("initial_state/output_final_state need causal=True (a state summarises a prefix)")
    if initial_state is not None:
        m = num_features
        check_state(initial_state, batch=batch, heads=heads, num_features=m * m if o.non_negative else m,
                    dim=dim if o.window else None, dim_v=dim_v, feature_dim=m, window=o.window, sinks=o.sinks,
                    like=like)


def _features(map_q, map_k, q, k, naive: bool, checked: bool = True):
    """``[B, T|S, H, D] -> [B, T|S, H, M]``: the maps' features of ``q`` and ``k``, or their float64 twins; checked
    finite (``phi_q``, ``phi_k`` in the error: a map's output on finite inputs can still overflow) unless the
    caller's backend checks them (``checked=False``: the memory mechanisms')."""
    fq, fk = (map_q.features_naive(q), map_k.features_naive(k)) if naive else (map_q.features(q), map_k.features(k))
    if checked:
        check_all_finite((fq, "phi_q"), (fk, "phi_k"))
    return fq, fk


def _route(q, k, v, map_q, map_k, o: AttentionOptions, params, gate, segments, key_padding_mask, initial_state,
           output_final_state: bool):
    """The backend of :func:`linear_attention` for checked ``q, k, v`` and resolved options ``o``: the fused
    kernel (two LLoPS maps), the memory mechanisms, the chunked path or the float64 twins, segment by segment."""
    from ..featuremaps import LLoPSMap

    B, T, H, D = q.shape
    name = type(map_q).__name__
    fused = isinstance(map_q, LLoPSMap)
    backend = resolve_backend(o.backend, q.device, q.dtype) if fused else _unfused_backend(o.backend, q, name)
    check_local_degree(map_q.degree, name, window=o.window, local=o.local)
    naive = backend == "reference"
    if fused:
        theta_q, theta_k = (m.theta if m.theta.dtype == q.dtype else m.theta.to(q.dtype) for m in (map_q, map_k))
        theta_q, theta_k = check_theta(theta_q, theta_k, heads=H, dim=D, like=q)
        if (o.memory or naive) and (theta_q is not map_q.theta or theta_k is not map_k.theta):
            map_q, map_k = LLoPSMap.over(theta_q), LLoPSMap.over(theta_k)  # their features, too, of Θ in q's dtype
        check_llops_kernel_range(q, k, theta_q, theta_k, non_negative=o.non_negative)
    key_padding_mask = check_key_padding_mask(key_padding_mask, B, k.shape[1], q.device)
    if segments is not None and (initial_state is not None or output_final_state):
        raise ValueError("segments cannot be combined with initial_state/output_final_state: a state carries one "
                         "sequence per batch row (split the joined sequences into rows instead)")
    state = dict(initial_state=initial_state, output_final_state=output_final_state)
    if o.memory:
        def memory(qs, ks, vs, mask):
            fq, fk = _features(map_q, map_k, qs, ks, naive, checked=False)  # [B, T|S, H, M]: check_memory_call's
            if not naive:
                dtype = torch.promote_types(fq.dtype, vs.dtype)
                fq, fk, vs, qs, ks = (x.to(dtype) for x in (fq, fk, vs, qs, ks))
            return memory_call(fq, fk, vs, qs, ks, options=o, params=params, gate=gate, degree=map_q.degree,
                               key_padding_mask=mask, **state)

        return by_segments(memory, segments, q, k, v, mask=key_padding_mask)
    gate = check_gate(far_gate("linear_attention", gate, params), heads=H, like=q)
    check_window_lengths(o.causal, o.window, T, k.shape[1])
    _check_attention_state(initial_state, output_final_state, o, batch=B, heads=H, dim=D, dim_v=v.shape[-1],
                           num_features=map_q.num_features, like=q)
    if backend == "triton":
        from .triton import llops_attention_triton  # lazy: triton is optional

        def run(qs, ks, vs, mask):
            return llops_attention_triton(qs, ks, vs, theta_q, theta_k, o, gate=gate, key_padding_mask=mask, **state)
    elif naive:
        def run(qs, ks, vs, mask):
            return feature_attention_naive(
                *_features(map_q, map_k, qs, ks, True), vs.double(), q=qs.double(), k=ks.double(),
                causal=o.causal, normalize=o.normalize, eps=o.eps, non_negative=o.non_negative, window=o.window,
                sinks=o.sinks, local=o.local, local_scale=o.local_scale, degree=map_q.degree, gate=gate,
                key_padding_mask=mask, denominator_check=o.denominator_check, **state)
    else:
        def run(qs, ks, vs, mask):
            qt, kt, vt = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)  # [B, H, T|S, ·]
            if fused:  # the LLoPS features block by block: [B, T, H, M] is never held whole
                feat_q, feat_k = TokenRanges(qt, llops_feature_fn(theta_q)), TokenRanges(kt, llops_feature_fn(theta_k))
            else:
                fq, fk = _features(map_q, map_k, qs, ks, False)  # [B, T|S, H, M]
                dtype = torch.promote_types(fq.dtype, vs.dtype)
                fq, fk, qt, kt, vt = (x.to(dtype) for x in (fq, fk, qt, kt, vt))
                feat_q, feat_k = TokenRanges(fq.transpose(1, 2)), TokenRanges(fk.transpose(1, 2))
            out = chunk_attention(feat_q, feat_k, qt, kt, vt, o,
                                  num_features=map_q.num_features, degree=map_q.degree, gate=gate, mask=mask,
                                  where="linear_attention", **state)
            return (out[0].transpose(1, 2), out[1]) if output_final_state else out.transpose(1, 2)
    return by_segments(run, segments, q, k, v, mask=key_padding_mask)
