"""Q/K dumps: load, validate and save the query/key (and value) tensors that sketches are fitted to.

A *dump* holds tensors ``q``, ``k`` and optionally ``v``, each of layout ``[L, H, n, d]``
(layers, heads, tokens, head dimension), ``[H, n, d]`` or ``[n, d]``, plus string metadata
(DESIGN.md §3: ``source``, ``layout``, ``scale``). :func:`load_qk` normalises every layout to
``[L, H, n, d]`` and validates once; :func:`save_qk` writes atomically.

File formats
------------
``.safetensors`` (preferred)
    Tensors ``q``, ``k``, ``v``; metadata in the safetensors header (str → str).
``.pt``
    A ``dict`` read with ``torch.load(weights_only=True)``: ``{"q": T, "k": T, "v": T,
    "meta": {str: str}}``.
``.npz``
    Arrays ``q``, ``k``, ``v`` and optionally ``__metadata__``, a 0-d string array holding a JSON
    object of strings (read with ``allow_pickle=False``).
``.npy``
    One array per file, so a dump is a set of sibling files ``NAME.q.npy``, ``NAME.k.npy``,
    optional ``NAME.v.npy`` and optional ``NAME.meta.json``; pass any of them (or
    ``NAME.npy`` where that file does not exist) to :func:`load_qk`. A *single* ``.npy`` array
    (e.g. q and k stacked as ``[2, ...]``) is rejected: its leading axis could be the q/k pair or
    the layers, and guessing would silently fit the wrong tensors.

Dict keyed by layer
-------------------
Instead of one ``q`` tensor a file may hold one tensor per layer, ``[H, n, d]`` or ``[n, d]``:
keys ``q.0, q.1, …`` (and ``k.i``, ``v.i``) in ``.safetensors``, ``.pt`` and ``.npz``, or, in ``.pt``, a nested
``{"q": {0: T, 1: T, …}, …}`` with integer (or digit-string) keys. Layers must be numbered
``0 … L-1`` without gaps and share one shape; they are stacked on a new leading axis.

Validation (each rejection names the file, the tensor and the rule): unknown extension,
unreadable / truncated / corrupt file, missing ``q`` or ``k``, unexpected entries,
non-floating dtype, rank not in {2, 3, 4}, a ``layout`` metadata entry that disagrees with the
rank, empty tensors, ``q`` and ``k`` of different shapes, ``v`` not matching ``k`` in
``[L, H, n]``, and non-finite values (count and first index).

Layer / head selections (:func:`load_qk`, :func:`sketchlab.compare`) go through
:func:`select_indices`: negative indices count from the end, duplicates are rejected.

Θ export
--------
:func:`save_theta` / :func:`load_theta` (DESIGN.md §3): a ``.safetensors`` file with
``theta_q``, ``theta_k`` of shape ``[L, H, t, p, d, m]`` and string metadata ``p, m, t, d,
method, scale, source_sha256, errors`` (JSON) ``, sketchlab_version`` and ``layout``; loading
checks the shapes against the metadata.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ._validation import check_finite

__all__ = [
    "QKDump", "as_lhnd", "atomic_write", "load_qk", "load_theta", "save_qk", "save_theta", "select_indices", "validate_qk",
]

_EXTENSIONS = (".safetensors", ".pt", ".npz", ".npy")
_LAYOUTS = {2: "n,d", 3: "H,n,d", 4: "L,H,n,d"}
_NAMES = ("q", "k", "v")
_LAYER_KEY = re.compile(r"^([qkv])\.(\d+)$")


@dataclass
class QKDump:
    """A validated dump: ``q``, ``k`` (and ``v`` or ``None``) of shape ``[L, H, n, d]``.

    ``meta`` holds the file's string metadata (``source``, ``layout``, ``scale``, …) and
    ``path`` the file read (``None`` for dumps built in memory).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None = None
    meta: dict[str, str] = field(default_factory=dict)
    path: Path | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(L, H, n, d)`` of ``q``."""
        return tuple(self.q.shape)  # type: ignore[return-value]


@contextlib.contextmanager
def atomic_write(path):
    """Yield a temporary path beside ``path``; on success ``os.replace`` it onto ``path``.

    Readers never see a half-written file: either the old file or the complete new one. On any
    exception the temporary file is removed and the target is left untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------------------------
