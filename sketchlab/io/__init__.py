"""File formats and file writing: Q/K dumps, the Θ export, atomic writes.

Modules (each name says what it holds; every public name is re-exported here, so
``from sketchlab.io import load_qk`` keeps working):

``sketchlab.io.dumps``
    The Q/K dump formats (``.safetensors``, ``.pt``, ``.npz``, ``.npy`` parts) and their
    validation: :class:`QKDump`, :func:`load_qk`, :func:`save_qk`, :func:`validate_qk`.
``sketchlab.io.layout``
    Axis roles of dump tensors: :func:`parse_layout`, :func:`as_lhnd`, :func:`select_indices`.
``sketchlab.io.theta``
    The Θ export format: :func:`save_theta`, :func:`load_theta`.
``sketchlab.io.atomic``
    Atomic, durable writes and output checks: :func:`atomic_write`, :func:`staged_directory`,
    :func:`check_output_paths`, :func:`dump_files`.
``sketchlab.io.formats``
    What the two formats share (bounded JSON metadata, :data:`MAX_JSON_DEPTH`, safetensors bytes), and
    :func:`rename_keys` (a saved state dict's keys after a rename).

Layers: ``formats``, ``atomic``, ``layout`` import nothing of ``io``; ``dumps`` and ``theta``
import them and not each other.
"""

from .atomic import atomic_write, check_output_paths, check_staged_directory, dump_files, staged_directory
from .dumps import QKDump, load_qk, save_qk, validate_qk
from .formats import MAX_JSON_DEPTH, rename_keys
from .layout import as_lhnd, parse_layout, select_indices
from .theta import load_theta, save_theta

__all__ = [
    "MAX_JSON_DEPTH", "QKDump", "as_lhnd", "atomic_write", "check_output_paths", "check_staged_directory", "dump_files",
    "load_qk", "load_theta", "parse_layout", "rename_keys", "save_qk", "save_theta", "select_indices", "staged_directory",
    "validate_qk",
]
