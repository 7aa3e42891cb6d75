r"""Functional attention API (layout ``[B, T, H, D]``): the op on feature maps, LLoPS, exact polynomial, softmax.

Backends of :func:`llops_attention`:

``"triton"``
    the fused kernel :func:`sketchlab.attention.triton.llops_attention_triton` (CUDA, or the
    Triton interpreter on the CPU when ``TRITON_INTERPRET=1``);
``"torch"``
    :func:`sketchlab.attention.chunked.llops_attention_chunked` (chunked PyTorch);
``"reference"``
    :func:`sketchlab.attention.reference.llops_attention_naive` (dense, float64; tests and small problems);
``"auto"``
    Triton when ``q`` is on CUDA and ``triton`` imports, otherwise torch.

Normalisation semantics are the same in every backend (see :mod:`sketchlab.attention.reference`).
"""

from __future__ import annotations

import importlib.util

import torch

from ..llops.maps import llops_feature_fn, llops_is_non_negative
from ..numerics import check_llops_kernel_range
from ._checks import (
    check_backend_name,
    check_flag,
    check_key_padding_mask,
    check_qkv,
    check_segments,
    check_theta,
    hybrid_args,
)
from ._entry import by_segments as _by_segments
from ._entry import call_options, far_gate, keyword_defaults, memory_call
from .chunked import DEFAULT_CHUNK_SIZE, feature_attention, llops_attention_chunked
from .ops.additive.naive import feature_attention_naive
from .options import BACKENDS, AttentionOptions, FarParams
from .poly import poly_attention  # re-exported: blocked exact polynomial attention
from .qk_conv import with_qk_conv
from .reference import llops_attention_naive
from .softmax import softmax_attention  # re-exported: the exact softmax attention

__all__ = ["BACKENDS", "dump_segments", "linear_attention", "llops_attention", "poly_attention", "resolve_backend", "softmax_attention"]



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


def _uses_hybrid(window, sinks, gate, key_padding_mask, initial_state, output_final_state) -> bool:
    return bool(window or sinks or gate is not None or key_padding_mask is not None or initial_state is not None
                or output_final_state)


def _check_stateful_segments(segments, initial_state, output_final_state):
    if segments is not None and (initial_state is not None or output_final_state):
        raise ValueError("segments cannot be combined with initial_state/output_final_state: a state carries one "
                         "sequence per batch row (split the joined sequences into rows instead)")


