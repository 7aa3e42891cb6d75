"""Input checks shared by the public entry points.

Each public function validates once, at its entry, with these helpers. Every error names the
parameter, the rule it broke and the offending value, so a user can fix the call without reading
the source.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import weakref

import numpy as np
import torch

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_WORK",
    "InvalidParameterError",
    "MAX_DEGREE",
    "MAX_SYMMETRIC_INDEX",
    "SUPPORTED_FLOAT_DTYPES",
    "as_float_tensor",
    "check_choice",
    "check_tensor_storage",
    "check_memory",
    "check_degree",
    "check_finite",
    "check_flag",
    "check_fraction",
    "check_int",
    "check_nonnegative_int",
    "check_pair",
    "check_positive_int",
    "check_real",
    "check_seed",
    "check_symmetric_features",
    "check_work",
    "per_version",
    "symmetric_feature_cost",
]


#: The one memory budget (bytes) for any single allocation that grows with n², d^p, D² or the
#: number of p-multisets: 4 GiB. Functions that allocate such a tensor take ``max_bytes`` (default
#: this) and call :func:`check_memory` *before* allocating.
DEFAULT_MAX_BYTES = 4 * 2**30


def check_memory(nbytes: int, *, what: str, way_out: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """Raise ``ValueError`` if an allocation of ``nbytes`` would exceed ``max_bytes``.

    Call it before allocating. ``what`` names the tensor and its shape (``"the n×n kernel of
    layer 0 (20000 x 20000 float64)"``), ``way_out`` what the user can change; the message adds the
    size, the budget and ``or raise max_bytes``. ``nbytes`` may be a Python int of any size (count
    multiset sizes with :func:`math.comb`, never by enumerating them).
    """
    max_bytes = check_positive_int(max_bytes, "max_bytes")
    if nbytes > max_bytes:
        raise ValueError(
            f"{what} would take {nbytes / 2**30:.3g} GiB, over the memory budget max_bytes="
            f"{max_bytes / 2**30:.3g} GiB; {way_out}, or raise max_bytes"
        )


#: The one work budget (multiply-adds) of a run whose cost grows with d^p or the number of p-multisets
#: (the HOPM searches of ``sketchlab verify``): about ten minutes on one CPU core at ~2e9 multiply-adds/s.
#: Functions that start such work estimate it first and call :func:`check_work`.
DEFAULT_MAX_WORK = 1e12

#: Most entries ``p · C(d+p-1, p)`` of the symmetric multiset index (:func:`sketchlab.symmetric_index`)
#: a run enumerates: the index is built in Python at ~3 µs an entry on a shared 2-core machine, so this
#: bound (8.4e6 entries) keeps it to about half a minute (d=64: p <= 4; d=32: p <= 5; d=8: p <= 17).
MAX_SYMMETRIC_INDEX = 2**23

#: Seconds per index entry of :data:`MAX_SYMMETRIC_INDEX` (measured: 245 157 multisets of d=8, p=16 in
#: 10.5 s under load), for the estimate in the message only.
_SECONDS_PER_INDEX_ENTRY = 3e-6


def _duration(seconds: float) -> str:
    """``seconds`` in the unit a reader takes in at once (s, min, h, days, years)."""
    for unit, size in (("years", 3.15e7), ("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def check_work(work: float, *, what: str, way_out: str, max_work: float = DEFAULT_MAX_WORK) -> None:
    """Raise ``ValueError`` if ``work`` estimated multiply-adds exceed ``max_work``; the work-time twin of
    :func:`check_memory`. Call it where the work starts, before any of it; ``what`` names the work and its
    sizes, ``way_out`` what the user can change. The message gives the time at ~2e9 multiply-adds a second."""
    if not work <= max_work:  # NaN and inf too
        raise ValueError(
            f"{what} would take about {work:.3g} multiply-adds (~{_duration(work / 2e9)} at ~2e9 a second on one "
            f"core), over the work budget of {max_work:.3g} (~{_duration(max_work / 2e9)}); {way_out}"
        )


def symmetric_feature_cost(d: int, p: int) -> tuple[int, int]:
    """``(D, entries)``: the exact symmetric feature count ``D = C(d+p-1, p)`` and the ``p · D`` entries
    of its multiset index (each enumerated in Python). Exact integers of any size, never enumerated."""
    count = math.comb(d + p - 1, p)
    return count, p * count


def check_symmetric_features(d: int, p: int, rows: int, *, where: str, lower_p: str, fewer_rows: str,
                             max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Refuse, before any work, a run that needs the exact symmetric features of ``rows`` vectors of
    dimension ``d`` at degree ``p`` (the Theorem 3.1 optimum every report is measured against): when
    enumerating their index takes more than :data:`MAX_SYMMETRIC_INDEX` entries, ``ValueError`` naming the
    count, the estimated time and ``lower_p`` (how to lower p: only p and d set it); when the ``rows × D``
    float64 features exceed ``max_bytes``, :func:`check_memory`'s, with ``lower_p`` and ``fewer_rows``.
    Returns ``D``."""
    count, entries = symmetric_feature_cost(d, p)
    if entries > MAX_SYMMETRIC_INDEX:
        raise ValueError(
            f"{where}: the exact symmetric features of degree p={p} in d={d} number C(d+p-1, p) = {count:.4g}; "
            f"enumerating them ({entries:.3g} index entries, ~{_duration(entries * _SECONDS_PER_INDEX_ENTRY)}) "
            f"is over the bound of {MAX_SYMMETRIC_INDEX:.3g} entries "
            f"(~{_duration(MAX_SYMMETRIC_INDEX * _SECONDS_PER_INDEX_ENTRY)}); {lower_p}"
        )
    check_memory(rows * count * 8, what=f"{where}: the symmetric features of {rows} tokens ({rows} x {count} float64)",
                 way_out=f"{lower_p}, or {fewer_rows}", max_bytes=max_bytes)
    return count


#: Floating dtypes the math accepts. float8 types are floating point to torch, but most operations
#: (matmul, pow, SVD) are not implemented for them and their 2-3 mantissa bits make every error
#: metric meaningless: they are rejected with a hint to upcast.
SUPPORTED_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Largest polynomial degree accepted. Beyond it ``(qᵀk)^p`` overflows float64 for ``|qᵀk| >= 2``
#: (``2**1024`` exceeds the largest float64) and underflows for ``|qᵀk| <= 1/2``, so no data
#: gives a usable kernel; it also keeps exact counts such as ``d**p`` cheap to compute.
MAX_DEGREE = 1024


def check_tensor_storage(x: torch.Tensor, name: str, *, allow_meta: bool = True) -> None:
    """Reject tensors without ordinary dense storage (and, unless ``allow_meta``, without values).

    Sparse layouts (COO, CSR, …) break element-wise checks and reshapes: ``TypeError`` naming
    ``name`` and the way out. ``meta`` tensors (shapes only) pass through shape-level functions
    (feature maps follow their input's device), but data entry points reject them
    (``allow_meta=False``, via :func:`check_finite`): they have no values to fit or check.
    """
    if x.layout != torch.strided:
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got layout {x.layout}; convert it with .to_dense()"
        )
    if x.is_meta and not allow_meta:
        raise TypeError(
            f"{name} is a 'meta' tensor (shape only, no values, e.g. from a model built on the meta device); "
            "load or materialise the weights before passing it"
        )


