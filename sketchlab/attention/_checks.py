"""Argument checks shared by the attention entry points (layout ``[B, T, H, D]``).

Every public function of :mod:`sketchlab.attention` validates once, at its entry, with these
helpers; each error names the argument, the rule and the offending value.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
import warnings

import torch

from .._validation import as_float_tensor, check_choice, check_finite, check_flag, check_real, per_version
from .options import BACKENDS, DENOMINATOR_CHECKS, NORMALIZE, AttentionOptions

# NORMALIZE is the options' own and check_flag the one flag rule (sketchlab._validation): re-exported, ops/ imports
# no options module
__all__ = ["DenominatorCounter", "NORMALIZE", "check_eps", "check_finite_once", "check_flag", "check_normalize",
           "check_qkv", "check_segments", "check_theta", "check_window_lengths", "count_denominators"]

# The rules on options live in :class:`~sketchlab.attention.options.AttentionOptions` (DESIGN §7); the
# checks below that test an option are those rules, called on one value (never restated here).

def check_normalize(normalize) -> str:
    """``normalize`` must be ``"none"`` or ``"sum"`` (the rule of ``AttentionOptions.normalize``)."""
    return check_choice(normalize, "normalize", NORMALIZE)


def check_eps(eps) -> float:
    """``eps`` must be a finite number ``>= 0`` (the rule of ``AttentionOptions.eps``)."""
    return check_real(eps, "eps", lo=0.0, lo_open=False)


def check_window_lengths(causal: bool, window: int, T: int, S: int) -> None:
    """The non-causal hybrid window ``|i − j| < w`` pairs query ``i`` with key ``i``: it needs ``T == S``."""
    if window and not causal and T != S:
        raise ValueError(f"the non-causal hybrid window |i−j| < w needs T == S, got T={T}, S={S}")


def check_backend_name(backend) -> str:
    """``backend`` must be one of ``"auto", "triton", "torch", "reference"`` (``AttentionOptions.backend``)."""
    return check_choice(backend, "backend", BACKENDS)


def check_qkv(q, k, v, *, causal: bool, names=("q", "k", "v"), feature_dims_match: bool = True, finite: bool = True):
    """Validate ``q [B, T, H, D]``, ``k [B, S, H, D]``, ``v [B, S, H, Dv]``.

    Rules: floating tensors of rank 4, non-empty, finite; the same batch ``B`` and heads ``H``; ``q`` and
    ``k`` share the last axis (when ``feature_dims_match``), ``k`` and ``v`` the token axis ``S``;
    causal attention needs ``T == S``; one dtype and one device for the three.
    The layout is trusted: a ``[B, H, T, D]`` tensor with ``T == H`` has the shape of a
    ``[B, T, H, D]`` one and cannot be told from it here (transpose with ``x.transpose(1, 2)``).
    Returns the three tensors (numpy arrays converted), dtypes unchanged. ``finite=False``: every rule
    but finiteness (a caller that checks more tensors at once with :func:`check_all_finite`).
    """
    nq, nk, nv = names
    q, k, v = as_float_tensor(q, nq), as_float_tensor(k, nk), as_float_tensor(v, nv)
    for x, name in ((q, nq), (k, nk), (v, nv)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have layout [B, T, H, D] (rank 4), got rank {x.ndim} with shape {tuple(x.shape)}"
            )
        if x.numel() == 0:
            raise ValueError(f"{name} must not be empty ([B, T, H, D] every size >= 1), got shape {tuple(x.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"{nq}, {nk}, {nv} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"{nq}, {nk}, {nv} must be on one device, got {q.device}, {k.device}, {v.device}")
    for x, name in ((k, nk), (v, nv)):
        if x.shape[0] != q.shape[0] or x.shape[2] != q.shape[2]:
            raise ValueError(
                f"{nq}, {nk}, {nv} must share the batch B (axis 0) and heads H (axis 2) of layout [B, T, H, D]: "
                f"{nq} {tuple(q.shape)}, {name} {tuple(x.shape)}"
            )
    if feature_dims_match and q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{nq} and {nk} must share the last axis (D or M) of layout [B, T, H, D]: "
            f"{nq} has {q.shape[-1]}, {nk} has {k.shape[-1]}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(
            f"{nk} and {nv} must share the token axis S (axis 1): {nk} has S={k.shape[1]}, {nv} has S={v.shape[1]}"
        )
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal attention needs as many queries as keys (T == S): {nq} has T={q.shape[1]}, {nk} has S={k.shape[1]}"
        )
    if finite:
        check_all_finite((q, nq), (k, nk), (v, nv))
    return q, k, v


def check_all_finite(*named: tuple[torch.Tensor, str]) -> None:
    """Every tensor of ``(tensor, name)`` pairs (one dtype and device) finite: one pass and one device sync
    (:func:`_all_finite`), then, only if that fails, the exact check naming the first culprit. Meta
    tensors have no values: nothing to check."""
    xs = [x for x, _ in named]
    if not xs[0].is_meta and not _all_finite(*xs):
        for x, name in named:
            check_finite(x.detach(), name)


def _all_finite(*xs: torch.Tensor) -> bool:
    """True only if every entry of every ``x`` is finite: one sum per tensor, one device sync.

    A non-finite entry makes its sum non-finite (``inf`` or ``nan`` survive every addition), so a
    finite sum proves the tensor finite; a non-finite sum (such an entry, or a sum beyond the
    dtype's range) answers False and the caller runs the exact check. One reading pass per
    tensor, where ``isfinite(x).all()`` takes several. ``xs`` share one dtype.
    """
    with torch.no_grad():
        acc = torch.float32 if xs[0].element_size() < 4 else None
        return all(map(math.isfinite, torch.stack([x.sum(dtype=acc) for x in xs]).tolist()))


def check_theta(theta_q, theta_k, *, heads: int, dim: int, like: torch.Tensor):
    """Validate LLoPS factors ``theta_q``, ``theta_k`` of shape ``[H, t, p, D, M]``.

    Rules: floating tensors of rank 5, the same shape (so the same degree ``p``, rank ``t`` and
    size ``M``), ``H`` equal to the heads of ``q``, ``D`` equal to its head dimension, every size
    >= 1, the dtype and device of ``like`` (``q``), finite values (the kernel's range with q, k:
    :func:`sketchlab.numerics.check_llops_kernel_range`).
    """
    out = []
    for theta, name in ((theta_q, "theta_q"), (theta_k, "theta_k")):
        theta = as_float_tensor(theta, name)
        if theta.ndim != 5:
            raise ValueError(
                f"{name} must have shape [H, t, p, D, M] (rank 5; one LLoPS map per head), got rank "
                f"{theta.ndim} with shape {tuple(theta.shape)}"
            )
        if 0 in theta.shape:
            raise ValueError(f"{name} must have every size of [H, t, p, D, M] >= 1, got {tuple(theta.shape)}")
        if theta.shape[0] != heads:
            raise ValueError(f"{name} must have one map per head: H={theta.shape[0]} (axis 0) but q has H={heads}")
        if theta.shape[3] != dim:
            raise ValueError(
                f"{name} must act on the head dimension of q and k: D={theta.shape[3]} (axis 3 of [H, t, p, D, M]) "
                f"but q has D={dim}"
            )
        if theta.dtype != like.dtype:
            raise TypeError(f"{name} must have the dtype of q ({like.dtype}), got {theta.dtype}")
        if theta.device != like.device:
            raise ValueError(f"{name} must be on the device of q ({like.device}), got {theta.device}")
        out.append(theta)
    tq, tk = out
    if tq.shape[2] != tk.shape[2]:
        raise ValueError(
            f"theta_q and theta_k must have the same degree p (axis 2 of [H, t, p, D, M]): "
            f"theta_q has p={tq.shape[2]}, theta_k has p={tk.shape[2]}"
        )
    if tq.shape != tk.shape:
        raise ValueError(
            f"theta_q and theta_k must have the same shape [H, t, p, D, M], got {tuple(tq.shape)} and {tuple(tk.shape)}"
        )
    with torch.no_grad():
        for theta, name in ((tq, "theta_q"), (tk, "theta_k")):
            check_finite_once(theta, name)
    return tq, tk


#: Θ tensors already found finite: ``id → (weak reference, in-place version then, None)``. A decoding
#: loop calls the attention once per token with the same Θ; its finiteness is checked once, and
#: again after any in-place change (an optimiser step bumps ``_version``).
_FINITE: dict[int, tuple] = {}


def check_finite_once(theta: torch.Tensor, name: str) -> None:
    """:func:`~sketchlab._validation.check_finite` on ``theta``, unless this very tensor, unmodified since (its in-place
    version), passed it.

    Parameters
    ----------
    theta : Tensor
    name : str
        Its name in the error.
    """
    per_version(_FINITE, theta, lambda: check_finite(theta.detach(), name))


def check_segments(segments, length: int) -> list[int] | None:
    """Segment lengths of sequences joined along the token axis: positive ints summing to ``length``.

    ``None`` means one sequence. An ``int`` ``n`` means equal segments of ``n`` tokens
    (``length`` must be a multiple of it).
    """
    if segments is None:
        return None
    if isinstance(segments, numbers.Integral) and not isinstance(segments, bool):
        if segments < 1 or length % int(segments):
            raise ValueError(
                f"segments as an int is the length of each joined sequence and must divide the {length} tokens, "
                f"got {segments}"
            )
        return [int(segments)] * (length // int(segments))
    try:
        values = list(segments)
    except TypeError:
        raise TypeError(f"segments must be None, an int or a sequence of ints, got {segments!r}") from None
    if not values or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in values):
        raise ValueError(f"segments must be a non-empty sequence of integers >= 1, got {segments!r}")
    if sum(values) != length:
        raise ValueError(f"segments must sum to the number of tokens {length}, got {values} (sum {sum(values)})")
    return [int(s) for s in values]




def check_hybrid(window, sinks, local, local_scale, gate, *, normalize: str, heads: int, dim: int, like: torch.Tensor):
    """Validate the sliding-window options; returns ``(window, sinks, local, scale, gate)``.

    The options' rules are :class:`AttentionOptions`' (``window``, ``sinks`` ints ``>= 0``;
    ``sinks > 0`` needs ``window >= 1``; ``local`` in :data:`~sketchlab.attention.options.LOCALS`; ``local_scale`` ``None``
    (→ ``1/√D``) or a finite number ``> 0``; the hybrid is normalised: ``normalize="none"`` with
    ``window > 0`` is an error), checked by building one; ``gate`` (a tensor, not an option):
    ``None`` or a finite floating tensor ``[H]`` (logits) on ``q``'s device (:func:`check_gate`).
    """
    o = AttentionOptions(window=window, sinks=sinks, local=local, local_scale=local_scale, normalize=normalize)
    scale = dim ** -0.5 if o.local_scale is None else o.local_scale
    return o.window, o.sinks, o.local, scale, check_gate(gate, heads=heads, like=like)


def check_gate(gate, *, heads: int, like: torch.Tensor):
    """``gate``: ``None`` or a finite floating tensor ``[H]`` of logits on the device of ``like``."""
    if gate is not None:
        if not isinstance(gate, torch.Tensor) or not gate.is_floating_point():
            raise TypeError(f"gate must be None or a floating tensor [H] of logits, got {type(gate).__name__}")
        if tuple(gate.shape) != (heads,):
            raise ValueError(f"gate must have shape [H] = [{heads}] (one logit per head), got {tuple(gate.shape)}")
        if gate.device != like.device:
            raise ValueError(f"gate must be on the device of q ({like.device}), got {gate.device}")
        with torch.no_grad():
            check_finite(gate.detach(), "gate")
    return gate


def check_key_padding_mask(mask, batch: int, length: int, device) -> torch.Tensor | None:
    """``key_padding_mask``: ``None`` or a bool tensor ``[B, S]``, ``True`` = a real token."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor [B, S] (True = a real token), got "
                        f"{mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"key_padding_mask must have shape [B, S] = [{batch}, {length}], got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"key_padding_mask must be on the device of the keys ({device}), got {mask.device}")
    return mask


