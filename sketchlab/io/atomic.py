"""Atomic, durable file writing and the checks a command runs on its outputs before any work.

:func:`atomic_write` writes through symbolic links, fsyncs the file and its directory, gives a new
file the usual permissions without touching the process umask, and leaves the target untouched on
failure; :func:`staged_directory` does the same for a set of files and directories written into one
directory (a run directory). :func:`check_output_paths` refuses, before any work, outputs that are an input of the same
run or each other; :func:`dump_files` lists the files a Q/K dump consists of (a ``.npy`` dump is a
set of sibling files, :func:`npy_parts`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path

__all__ = ["atomic_write", "check_output_directory", "check_output_paths", "check_staged_directory", "dump_files",
           "input_files", "npy_parts", "replace_together", "staged_directory", "write_text_atomic"]

#: The tensors of a Q/K dump, in file order.
DUMP_NAMES = ("q", "k", "v")


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


def write_text_atomic(path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` with :func:`atomic_write` (through symlinks)."""
    with atomic_write(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def _create_temp_dir(target: Path) -> Path:
    """Create an empty, unique directory beside ``target`` with the permissions a new directory gets
    (``0o777 & ~umask``, applied by the kernel; see :func:`_create_temp`)."""
    for _ in range(100):
        tmp = target.parent / f".{target.name}.{secrets.token_hex(6)}.partial"
        try:
            os.mkdir(tmp, 0o777)
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"could not create a unique temporary directory beside {target}")


@contextlib.contextmanager
def staged_directory(path, *, last=()):
    """Yield a new, empty directory beside ``path`` to build entries of ``path`` in; on success they
    replace the same-named entries of ``path`` together, on failure ``path`` is left as it was.

    Parameters
    ----------
    path : str or Path
        The directory the entries are for (written through a symbolic link; created when missing;
        its parent must exist). Its entries of other names are kept.
    last : iterable of str
        Names moved in after all others (e.g. the summary file that marks a run as finished).

    Notes
    -----
    The staging directory is a sibling of ``path`` (the same file system, so every move is a
    rename). On success: when ``path`` does not exist the staging directory is renamed to it (one
    atomic step); otherwise the entries of ``path`` that the new ones replace are moved aside, the
    new ones renamed in, the old ones deleted, and the directory fsynced. On any exception, in the
    ``with`` block or while moving, the moves done so far are undone (``path`` holds exactly what it
    held, or does not exist if it did not) and the staging directory is removed. If an undo itself
    fails, the staging directory is kept (the replaced entries in its ``previous/``) and the error
    names it. Only a crash of the machine during the renames can leave part of the set; a process
    killed outright (SIGKILL, the out-of-memory killer) while building leaves its hidden
    ``.NAME.<hex>.partial`` directory beside ``path`` (delete it; nothing reads it). The fsyncs
    after the moves can still raise; the new set is in place then.

    A ``path`` that is a mount point (another file system than its parent: a container volume, an
    NFS or tmpfs mount) cannot take renames from beside it and is refused before anything is made
    (:func:`check_staged_directory`).
    """
    target = check_staged_directory(path)
    stage = _create_temp_dir(target)
    try:
        yield stage
        names = sorted(os.listdir(stage), key=lambda name: (name in last, name))
        if not os.path.lexists(target):
            os.rename(stage, target)
        else:
            aside = _create_temp_dir(stage / "previous")  # the replaced entries, deleted with the stage
            old, new = [], []
            try:
                for name in names:
                    if os.path.lexists(target / name):
                        os.rename(target / name, aside / name)
                        old.append(name)
                for name in names:
                    os.rename(stage / name, target / name)
                    new.append(name)
            except BaseException as err:
                failed = []
                for src, dst in [(target / n, stage / n) for n in reversed(new)] + \
                        [(aside / n, target / n) for n in reversed(old)]:
                    try:
                        os.rename(src, dst)
                    except OSError:
                        failed.append(str(dst.name))
                if failed:
                    stage = None  # keep it: it holds what could not be put back
                    raise OSError(f"writing {str(target)!r} failed ({err}) and putting back {', '.join(failed)} "
                                  f"failed too: the previous entries are in {str(aside)!r}") from err
                raise
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    _fsync_dir(target)
    _fsync_dir(target.parent)