def as_float_tensor(x, name: str) -> torch.Tensor:
    """Return ``x`` as a floating-point tensor (numpy arrays are converted without copying).

    Raises ``TypeError`` for anything that is not a tensor or array, for integer, boolean or
    complex dtypes (the polynomial kernel of integer inputs overflows silently, and complex
    inputs have no meaning here), for float8 dtypes (see :data:`SUPPORTED_FLOAT_DTYPES`), and for
    sparse or ``meta`` tensors (:func:`check_tensor_storage`).
    """
    if isinstance(x, np.ndarray):
        if x.dtype.kind != "f":
            raise TypeError(
                f"{name} must have a real floating-point dtype (float16/float32/float64), got numpy {x.dtype}"
            )
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    check_tensor_storage(x, name)
    if x.dtype not in SUPPORTED_FLOAT_DTYPES:
        hint = "; upcast it first, e.g. x.float()" if x.dtype.is_floating_point else ""
        raise TypeError(
            f"{name} must have a real floating-point dtype (float16/bfloat16/float32/float64), "
            f"got {x.dtype}{hint}"
        )
    return x


def check_finite(x: torch.Tensor, name: str, *, allow_meta: bool = False) -> None:
    """Raise ``ValueError`` naming the count and first index of non-finite entries of ``x``.

    A ``meta`` tensor has no values: ``TypeError`` unless ``allow_meta`` (then nothing is checked;
    used by feature maps, which only follow their input's shape and device).
    """
    if x.is_meta:
        check_tensor_storage(x, name, allow_meta=allow_meta)
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must be finite: {int(bad.sum())} non-finite value(s) of {x.numel()}, "
            f"the first at index {first} ({x[first].item()})"
        )