def llops_attention(q, k, v, theta_q, theta_k, *, options: AttentionOptions | None = None,
                    params: FarParams | None = None, causal: bool = True, normalize: str = "sum",
                    non_negative: bool = False, eps: float = 1e-6, backend: str = "auto",
                    chunk_size: int = DEFAULT_CHUNK_SIZE, segments=None, window: int = 0, sinks: int = 0,
                    local: str = "softmax", local_scale=None, gate=None, key_padding_mask=None, initial_state=None,
                    output_final_state: bool = False, denominator_check: str = "warn"):
    r"""Causal (or not) linear attention through per-head LLoPS feature maps, optionally with a
    sliding window of exact keys (the hybrid) and a carried recurrent state.

    Parameters
    ----------
    q : Tensor ``[B, T, H, D]``
    k : Tensor ``[B, S, H, D]``
    v : Tensor ``[B, S, H, Dv]``
        One dtype and one device for all three.
    theta_q, theta_k : Tensor ``[H, t, p, D, M]``
        One LLoPS map per head (same shape, dtype and device as ``q``; finite).
    options : AttentionOptions or None
        Every option at once (DESIGN §7): the keyword options below (``causal`` … ``local_scale``,
        ``backend``, ``chunk_size``, ``denominator_check``) must then be left at their defaults
        (passing one too is refused, naming it); ``None``: one is built from them (its checks are
        the rules). ``options.normalize=None`` is ``"sum"``; ``options.non_negative=None``
        self-tensors when normalising with a Θ that can be signed
        (:func:`~sketchlab.attention.llops_is_non_negative`), never under ``state="delta"`` (no
        denominator). Options with ``.memory`` (a cache, a decay, the delta state) run
        :func:`~sketchlab.attention.memory.memory_attention` on the LLoPS features (``llops_feature_fn``; float64
        :func:`sketchlab.llops_features` and :func:`~sketchlab.attention.memory.memory_attention_naive` with
        ``backend="reference"``), the state then a :class:`~sketchlab.attention.MemoryState`.
    params : FarParams or None
        The learnable tensors the options call for (decay, β, and the gate unless ``gate=`` holds
        it); a non-memory call may take ``params.gate`` only.
    causal, normalize, non_negative, eps, backend, chunk_size, window, sinks, local, local_scale, denominator_check
        As :class:`~sketchlab.attention.AttentionOptions` (``causal``: ``T == S``; backends: the module
        docstring). ``normalize="sum"`` is safe only for non-negative maps (rank-1 LLoPS with even
        ``p`` and equal factors, or ``non_negative=True``: ``φ ⊗ φ``, degree ``2p``, ``M²`` features);
        ``local="poly"`` scores ``(s·qᵀk)^p`` with ``p`` of Θ. The hybrid, padding masks and states go
        to the fused kernel only when it takes them; otherwise ``backend="triton"`` raises and
        ``"auto"`` runs torch.
    segments : sequence of int or None
        Lengths of independent sequences joined along the token axis (``T == S``): no query
        attends across a boundary (see :func:`dump_segments`); positions (window, sinks) restart
        in each.
    gate : Tensor ``[H]`` or None
        Per-head logits of ``g = sigmoid(gate)`` weighting local against far; ``None``: ``g = 1/2``.
    key_padding_mask : bool Tensor ``[B, S]`` or None
        ``True`` = a real token (as transformers passes for padded batches).
    initial_state : AttentionState or None
        The state returned by an earlier call on the preceding tokens (causal only).
    output_final_state : bool
        Also return the final :class:`~sketchlab.attention.AttentionState`.

    Returns
    -------
    Tensor ``[B, T, H, Dv]``, or ``(o, AttentionState)`` when ``output_final_state``:
    :math:`o_t = \sum_{s} a_{ts} v_s\,[/(\sum_s a_{ts} + \varepsilon)]` with
    :math:`a_{ts} = \phi_Q(q_t)\cdot\phi_K(k_s)`,
    :math:`\phi(x)_i = \sum_r \prod_j \langle\theta_{r,j,:,i}, x\rangle`; the hybrid's
    formula is in :func:`~sketchlab.attention.ops.additive.naive.feature_attention_naive`. The reference backend
    returns float64. Gradients reach ``q, k, v, theta_q, theta_k`` and ``gate``.
    """
    o = call_options("llops_attention", options, params,
                     dict(causal=causal, normalize=normalize, non_negative=non_negative, eps=eps, backend=backend,
                          chunk_size=chunk_size, window=window, sinks=sinks, local=local, local_scale=local_scale,
                          denominator_check=denominator_check), _DEFAULTS["llops_attention"])
    check_flag(output_final_state, "output_final_state")
    q, k, v = check_qkv(q, k, v, causal=o.causal)
    theta_q, theta_k = check_theta(theta_q, theta_k, heads=q.shape[2], dim=q.shape[3], like=q)
    return with_qk_conv(lambda qs, ks, vs: _llops(qs, ks, vs, theta_q, theta_k, o, params, gate, segments,
                                                     key_padding_mask, initial_state, output_final_state),
                           q, k, v, options=o, params=params, initial_state=initial_state,
                           output_final_state=output_final_state, key_padding_mask=key_padding_mask, segments=segments)


