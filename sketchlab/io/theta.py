"""The Θ export (DESIGN.md §3): a ``.safetensors`` file with ``theta_q``, ``theta_k`` of shape
``[L, H, t, p, d, m]`` and string metadata ``p, m, t, d, method, scale, source_sha256, errors``
(JSON) ``, sketchlab_version`` and ``layout``; a tied Θ (one map for both sides) is stored once, ``theta_q``
alone, with metadata ``tied = "true"`` (absent: ``"false"``, as in every file written before the key).
:func:`save_theta` checks everything by the rules :func:`load_theta` applies before writing (atomically), so
a file it wrote always loads.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from pathlib import Path

import torch

from .._validation import check_finite
from .atomic import atomic_write
from .formats import _as_tensor, _canonical_safetensors, _check_meta, _loads_json, _read_safetensors

__all__ = ["load_theta", "save_theta"]

_THETA_NAMES = ("theta_q", "theta_k")
_THETA_LAYOUT = "L,H,t,p,d,m"
_THETA_INTS = ("p", "m", "t", "d")
_THETA_STRS = ("method", "scale", "source_sha256", "sketchlab_version")
_THETA_KEYS = _THETA_INTS + _THETA_STRS + ("errors",)
#: Optional metadata: ``"true"`` when the file holds one Θ for both sides (``theta_q`` alone).
_THETA_TIED = "tied"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _check_scale_label(scale: str, label: str) -> None:
    """A Θ export's ``scale``: ``"none"``, ``"sqrt-d"`` or a positive finite number (as text)."""
    if scale in ("none", "sqrt-d"):
        return
    try:
        value = float(scale)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{label}: metadata scale must be 'none', 'sqrt-d' or a positive finite number, got {scale!r}"
        )


def _theta_meta(meta: dict, label: str) -> dict:
    """Parse and check the string metadata of a Θ export; returns typed values.

    ``p, m, t, d`` become ints (>= 1), ``errors`` a dict (parsed JSON), ``tied`` a bool (absent: False), the
    rest stay strings.
    """
    missing = [key for key in _THETA_KEYS if key not in meta]
    if missing:
        raise ValueError(
            f"{label}: metadata is missing {', '.join(map(repr, missing))}; a Θ export records "
            f"{', '.join(_THETA_KEYS)}"
        )
    out: dict = {}
    for key in _THETA_INTS:
        raw = meta[key]
        if not re.fullmatch(r"[0-9]+", raw) or int(raw) < 1:
            raise ValueError(f"{label}: metadata {key} must be a decimal integer >= 1, got {raw!r}")
        out[key] = int(raw)
    for key in _THETA_STRS:
        if not meta[key]:
            raise ValueError(f"{label}: metadata {key} must be a non-empty string, got ''")
        out[key] = meta[key]
    _check_scale_label(out["scale"], label)
    if not _SHA256.match(out["source_sha256"]):
        raise ValueError(
            f"{label}: metadata source_sha256 must be 64 lowercase hex digits (the SHA-256 of the Q/K dump), "
            f"got {out['source_sha256']!r}"
        )
    try:
        errors = _loads_json(meta["errors"], f"{label}: metadata errors")
    except json.JSONDecodeError as err:
        raise ValueError(f"{label}: metadata errors must be a JSON object, not valid JSON ({err}): {meta['errors'][:80]!r}") from err
    if not isinstance(errors, dict):
        raise ValueError(f"{label}: metadata errors must be a JSON object, got JSON {type(errors).__name__}")
    out["errors"] = errors
    tied = meta.get(_THETA_TIED, "false")
    if tied not in ("true", "false"):
        raise ValueError(f"{label}: metadata tied must be 'true' or 'false', got {tied!r}")
    out["tied"] = tied == "true"
    layout = meta.get("layout", _THETA_LAYOUT)
    if layout != _THETA_LAYOUT:
        raise ValueError(f"{label}: metadata layout must be {_THETA_LAYOUT!r} for a Θ export, got {layout!r}")
    return out


