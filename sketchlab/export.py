r"""Export a fitted sketch's Θ in one call (DESIGN.md §3), every metadata field filled in.

:func:`export_theta` writes what :func:`sketchlab.save_theta` takes — ``theta_q``, ``theta_k``
``[L, H, t, p, d, m]`` and ``p, m, t, d, method, scale, source_sha256, errors,
sketchlab_version`` — from a :class:`sketchlab.Fit` and the dump it was fitted to.
:meth:`sketchlab.Fit.save_theta` calls it; ``sketchlab fit`` does the same from the shell.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch

from .scaling import resolve_scale, scale_label

__all__ = ["export_theta", "file_sha256"]


def file_sha256(path) -> str:
    """SHA-256 (64 lowercase hex digits) of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _dump_sha256(path: Path, parts: list) -> str:
    """``source_sha256`` of a dump: the SHA-256 of its file; for a ``NAME.npy`` dump (sibling parts) that of
    ``NAME.meta.json``, which records every part's SHA-256, or without it of the parts' bytes in order."""
    if path.is_file():
        return file_sha256(path)
    meta = [part for part in parts if part.name.endswith(".meta.json")]
    if meta:
        return file_sha256(meta[0])
    digest = hashlib.sha256()
    for part in sorted(parts):
        digest.update(bytes.fromhex(file_sha256(part)))
    return digest.hexdigest()


def _json_safe(value):
    """Tensors → lists, non-finite floats → None (JSON has no NaN), recursively."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def fit_llops_maps(fit):
    """The LLoPS maps ``(map_q, map_k)`` of a fit (:class:`~sketchlab.featuremaps.LLoPSMap` s of its ``L·H`` heads, one
    object when tied): its own maps when they are LLoPS, else their exact LLoPS form
    (:func:`sketchlab.featuremaps.to_llops.as_llops`, which raises ``ValueError`` for a map without one)."""
    from .featuremaps.base import FeatureMap
    from .featuremaps.to_llops import as_llops

    llops = as_llops(fit.maps)  # LLoPS maps come back unchanged
    return (llops, llops) if isinstance(llops, FeatureMap) else llops


def export_theta(fit, path, *, dump, scale=None) -> Path:
    """Write the Θ of ``fit``'s LLoPS maps to ``path`` (``.safetensors``) with all DESIGN.md §3 metadata; a tied
    pair (one LLoPS map for both sides: ``fit.tied``, or a tied map's exact LLoPS form) is stored once, ``tied``.

    Parameters
    ----------
    fit : sketchlab.Fit
        A fit whose maps are :class:`~sketchlab.featuremaps.LLoPSMap` s or have an exact LLoPS form
        (:func:`sketchlab.as_llops`: ``TiedLLoPSMap``, ``ExpandMap``, ``PSFRandomMap``), of batch shape ``[]``, ``[H]``
        or ``[L, H]`` (stored as ``[1, 1]``, ``[1, H]``, ``[L, H]``: the maps' ``L·H`` heads unflattened).
    path : str or Path
        Output ``.safetensors`` file, written atomically; it must not be the dump itself.
    dump : str, Path or QKDump
        The Q/K dump file the sketch was fitted to (a loaded :class:`sketchlab.QKDump` with a
        ``path``): its SHA-256 becomes ``source_sha256`` (for a ``NAME.npy`` dump of sibling parts,
        the SHA-256 of ``NAME.meta.json``, which records each part's).
    scale : "none", "sqrt-d", float or None
        The factor q and k were multiplied by before fitting. ``None`` takes ``fit.scale`` (set by
        ``sketchlab fit``) and fails when the fit does not record one, since a wrong ``scale``
        would silently change the kernel the block computes.

    Returns
    -------
    Path written. ``p, m, t, d`` come from Θ's shape, ``method`` from ``fit.report.method``,
    ``errors`` from ``fit.report.as_dict()`` (non-finite values stored as ``null``),
    ``sketchlab_version`` from ``sketchlab.__version__``.
    """
    from ._version import __version__
    from .io import check_output_paths, dump_files, save_theta

    if not hasattr(fit, "maps") or not hasattr(fit, "report"):
        raise TypeError(f"fit must be a sketchlab.Fit (with .maps and .report), got {type(fit).__name__}")
    dump_path = getattr(dump, "path", dump)
    if dump_path is None or not isinstance(dump_path, (str, os.PathLike)):
        raise TypeError(
            f"dump must be the path of the Q/K dump file (or a QKDump loaded from a file), got {type(dump).__name__}; "
            "source_sha256 is the SHA-256 of that file"
        )
    dump_path = Path(dump_path)
    parts = dump_files(dump_path)
    if not parts:
        raise FileNotFoundError(f"Q/K dump {str(dump_path)!r} does not exist")
    path = Path(path)
    check_output_paths({"path": path}, dump_files(dump_path))  # never onto the dump, whatever the link or name
    if scale is None:
        scale = getattr(fit, "scale", None)
        if scale is None:
            raise ValueError(
                "scale is not recorded in this fit: pass scale= the factor q and k were multiplied by before "
                "fitting ('none', 'sqrt-d' for d^-1/4, or a number)"
            )
    try:
        map_q, map_k = fit_llops_maps(fit)
    except ValueError as err:
        raise ValueError(f"method {fit.report.method!r} cannot be exported as Θ: {err}") from err
    theta_q = map_q.theta.detach()  # [L·H, t, p, d, m]
    lead = tuple(fit.batch_shape)
    if len(lead) > 2:
        raise ValueError(f"Θ must have leading shape [], [H] or [L, H] to export, got {list(lead)}")
    shape6 = (1,) * (2 - len(lead)) + lead + tuple(theta_q.shape[-4:])
    theta_q = theta_q.reshape(shape6)  # [L, H, t, p, d, m]
    theta_k = theta_q if map_k is map_q else map_k.theta.detach().reshape(shape6)  # tied: save_theta stores it once
    t, p, d, m = shape6[2:]
    resolve_scale(scale, d)  # validates: "none", "sqrt-d" or a positive finite number
    label = scale_label(scale)
    errors = _json_safe(fit.report.as_dict())
    json.dumps(errors)  # every value is JSON now
    return save_theta(path, theta_q, theta_k, p=p, m=m, t=t, d=d, method=fit.report.method, scale=label,
                      source_sha256=_dump_sha256(dump_path, parts), errors=errors, sketchlab_version=__version__)
