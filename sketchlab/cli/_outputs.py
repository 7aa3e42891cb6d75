"""Output-path check of the verify / advise / spectrum commands: fail before the work, not after it."""

from __future__ import annotations

from pathlib import Path


def output_dir_exists(path) -> None:
    """Raise ``FileNotFoundError`` (exit 2) when ``path`` is given and its directory does not exist."""
    if path is not None and not Path(path).parent.is_dir():
        raise FileNotFoundError(f"output directory {str(Path(path).parent)!r} does not exist (for {path!r})")