# reading raw entries


def _npy_parts(path: Path) -> dict[str, Path]:
    """Sibling files of a ``.npy`` dump: ``{"q": NAME.q.npy, "k": …, "v": …, "meta": NAME.meta.json}``."""
    stem = path.name[: -len(".npy")]
    for name in _NAMES:
        if stem.endswith("." + name):
            stem = stem[: -2]
            break
    base = path.parent / stem
    parts = {name: Path(f"{base}.{name}.npy") for name in _NAMES}
    parts["meta"] = Path(f"{base}.meta.json")
    return parts


def _read_raw(path: Path) -> tuple[dict, dict]:
    """Return ``(entries, meta)`` as stored; ``entries`` maps names to tensors/arrays/dicts."""
    ext = path.suffix.lower()
    if ext not in _EXTENSIONS:
        raise ValueError(
            f"{path}: unknown extension {path.suffix!r}; a Q/K dump must end in one of {', '.join(_EXTENSIONS)}"
        )
    if ext == ".npy":
        parts = _npy_parts(path)
        single = path.is_file() and path not in (parts["q"], parts["k"], parts["v"])
        if single:
            arr = _np_load(path)
            hint = (
                "its leading axis of size 2 could be the (q, k) pair or L=2 layers"
                if arr.ndim >= 1 and arr.shape[0] == 2
                else "one array cannot hold both q and k"
            )
            raise ValueError(
                f"{path}: a single .npy array of shape {tuple(arr.shape)} is ambiguous ({hint}); save q and k "
                f"as sibling files NAME.q.npy and NAME.k.npy (see save_qk) or use .npz/.safetensors"
            )
        if not parts["q"].is_file() and not parts["k"].is_file():
            raise FileNotFoundError(f"{path}: no such dump (looked for {parts['q']} and {parts['k']})")
        entries = {name: _np_load(parts[name]) for name in _NAMES if parts[name].is_file()}
        meta = {}
        if parts["meta"].is_file():
            try:
                meta = json.loads(parts["meta"].read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{parts['meta']}: corrupt metadata file, not JSON ({err})") from err
        return entries, meta
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes), not a {ext} dump")
    if ext == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
                entries = {key: f.get_tensor(key) for key in f.keys()}
        except Exception as err:  # safetensors raises SafetensorError/OSError/ValueError for bad files
            raise ValueError(f"{path}: unreadable safetensors file (truncated or corrupt): {err}") from err
        return entries, meta
    if ext == ".pt":
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises RuntimeError/UnpicklingError/EOFError for bad files
            raise ValueError(f"{path}: unreadable .pt file (truncated, corrupt or not weights-only): {err}") from err
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: a .pt dump must hold a dict with 'q' and 'k', got {type(obj).__name__}")
        obj = dict(obj)
        meta = obj.pop("meta", {})
        return obj, meta
    # .npz
    try:
        with np.load(str(path), allow_pickle=False) as z:
            entries = {key: z[key] for key in z.files}
    except Exception as err:  # zipfile.BadZipFile, ValueError, EOFError, OSError
        raise ValueError(f"{path}: unreadable .npz file (truncated or corrupt): {err}") from err
    meta = {}
    if "__metadata__" in entries:
        raw = entries.pop("__metadata__")
        try:
            meta = json.loads(str(raw.item()))
        except (json.JSONDecodeError, ValueError) as err:
            raise ValueError(f"{path}: __metadata__ must be a 0-d string array holding a JSON object ({err})") from err
    return entries, meta


def _np_load(path: Path) -> np.ndarray:
    try:
        arr = np.load(str(path), allow_pickle=False)
    except Exception as err:  # ValueError/EOFError/OSError/UnpicklingError
        raise ValueError(f"{path}: unreadable .npy file (truncated or corrupt): {err}") from err
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{path}: expected a .npy array, got {type(arr).__name__}")
    return arr