def per_version(store: dict, x: torch.Tensor, compute):
    """``compute()``, remembered in ``store`` for this very tensor ``x`` and its in-place version: a
    decoding loop passes one Θ every token (an inference tensor, which has no version, or one not
    weak-referenceable: computed every time)."""
    entry = store.get(id(x))
    if entry is not None and entry[0]() is x and entry[1] == x._version:
        return entry[2]
    value = compute()
    if len(store) > 256:  # dead or stale entries: start afresh
        store.clear()
    with contextlib.suppress(TypeError, RuntimeError):
        store[id(x)] = (weakref.ref(x), x._version, value)
    return value


class InvalidParameterError(ValueError, TypeError):
    """An argument of the wrong type, raised by the scalar rules below (:func:`check_int`, :func:`check_real`,
    :func:`check_flag`, :func:`check_choice`): a ``TypeError`` by Python's convention, and a ``ValueError`` too,
    so that callers catching either (the CLIs' and loaders' ``except ValueError``, the attention options' rules,
    which raised it) keep catching it; scikit-learn's ``InvalidParameterError`` does the same. A right type with
    a wrong value raises a plain ``ValueError``."""


# The scalar rules: the one copy of each, used by every argument check and by the attention options
# (sketchlab.attention.options). Each error names the argument, states the whole rule and shows the value.


