"""Where data files are looked up: an explicit directory, then $ATTNLAB_DATA, then the user cache."""

from __future__ import annotations

import os
from pathlib import Path

from attnlab.errors import DataError


def data_dirs(data_dir: str | Path | None = None) -> list[Path]:
    """Candidate data directories, in lookup order."""
    dirs = [Path(data_dir)] if data_dir else []
    if os.environ.get("ATTNLAB_DATA"):
        dirs.append(Path(os.environ["ATTNLAB_DATA"]))
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attnlab"
    return dirs + [cache]


def find_data_file(relative: str, data_dir: str | Path | None = None) -> Path:
    """The first existing `<dir>/<relative>`; the error says where it looked and how to provide it."""
    tried = [d / relative for d in data_dirs(data_dir)]
    for path in tried:
        if path.exists():
            return path
    raise DataError(
        f"{relative} not found (looked in: {', '.join(map(str, tried))}); "
        "pass --data-dir DIR or set ATTNLAB_DATA to a directory that holds it"
    )
