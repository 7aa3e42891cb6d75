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

Outputs (:func:`atomic_write`) are written through symbolic links, fsynced (file and directory),
with the usual permissions and without touching the process umask; :func:`check_output_paths`
refuses, before any work, outputs that are an input of the same run or each other.

Validation (each rejection names the file, the tensor and the rule): unknown extension,
unreadable / truncated / corrupt file, missing ``q`` or ``k``, unexpected entries,
non-floating, float8, sparse or meta tensors, rank not in {2, 3, 4}, a ``layout`` metadata entry
that cannot be understood or disagrees with the rank, JSON metadata nested deeper than
:data:`MAX_JSON_DEPTH`, empty tensors, ``q`` and ``k`` of different shapes, ``v`` not matching ``k`` in
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
import hashlib
import io
import json
import math
import numbers
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ._validation import as_float_tensor, check_finite, check_tensor_storage

__all__ = [
    "MAX_JSON_DEPTH", "QKDump", "as_lhnd", "atomic_write", "check_output_paths", "dump_files", "load_qk", "parse_layout", "load_theta", "save_qk", "save_theta", "select_indices", "validate_qk",
]

_EXTENSIONS = (".safetensors", ".pt", ".npz", ".npy")
_LAYOUTS = {2: "n,d", 3: "H,n,d", 4: "L,H,n,d"}
_NAMES = ("q", "k", "v")
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


def _fsync_dir(directory: Path) -> None:
    """fsync a directory so that a rename in it survives a crash (POSIX; a no-op where directories
    cannot be opened, e.g. on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems do not support fsync on directories
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temp(target: Path) -> Path:
    """Create an empty, unique temporary file beside ``target`` with the permissions a new file gets.

    ``os.open(..., O_CREAT | O_EXCL, 0o666)`` lets the kernel apply the process umask itself, so
    the file gets the usual ``0o666 & ~umask`` without reading or toggling the process-wide umask
    (``os.umask`` is not thread-safe). When ``target`` already exists its permission bits are
    copied instead, so an atomic rewrite keeps them.
    """
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = None
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        try:
            if mode is not None:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)
        return tmp
    raise FileExistsError(f"could not create a unique temporary file beside {target}")


@contextlib.contextmanager
def atomic_write(path):
    """Yield a temporary path beside ``path``; on success it replaces ``path`` atomically and durably.

    Readers never see a half-written file: either the old file or the complete new one. On
    success the temporary file is fsynced, renamed onto the target with ``os.replace``, and the
    directory is fsynced, so the new file survives a crash. On any exception the temporary file
    is removed and the target is left untouched.

    Symbolic links are written *through*: if ``path`` is a symlink (or a chain of them), the file
    it points to is replaced and the link is kept. A new file gets ``0o666 & ~umask``; an existing
    one keeps its permission bits (see :func:`_create_temp`). ``path``'s directory must exist.
    """
    path = Path(os.path.realpath(path))  # write through symlinks
    if not path.parent.is_dir():
        raise FileNotFoundError(f"output directory {str(path.parent)!r} does not exist (for {str(path)!r})")
    if path.is_dir():
        raise IsADirectoryError(f"output {str(path)!r} is a directory, not a file")
    tmp = _create_temp(path)
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _file_identity(path: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file ``path`` points to (through symlinks), ``None`` if absent."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


def dump_files(path) -> list[Path]:
    """The files a Q/K dump at ``path`` consists of (that exist): the file itself, or for a
    ``.npy`` dump its sibling parts ``NAME.q.npy``, ``NAME.k.npy``, ``NAME.v.npy`` and
    ``NAME.meta.json``."""
    path = Path(path)
    if path.suffix.lower() == ".npy":
        return [part for part in _npy_parts(path).values() if part.exists()]
    return [path] if path.exists() else []


def check_output_paths(outputs: dict, inputs=(), *, dumps=()) -> None:
    """Check where a command will write, *before* it does any work.

    Parameters
    ----------
    outputs : dict
        ``{label: path}`` of the files to be written (``None`` paths are skipped); the label
        (e.g. ``"--json"``) names the output in errors.
    inputs : iterable of path
        Files the same run reads (for a ``.npy`` dump pass its parts, see :func:`dump_files`).
    dumps : iterable of str
        Labels of outputs that are Q/K dumps (:func:`save_qk`): a ``.npy`` one stands for all of
        its sibling parts ``NAME.q.npy``, ``NAME.k.npy``, ``NAME.v.npy``, ``NAME.meta.json``.

    Raises
    ------
    FileNotFoundError
        An output's directory does not exist.
    ValueError
        An output is a directory; two outputs are the same file (same path after resolving
        symlinks, or an existing file reached by two names, i.e. the same inode); or an output
        is one of the ``inputs`` (same inode: writing it would destroy the data being read).

    Notes
    -----
    Outputs are written through symlinks (:func:`atomic_write`), so a link is compared by the
    file it points to.
    """
    seen: dict = {}
    input_ids = {}
    for path in inputs:
        ident = _file_identity(Path(path))
        if ident is not None:
            input_ids[ident] = str(path)
    for label, path in outputs.items():
        if path is None:
            continue
        path = Path(path)
        is_npy_dump = label in dumps and path.suffix.lower() == ".npy"
        parts = list(_npy_parts(path).values()) if is_npy_dump else [path]
        for part in parts:
            real = Path(os.path.realpath(part))
            if not real.parent.is_dir():
                raise FileNotFoundError(
                    f"{label}: output directory {str(real.parent)!r} does not exist (for {str(path)!r})"
                )
            if real.is_dir():
                raise ValueError(f"{label}: output {str(path)!r} is a directory, not a file")
            ident = _file_identity(real)
            if ident is not None and ident in input_ids:
                raise ValueError(
                    f"{label}: output {str(path)!r} is the input {input_ids[ident]!r} (the same file); "
                    "writing it would destroy the data being read: choose another output path"
                )
            for key in (("path", str(real)), ("inode", ident)):
                if key[1] is None:
                    continue
                if key in seen and seen[key] != label:
                    raise ValueError(
                        f"outputs {seen[key]} and {label} are the same file {str(path)!r}: one would overwrite "
                        "the other; give each output its own path"
                    )
                seen[key] = label


# --------------------------------------------------------------------------------------------
# reading raw entries


#: Deepest nesting of JSON arrays/objects accepted in metadata (a dump's metadata file, a Θ export's
#: ``errors``). Checked before parsing: Python's parser recurses once per level and would raise
#: ``RecursionError`` (or exhaust the stack) on a hostile file.
MAX_JSON_DEPTH = 64


def _json_depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting of a JSON text (brackets inside strings are skipped)."""
    depth = best = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


