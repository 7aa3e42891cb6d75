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
    ``NAME.npy`` where that file does not exist) to :func:`load_qk`. :func:`save_qk` writes them
    all-or-nothing: ``NAME.meta.json`` records the SHA-256 of every part (``parts_sha256``) and
    :func:`load_qk` rejects parts that disagree with it (an interrupted save). A *single* ``.npy`` array
    (e.g. q and k stacked as ``[2, ...]``) is rejected: its leading axis could be the q/k pair or
    the layers, and guessing would silently fit the wrong tensors.

Dict keyed by layer
-------------------
Instead of one ``q`` tensor a file may hold one tensor per layer, ``[H, n, d]`` or ``[n, d]``:
keys ``q.0, q.1, …`` (and ``k.i``, ``v.i``) in ``.safetensors``, ``.pt`` and ``.npz``, or, in ``.pt``, a nested
``{"q": {0: T, 1: T, …}, …}`` with integer (or digit-string) keys. Layers must be numbered
``0 … L-1`` without gaps and share one shape; they are stacked on a new leading axis.

Layout metadata is read by axis role (:func:`parse_layout`): ``"layer,head,token,dim"``,
``"L,H,n,d"``, ``"seq,head,dim"``… in any order; tensors are transposed to ``[L, H, n, d]``.


Validation (each rejection names the file, the tensor and the rule): unknown extension,
unreadable / truncated / corrupt file, missing ``q`` or ``k``, unexpected entries,
non-floating, float8, sparse or meta tensors, rank not in {2, 3, 4}, a ``layout`` metadata entry
that cannot be understood or disagrees with the rank, JSON metadata nested deeper than
:data:`MAX_JSON_DEPTH`, empty tensors, ``q`` and ``k`` of different shapes, ``v`` not matching ``k`` in
``[L, H, n]``, and non-finite values (count and first index).

Layer / head selections (:func:`load_qk`, :func:`sketchlab.compare`) go through
:func:`select_indices`: negative indices count from the end, duplicates are rejected.

The layout rules are in :mod:`sketchlab.io.layout`, the writing in :mod:`sketchlab.io.atomic`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .._validation import check_finite
from .atomic import DUMP_NAMES as _NAMES
from .atomic import _create_temp, _fsync_file, atomic_write, npy_parts, replace_together
from .formats import _as_tensor, _canonical_safetensors, _check_meta, _loads_json, _read_safetensors, require_file
from .layout import LAYOUTS as _LAYOUTS
from .layout import _apply_layout, select_indices

__all__ = ["QKDump", "load_qk", "save_qk", "validate_qk"]

_EXTENSIONS = (".safetensors", ".pt", ".npz", ".npy")
_LAYER_KEY = re.compile(r"^([qkv])\.(\d+)$")
_PARTS_KEY = "parts_sha256"  # marker entry of a .npy dump's NAME.meta.json (see _save_npy_parts)


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


def _read_raw(path: Path) -> tuple[dict, dict]:
    """Return ``(entries, meta)`` as stored; ``entries`` maps names to tensors/arrays/dicts."""
    if path.is_dir():
        require_file(path)  # "is a directory", not "no such file" or "unknown extension"
    ext = path.suffix.lower()
    if ext not in _EXTENSIONS:
        raise ValueError(
            f"{path}: unknown extension {path.suffix!r}; a Q/K dump must end in one of {', '.join(_EXTENSIONS)}"
        )
    if ext == ".npy":
        parts = npy_parts(path)
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
            if parts["q"].is_dir():
                require_file(parts["q"])  # names the directory
            raise FileNotFoundError(f"{path}: no such dump, it does not exist (looked for {parts['q']} and {parts['k']})")
        for part in parts.values():
            if os.path.lexists(part):
                require_file(part)
        meta = {}
        if parts["meta"].is_file():
            try:
                meta = _loads_json(parts["meta"].read_text(encoding="utf-8"), str(parts["meta"]))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{parts['meta']}: corrupt metadata file, not JSON ({err})") from err
        entries = {name: _np_load(parts[name]) for name in _NAMES if parts[name].is_file()}
        if isinstance(meta, dict):
            meta = _verify_npy_parts(parts, meta)
        return entries, meta
    if ext == ".safetensors":
        return _read_safetensors(path)
    require_file(path)
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes), not a {ext} dump")
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
            meta = _loads_json(str(raw.item()), f"{path}: __metadata__")
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
            tensors[name] = _apply_layout(t, meta, f"{label}: tensor {name}")
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