# --------------------------------------------------------------------------------------------
# validation


def _as_tensor(x, where: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype.kind != "f":
            raise ValueError(f"{where} must be a floating-point array, got dtype {x.dtype}")
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where} must be a tensor or array, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{where} must have a real floating-point dtype, got {x.dtype}")
    return x


def _layer_index(key, where: str) -> int:
    if isinstance(key, bool):
        raise ValueError(f"{where}: layer keys must be integers, got {key!r}")
    if isinstance(key, int):
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    raise ValueError(f"{where}: layer keys must be integers (or digit strings), got {key!r}")


def _stack_layers(layers: dict[int, object], where: str) -> torch.Tensor:
    """Stack ``{layer: [H, n, d] or [n, d]}`` into ``[L, H, n, d]``; layers ``0 … L-1``, one shape."""
    if not layers:
        raise ValueError(f"{where} is an empty dict of layers")
    idx = sorted(layers)
    if idx != list(range(len(idx))):
        raise ValueError(f"{where}: layers must be numbered 0..L-1 without gaps, got {idx}")
    out = []
    for i in idx:
        t = _as_tensor(layers[i], f"{where}[layer {i}]")
        if t.ndim not in (2, 3):
            raise ValueError(
                f"{where}[layer {i}] must have rank 2 [n, d] or 3 [H, n, d], got rank {t.ndim} shape {tuple(t.shape)}"
            )
        t = t if t.ndim == 3 else t[None]  # [H, n, d]
        if out and t.shape != out[0].shape:
            raise ValueError(
                f"{where}: every layer must have the same shape, layer 0 has {tuple(out[0].shape)}, "
                f"layer {i} has {tuple(t.shape)}"
            )
        out.append(t)
    return torch.stack(out)  # [L, H, n, d]


def _check_layout(meta: dict, rank: int, where: str) -> None:
    layout = meta.get("layout")
    if layout is None:
        return
    norm = re.sub(r"[\s\[\]()]", "", str(layout))
    if norm not in _LAYOUTS.values():
        raise ValueError(
            f"{where}: metadata layout {layout!r} is not one of {sorted(_LAYOUTS.values(), key=len)}"
        )
    if norm != _LAYOUTS[rank]:
        raise ValueError(f"{where}: metadata layout {layout!r} disagrees with the tensor rank {rank} ({_LAYOUTS[rank]})")


