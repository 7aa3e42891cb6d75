"""Pieces every ``sketchlab`` sub-command shares: the usage error, the common options (one
convention: the same flag, type, default and help everywhere), argument types, and the outputs
(checked before any work, written all-or-nothing, each reported as ``wrote PATH``)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path

from ..io.atomic import write_text_atomic

__all__ = [
    "DEFAULT_HOLDOUT", "DEFAULT_M", "DEFAULT_P", "MAX_SEED", "Outputs", "UsageError", "add_common", "available_memory",
    "check_run_dir",
    "decay_arg", "degree_arg", "device_arg", "fraction_arg", "int_list", "nonnegative_float", "nonnegative_int", "positive_float",
    "positive_int", "positive_int_list", "scale_arg", "seed_arg", "write_text_atomic",
]

#: Defaults of ``--p`` and ``--m`` in every command (the paper's main setting; the demo's).
DEFAULT_P = 2
DEFAULT_M = 64
#: Default of ``--holdout`` in every command.
DEFAULT_HOLDOUT = 0.25
#: Largest ``--seed``: a command derives further streams from ``seed + offset`` (``linearize``'s capture,
#: held-out and training streams add up to ~2e6), which must stay a valid 64-bit generator seed.
MAX_SEED = 2**62


class UsageError(Exception):
    """Bad command-line input; reported as one ``sketchlab: error:`` line, exit status 2."""


def int_list(text: str) -> list[int]:
    """``"0,3"`` → ``[0, 3]`` (an argparse type)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def seed_arg(text: str) -> int:
    """``--seed``: an integer in ``[0, MAX_SEED]`` (an argparse type).

    One range for every command: a negative seed is only another spelling of a large one for
    torch's generator (``-1`` is ``2**64 - 1``), and the commands offset the seed for their data
    streams, so the top of the 64-bit range is kept out (:data:`MAX_SEED`).
    """
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer seed in [0, 2**62], got "
                                         f"{repr(text) if value is None else value}")
    return value


def device_arg(text: str):
    """A torch device this machine has: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` (an argparse type)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected a device such as 'cpu', 'cuda' or 'cuda:0', got {text!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected a device of type 'cpu' or 'cuda', got {text!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"device {text!r}: CUDA is not available on this machine")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"device {text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def positive_int_list(text: str) -> list[int]:
    """``"8,16"`` → ``[8, 16]``, every value >= 1 (an argparse type)."""
    values = int_list(text)
    bad = [v for v in values if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {bad[0]} in {text!r}")
    return values


def number_arg(cast, ok, rule: str):
    """An argparse type: ``cast(text)`` (``int`` or ``float``) for which ``ok(value)`` holds.

    Anything else is refused as ``expected {rule}, got ...`` (the value for a bad integer, the text
    as typed for a bad float, which ``nan`` and ``inf`` never pass unless ``ok`` says so).
    """

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {rule}, got {value if cast is int else repr(text)}")
        return value

    parse.__doc__ = f"{rule[0].upper()}{rule[1:]} (an argparse type)."
    return parse


#: The argparse types of every command's numeric options.
nonnegative_int = number_arg(int, lambda v: v >= 0, "an integer >= 0")
positive_int = number_arg(int, lambda v: v >= 1, "an integer >= 1")
positive_float = number_arg(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
nonnegative_float = number_arg(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
finite_float = number_arg(float, math.isfinite, "a finite number")
#: ``--holdout``: the fraction of tokens held out, in ``[0, 1)``.
fraction_arg = number_arg(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def available_memory() -> int:
    """Bytes this machine can give a new run now: ``MemAvailable`` of ``/proc/meminfo`` (Linux), else
    half of its physical memory (16 GiB where neither can be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def degree_arg(text: str) -> int:
    """``--p``: an integer in ``[1, MAX_DEGREE]`` (an argparse type; the rule of
    :func:`sketchlab._validation.check_degree`, checked at parse time)."""
    from .._validation import MAX_DEGREE

    value = positive_int(text)
    if value > MAX_DEGREE:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_DEGREE}] (beyond it (qᵀk)^p over- or "
                                         f"underflows float64), got {value}")
    return value