def _theta_tensors(entries: dict, meta: dict, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``theta_q``, ``theta_k`` against the parsed metadata: ``[L, H, t, p, d, m]``, same shape, finite;
    a tied file's ``theta_q`` alone, returned for both sides (the same tensor)."""
    names = _THETA_NAMES[:1] if meta["tied"] else _THETA_NAMES
    extra = sorted(set(entries) - set(names))
    if extra:
        holds = "theta_q alone (metadata tied)" if meta["tied"] else "exactly theta_q and theta_k"
        raise ValueError(f"{label}: unexpected tensor(s) {extra}; a Θ export holds {holds}")
    expect = tuple(meta[key] for key in ("t", "p", "d", "m"))
    out = []
    for name in names:
        if name not in entries:
            raise ValueError(f"{label}: tensor {name} is missing; a Θ export holds theta_q and theta_k")
        t = _as_tensor(entries[name], f"{label}: tensor {name}")
        if t.ndim != 6:
            raise ValueError(
                f"{label}: tensor {name} must have rank 6 [L, H, t, p, d, m], got rank {t.ndim} "
                f"with shape {tuple(t.shape)} (add leading axes, e.g. theta[None, None], for one head)"
            )
        if t.numel() == 0:
            raise ValueError(f"{label}: tensor {name} is empty, shape {tuple(t.shape)} ([L, H, t, p, d, m])")
        if tuple(t.shape[2:]) != expect:
            raise ValueError(
                f"{label}: tensor {name} has shape {tuple(t.shape)}, but the metadata says "
                f"[L, H, t, p, d, m] = [L, H, {', '.join(map(str, expect))}] "
                f"(t={meta['t']}, p={meta['p']}, d={meta['d']}, m={meta['m']})"
            )
        check_finite(t, f"{label}: tensor {name}")
        out.append(t)
    if meta["tied"]:
        return out[0], out[0]
    if out[0].shape != out[1].shape:
        raise ValueError(
            f"{label}: tensors theta_q {tuple(out[0].shape)} and theta_k {tuple(out[1].shape)} must have the "
            f"same shape [L, H, t, p, d, m] (pass the same tensor twice for a tied Θ)"
        )
    return out[0], out[1]


def save_theta(path, theta_q, theta_k, *, p: int, m: int, t: int, d: int, method: str, scale,
               source_sha256: str, errors: dict, sketchlab_version: str) -> Path:
    """Validate and write a learned Θ pair atomically as safetensors (DESIGN.md §3).

    Parameters
    ----------
    path : str or Path
        Must end in ``.safetensors``.
    theta_q, theta_k : Tensor or ndarray ``[L, H, t, p, d, m]``
        LLoPS factors per layer and head (:func:`sketchlab.llops.llops_features` takes one
        ``[..., t, p, d, m]``); same shape, finite floating values. For a tied Θ pass the
        same tensor object twice: it is stored once (``theta_q`` alone, metadata ``tied = "true"``).
    p, m, t, d : int >= 1
        Degree, sketch size, rank and head dimension; must equal ``shape[2:]`` as ``(t, p, d, m)``.
    method : str
        The fitting method (e.g. ``"llops"``).
    scale : str or float
        The factor the Q/K were scaled by before fitting (``"none"``, ``"sqrt-d"`` or a positive
        number, as :func:`sketchlab.compare.resolve_scale` labels it); stored as a string.
    source_sha256 : str
        SHA-256 (64 lowercase hex digits) of the Q/K dump file Θ was fitted to.
    errors : dict
        Fit errors (e.g. ``{"rel_mae": [...], ...}``), stored as JSON text (keys sorted;
        non-finite floats are written as ``NaN``/``Infinity``, which :func:`load_theta` reads back).
    sketchlab_version : str
        ``sketchlab.__version__`` of the writer.

    Returns
    -------
    Path written. The file holds tensors ``theta_q``, ``theta_k`` (``theta_q`` alone when tied) and string
    metadata ``p, m, t, d, method, scale, source_sha256, errors, sketchlab_version`` plus ``layout =
    "L,H,t,p,d,m"`` (and ``tied = "true"`` when tied).

    Notes
    -----
    Everything is checked by the same rules :func:`load_theta` applies, before anything is
    written, so a file ``save_theta`` produced always loads.
    """
    path = Path(path)
    label = str(path)
    if path.suffix.lower() != ".safetensors":
        raise ValueError(f"{path}: a Θ export must be a .safetensors file, got extension {path.suffix!r}")
    meta: dict[str, str] = {"layout": _THETA_LAYOUT}
    if theta_k is theta_q:  # one Θ for both sides: stored once (files untied keep the format they always had)
        meta[_THETA_TIED] = "true"
    for key, value in (("p", p), ("m", m), ("t", t), ("d", d)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{label}: {key} must be an integer >= 1, got {value!r} ({type(value).__name__})")
        meta[key] = str(int(value))
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{label}: scale must be 'none', 'sqrt-d' or a positive finite number, got {scale!r}")
        scale = repr(float(scale))  # the label sketchlab.compare.resolve_scale records for a number
    for key, value in (("method", method), ("scale", scale), ("source_sha256", source_sha256),
                       ("sketchlab_version", sketchlab_version)):
        if not isinstance(value, str):
            raise TypeError(f"{label}: {key} must be a string, got {value!r} ({type(value).__name__})")
        meta[key] = value
    if not isinstance(errors, dict) or not all(isinstance(key, str) for key in errors):
        raise TypeError(f"{label}: errors must be a dict with string keys, got {errors!r}")
    try:
        meta["errors"] = json.dumps(errors, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{label}: errors must be JSON-serialisable (numbers, strings, lists, dicts): {err}") from err
    parsed = _theta_meta(meta, label)
    tq, tk = _theta_tensors({"theta_q": theta_q} if parsed["tied"] else {"theta_q": theta_q, "theta_k": theta_k},
                            parsed, label)
    tensors = {"theta_q": tq} if parsed["tied"] else {"theta_q": tq, "theta_k": tk}
    tensors = {n: x.detach().cpu().contiguous().clone() for n, x in tensors.items()}  # own storage
    from safetensors.torch import save

    data = _canonical_safetensors(save(tensors, metadata=meta))
    with atomic_write(path) as tmp:
        tmp.write_bytes(data)
    return path


def load_theta(path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Load a Θ export written by :func:`save_theta` and check it against its metadata.

    Returns
    -------
    theta_q, theta_k : Tensor ``[L, H, t, p, d, m]`` (stored dtype); one tensor, returned twice, for a tied file
    meta : dict
        ``p, m, t, d`` (int), ``method``, ``scale``, ``source_sha256``, ``sketchlab_version``
        (str), ``errors`` (dict, parsed JSON), ``tied`` (bool: False for a file with both tensors, every file
        written before the key among them).

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    ValueError
        Wrong extension, unreadable file, missing or malformed metadata (each key named), a
        tensor missing, extra, of the wrong rank or of a shape that disagrees with ``t, p, d,
        m``, ``theta_q`` and ``theta_k`` of different shapes, or non-finite values; the message
        names the file, the tensor or key, and the rule.
    """
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise ValueError(f"{path}: a Θ export must be a .safetensors file, got extension {path.suffix!r}")
    entries, meta = _read_safetensors(path)
    meta = _check_meta(meta, str(path))
    parsed = _theta_meta(meta, str(path))
    tq, tk = _theta_tensors(entries, parsed, str(path))
    return tq, tk, parsed