def _normalise(entries: dict, meta: dict, label: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Turn raw entries into validated ``q, k, v`` of shape ``[L, H, n, d]``."""
    plain: dict[str, object] = {}
    per_layer: dict[str, dict[int, object]] = {}
    for key, value in entries.items():
        m = _LAYER_KEY.match(str(key))
        if key in _NAMES:
            if isinstance(value, dict):
                per_layer[key] = {_layer_index(i, f"{label}: {key}"): t for i, t in value.items()}
            else:
                plain[key] = value
        elif m:
            per_layer.setdefault(m.group(1), {})[int(m.group(2))] = value
        else:
            raise ValueError(
                f"{label}: unexpected entry {key!r}; a dump holds 'q', 'k', optional 'v' "
                f"(or per-layer 'q.0', 'k.0', …)"
            )
    tensors: dict[str, torch.Tensor] = {}
    for name in _NAMES:
        if name in plain and name in per_layer:
            raise ValueError(f"{label}: tensor {name} is given both whole ('{name}') and per layer ('{name}.i')")
        if name in plain:
            t = _as_tensor(plain[name], f"{label}: tensor {name}")
            if t.ndim in _LAYOUTS:
                _check_layout(meta, t.ndim, f"{label}: tensor {name}")
            tensors[name] = as_lhnd(t, f"{label}: tensor {name}")
        elif name in per_layer:
            tensors[name] = _stack_layers(per_layer[name], f"{label}: tensor {name}")
    for name in ("q", "k"):
        if name not in tensors:
            raise ValueError(f"{label}: tensor {name} is missing; a dump must hold both 'q' and 'k'")
    for name, t in tensors.items():
        if t.numel() == 0:
            raise ValueError(f"{label}: tensor {name} is empty, shape {tuple(t.shape)} ([L, H, n, d])")
    q, k, v = tensors["q"], tensors["k"], tensors.get("v")
    if q.shape != k.shape:
        raise ValueError(f"{label}: tensors q and k must have the same shape [L, H, n, d], got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if v is not None and v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"{label}: tensor v must match k in [L, H, n], got v {tuple(v.shape)} and k {tuple(k.shape)}"
        )
    for name, t in tensors.items():
        check_finite(t, f"{label}: tensor {name}")
    return q, k, v


def _check_meta(meta, label: str) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise ValueError(f"{label}: metadata must be a dict of strings, got {type(meta).__name__}")
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(
                f"{label}: metadata must map strings to strings (JSON-encode anything else), "
                f"got {key!r}: {value!r} ({type(value).__name__})"
            )
    return dict(meta)


def as_lhnd(x: torch.Tensor, where: str) -> torch.Tensor:
    """Normalise ``[n, d]``, ``[H, n, d]`` or ``[L, H, n, d]`` to ``[L, H, n, d]`` (a view).

    Missing leading axes become size 1. Any other rank raises ``ValueError`` naming ``where``
    (e.g. ``"dump.safetensors: tensor q"``), the accepted layouts and the shape.
    """
    if x.ndim not in _LAYOUTS:
        raise ValueError(
            f"{where} must have rank 2 [n, d], 3 [H, n, d] or 4 [L, H, n, d], "
            f"got rank {x.ndim} with shape {tuple(x.shape)}"
        )
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))  # [L, H, n, d]


def validate_qk(q, k, v=None, *, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Apply the dump rules (module docstring) to in-memory ``q``, ``k`` (and ``v``).

    Returns ``(q, k, v)`` normalised to ``[L, H, n, d]`` (``v`` may be ``None``), dtypes kept.
    Every rejection names ``where`` (a file or ``"capture_qk"``, …), the tensor and the rule.
    This is the check :func:`load_qk` and :func:`save_qk` run, so anything it accepts saves
    and loads.
    """
    entries = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    return _normalise(entries, {}, where)


def select_indices(index, size: int, what: str, where: str) -> list[int]:
    """Validate a selection of ``what`` (``"layer"``/``"head"``) positions on an axis of ``size``.

    Rules: ``None`` selects all (``0 … size-1``); otherwise one integer or a non-empty list /
    tuple of integers (bools rejected). Negative indices count from the end, as in Python
    (``-1`` is the last), and are returned as their non-negative position. Duplicates, after
    that normalisation (``0`` and ``-size`` are the same position), are rejected: a repeated
    layer or head would be fitted and reported twice. The given order is kept.

    Every error is a ``ValueError`` naming ``where`` (the dump), the index and the valid range.
    """
    if index is None:
        return list(range(size))
    if isinstance(index, numbers.Integral) and not isinstance(index, bool):
        index = [index]
    if not isinstance(index, (list, tuple)) or not index:
        raise ValueError(f"{where}: {what}s must be a non-empty list of integers, got {index!r}")
    out = []
    for i in index:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise ValueError(f"{where}: {what}s must be a list of integers, got {list(index)!r}")
        if not -size <= i < size:
            raise ValueError(
                f"{where}: {what} {i} is out of range: the dump has {size} {what}s "
                f"(valid indices 0..{size - 1}, or -{size}..-1 from the end)"
            )
        out.append(int(i) % size)
    dups = sorted({i for i in out if out.count(i) > 1})
    if dups:
        raise ValueError(
            f"{where}: {what}s contain duplicates: {list(index)!r} selects position(s) {dups} more than once"
        )
    return out


def _canonical_safetensors(raw: bytes) -> bytes:
    """Rewrite a safetensors buffer's JSON header in a fixed key order (same tensors, same bytes).

    safetensors serialises ``__metadata__`` from a hash map whose iteration order changes from
    process to process, so the same dump would get different file bytes (and checksums) on each
    run. The header is re-emitted with ``__metadata__`` first, its keys sorted, then the tensor
    entries in data order, padded with spaces to a multiple of 8 bytes as the format requires;
    the data section is copied unchanged.
    """
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    ordered = {} if meta is None else {"__metadata__": dict(sorted(meta.items()))}
    ordered.update(sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])))
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + raw[8 + n :]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: such tensors are widened to float32 (exactly) for .npy/.npz."""
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


# --------------------------------------------------------------------------------------------
# public API


def load_qk(path, *, layers=None, heads=None) -> QKDump:
    """Load and validate a Q/K dump, normalised to ``[L, H, n, d]``.

    Parameters
    ----------
    path : str or Path
        ``.safetensors``, ``.pt``, ``.npz`` or ``.npy`` (see the module docstring for each format).
    layers, heads : list of int, optional
        Keep only these layer / head indices (in the given order; negative indices count from
        the end; duplicates are rejected, see :func:`select_indices`). Out-of-range indices
        raise ``ValueError`` naming the file and the valid range.

    Returns
    -------
    QKDump
        ``q``, ``k`` (and ``v`` or ``None``) of shape ``[L', H', n, d]`` in the stored dtype,
        ``meta`` (str → str) and ``path``.

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    ValueError
        Any validation rule (module docstring); the message names the file, tensor and rule.
    """
    path = Path(path)
    entries, meta = _read_raw(path)
    meta = _check_meta(meta, str(path))
    q, k, v = _normalise(entries, meta, str(path))
    tensors = [q, k, v]
    for axis, index, what in ((0, layers, "layer"), (1, heads, "head")):
        keep = torch.tensor(select_indices(index, q.shape[axis], what, str(path)))
        tensors = [None if t is None else t.index_select(axis, keep) for t in tensors]
    return QKDump(q=tensors[0], k=tensors[1], v=tensors[2], meta=meta, path=path)


def save_qk(path, q, k, v=None, meta=None) -> Path:
    """Validate and write a Q/K dump atomically; returns the path written.

    Parameters
    ----------
    path : str or Path
        Extension picks the format. For ``.npy`` the dump is written as sibling files
        ``NAME.q.npy``, ``NAME.k.npy`` (``NAME.v.npy``, ``NAME.meta.json``) and ``path`` may be
        ``NAME.npy`` or ``NAME.q.npy``; the returned path is ``NAME.q.npy``.
    q, k : Tensor or ndarray ``[n, d]``, ``[H, n, d]`` or ``[L, H, n, d]``
        Same shape; finite floating values.
    v : Tensor or ndarray, optional
        Same ``[L, H, n]`` as ``k``.
    meta : dict of str, optional
        Metadata (DESIGN.md §3: ``source``, ``scale``, …). ``layout`` is set to
        ``"L,H,n,d"``: tensors are written normalised to rank 4.

    Notes
    -----
    The same rules as :func:`load_qk` apply before anything is written, so a file that
    ``save_qk`` produced always loads.
    """
    path = Path(path)
    label = str(path)
    ext = path.suffix.lower()
    if ext not in _EXTENSIONS:
        raise ValueError(f"{path}: unknown extension {path.suffix!r}; use one of {', '.join(_EXTENSIONS)}")
    meta = _check_meta(meta, label)
    meta.pop("layout", None)  # validated against the normalised rank below
    entries = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    tq, tk, tv = _normalise(entries, {}, label)
    meta["layout"] = _LAYOUTS[4]
    tensors = {"q": tq, "k": tk} if tv is None else {"q": tq, "k": tk, "v": tv}
    tensors = {n: t.detach().cpu().contiguous().clone() for n, t in tensors.items()}  # own storage
    if ext == ".safetensors":
        from safetensors.torch import save

        data = _canonical_safetensors(save(tensors, metadata=meta))
        with atomic_write(path) as tmp:
            tmp.write_bytes(data)
        return path
    if ext == ".pt":
        with atomic_write(path) as tmp:
            torch.save({**tensors, "meta": meta}, str(tmp))
        return path
    if ext == ".npz":
        arrays = {n: _to_numpy(t) for n, t in tensors.items()}
        arrays["__metadata__"] = np.array(json.dumps(meta, sort_keys=True))
        with atomic_write(path) as tmp:
            with open(tmp, "wb") as fh:
                np.savez(fh, **arrays)
        return path
    parts = _npy_parts(path)
    for name, t in tensors.items():
        with atomic_write(parts[name]) as tmp:
            with open(tmp, "wb") as fh:
                np.save(fh, _to_numpy(t), allow_pickle=False)
    if tv is None and parts["v"].is_file():
        os.unlink(parts["v"])  # a stale v from an earlier dump of the same name would be read back
    with atomic_write(parts["meta"]) as tmp:
        Path(tmp).write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n")
    return parts["q"]


# --------------------------------------------------------------------------------------------
# Θ export (DESIGN.md §3)

_THETA_NAMES = ("theta_q", "theta_k")
_THETA_LAYOUT = "L,H,t,p,d,m"
_THETA_INTS = ("p", "m", "t", "d")
_THETA_STRS = ("method", "scale", "source_sha256", "sketchlab_version")
_THETA_KEYS = _THETA_INTS + _THETA_STRS + ("errors",)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _theta_meta(meta: dict, label: str) -> dict:
    """Parse and check the string metadata of a Θ export; returns typed values.

    ``p, m, t, d`` become ints (>= 1), ``errors`` a dict (parsed JSON), the rest stay strings.
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
    if not _SHA256.match(out["source_sha256"]):
        raise ValueError(
            f"{label}: metadata source_sha256 must be 64 lowercase hex digits (the SHA-256 of the Q/K dump), "
            f"got {out['source_sha256']!r}"
        )
    try:
        errors = json.loads(meta["errors"])
    except json.JSONDecodeError as err:
        raise ValueError(f"{label}: metadata errors must be a JSON object, not valid JSON ({err}): {meta['errors'][:80]!r}") from err
    if not isinstance(errors, dict):
        raise ValueError(f"{label}: metadata errors must be a JSON object, got JSON {type(errors).__name__}")
    out["errors"] = errors
    layout = meta.get("layout", _THETA_LAYOUT)
    if layout != _THETA_LAYOUT:
        raise ValueError(f"{label}: metadata layout must be {_THETA_LAYOUT!r} for a Θ export, got {layout!r}")
    return out


