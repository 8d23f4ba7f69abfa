"""One process at a time in a run folder: an exclusive lock on <run>/run.lock while a run trains there
(attnlab.data.files.folder_lock). Two `attnlab run` into the same folder would interleave their checkpoints and
metrics (and prune each other's checkpoints); the second is refused with one line naming the folder and the pid of
the one training it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from attnlab.data.files import folder_lock, lock_holder

LOCK_NAME = "run.lock"


def _busy(folder: str | Path, holder: str) -> str:
    return f"{folder}: another attnlab run{holder} is training it (wait for it to finish, or use another --out)"


def busy_problem(folder: str | Path) -> str | None:
    """Why a run cannot start in `folder` now (another process holds its lock), or None."""
    holder = lock_holder(Path(folder) / LOCK_NAME)
    return None if holder is None else _busy(folder, holder)


@contextlib.contextmanager
def run_lock(folder: str | Path) -> Iterator[None]:
    """Holds `folder`'s lock (the folder made if needed) for the block; InputError naming the folder and the
    other process's pid when it holds it."""
    with folder_lock(folder, LOCK_NAME, lambda holder: _busy(folder, holder)):
        yield