def _loads_json(text: str, where: str):
    """``json.loads`` with the nesting bounded by :data:`MAX_JSON_DEPTH` (``ValueError`` naming ``where``)."""
    depth = _json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(
            f"{where}: JSON nested {depth} levels deep, over the limit of {MAX_JSON_DEPTH} (MAX_JSON_DEPTH); "
            "metadata must be a shallow JSON object"
        )
    return json.loads(text)


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
            raise FileNotFoundError(f"{path}: no such dump, it does not exist (looked for {parts['q']} and {parts['k']})")
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
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (it does not exist)")
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


# --------------------------------------------------------------------------------------------
# validation


def _as_tensor(x, where: str) -> torch.Tensor:
    """A stored entry as a dense floating tensor; every other kind is a ``ValueError`` naming ``where``.

    The rules of :func:`sketchlab._validation.as_float_tensor` (real float16/bfloat16/float32/float64,
    dense, with values), reported as ``ValueError`` because here they describe a bad file.
    """
    if isinstance(x, np.ndarray):
        if x.dtype.kind != "f":
            raise ValueError(f"{where} must be a floating-point array, got dtype {x.dtype}")
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where} must be a tensor or array, got {type(x).__name__}")
    try:
        as_float_tensor(x, where)
        check_tensor_storage(x, where, allow_meta=False)
    except TypeError as err:
        raise ValueError(str(err)) from None
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


#: Axis roles of a dump tensor and the spellings a ``layout`` metadata entry may use (case-insensitive).
_AXIS_NAMES = {
    "layer": ("layer", "layers", "l"),
    "head": ("head", "heads", "h"),
    "token": ("token", "tokens", "seq", "sequence", "n", "t"),
    "dim": ("dim", "d", "head_dim"),
}
_ROLE_OF = {name: role for role, names in _AXIS_NAMES.items() for name in names}
_ROLE_ORDER = ("layer", "head", "token", "dim")