def _theta_tensors(entries: dict, meta: dict, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``theta_q``, ``theta_k`` against the parsed metadata: ``[L, H, t, p, d, m]``, same shape, finite."""
    extra = sorted(set(entries) - set(_THETA_NAMES))
    if extra:
        raise ValueError(f"{label}: unexpected tensor(s) {extra}; a Θ export holds exactly theta_q and theta_k")
    expect = tuple(meta[key] for key in ("t", "p", "d", "m"))
    out = []
    for name in _THETA_NAMES:
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
        same tensor twice.
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
    Path written. The file holds tensors ``theta_q``, ``theta_k`` and string metadata ``p, m, t,
    d, method, scale, source_sha256, errors, sketchlab_version`` plus ``layout = "L,H,t,p,d,m"``.

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
    tq, tk = _theta_tensors({"theta_q": theta_q, "theta_k": theta_k}, parsed, label)
    tensors = {"theta_q": tq, "theta_k": tk}
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
    theta_q, theta_k : Tensor ``[L, H, t, p, d, m]`` (stored dtype)
    meta : dict
        ``p, m, t, d`` (int), ``method``, ``scale``, ``source_sha256``, ``sketchlab_version``
        (str), ``errors`` (dict, parsed JSON).

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
    entries, meta = _read_raw(path)
    meta = _check_meta(meta, str(path))
    parsed = _theta_meta(meta, str(path))
    tq, tk = _theta_tensors(entries, parsed, str(path))
    return tq, tk, parsed