def scale_arg(text: str):
    """``"sqrt-d"``, ``"none"`` or a number (an argparse type; the value is checked where it is used)."""
    if text in ("none", "sqrt-d"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'sqrt-d', 'none' or a positive number, got {text!r}") from None
    return value


def decay_arg(text: str):
    """``--decay``: a number (a fixed decay per step) or a name (``head``, ``input``), as given; the value is
    checked by the options' one rule (:class:`sketchlab.attention.options.AttentionOptions`)."""
    try:
        return float(text)
    except ValueError:
        return text


def add_common(cmd, *names: str) -> None:
    """Add the options every command spells the same way: ``names`` among ``"p"``, ``"m"``,
    ``"layers"``, ``"heads"``, ``"scale"``, ``"seed"``, ``"holdout"``, ``"device"``, ``"progress"``."""
    for name in names:
        if name == "p":
            cmd.add_argument("--p", type=degree_arg, default=DEFAULT_P,
                             help=f"polynomial degree p of the kernel (qᵀk)^p (default {DEFAULT_P})")
        elif name == "m":
            cmd.add_argument("--m", type=positive_int, default=DEFAULT_M,
                             help=f"sketch size: features per map (default {DEFAULT_M})")
        elif name == "layers":
            cmd.add_argument("--layers", type=int_list, default=None, help="comma-separated layer positions (default: all)")
        elif name == "heads":
            cmd.add_argument("--heads", type=int_list, default=None, help="comma-separated head positions (default: all)")
        elif name == "scale":
            cmd.add_argument("--scale", type=scale_arg, default="sqrt-d",
                             help="'sqrt-d' (q, k × d^-1/4 so qᵀk → qᵀk/√d; default), 'none', or a positive number "
                                  "multiplying q and k")
        elif name == "seed":
            cmd.add_argument("--seed", type=seed_arg, default=0,
                             help="random seed (an integer in [0, 2**62]): the held-out split, the fits, random "
                                  "sketches and data streams (default 0)")
        elif name == "holdout":
            cmd.add_argument("--holdout", type=fraction_arg, default=DEFAULT_HOLDOUT,
                             help=f"fraction of tokens held out, in [0, 1) (default {DEFAULT_HOLDOUT})")
        elif name == "device":
            cmd.add_argument("--device", type=device_arg, default="cpu", help="cpu (default), cuda or cuda:N")
        elif name == "progress":
            cmd.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
        else:  # a programming error, not bad input
            raise KeyError(f"unknown common option {name!r}")


def check_run_dir(out, *, command: str, known, kind: str = "", recorded=None, wanted=None,
                  paths=()) -> list[str]:
    """Refuse (``ValueError``) an output directory that holds anything but a run of ``command``.

    Parameters
    ----------
    out : str or Path
        The run directory; absent or empty, there is nothing to check.
    command : str
        The command that writes such directories (``"train"``, ``"linearize"``), for the messages.
    known : iterable of str
        The names a run of ``command`` writes at the top of ``out``; any other entry is foreign.
    kind : str
        Qualifies the run in the foreign-files message (``" of this kind"`` where a command has
        paths that write different files).
    recorded : callable, optional
        ``recorded(out) -> dict | None``: the settings recorded by the run in ``out``. Given, a
        non-empty ``out`` whose settings are not recorded is refused, and every option of
        ``wanted`` recorded with another value is named in the refusal.
    wanted : dict, optional
        ``{option: value}`` of this run (with ``recorded``).
    paths : iterable of str
        Options of ``wanted`` whose values are paths, compared by real path.

    Returns
    -------
    list of str
        The entries of ``out``, sorted (empty when it is absent), for the command's own checks.
    """
    out = Path(out)
    if not out.is_dir():
        return []
    names = sorted(entry.name for entry in out.iterdir())
    foreign = [name for name in names if name not in known]
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise ValueError(f"--out {str(out)!r} holds files that no sketchlab {command} run{kind} writes ({shown}): this "
                         "run would mix its files with them; choose an empty or new directory")
    if recorded is None or not names:
        return names
    settings = recorded(out)
    if settings is None:
        raise ValueError(f"--out {str(out)!r} holds files of an unfinished {command} run ({', '.join(names)}) whose "
                         "settings are not recorded, so this run could mix its files with them; remove them or "
                         "choose an empty or new directory")
    differ = []
    for key, value in (wanted or {}).items():
        if key not in settings:
            continue
        there = settings[key]
        same = (os.path.realpath(str(there)) == os.path.realpath(str(value))) if key in paths else there == value
        if not same:
            differ.append(f"--{key.replace('_', '-')} {there} there, {value} here")
    if differ:
        raise ValueError(f"--out {str(out)!r} holds the output of another {command} run ({'; '.join(differ[:3])}): "
                         "this run would replace or mix with its files; choose another directory (or remove it)")
    return names


def _nearest_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _identity(path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Outputs:
    """A command's outputs: checked before any work, then written all-or-nothing.

    Parameters
    ----------
    files : dict
        ``{option: path}`` of the output files (``None``: not given). ``"-"`` means standard
        output, for the options in ``stdout`` only (at most one; the command's table then stays
        off stdout so that what is piped is exactly that output).
    inputs : iterable of path
        What the run reads: files, Q/K dumps (a ``NAME.npy`` dump counts with all its parts) and
        directories (every file under them).
    directories : dict
        ``{option: path}`` of output directories (``train --out``).
    stdout : iterable of str
        Options that accept ``"-"``.
    dumps : iterable of str
        Options whose output is a Q/K dump (a ``.npy`` one stands for all its sibling parts).
    staged : iterable of str
        Options of ``directories`` built beside the directory and moved in at the end
        (:func:`sketchlab.io.staged_directory`): their parent must be writable too.

    Raises
    ------
    ValueError
        An output resolves (any spelling, symlink or hard link) to an input; an output directory
        is an input directory or holds an input; two outputs are the same file; an output is a
        directory, or its would-be parent is a file; ``"-"`` where it is not allowed or twice.
    PermissionError
        An output's directory (or its nearest existing ancestor, where the directory is created) is
        not writable.

    Notes
    -----
    Missing parent directories are created when writing. :meth:`write` stages every file as a
    temporary beside its target and renames them into place only after all were written, so a
    failing output leaves none of the others written (and any directory it created removed). A
    rename failing after an earlier one succeeded (it needs a failing file system) is the one
    case that can leave part of the set.
    """

    def __init__(self, files: dict, *, inputs=(), directories: dict | None = None, stdout=(), dumps=(), staged=()):
        from ..io.atomic import check_output_directory
        from ..io.atomic import input_files as read_by

        self.files = {label: str(path) for label, path in files.items() if path is not None}
        self.directories = {label: str(path) for label, path in (directories or {}).items() if path is not None}
        self.to_stdout = None
        inputs = list(inputs)
        input_files = read_by(inputs)[0]  # realpath -> spelling as given
        input_ids = {_identity(real): given for real, given in input_files.items() if _identity(real) is not None}
        seen: dict = {}
        for label, path in self.files.items():
            if path == "-":
                if label not in stdout:
                    raise UsageError(f"{label} -: standard output is not supported for {label}; give a file path")
                if self.to_stdout is not None:
                    raise UsageError(f"{self.to_stdout} - and {label} -: only one output can go to standard output")
                self.to_stdout = label
                continue
            parts = [Path(path)]
            if label in dumps and Path(path).suffix.lower() == ".npy":
                from ..io.atomic import npy_parts

                parts = list(npy_parts(Path(path)).values())
            for part in parts:
                real = os.path.realpath(part)
                self._check_writable(label, str(part), Path(real))
                clash = input_files.get(real) or input_ids.get(_identity(real))
                if clash is not None:
                    raise ValueError(f"{label}: output {path!r} is the input {clash!r} (the same file): writing it would "
                                     "destroy the data being read; choose another output path")
                for key in (real, _identity(real)):
                    if key is not None and key in seen and seen[key] != label:
                        raise ValueError(f"outputs {seen[key]} and {label} are the same file {path!r}: one would overwrite "
                                         "the other; give each output its own path")
                    if key is not None:
                        seen[key] = label
        for label, path in self.directories.items():
            real = os.path.realpath(path)
            if os.path.lexists(real) and not os.path.isdir(real):
                raise ValueError(f"{label} {path!r} is a file, not a directory")
            self._check_writable(label, path, Path(real), directory=True)
            parent = _nearest_existing(Path(real).parent)
            if label in staged and parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
                raise PermissionError(f"{label}: directory {str(parent)!r} is not writable: the run's files are built "
                                      f"beside {path!r} and moved into it at the end; choose an output directory whose "
                                      "parent you can write")
            if label in staged and os.path.isdir(real):
                from ..io.atomic import check_staged_directory

                check_staged_directory(path)  # a mount point cannot take the final renames
            check_output_directory(path, inputs, label=label)  # the one rule, shared with sketchlab.save_linearized

        plot = self.files.get("--plot")
        if plot is not None and plot != "-":
            import importlib.util

            if Path(plot).suffix.lower() != ".png":
                raise UsageError(f"--plot {plot}: plots are written as PNG; give a path ending in .png")
            if importlib.util.find_spec("matplotlib") is None:
                raise UsageError("--plot needs matplotlib, which is not installed: pip install 'sketchlab[plot]'")

    @staticmethod
    def _check_writable(label: str, given: str, real: Path, *, directory: bool = False) -> None:
        if not directory and real.is_dir():
            raise ValueError(f"{label}: output {given!r} is a directory, not a file")
        base = _nearest_existing(real if directory else real.parent)
        if not base.is_dir():
            raise ValueError(f"{label}: cannot create the output directory of {given!r}: {str(base)!r} is a file")
        if not os.access(base, os.W_OK | os.X_OK):
            raise PermissionError(f"{label}: directory {str(base)!r} is not writable (for {given!r})")

    @property
    def stdout_taken(self) -> bool:
        """Whether one of the outputs goes to standard output (then the command prints nothing else there)."""
        return self.to_stdout is not None

    def make_directories(self) -> None:
        """Create the output directories (and their parents)."""
        for path in self.directories.values():
            Path(path).mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def parents_created(self):
        """Create the missing parent directories of the output files and directories for a command
        that writes them itself, inside this ``with`` block; a failure inside it removes the
        directories it created (so a failed run leaves nothing behind)."""
        created = _make_parents([*self.files.values(), *self.directories.values()])
        try:
            yield
        except BaseException:
            _remove_created(created)
            raise

    @staticmethod
    def announce(*paths) -> None:
        """Print ``wrote PATH`` (stderr) for files a command wrote itself."""
        for path in paths:
            print(f"wrote {path}", file=sys.stderr)

    def write(self, contents: dict) -> list[str]:
        """Write every output all-or-nothing; print ``wrote PATH`` (stderr) for each file.

        ``contents`` maps each option to its text, bytes, or a callable ``write(path)`` that
        writes the file at ``path`` (e.g. a figure); options not given on the command line are
        skipped. Returns the paths written.
        """
        from ..io import atomic_write

        created: list[Path] = []
        written: list[str] = []
        stdout_text = None
        try:
            with contextlib.ExitStack() as stack:
                for label, content in contents.items():
                    path = self.files.get(label)
                    if path is None:
                        continue
                    if path == "-":
                        stdout_text = content
                        continue
                    created += _make_parents([path])
                    tmp = stack.enter_context(atomic_write(path))
                    if isinstance(content, str):
                        Path(tmp).write_text(content, encoding="utf-8")
                    elif isinstance(content, bytes):
                        Path(tmp).write_bytes(content)
                    else:
                        content(tmp)
                    written.append(path)
        except BaseException:
            _remove_created(created)
            raise
        if stdout_text is not None:
            sys.stdout.write(stdout_text if isinstance(stdout_text, str) else stdout_text.decode())
            sys.stdout.flush()
        self.announce(*written)
        return written


def _make_parents(paths) -> list[Path]:
    """Create the missing parent directories of ``paths`` (``"-"`` skipped); return those created, outermost first."""
    created: list[Path] = []
    for path in paths:
        if path == "-":
            continue
        parent = Path(os.path.realpath(path)).parent
        missing = []
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        for folder in reversed(missing):
            folder.mkdir()
            created.append(folder)
    return created


def _remove_created(created: list[Path]) -> None:
    """Remove the directories :func:`_make_parents` created (innermost first) where they are still empty."""
    for folder in reversed(created):
        with contextlib.suppress(OSError):
            folder.rmdir()