def _llops(q, k, v, theta_q, theta_k, o: AttentionOptions, params, gate, segments, key_padding_mask, initial_state,
           output_final_state: bool):
    """LLoPS attention on checked ``q, k, v`` and Θ with built options ``o`` (not yet resolved for Θ): the
    backend choice of :func:`llops_attention` and :func:`linear_attention`."""
    o = o.resolve(lambda: llops_is_non_negative(theta_q) and llops_is_non_negative(theta_k))
    causal, normalize, eps, mode, chunk_size = o.causal, o.normalize, o.eps, o.denominator_check, o.chunk_size
    non_negative = o.non_negative
    check_llops_kernel_range(q, k, theta_q, theta_k, non_negative=non_negative)
    key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[1], q.device)
    _check_stateful_segments(segments, initial_state, output_final_state)
    if o.memory:
        return _llops_memory(q, k, v, theta_q, theta_k, o, params, gate, non_negative, segments, key_padding_mask,
                             initial_state, output_final_state)
    gate = far_gate("llops_attention", gate, params)
    window, sinks, local, scale, gate = hybrid_args(o, gate, heads=q.shape[2], dim=q.shape[3], like=q)
    hybrid = _uses_hybrid(window, sinks, gate, key_padding_mask, initial_state, output_final_state)
    opts = dict(window=window, sinks=sinks, local=local, local_scale=scale, gate=gate)
    backend = resolve_backend(o.backend, q.device, q.dtype)
    if backend == "triton":
        from .triton import llops_attention_triton as fused  # lazy: triton is optional

    def run(qs, ks, vs, mask):
        extra = dict(key_padding_mask=mask, initial_state=initial_state, output_final_state=output_final_state)
        if backend == "reference":
            return llops_attention_naive(qs, ks, vs, theta_q, theta_k, causal=causal, normalize=normalize,
                                         non_negative=non_negative, eps=eps, denominator_check=mode, **opts, **extra)
        if backend == "torch":
            return llops_attention_chunked(qs, ks, vs, theta_q, theta_k, causal=causal, normalize=normalize,
                                           non_negative=non_negative, eps=eps, chunk_size=chunk_size, validate=False,
                                           denominator_check=mode, **opts, **extra)
        if hybrid:
            return fused(qs, ks, vs, theta_q, theta_k, causal=causal, normalize=normalize,
                         non_negative=non_negative, eps=eps, **opts, **extra)
        return fused(qs, ks, vs, theta_q, theta_k, causal=causal, normalize=normalize, non_negative=non_negative,
                     eps=eps)
    return _by_segments(run, segments, q, k, v, mask=key_padding_mask)


def _llops_memory(q, k, v, theta_q, theta_k, o, params, gate, non_negative, segments, mask, initial_state,
                  output_final_state):
    """:func:`llops_attention` with memory options (checked): LLoPS features, then :func:`memory_call`."""
    from ..llops import llops_features

    if o.backend == "reference":  # float64 features by the library's definition
        def feats(x, theta):  # [B, T, H, D] -> [B, T, H, M]
            return llops_features(x.double().transpose(1, 2), theta.double()).transpose(1, 2)
    else:
        fn_q, fn_k = llops_feature_fn(theta_q), llops_feature_fn(theta_k)

        def feats(x, theta):  # [B, T, H, D] -> [B, T, H, M]
            return (fn_q if theta is theta_q else fn_k)(x.transpose(1, 2)).transpose(1, 2)

    def run(qs, ks, vs, m):
        return memory_call(feats(qs, theta_q), feats(ks, theta_k), vs, qs, ks, where="llops_attention",
                           qkv_checked=True, options=o, params=params, gate=gate, degree=theta_q.shape[2], non_negative=non_negative,
                           key_padding_mask=m, initial_state=initial_state, output_final_state=output_final_state)

    return _by_segments(run, segments, q, k, v, mask=mask)


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