def check_int(value, name: str, lo: int) -> int:
    """An integer rule: ``value`` an integer (not a bool) ``>= lo``.

    Parameters
    ----------
    value
    name : str
        The argument's name in the error.
    lo : int

    Returns
    -------
    int

    Raises
    ------
    InvalidParameterError
        Not an integer (or a bool).
    ValueError
        Below ``lo``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidParameterError(f"{name} must be an integer >= {lo}, got {value!r} ({type(value).__name__})")
    if value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value}")
    return int(value)


def check_positive_int(value, name: str) -> int:
    """Return ``value`` as ``int`` if it is an integer ``>= 1`` (bools are rejected): :func:`check_int`."""
    return check_int(value, name, 1)


def check_nonnegative_int(value, name: str) -> int:
    """Return ``value`` as ``int`` if it is an integer ``>= 0`` (bools are rejected): :func:`check_int`."""
    return check_int(value, name, 0)


def check_real(value, name: str, *, positive: bool | None = None, lo: float = -math.inf, lo_open: bool = False,
               hi: float | None = None) -> float:
    """A real rule: ``value`` a finite real (not a bool) ``>= lo`` (``> lo`` if ``lo_open``; ``lo = -inf``:
    unbounded below) and ``<= hi``; the error states the whole rule, each bound as given (``0`` or ``0.0``).

    Parameters
    ----------
    value
    name : str
        The argument's name in the error.
    positive : bool, optional
        The common bounds in one word: ``> 0`` (True) or ``>= 0`` (False), i.e. ``lo=0, lo_open=positive``.
    lo, lo_open, hi
        The bounds otherwise.

    Returns
    -------
    float

    Raises
    ------
    InvalidParameterError
        Not a real number (or a bool).
    ValueError
        Not finite, or out of the bounds.
    """
    if positive is not None:
        lo, lo_open = 0, positive
    bounds = ([] if lo == -math.inf else [f"{'>' if lo_open else '>='} {lo}"]) + ([] if hi is None else [f"<= {hi}"])
    rule = f"{name} must be a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidParameterError(f"{rule}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        raise ValueError(f"{rule}, got {value!r}")
    return float(value)


def check_flag(value, name: str) -> bool:
    """A flag rule: ``value`` a Python bool (else :class:`InvalidParameterError`, a ``TypeError``).

    Parameters
    ----------
    value
    name : str
        The argument's name in the error.

    Returns
    -------
    bool
    """
    if not isinstance(value, bool):
        raise InvalidParameterError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_choice(value, name: str, choices) -> str:
    """A choice rule: ``value`` one of the strings ``choices`` (a string not among them: ``ValueError``; not a
    string: :class:`InvalidParameterError`, a ``ValueError`` too).

    Parameters
    ----------
    value
    name : str
        The argument's name in the error.
    choices : tuple of str

    Returns
    -------
    str
    """
    if not isinstance(value, str):
        raise InvalidParameterError(f"{name} must be one of {list(choices)}, got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_degree(p) -> int:
    """Validate the polynomial degree ``p``: an integer with ``1 <= p <=`` :data:`MAX_DEGREE`."""
    p = check_positive_int(p, "p (the polynomial degree)")
    if p > MAX_DEGREE:
        raise ValueError(
            f"p (the polynomial degree) must be at most {MAX_DEGREE}, got {p}: beyond it (qᵀk)^p overflows "
            "float64 for |qᵀk| >= 2 and underflows for |qᵀk| <= 1/2, so no input gives a usable kernel"
        )
    return p


#: Seeds must fit torch's generator state (a 64-bit integer).
_SEED_RANGE = (-(2**63), 2**64 - 1)


def check_seed(seed, name: str = "seed") -> int:
    """Return ``seed`` as ``int`` if it is an integer that ``torch.Generator.manual_seed`` takes.

    torch accepts ``[-2**63, 2**64 - 1]``; outside it raises an opaque ``RuntimeError``
    ("Overflow when unpacking long long"), so the range is checked here, naming ``name``.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {seed!r} ({type(seed).__name__})")
    lo, hi = _SEED_RANGE
    if not lo <= seed <= hi:
        raise ValueError(f"{name} must lie in [-2**63, 2**64 - 1] (a 64-bit generator seed), got {seed}")
    return int(seed)


def check_fraction(value, name: str) -> float:
    """Validate a fraction in ``[0, 1)``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number in [0, 1), got {value!r}")
    if not 0 <= value < 1:
        raise ValueError(f"{name} must lie in [0, 1), got {value}")
    return float(value)


def check_pair(q, k, *, names: tuple[str, str] = ("q", "k")) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a query/key pair ``q[..., n_q, d]``, ``k[..., n_k, d]``.

    Rules: both are real floating tensors of rank >= 2 with at least one token and one
    coordinate, the same feature dimension ``d``, the same leading (batch) shape, and finite
    values. Returns the pair as tensors (numpy input converted), dtypes unchanged.
    """
    nq, nk = names
    q = as_float_tensor(q, nq)
    k = as_float_tensor(k, nk)
    for x, name in ((q, nq), (k, nk)):
        if x.ndim < 2:
            raise ValueError(
                f"{name} must have shape [..., n, d] (rank >= 2), got rank {x.ndim} "
                f"with shape {tuple(x.shape)}"
            )
        if x.shape[-1] == 0 or x.shape[-2] == 0:
            raise ValueError(f"{name} must have n >= 1 tokens and d >= 1 coordinates, got shape {tuple(x.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{nq} and {nk} must share the feature dimension d (last axis): "
            f"{nq} has d={q.shape[-1]}, {nk} has d={k.shape[-1]}"
        )
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(
            f"{nq} and {nk} must have the same leading (batch) shape: "
            f"{nq} {tuple(q.shape[:-2])} vs {nk} {tuple(k.shape[:-2])}"
        )
    check_finite(q, nq)
    check_finite(k, nk)
    return q, k

