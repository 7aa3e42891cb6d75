"""Keyword calls of the one attention op, for the tests (not a test module).

``run_llops(q, k, v, θ_q, θ_k, window=2, backend="torch")`` is
``linear_attention(q, k, v, LLoPSMap.over(θ_q), LLoPSMap.over(θ_k), options=AttentionOptions(normalize="sum",
non_negative=False, window=2, backend="torch"))``: the option keywords build the options (the two defaults are
what the tests were written against: sum-normalised, never self-tensored unless asked), the call keywords
(``params``, ``gate``, ``segments``, ``key_padding_mask``, ``initial_state``, ``output_final_state``) go to the op,
and the output is ``o`` alone unless ``output_final_state``.

``run_llops_naive`` is ``run_llops(…, backend="reference")``; ``run_triton`` calls the fused backend itself with the
options so built. ``run_chunked(φ_q, φ_k, v, q=…, k=…, window=2, block_chunks=2)`` runs the additive mechanism's
chunked path (:func:`sketchlab.attention.ops.additive.chunk.chunk_attention`) on given features ``[B, T, H, M]``, as
the op does after computing them; ``backend="reference"`` its float64 twin. Its arguments are the op's to check:
tests of bad input go through :func:`linear_attention`.
"""

from __future__ import annotations

from sketchlab._validation import DEFAULT_MAX_BYTES
from sketchlab.attention import AttentionOptions, linear_attention
from sketchlab.attention.ops.additive.chunk import TokenRanges, chunk_attention
from sketchlab.attention.ops.additive.naive import feature_attention_naive
from sketchlab.featuremaps import LLoPSMap

CALL = ("params", "gate", "segments", "key_padding_mask", "initial_state", "output_final_state")


def _split(keywords: dict, options) -> tuple[AttentionOptions, dict]:
    call = {name: keywords.pop(name) for name in CALL if name in keywords}
    if options is None:
        options = AttentionOptions(**{"normalize": "sum", "non_negative": False, **keywords})
    elif keywords:
        raise TypeError(f"options= and option keywords {sorted(keywords)} both given")
    return options, call


def run_llops(q, k, v, theta_q, theta_k, *, options=None, **keywords):
    """The op on two LLoPS maps of the given Θ (gradients reach them); ``o`` or ``(o, state)``."""
    options, call = _split(keywords, options)
    map_q = LLoPSMap.over(theta_q)
    map_k = map_q if theta_k is theta_q else LLoPSMap.over(theta_k)
    out, state = linear_attention(q, k, v, map_q, map_k, options=options, **call)
    return (out, state) if call.get("output_final_state") else out


def run_llops_naive(q, k, v, theta_q, theta_k, **keywords):
    """:func:`run_llops` with ``backend="reference"``: the float64 twins (LLoPS features, then the formula)."""
    return run_llops(q, k, v, theta_q, theta_k, backend="reference", **keywords)


def run_triton(q, k, v, theta_q, theta_k, *, options=None, **keywords):
    """The fused backend :func:`sketchlab.attention.triton.llops_attention_triton` itself, on options built (and
    resolved: never self-tensored unless asked) from the keywords as :func:`run_llops` builds them; ``o`` or
    ``(o, state)``. Its arguments are the op's to check: tests of bad input go through :func:`run_llops`."""
    from sketchlab.attention.triton import llops_attention_triton  # lazy: triton is optional

    options, call = _split(keywords, options)
    if "segments" in call or "params" in call:
        raise TypeError("run_triton takes no segments or params (the op's: run them through run_llops)")
    return llops_attention_triton(q, k, v, theta_q, theta_k, options.resolve(True), **call)


def run_chunked(phi_q, phi_k, v, q=None, k=None, *, options=None, degree=None, max_bytes=DEFAULT_MAX_BYTES,
                **keywords):
    """The additive chunked path on given features (``non_negative`` self-tensors them); ``o`` or ``(o, state)``."""
    options, call = _split(keywords, options)
    if "segments" in call or "params" in call:
        raise TypeError("run_chunked takes no segments or params (the op's: run them through linear_attention)")
    o = options.resolve(True)  # given features: self-tensored only when asked
    state = {name: call.get(name) for name in ("initial_state", "key_padding_mask", "gate")}
    final = call.get("output_final_state", False)
    if o.backend == "reference":
        return feature_attention_naive(
            phi_q, phi_k, v, q=q, k=k, causal=o.causal, normalize=o.normalize, eps=o.eps, non_negative=o.non_negative,
            window=o.window, sinks=o.sinks, local=o.local, local_scale=o.local_scale, degree=degree,
            denominator_check=o.denominator_check, output_final_state=final, **state)
    qt, kt = (None, None) if not o.window else (q.transpose(1, 2), k.transpose(1, 2))
    out = chunk_attention(TokenRanges(phi_q.transpose(1, 2)), TokenRanges(phi_k.transpose(1, 2)), qt, kt,
                          v.transpose(1, 2), o, num_features=phi_q.shape[-1], degree=degree, gate=state["gate"],
                          mask=state["key_padding_mask"], initial_state=state["initial_state"], output_final_state=final,
                          where="linear_attention", max_bytes=max_bytes)
    return (out[0].transpose(1, 2), out[1]) if final else out.transpose(1, 2)