def check_denominator_check(value) -> str:
    """``denominator_check`` must be one of :data:`DENOMINATOR_CHECKS` (``AttentionOptions.denominator_check``)."""
    return check_choice(value, "denominator_check", DENOMINATOR_CHECKS)


_DENOMINATOR_MESSAGE = re.compile(r"(\d+) of \d+ query rows have a normalising denominator <= 0")


@contextlib.contextmanager
def count_denominators():
    """Count the warnings of :func:`report_denominators` issued inside the block.

    Yields a dict ``{"calls", "rows"}``, filled when the block ends: how many attention calls warned
    of normalising denominators ``<= 0`` and how many query rows they named, in all (every such call
    is counted, whatever the warning filters). Other warnings are recorded under the filters in force
    and issued again when the block ends.
    """
    counts = {"calls": 0, "rows": 0}
    try:
        with warnings.catch_warnings(record=True) as caught:
            # `message` matches from the start: the warning begins with the caller's name
            warnings.filterwarnings("always", message=".*normalising denominator <= 0", category=RuntimeWarning)
            yield counts
    finally:
        for w in caught:
            hit = _DENOMINATOR_MESSAGE.search(str(w.message))
            if hit:
                counts["calls"] += 1
                counts["rows"] += int(hit.group(1))
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def denominator_counts(den: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The normalising denominators ``den`` (any shape) ``<= 0`` of real query rows (``rows``: a bool mask
    broadcast against ``den``, or None for all), and how many of them are exactly 0: int64 ``[2]``, no sync."""
    den = den.detach()
    bad = den <= 0 if rows is None else (den <= 0) & rows
    return torch.stack([bad.sum(), (bad & (den == 0)).sum()])


def report_denominators(counts, rows: int, where: str, mode: str) -> None:
    """Warn (or raise) when some of ``rows`` normalising denominators were ``<= 0``; ``counts``: how many, and how
    many of them exactly 0 (:func:`denominator_counts`). The two have different causes and remedies: a negative
    sum comes from signed features, an exact 0 from a row whose every kernel value is 0 or underflowed."""
    bad, zero = (int(c) for c in counts)
    if not bad or mode == "off":
        return
    causes = []
    if bad > zero:
        causes.append(f"{bad - zero} negative (signed features with normalize='sum'), so their output is unbounded "
                      "or sign-flipped. Remedies: non_negative=True (self-tensored features φ⊗φ, kernel "
                      "(φ(q)·φ(k))² >= 0), a non-negative map (rank-1 LLoPS with equal factors and even p, a "
                      "Taylor/Hedgehog map), normalize='none', or a hybrid window (window > 0)")
    if zero:
        causes.append(f"{zero} exactly 0 (every kernel value of the row is 0: its features are 0 or the kernel "
                      "values underflow the dtype), so their output is 0. Remedies: scale q, k (or Θ) up so that "
                      "|φ(q)·φ(k)| stays near 1, or use float64")
    msg = f"{where}: {bad} of {rows} query rows have a normalising denominator <= 0: " + "; ".join(causes) + "."
    if mode == "raise":
        raise FloatingPointError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


class DenominatorCounter:
    """Counts the normalising denominators ``<= 0`` of real query rows chunk by chunk and reports them once at the
    end (:func:`report_denominators`; one sync). Per chunk only the ``<= 0`` count is formed (what the loop
    pays); the blocks' denominators are kept (detached; copied when they are a view into a larger product, so no
    block's product outlives it: at most ``B·H·T`` numbers) so that the report, in the rare call that has one,
    can say how many of them are exactly 0 (:func:`denominator_counts`)."""

    def __init__(self):
        self.bad, self.rows, self.blocks = None, 0, []

    def add(self, den: torch.Tensor, rows: torch.Tensor | None) -> None:
        """``den [B, H, n]``; ``rows [B, n]`` bool (real queries) or None (all)."""
        den = den.detach()
        if den.untyped_storage().nbytes() > 2 * den.numel() * den.element_size():
            den = den.clone()  # a view into a larger product (a non-causal block's [φ(q)·S | φ(q)·z]): keep den alone
        rows = None if rows is None else rows[:, None, :]
        bad = den <= 0 if rows is None else (den <= 0) & rows
        count = bad.sum()
        self.bad = count if self.bad is None else self.bad + count
        self.blocks.append((den, rows))
        self.rows += den.numel()

    def report(self, where: str, mode: str) -> None:
        """:func:`report_denominators` of what was added (nothing added, or nothing ``<= 0``: nothing reported)."""
        if self.bad is None or mode == "off":
            return
        bad = int(self.bad)
        if bad:
            zero = sum(int(denominator_counts(den, rows)[1]) for den, rows in self.blocks)
            report_denominators((bad, zero), self.rows, where, mode)


# ----------------------------------------------------------------------------------------------- the recurrences
def _check_tokens(x, like: torch.Tensor, name: str, *, low: float | None = None, high: float | None = None):
    """``x [B, T, H]`` (or None) with ``like``'s first three axes, finite, in ``[low, high]``."""
    if x is None:
        return None
    x = as_float_tensor(x, name)
    want = tuple(like.shape[:3])
    if tuple(x.shape) != want:
        raise ValueError(f"{name} must have shape [B, T, H] = {want} (from the token tensors), got {tuple(x.shape)}")
    check_finite(x.detach(), name)
    for bound, bad, rule in ((low, lambda t: t < low, f">= {low}"), (high, lambda t: t > high, f"<= {high}")):
        if bound is not None and bool(bad(x.detach()).any()):
            i = tuple(int(j) for j in bad(x.detach()).nonzero()[0])
            raise ValueError(f"{name} must be {rule} everywhere, got {x[i].item()!r} at index {i}")
    return x


def _check_state(x, shape: tuple, name: str):
    """An initial-state tensor of the given shape, finite."""
    x = as_float_tensor(x, name)
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    check_finite(x.detach(), name)
    return x


def check_decayed(fq, fk, v, log_decay, initial_state):
    """The arguments of :mod:`~sketchlab.attention.ops.decayed`'s twins, checked (``log_decay <= 0``, the state a pair)."""
    fq, fk, v = check_qkv(fq, fk, v, causal=True, names=("fq", "fk", "v"))
    log_decay = _check_tokens(log_decay, fk, "log_decay", high=0.0)
    B, _, H, M = fk.shape
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError(f"initial_state must be a pair (S [B, H, M, Dv], z [B, H, M]) or None, "
                            f"got {type(initial_state).__name__}")
        initial_state = (_check_state(initial_state[0], (B, H, M, v.shape[-1]), "initial_state[0] (S)"),
                         _check_state(initial_state[1], (B, H, M), "initial_state[1] (z)"))
    return fq, fk, v, log_decay, initial_state


def check_delta(q, k, v, beta, log_alpha, initial_state):
    """The arguments of :mod:`~sketchlab.attention.ops.delta`'s twins, checked (``beta`` in ``[0, 2]``, ``log_alpha <= 0``)."""
    q, k, v = check_qkv(q, k, v, causal=True)
    if beta is None:
        raise TypeError("beta must be a tensor [B, T, H] with values in [0, 2], got None")
    beta = _check_tokens(beta, k, "beta", low=0.0, high=2.0)
    log_alpha = _check_tokens(log_alpha, k, "log_alpha", high=0.0)
    if initial_state is not None:
        B, _, H, M = k.shape
        initial_state = _check_state(initial_state, (B, H, M, v.shape[-1]), "initial_state (S)")
    return q, k, v, beta, log_alpha, initial_state