def _features_by_backend(fq, fk, v, q, k, *, backend, segments, key_padding_mask, chunk_size, **kw):
    """Feature attention (``[B, T, H, ·]`` features, raw ``q, k`` for the local part) on the
    reference twin or the chunked path, segment by segment."""

    def run(fqs, fks, vs, qs, ks, mask):
        if backend == "reference":
            return feature_attention_naive(fqs, fks, vs, q=qs, k=ks, key_padding_mask=mask, **kw)
        return feature_attention(fqs, fks, vs, q=qs, k=ks, key_padding_mask=mask, chunk_size=chunk_size, **kw)

    return _by_segments(run, segments, fq, fk, v, q, k, mask=key_padding_mask)


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
        ``local="poly"`` scores ``(s·qᵀk)^p`` with the map's ``degree``.
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


def _route(q, k, v, feature_map, fk_map, o: AttentionOptions, params, gate, segments, key_padding_mask, initial_state,
           output_final_state: bool):
    """The backend of :func:`linear_attention` for checked q, k, v and resolved options: two LLoPS maps to
    :func:`_llops` (the fused kernel), memory options to :func:`memory_call`, the rest to the feature paths."""
    from ..featuremaps import LLoPSMap

    causal, eps, backend, chunk_size, denominator_check = o.causal, o.eps, o.backend, o.chunk_size, o.denominator_check
    window, sinks, local, local_scale = o.window, o.sinks, o.local, o.local_scale
    normalize, non_negative = o.normalize, o.non_negative
    if isinstance(feature_map, LLoPSMap):
        theta_q, theta_k = check_theta(feature_map.theta.to(q.dtype), fk_map.theta.to(q.dtype), heads=q.shape[2],
                                       dim=q.shape[3], like=q)
        return _llops(q, k, v, theta_q, theta_k, o, params, gate, segments, key_padding_mask, initial_state,
                      output_final_state)
    backend = _unfused_backend(backend, q, type(feature_map).__name__)
    check_local_degree(feature_map.degree, type(feature_map).__name__, window=window, local=local)
    if o.memory:
        _check_stateful_segments(segments, initial_state, output_final_state)
        key_padding_mask = check_key_padding_mask(key_padding_mask, q.shape[0], k.shape[1], q.device)
        naive = backend == "reference"

        def run(qs, ks, vs, m):
            fq = feature_map.features_naive(qs) if naive else feature_map.features(qs)  # [B, T, H, M]
            fk = fk_map.features_naive(ks) if naive else fk_map.features(ks)
            if not naive:
                dtype = torch.promote_types(fq.dtype, vs.dtype)
                fq, fk, vs, qs, ks = (x.to(dtype) for x in (fq, fk, vs, qs, ks))
            return memory_call(fq, fk, vs, qs, ks, where="linear_attention", qkv_checked=True, options=o,
                               params=params, gate=gate, degree=feature_map.degree, non_negative=non_negative, key_padding_mask=m,
                               initial_state=initial_state, output_final_state=output_final_state)

        return _by_segments(run, segments, q, k, v, mask=key_padding_mask)
    gate = far_gate("linear_attention", gate, params)
    opts = dict(normalize=normalize, non_negative=non_negative, eps=eps, window=window, sinks=sinks, local=local,
                local_scale=local_scale, gate=gate, initial_state=initial_state,
                output_final_state=output_final_state, denominator_check=denominator_check)
    if backend == "reference":
        fq, fk = feature_map.features_naive(q), fk_map.features_naive(k)  # [B, T|S, H, M] float64
        qq, kk, vv = q.double(), k.double(), v.double()
    else:
        fq, fk = feature_map.features(q), fk_map.features(k)  # [B, T|S, H, M]
        dtype = torch.promote_types(fq.dtype, v.dtype)
        fq, fk, qq, kk, vv = (x.to(dtype) for x in (fq, fk, q, k, v))
    _check_stateful_segments(segments, initial_state, output_final_state)
    return _features_by_backend(fq, fk, vv, qq, kk, backend=backend, segments=segments, causal=causal,
                                key_padding_mask=key_padding_mask, chunk_size=chunk_size, degree=feature_map.degree,
                                **opts)


#: The option keywords' defaults of each entry point (options= must leave them so).
_DEFAULTS = {fn.__name__: keyword_defaults(fn) for fn in (llops_attention,)}