def replace_together(moves: dict) -> None:
    """Rename each temporary file onto its target (``{target: temp}``, both in existing directories;
    a ``None`` temp deletes the target) all together: on any failure the targets renamed so far are
    put back, so the targets hold either all the new files or all the old ones.

    The old files are first moved aside (renamed beside their targets), then the new ones renamed
    in, then the old ones deleted; the directories are fsynced. A failed undo (it needs a failing
    file system) leaves the old files beside their targets under ``.NAME.<hex>.old`` names, and the
    error names them. Temporary files not renamed in are removed.
    """
    moves = {Path(os.path.realpath(t)): (None if tmp is None else Path(tmp)) for t, tmp in moves.items()}
    aside: dict[Path, Path] = {}
    placed: list[Path] = []
    try:
        for target in moves:
            if os.path.lexists(target):
                old = target.parent / f".{target.name}.{secrets.token_hex(6)}.old"
                os.rename(target, old)
                aside[target] = old
        for target, tmp in moves.items():
            if tmp is not None:
                os.replace(tmp, target)
                placed.append(target)
    except BaseException as err:
        failed = []
        for target in reversed(placed):
            with contextlib.suppress(OSError):
                os.unlink(target)
        for target, old in aside.items():
            try:
                os.rename(old, target)
            except OSError:
                failed.append(str(old))
        for tmp in moves.values():
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        if failed:
            raise OSError(f"replacing {', '.join(str(t) for t in moves)} failed ({err}) and putting the old files "
                          f"back failed too: they are at {', '.join(failed)}") from err
        raise
    for old in aside.values():
        with contextlib.suppress(OSError):
            os.unlink(old)
    for folder in {t.parent for t in moves}:
        _fsync_dir(folder)


def input_files(inputs) -> tuple[dict, dict]:
    """``(files, directories)`` a run reads, each ``{real path: path as given}``: every file under an
    input directory, and a ``.npy`` Q/K dump with all its parts (:func:`dump_files`); ``None`` skipped."""
    files: dict = {}
    directories: dict = {}
    for path in inputs:
        if path is None:
            continue
        if os.path.isdir(path):
            directories[os.path.realpath(path)] = str(path)
            for root, _, names in os.walk(path):
                for name in names:
                    files[os.path.realpath(os.path.join(root, name))] = os.path.join(root, name)
        else:
            for part in dump_files(path) or [Path(path)]:
                files[os.path.realpath(part)] = str(part)
    return files, directories


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def check_output_directory(directory, inputs=(), *, label: str = "output") -> None:
    """Refuse (``ValueError``, before any work) an output directory that is an input of the same run
    or holds one: it resolves (any spelling, symlink or hard link) to an input file, it is an input
    directory, or an input lies under it (writing it would overwrite or mix files with the data being
    read). ``inputs``: files, Q/K dumps and directories (:func:`input_files`); ``label`` names the
    output in the message."""
    real = os.path.realpath(directory)
    files, directories = input_files(inputs)
    ident = _file_identity(Path(real))
    for inp_real, given in {**directories, **files}.items():
        same = inp_real == real or (ident is not None and _file_identity(Path(inp_real)) == ident)
        if same and inp_real in files:
            raise ValueError(f"{label}: output directory {str(directory)!r} is the input {given!r}: writing there would "
                             "destroy the data being read; choose another output directory")
        if same or _inside(inp_real, real):
            raise ValueError(f"{label}: output directory {str(directory)!r} holds the input {given!r}: this run would "
                             "overwrite or mix files with the data it reads; choose another output directory")


def _device(path: Path) -> int:
    """The file system (``st_dev``) ``path`` lies on."""
    return os.stat(path).st_dev


def check_staged_directory(path) -> Path:
    """The real path of ``path`` if :func:`staged_directory` can build it, else a clear error: its
    parent must exist, it must be a directory if it exists, and not a mount point (a different file
    system from its parent, where the final renames fail with EXDEV)."""
    target = Path(os.path.realpath(path))
    if not target.parent.is_dir():
        raise FileNotFoundError(f"output directory's parent {str(target.parent)!r} does not exist (for {str(path)!r})")
    if os.path.lexists(target) and not target.is_dir():
        raise NotADirectoryError(f"output directory {str(path)!r} is a file, not a directory")
    if target.is_dir() and _device(target) != _device(target.parent):
        raise OSError(f"output directory {str(path)!r} is a mount point (another file system than its parent "
                      f"{str(target.parent)!r}): a run is built beside it and moved in by renames, which cannot cross "
                      "file systems; give a directory inside it")
    return target


def _file_identity(path: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file ``path`` points to (through symlinks), ``None`` if absent."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


def npy_parts(path: Path) -> dict[str, Path]:
    """Sibling files of a ``.npy`` dump: ``{"q": NAME.q.npy, "k": …, "v": …, "meta": NAME.meta.json}``.

    ``path`` may be ``NAME.npy`` or any part ``NAME.q.npy`` / ``NAME.k.npy`` / ``NAME.v.npy``.
    """
    path = Path(path)
    stem = path.name[: -len(".npy")]
    for name in DUMP_NAMES:
        if stem.endswith("." + name):
            stem = stem[: -2]
            break
    base = path.parent / stem
    parts = {name: Path(f"{base}.{name}.npy") for name in DUMP_NAMES}
    parts["meta"] = Path(f"{base}.meta.json")
    return parts


def dump_files(path) -> list[Path]:
    """The files a Q/K dump at ``path`` consists of (that exist): the file itself, or for a
    ``.npy`` dump its sibling parts ``NAME.q.npy``, ``NAME.k.npy``, ``NAME.v.npy`` and
    ``NAME.meta.json``."""
    path = Path(path)
    if path.suffix.lower() == ".npy":
        return [part for part in npy_parts(path).values() if part.exists()]
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
        parts = list(npy_parts(path).values()) if is_npy_dump else [path]
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
