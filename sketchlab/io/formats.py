"""What the Q/K dump and the Θ export formats share: bounded JSON, string metadata, stored
entries checked as dense floating tensors, safetensors read with clear errors and written with
reproducible bytes; and how a module's saved state dict keeps loading after a rename
(:func:`rename_keys`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from .._validation import as_float_tensor, check_tensor_storage

__all__ = ["MAX_JSON_DEPTH", "rename_keys"]


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


def require_file(path: Path) -> None:
    """A readable regular file at ``path``, or the cause named: ``FileNotFoundError`` (it does not
    exist), ``IsADirectoryError`` (a directory), ``PermissionError`` (no read permission); the one
    check every reader of the toolkit's files runs first."""
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not a file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (it does not exist)")
    if not os.access(path, os.R_OK):
        raise PermissionError(f"{path}: cannot be read (permission denied: the file's mode is "
                              f"{path.stat().st_mode & 0o777:03o}); chmod u+r it or run as its owner")


def _read_safetensors(path: Path) -> tuple[dict, dict]:
    """``(entries, meta)`` of a ``.safetensors`` file; a missing file is ``FileNotFoundError``, an
    empty, truncated or corrupt one ``ValueError`` naming ``path``."""
    require_file(path)
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes), not a .safetensors dump")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            entries = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # safetensors raises SafetensorError/OSError/ValueError for bad files
        raise ValueError(f"{path}: unreadable safetensors file (truncated or corrupt): {err}") from err
    return entries, meta


def rename_keys(state_dict: dict, prefix: str, pairs) -> dict:
    """Rename, in place, the keys of ``state_dict`` under ``prefix`` that begin with ``old`` to begin with ``new``
    instead, for each ``(old, new)`` of ``pairs`` (a key or a key prefix: ``("theta_q", "map_q.theta")``,
    ``("feature_map_q.", "map_q.")``); returns ``state_dict``. How files saved before a rename keep loading
    (the layer core's adapters, the older toy kernels)."""
    for old, new in pairs:
        for key in [key for key in state_dict if key.startswith(prefix + old)]:
            state_dict[prefix + new + key.removeprefix(prefix + old)] = state_dict.pop(key)
    return state_dict