def validate_qk(q, k, v=None, *, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Apply the dump rules (module docstring) to in-memory ``q``, ``k`` (and ``v``).

    Returns ``(q, k, v)`` normalised to ``[L, H, n, d]`` (``v`` may be ``None``), dtypes kept.
    Every rejection names ``where`` (a file or ``"capture_qk"``, …), the tensor and the rule.
    This is the check :func:`load_qk` and :func:`save_qk` run, so anything it accepts saves
    and loads.
    """
    entries = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    return _normalise(entries, {}, where)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """numpy has no bfloat16: such tensors are widened to float32 (exactly) for .npy/.npz."""
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


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
    ``save_qk`` produced always loads. Every file is written with :func:`atomic_write` (through
    symlinks, fsynced). A ``.npy`` dump is several files: they are written all-or-nothing, the
    marker ``NAME.meta.json`` recording each part's SHA-256 (entry ``parts_sha256``, checked and
    removed from ``meta`` by :func:`load_qk`), so an interrupted save never loads as a mix of
    old and new tensors (see :func:`_save_npy_parts`). ``meta`` must not contain ``parts_sha256``.
    """
    path = Path(path)
    label = str(path)
    ext = path.suffix.lower()
    if ext not in _EXTENSIONS:
        raise ValueError(f"{path}: unknown extension {path.suffix!r}; use one of {', '.join(_EXTENSIONS)}")
    meta = _check_meta(meta, label)
    if _PARTS_KEY in meta:
        raise ValueError(f"{label}: metadata key {_PARTS_KEY!r} is reserved (the .npy dump's part checksums)")
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
    return _save_npy_parts(path, tensors, meta)


def _save_npy_parts(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    """Write a ``.npy`` dump's sibling files all together: every part and the marker
    ``NAME.meta.json`` (recording each part's SHA-256 under ``parts_sha256``) are written to temporary
    files beside their names and fsynced, then moved in together (:func:`sketchlab.io.atomic.replace_together`,
    a stale ``NAME.v.npy`` removed with them): a save that fails at any point leaves the earlier dump
    as it was. Only a crash of the machine during the renames can leave a mix, which :func:`load_qk`
    rejects by the checksums ("the dump is incomplete").
    """
    parts = npy_parts(path)
    blobs = {}
    for name, t in tensors.items():
        buf = io.BytesIO()
        np.save(buf, _to_numpy(t), allow_pickle=False)
        blobs[name] = buf.getvalue()
    meta = dict(meta)
    meta[_PARTS_KEY] = json.dumps({name: hashlib.sha256(b).hexdigest() for name, b in blobs.items()}, sort_keys=True)
    moves: dict[Path, Path | None] = {}
    try:
        for name, blob in blobs.items():
            target = Path(os.path.realpath(parts[name]))
            moves[target] = _create_temp(target)
            moves[target].write_bytes(blob)
            _fsync_file(moves[target])
        target = Path(os.path.realpath(parts["meta"]))
        moves[target] = _create_temp(target)
        moves[target].write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        _fsync_file(moves[target])
        if "v" not in blobs and parts["v"].is_file():
            moves[Path(os.path.realpath(parts["v"]))] = None  # a stale v of an earlier dump would be read back
    except BaseException:
        for tmp in moves.values():
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        raise
    replace_together(moves)  # all the new parts, or (on failure) all the old ones
    return parts["q"]


def _verify_npy_parts(parts: dict[str, Path], meta: dict) -> dict:
    """Check the parts of a ``.npy`` dump against the SHA-256 its marker records; return ``meta``
    without the ``parts_sha256`` entry. Dumps without the entry (written by other tools) pass."""
    if _PARTS_KEY not in meta:
        return meta
    meta = dict(meta)
    raw = meta.pop(_PARTS_KEY)
    try:
        recorded = _loads_json(raw, f"{parts['meta']}: {_PARTS_KEY}") if isinstance(raw, str) else None
    except json.JSONDecodeError:
        recorded = None
    if not isinstance(recorded, dict) or not set(recorded) <= set(_NAMES):
        raise ValueError(f"{parts['meta']}: {_PARTS_KEY} must be a JSON object {{part: sha256}}, got {raw!r}")
    for name in _NAMES:
        part = parts[name]
        if name not in recorded:
            if part.is_file():
                raise ValueError(
                    f"{part}: not part of the dump recorded in {parts['meta']} (it lists {sorted(recorded)}): "
                    "the dump is incomplete (an interrupted save_qk) or the file was added by hand; "
                    "remove it or save the dump again"
                )
            continue
        if not part.is_file():
            raise ValueError(f"{part}: missing, but {parts['meta']} records it: the dump is incomplete; save it again")
        digest = hashlib.sha256(part.read_bytes()).hexdigest()
        if digest != recorded[name]:
            raise ValueError(
                f"{part}: its SHA-256 does not match the one recorded in {parts['meta']}: the dump is incomplete "
                "(an interrupted save_qk left old and new parts mixed) or a part was replaced afterwards; "
                "save the dump again"
            )
    return meta
