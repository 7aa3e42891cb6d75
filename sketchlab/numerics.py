r"""The numeric rules of the toolkit, in one place (DESIGN.md §2, "Numeric rules").

**Range of a kernel.** Whether a polynomial kernel can be computed in a dtype, decided before it is:

- :func:`check_poly_kernel_range` for :math:`A = (QK^\top)^{\circ p}` of q, k (the dump tools, the fits and the
  optimum: everything that takes a dump or q, k);
- :func:`check_llops_kernel_range` for the LLoPS kernel :math:`\phi_Q(q)\cdot\phi_K(k)` of q, k and Θ (the
  attention, hence every module and model that holds a Θ: ``LLoPSAttention.from_pretrained``, the toy model's
  ``--init theta``);
- :func:`check_float64_finite` for an intermediate float64 result (a kernel, ``ψ_p``, a QR core) already formed.

Each refusal is a :class:`KernelRangeError` (a ``ValueError``, bad input, and a ``FloatingPointError``) naming
the tensors, the measured range and the remedy that helps: a scale (with its size), float64, a smaller ``p``.

**Round-off.** A quantity ``x`` derived from ``A`` (a tail :math:`\sqrt{\sum_{i>m}\sigma_i^2}`, an error
:math:`\|\hat A - A\|_F`) is *round-off* when

.. math:: x \le \mathrm{ROUNDOFF}\cdot n\cdot\varepsilon\cdot\|A\|_F,

``n = max(n_q, n_k)``, ``ε`` the epsilon of the dtype ``A`` was computed in (float64): the size of the
rounding error of the singular values of ``A`` (each :math:`\lesssim n\varepsilon\|A\|`) with a safety factor
of 64 (:func:`is_roundoff`). A ratio whose denominator is round-off divides round-off by round-off (a tail of
2.5e-256 once gave 7e114, a reference error of 1e-15 gave 2e15): it is **undefined**, NaN in tensors,
``"undefined"`` in tables (:func:`ratio_text`), ``null`` with a reason in JSON (:func:`json_ratios`), and one
warning per call names the cause (:func:`warn_undefined`).
"""

from __future__ import annotations

import math
import warnings

import torch

from ._validation import DEFAULT_MAX_BYTES, per_version

__all__ = ["EXACT_UNDERFLOW_GATE", "OVERFLOW_ROOM", "ROUNDOFF", "UNDEFINED", "UNDEFINED_REASONS", "KernelRangeError",
           "check_float64_finite", "check_llops_kernel_range", "check_poly_kernel_range", "is_roundoff", "json_ratios",
           "ratio_text", "warn_undefined"]

#: Safety factor of the round-off rule: ``x <= ROUNDOFF · n · eps · ‖A‖_F`` is round-off.
ROUNDOFF = 64.0

#: Room kept below float64's largest value for ``‖A‖_F²``: the squared error of a sketch up to 1000× ``‖A‖_F``
#: (a random sketch's rel_fro reaches a few units) and sums of such squares stay finite.
OVERFLOW_ROOM = 1e6

#: The exact underflow test of :func:`check_llops_kernel_range` runs when the cheap bound is below the
#: dtype's smallest normal number times this: on tokens of random direction the bound exceeds the exact value by
#: about ``M·d^p`` (each side's ``√M`` and ``d^{p/2}``; squared when self-tensored), ``2^{36}`` at ``M = 256,
#: d = 128, p = 4`` and ``2^{72}`` self-tensored, under this gate. It costs nothing usual inputs meet: in float32 it
#: opens at kernel bounds of ~1e-9, far below a normaliser's ``eps``.
EXACT_UNDERFLOW_GATE = 2.0 ** 96

#: Shown for an undefined ratio in every table.
UNDEFINED = "undefined"