def parse_layout(layout: str, rank: int, where: str) -> tuple[int, ...]:
    """Parse a ``layout`` metadata string by axis role; return the permutation to ``[.., n, d]`` order.

    The layout lists one name per axis, separated by commas (spaces, brackets and parentheses are
    ignored): layer (``layer``/``l``), head (``head``/``h``), token (``token``/``seq``/``n``/``t``)
    and dim (``dim``/``d``), in any order and case, each at most once; token and dim are required,
    layer and head optional. ``"layer,head,token,dim"``, ``"L,H,n,d"``, ``"[H, T, D]"`` and
    ``"seq,head,dim"`` are all understood. Returns the permutation ``perm`` such that
    ``x.permute(perm)`` has the given axes in the order layer, head, token, dim (missing ones are
    added by :func:`as_lhnd`). Anything else raises ``ValueError`` naming ``where``, the layout
    and the accepted names.
    """
    accepted = "; ".join(f"{role}: {'/'.join(names)}" for role, names in _AXIS_NAMES.items())
    names = [part for part in re.sub(r"[\s\[\]()]", "", str(layout)).split(",")]
    roles = []
    for name in names:
        role = _ROLE_OF.get(name.lower())
        if role is None:
            raise ValueError(
                f"{where}: metadata layout {layout!r} has an axis name {name!r} that is not understood; "
                f"accepted names (any case, comma-separated, token and dim required) are {accepted}"
            )
        if role in roles:
            raise ValueError(f"{where}: metadata layout {layout!r} names the {role} axis twice")
        roles.append(role)
    for role in ("token", "dim"):
        if role not in roles:
            raise ValueError(
                f"{where}: metadata layout {layout!r} has no {role} axis; accepted names are {accepted}"
            )
    if len(roles) != rank:
        raise ValueError(
            f"{where}: metadata layout {layout!r} names {len(roles)} axes but the tensor has rank {rank}"
        )
    return tuple(sorted(range(rank), key=lambda i: _ROLE_ORDER.index(roles[i])))


def _apply_layout(t: torch.Tensor, meta: dict, where: str) -> torch.Tensor:
    """Permute ``t`` to layer, head, token, dim order following ``meta["layout"]``, then to ``[L, H, n, d]``.

    Without a layout the rank decides (``[n, d]``, ``[H, n, d]``, ``[L, H, n, d]``). A layout
    without a head axis (e.g. ``"layer,token,dim"``) gets a size-1 head axis.
    """
    layout = meta.get("layout")
    if layout is None or t.ndim not in _LAYOUTS:
        return as_lhnd(t, where)
    perm = parse_layout(layout, t.ndim, where)
    roles = [_ROLE_ORDER.index(_ROLE_OF[name.lower()])
             for name in re.sub(r"[\s\[\]()]", "", str(layout)).split(",")]
    t = t.permute(perm)  # axes now in layer, head, token, dim order (those present)
    present = sorted(roles)
    shape = [1, 1] + list(t.shape[-2:])  # [L, H, n, d] with missing axes of size 1
    for axis, size in zip(present[:-2], t.shape[:-2]):
        shape[axis] = size
    return t.reshape(shape).contiguous()  # [L, H, n, d]


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
    """Write a ``.npy`` dump's sibling files so that a reader never loads a mix of old and new parts.

    1. every part is written to a temporary file beside it and fsynced;
    2. the marker ``NAME.meta.json`` is replaced (atomically) *first*, recording the SHA-256 of each
       new part under ``parts_sha256``;
    3. the parts are renamed onto their names, a stale ``NAME.v.npy`` is removed, the directory
       is fsynced.

    A save interrupted after step 2 leaves parts that disagree with the marker, which
    :func:`load_qk` rejects ("the dump is incomplete"); one interrupted before it leaves the old
    dump untouched. Either way no mix of old and new tensors loads as a valid dump.
    """
    parts = _npy_parts(path)
    blobs = {}
    for name, t in tensors.items():
        buf = io.BytesIO()
        np.save(buf, _to_numpy(t), allow_pickle=False)
        blobs[name] = buf.getvalue()
    meta = dict(meta)
    meta[_PARTS_KEY] = json.dumps({name: hashlib.sha256(b).hexdigest() for name, b in blobs.items()}, sort_keys=True)
    temps: dict[str, Path] = {}
    try:
        for name, blob in blobs.items():
            target = Path(os.path.realpath(parts[name]))
            temps[name] = _create_temp(target)
            temps[name].write_bytes(blob)
            _fsync_file(temps[name])
        with atomic_write(parts["meta"]) as tmp:
            Path(tmp).write_text(json.dumps(meta, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        for name in list(temps):
            target = Path(os.path.realpath(parts[name]))
            os.replace(temps[name], target)
            del temps[name]
        if "v" not in blobs and parts["v"].is_file():
            os.unlink(parts["v"])  # a stale v from an earlier dump of the same name would be read back
        _fsync_dir(Path(os.path.realpath(parts["q"])).parent)
    finally:
        for tmp in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
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


# --------------------------------------------------------------------------------------------
# Θ export (DESIGN.md §3)

_THETA_NAMES = ("theta_q", "theta_k")
_THETA_LAYOUT = "L,H,t,p,d,m"
_THETA_INTS = ("p", "m", "t", "d")
_THETA_STRS = ("method", "scale", "source_sha256", "sketchlab_version")
_THETA_KEYS = _THETA_INTS + _THETA_STRS + ("errors",)
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