#: The causes of an undefined ratio, by the denominator that is round-off (JSON reasons and the warning).
UNDEFINED_REASONS = {
    "tail": f"the Theorem 3.1 tail √Σ_{{i>m}}σ_i² is round-off (≤ {ROUNDOFF:g}·n·eps·‖A‖_F): A has rank ≤ m on "
            "these tokens (e.g. a constant q or k), so a size-m sketch can be exact there; read rel_fro instead",
    "reference": f"the held-out reference's error is round-off (≤ {ROUNDOFF:g}·n·eps·‖A‖_F): the Theorem 3.1 "
                 "optimum reproduces the held-out kernel exactly (e.g. a constant q), so a ratio to it measures "
                 "round-off; read holdout_rel_fro instead",
}


class KernelRangeError(ValueError, FloatingPointError):
    """A kernel outside its dtype's range: bad input (``ValueError``) met as a floating-point failure."""


# ---------------------------------------------------------------------------------------------------------
# round-off and undefined ratios


def is_roundoff(value, norm, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    r"""``value <= ROUNDOFF · n · eps(dtype) · norm`` element-wise (module docstring): bool Tensor.

    ``value``, ``norm``: tensors or numbers of one broadcastable shape (e.g. a tail's square root and
    :math:`\|A\|_F` per head); ``n = max(n_q, n_k)``.
    """
    value = torch.as_tensor(value, dtype=torch.float64)
    norm = torch.as_tensor(norm, dtype=torch.float64, device=value.device)
    return value <= ROUNDOFF * n * torch.finfo(dtype).eps * norm


def ratio_text(value, spec: str = ".3f") -> str:
    """``value`` formatted with ``spec``, or :data:`UNDEFINED` for ``None`` or NaN (the table cell of a ratio)."""
    return UNDEFINED if value is None or math.isnan(value) else format(value, spec)


def json_ratios(row: dict, causes: dict[str, str]) -> dict:
    """``row`` for JSON: each key of ``causes`` (``{key: cause}``, a cause of :data:`UNDEFINED_REASONS`) that is
    NaN becomes ``None``, with its reason under ``row["undefined"][key]`` (absent when every ratio is defined)."""
    out, reasons = dict(row), {}
    for key, cause in causes.items():
        value = out.get(key)
        if isinstance(value, float) and math.isnan(value):
            out[key], reasons[key] = None, UNDEFINED_REASONS[cause]
    if reasons:
        out["undefined"] = reasons
    return out


def warn_undefined(where: str, counts, stacklevel: int = 3) -> None:
    """One ``RuntimeWarning`` for every undefined ratio of a call, naming each cause once.

    ``counts``: ``(name, cause, undefined, of)`` tuples (e.g. one per ratio of each fit,
    :meth:`sketchlab.FitReport.undefined_counts`), summed by ``(name, cause)``; ``cause`` a key of
    :data:`UNDEFINED_REASONS`. Nothing is issued when none is undefined.
    """
    total: dict[tuple[str, str], list[int]] = {}
    for name, cause, undefined, of in counts:
        entry = total.setdefault((name, cause), [0, 0])
        entry[0], entry[1] = entry[0] + undefined, entry[1] + of
    listed = [f"{undefined} of {of} {name}" for (name, _), (undefined, of) in total.items() if undefined]
    if not listed:
        return
    causes = dict.fromkeys(cause for (_, cause), (undefined, _) in total.items() if undefined)
    warnings.warn(f"{where}: {', '.join(listed)} undefined, shown as {UNDEFINED!r} (JSON null with the reason): "
                  + "; ".join(UNDEFINED_REASONS[c] for c in causes), RuntimeWarning, stacklevel=stacklevel)


# ---------------------------------------------------------------------------------------------------------
# the range of (QKᵀ)^p


def _log_top_norms(x: torch.Tensor) -> torch.Tensor:
    """``log max_t ‖x_t‖`` per batch index of ``x [..., n, d]``, float64 ``[...]`` (``-inf`` for a zero head)."""
    return x.detach().double().norm(dim=-1).amax(-1).log()


def _exact_logs(q: torch.Tensor, k: torch.Tensor, p: int, log_q: torch.Tensor, log_k: torch.Tensor,
                max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    r""":math:`\log\max|q_t^\top k_s|` and :math:`\log\|A\|_F^2` per head, exact and without overflow: of q, k
    divided by their largest token norms (``log_q, log_k``: their logs, ``[...]``, finite), in row blocks
    under ``max_bytes``; float64 ``[...]`` each."""
    a = q.detach().double() / log_q.exp()[..., None, None]  # [..., n_q, d], rows of norm <= 1
    b = k.detach().double() / log_k.exp()[..., None, None]  # [..., n_k, d]
    rows = max(1, max_bytes // (8 * 4 * max(1, math.prod(b.shape[:-1]))))
    top, total = torch.zeros_like(log_q), torch.zeros_like(log_q)
    for i in range(0, a.shape[-2], rows):
        scores = a[..., i:i + rows, :] @ b.mT  # [..., rows, n_k]
        top = torch.maximum(top, scores.abs().amax((-2, -1)))
        total = total + (scores ** p).square().sum((-2, -1))
    return top.log() + log_q + log_k, total.log() + 2 * p * (log_q + log_k)


def check_poly_kernel_range(q: torch.Tensor, k: torch.Tensor, p: int, *, where: str = "q, k", squares: bool = True,
                            max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    r"""Refuse ``q [..., n_q, d]``, ``k [..., n_k, d]`` whose kernel :math:`A = (QK^\top)^{\circ p}` leaves the range.

    Parameters
    ----------
    q, k : Tensor
        Finite, as used (scaled); one dtype, the one the caller computes in.
    p : int
    where : str
        Names the tensors in the message (a dump path and its scale, for the dump tools).
    squares : bool
        Whether the caller needs :math:`\|A\|_F^2` (tails, errors, the fits' loss): all but the spectrum,
        which works on :math:`\sigma_i/\sigma_1` (its σ come from LAPACK, which scales internally).
    max_bytes : int
        Memory of the exact test's row blocks.

    Raises
    ------
    KernelRangeError
        *Underflow*: :math:`|A_{ts}| \le b = (\max_t\|q_t\|\max_s\|k_s\|)^p` and
        :math:`\|A\|_F^2 \le n_q n_k b^2`; when that energy bound is below float64's smallest normal number
        for some head, every singular value, tail and error computed from A underflows to 0; when ``b`` is
        below the smallest normal number of the inputs' dtype (float32: 1.2e-38), every kernel value and every
        map evaluated in that dtype rounds to 0. *Overflow*: a row sum :math:`n_k\max|A_{ts}|` above the
        dtype's largest value (the fitters form such sums in the inputs' dtype: every kernel, loss or SVD
        would be inf/NaN); with ``squares``, :math:`\|A\|_F^2` above float64's largest value over
        :data:`OVERFLOW_ROOM`, although A itself may be finite (a Frobenius norm, a tail or an error would
        be inf and every ratio NaN). The bounds decide where they prove the head in range; elsewhere
        :math:`\max|q_t^\top k_s|` and :math:`\|A\|_F^2` are computed exactly (:func:`_exact_logs`).

    Notes
    -----
    Heads whose q or k is exactly zero are left alone (their kernel is exactly 0). The remedies quote the
    factor that brings the head into range: ``A`` of ``c·q, c·k`` is ``c^{2p} A``.
    """
    f64 = torch.finfo(torch.float64)
    with torch.no_grad():
        log_q, log_k = _log_top_norms(q), _log_top_norms(k)  # [...]
        entry = p * (log_q + log_k)  # [...]: log bound on max |A_ts|
        energy = 2 * entry + math.log(q.shape[-2] * k.shape[-2])  # [...]: log bound on ‖A‖_F²
        # (bound, its smallest normal number, what it bounds, its degree in a common factor c of q and k)
        for bound, tiny, what, degree in ((energy, f64.tiny, "‖A‖_F² (float64)", 4 * p),
                                          (entry, torch.finfo(q.dtype).tiny, f"every |A_ts| ({q.dtype})", 2 * p)):
            low = torch.isfinite(bound) & (bound < math.log(tiny))
            if bool(low.any()):
                first = tuple(int(i) for i in low.nonzero()[0])
                factor = math.exp((math.log(tiny) - float(bound[first])) / degree)
                raise KernelRangeError(
                    f"{where}: the kernel (qᵀk)^p with p={p} underflows at head {first}: {what} ≤ "
                    f"1e{float(bound[first]) / math.log(10):.0f}, below the smallest normal number {tiny:.2g}, so "
                    "every singular value, map and error would be 0; scale q and k up (multiply them by at least "
                    f"{factor:.2g}; x · d^-1/4 of the raw attention inputs is the usual choice), lower p, or use float64"
                )
        n_k, sums_room = k.shape[-2], math.log(torch.finfo(q.dtype).max)
        energy_room = math.log(f64.max / OVERFLOW_ROOM) if squares else math.inf
        near = torch.isfinite(entry) & ((entry + math.log(n_k) >= sums_room) | (energy >= energy_room))
        if not bool(near.any()):
            return
        top, energy = _exact_logs(q, k, p, torch.where(near, log_q, 0.0), torch.where(near, log_k, 0.0), max_bytes)
        sums, energy = torch.where(near, p * top + math.log(n_k), -math.inf), torch.where(near, energy, -math.inf)
    for value, room, degree in ((sums, sums_room, 2 * p), (energy, energy_room, 4 * p)):
        high = value >= room
        if not bool(high.any()):
            continue
        first = tuple(int(i) for i in high.nonzero()[0])
        size, factor = float(value[first]) / math.log(10), math.exp((room - float(value[first])) / degree)
        remedy = (f"scale q and k down (multiply them by at most {factor:.2g}; scale='sqrt-d', x · d^-1/4, is the "
                  "usual choice, --scale on the command line), or lower p")
        if value is sums:
            raise KernelRangeError(
                f"{where}: the kernel (qᵀk)^p with p={p} overflows {q.dtype} at head "
                f"{first}: max |qᵀk| = {math.exp(float(top[first])):.4g}, and {n_k} tokens × that^{p} ≈ 1e{size:.0f} "
                f"exceeds the dtype's maximum ≈ 1e{room / math.log(10):.0f}, so its sums, every fit and the spectrum "
                f"would be inf/NaN; {remedy}"
                + ("" if q.dtype == torch.float64 else ", or convert the dump to float64")
            )
        raise KernelRangeError(
            f"{where}: ‖A‖_F² of the kernel (qᵀk)^p with p={p} overflows float64 at head {first}: it is 1e{size:.0f}, "
            f"beyond float64's largest {f64.max:.3g} over a room of {OVERFLOW_ROOM:g} for the errors' squares, so the "
            f"Frobenius norm, the tail and every error would be inf (every ratio NaN) even where A is finite; {remedy}"
        )


def check_float64_finite(x: torch.Tensor, what: str, p: int, *, where: str) -> torch.Tensor:
    """``x [..., a, b]`` (float64, computed from q, k) unchanged, or :class:`KernelRangeError` naming the heads
    where it overflowed (before an SVD fails with ``_LinAlgError``)."""
    bad = ~torch.isfinite(x).flatten(-2).all(-1)  # [...] per head
    if bool(bad.any()):
        raise KernelRangeError(
            f"{where}: {what} overflows float64 for {int(bad.sum())} head(s) (first flattened batch index "
            f"{int(bad.flatten().nonzero()[0])}; values beyond {torch.finfo(torch.float64).max:.3g}): the input "
            f"scale is too large for p={p}; scale q and k down (scale='sqrt-d', x · d^-1/4, is the usual choice) "
            "or lower p"
        )
    return x


# ---------------------------------------------------------------------------------------------------------
# the range of the LLoPS kernel φ_Q(q)·φ_K(k) (attention, layout [B, T, H, D], Θ [H, t, p, D, M])


#: Θ's part of the kernel-range bound, per Θ tensor already seen: ``id → (weak reference, in-place
#: version then, bounds)`` (:func:`_map_bounds`). A decoding loop passes the same Θ every token; its
#: bounds (a pass over Θ in float64) are computed once, and again after any in-place change.
_MAP_BOUNDS: dict[int, tuple] = {}


def _map_bounds(theta: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per head of ``theta [H, t, p, D, M]``: ``log max_i Σ_r ∏_j ‖θ_{r,j,:,i}‖`` (bounds ``log |φ(x)_i|``
    at ``‖x‖ = 1``) and ``log max_{r,j,i} ‖θ_{r,j,:,i}‖`` (bounds one factor ``log |⟨θ_{r,j,:,i}, x⟩|``
    there), ``-inf`` for a zero head; cached per tensor and in-place version."""
    def bounds():
        with torch.no_grad():
            norms = theta.detach().double().norm(dim=3).log()  # [H, t, p, M]
            return norms.sum(2).logsumexp(1).amax(-1).tolist(), norms.amax(dim=(1, 2, 3)).tolist()  # [H], [H]

    return per_version(_MAP_BOUNDS, theta, bounds)


def _max_norm(x: torch.Tensor, top: list[float]) -> list[float]:
    """``max_{b, t} ‖x[b, t, h]‖`` per head of ``x [B, T, H, D]`` as floats, never below the exact value;
    ``top`` is that maximum of the token norms computed in ``x``'s dtype.

    float64: ``top``. float32: ``top`` times ``1 + 1e-3`` (far above the rounding, ~``D·ε``) when every
    head's lies in ``[1e-15, 1e15]`` (the largest token's squares then cannot underflow to matter nor
    overflow); else, and for other dtypes, the float64 norms (one more pass over ``x``).
    """
    if x.dtype == torch.float64:
        return top
    if x.dtype == torch.float32 and all(1e-15 <= t <= 1e15 for t in top):
        return [t * (1 + 1e-3) for t in top]
    return x.detach().double().norm(dim=-1).amax(dim=(0, 1)).tolist()


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _features(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """``φ(x)`` of ``x [B, T, H, D]`` with ``theta [H, t, p, D, M]``: ``[B, T, H, M]`` (the dtype of both)."""
    return torch.einsum("bthd,hrpdm->bthrpm", x.detach(), theta.detach()).prod(-2).sum(-2)


def _features_at(x: torch.Tensor, theta: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``φ(x*)`` of each (batch, head)'s largest token ``x*`` (the dtype of ``x``): ``[B, H, M]``."""
    pick = norms.argmax(dim=1)  # [B, H]: token of largest norm
    top = torch.gather(x.detach(), 1, pick[:, None, :, None].expand(-1, 1, -1, x.shape[-1]))  # [B, 1, H, D]
    return _features(top, theta)[:, 0]  # [B, H, M]


def _underflow(dtype: torch.dtype, tensors: str, values: str, h: int, log_value: float,
               degree: int) -> KernelRangeError:
    """The refusal of a head ``h`` whose ``values`` (of ``tensors``; homogeneous of ``degree`` in a common factor
    of q and k, or of Θ's factors) are at most ``exp(log_value)``, below ``dtype``'s range."""
    tiny = torch.finfo(dtype).tiny
    value = f"{math.exp(log_value):.3g}" if log_value > -700 else f"1e{log_value / math.log(10):.0f}"
    return KernelRangeError(
        f"{tensors} underflow {dtype}: every {values} of head {h} is at most {value}, below the smallest normal "
        f"number {tiny:.3g}, so the attention weights round to 0 (an all-zero output); Θ or q, k are scaled wrong "
        "(a Θ export is fitted to q, k times its scale): scale them up (multiply q and k, or every factor of Θ, by "
        f"at least {math.exp((math.log(tiny) - log_value) / degree):.3g}), or use float64"
    )


def check_llops_kernel_range(q: torch.Tensor, k: torch.Tensor, theta_q: torch.Tensor, theta_k: torch.Tensor, *,
                             non_negative: bool = False) -> None:
    r"""Refuse Θ and q, k whose LLoPS kernel values cannot be represented in their dtype.

    ``q [B, T, H, D]``, ``k [B, S, H, D]``, ``theta_* [H, t, p, D, M]`` (checked, finite); ``non_negative``:
    the kernel is :math:`(\phi_Q(q)\cdot\phi_K(k))^2` (self-tensored).

    Raises
    ------
    KernelRangeError
        *Underflow*: for some head every kernel value is below the dtype's smallest normal number (every
        attention weight of that head rounds to 0: an all-zero output), or every feature of one side is.
        First by the cheap bound
        :math:`|\phi_Q(q)\cdot\phi_K(k)| \le M\,\max_i\sum_r\prod_j\|\theta^Q_{r,j,:,i}\|\,\|q\|_{\max}^p
        \cdot \max_i\sum_r\prod_j\|\theta^K_{r,j,:,i}\|\,\|k\|_{\max}^p` (squared with ``non_negative``);
        where that bound is within :data:`EXACT_UNDERFLOW_GATE` of the limit, exactly: the features of every
        token in float64, :math:`\max_t\|\phi_Q(q_t)\|\,\max_s\|\phi_K(k_s)\|` (Cauchy–Schwarz; squared
        with ``non_negative``). *Overflow*: the features of the largest query or key, or one product of
        them, are not finite in the dtype (inf/NaN output).

    Warns
    -----
    RuntimeWarning
        When ``S`` such products exceed the dtype's largest value (a normaliser or state sum may overflow).

    Notes
    -----
    What depends on Θ alone (:func:`_map_bounds`) is computed once per Θ tensor and in-place version (a
    decoding loop passes one Θ every token). Per call: the largest token norm of q and of k (one pass each,
    one device sync), from which the bounds follow in a few scalar operations. When the bound proves every
    quantity of the overflow test finite with room (the kernel bound times ``S``, and
    :math:`t\,(\max\|\theta_{r,j,:,i}\|\,\|x\|_{\max})^p` for each side's features and their partial
    products, all below the dtype's largest value over ``e``) that test cannot fail and is skipped;
    otherwise it runs exactly: the features of the largest token per (batch, head). So a call of usual
    scale pays two norms. The usual cause of an error is a Θ applied to inputs of another scale (a Θ export
    is fitted to q, k × its ``scale``).
    """
    info = torch.finfo(q.dtype)
    power, (_, t, p, _, M), S = (2 if non_negative else 1), theta_q.shape, k.shape[1]
    with torch.no_grad():
        nq, nk = (torch.linalg.vector_norm(x, dim=-1) for x in (q, k))  # [B, T|S, H] token norms, one pass each
        top_q, top_k = torch.stack([nq.amax(dim=(0, 1)), nk.amax(dim=(0, 1))]).tolist()  # one device sync
    sides = []  # per side, per head: log bound on |φ(x)_i|, log bound on one factor
    for x, top, theta in ((q, top_q, theta_q), (k, top_k, theta_k)):
        logs = [_log(n) for n in _max_norm(x, top)]
        maps, factors = _map_bounds(theta)
        sides.append(([m + p * n for m, n in zip(maps, logs)], [f + n for f, n in zip(factors, logs)]))
    (lq, fq), (lk, fk) = sides
    bound = [power * (math.log(M) + a + b) for a, b in zip(lq, lk)]  # [H] log bound on |φ_Q(q)·φ_K(k)|
    low = [h for h, b in enumerate(bound) if math.isfinite(b) and b < math.log(info.tiny)]
    if low:
        raise _underflow(q.dtype, "theta_q, theta_k with q, k", "kernel value", low[0], bound[low[0]], 2 * p * power)
    if any(math.isfinite(b) and b < math.log(info.tiny * EXACT_UNDERFLOW_GATE) for b in bound):
        _kernel_underflow_exact(q, k, theta_q, theta_k, power)
    room = math.log(info.max) - 1.0
    if (all(b + math.log(S) < room for b in bound)
            and all(math.log(t) + p * max(f, 0.0) < room for f in fq + fk)):  # nan compares False: the exact test
        return
    _kernel_range_exact(q, k, theta_q, theta_k, nq, nk, non_negative=non_negative)


def _kernel_underflow_exact(q, k, theta_q, theta_k, power: int) -> None:
    """The underflow test of :func:`check_llops_kernel_range` computed on every token in float64: per side the
    largest feature norm, per head their product (``power``-th power)."""
    tiny = torch.finfo(q.dtype).tiny
    with torch.no_grad():
        tops = [_features(x.double(), theta.double()).norm(dim=-1).amax(dim=(0, 1))  # [H]
                for x, theta in ((q, theta_q), (k, theta_k))]
        kernel = (tops[0] * tops[1]) ** power  # [H]
        values = torch.stack([*tops, kernel]).tolist()  # one device sync
    for name, top in zip(("theta_q with q", "theta_k with k"), values[:2]):
        low = [h for h, v in enumerate(top) if 0 < v < tiny]
        if low:
            raise _underflow(q.dtype, name, "feature", low[0], math.log(top[low[0]]), theta_q.shape[2])
    low = [h for h, v in enumerate(values[2]) if 0 < v < tiny]
    if low:
        raise _underflow(q.dtype, "theta_q, theta_k with q, k", "kernel value", low[0], math.log(values[2][low[0]]),
                         2 * theta_q.shape[2] * power)


def _kernel_range_exact(q, k, theta_q, theta_k, nq, nk, *, non_negative: bool) -> None:
    """The overflow test of :func:`check_llops_kernel_range` at the largest token per (batch, head) (``nq, nk``:
    the token norms ``[B, T|S, H]``): its errors and warning, computed rather than bounded."""
    info, S = torch.finfo(q.dtype), k.shape[1]
    with torch.no_grad():
        fq, fk = _features_at(q, theta_q, nq), _features_at(k, theta_k, nk)  # [B, H, M]
        terms = fq.double().abs() * fk.double().abs()  # [B, H, M]
        sums = terms.sum(-1) ** 2 if non_negative else terms.sum(-1)  # [B, H]
        biggest = sums.amax() if non_negative else terms.amax()
        finite_q, finite_k, top, total = torch.stack([  # one device sync
            torch.isfinite(fq).all().double(), torch.isfinite(fk).all().double(), biggest, sums.amax() * S]).tolist()
    for ok, name in ((finite_q, "theta_q with q"), (finite_k, "theta_k with k")):
        if not ok:
            raise KernelRangeError(
                f"{name} overflows {q.dtype}: the features of the largest token are not finite (largest "
                f"representable {info.max:.3g}); Θ or the inputs are scaled wrong: scale them down, or use float64"
            )
    if top > info.max:
        raise KernelRangeError(
            f"theta_q, theta_k with q, k overflow {q.dtype}: a product of the features of the largest query and "
            f"key is {top:.3g}, above the largest representable {info.max:.3g}; Θ or the inputs are scaled "
            "wrong: scale them down, or use float64"
        )
    if total > info.max:
        warnings.warn(
            f"llops attention: {S} keys × kernel values up to {total / S:.3g} may overflow "
            f"{q.dtype} (largest {info.max:.3g}) in the state or normaliser sums; scale Θ or the inputs down, "
            "or use float64", RuntimeWarning, stacklevel=4)
