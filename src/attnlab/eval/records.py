"""Records: one JSON line per measured figure set, with what is needed to trust and reproduce it."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch

import attnlab
from attnlab.data.files import atomic_write_text, json_objects, read_json_lines
from attnlab.errors import InputError


def make_record(benchmark: str, model=None, **figures) -> dict:
    """A row: benchmark name, model label/path/config hash, device, dtype, versions, time, then the figures."""
    row = {
        "benchmark": benchmark,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "attnlab": attnlab.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    if model is not None:
        row.update(
            model=model.name, model_path=str(model.path), config_hash=model.cfg.config_hash(),
            kind=model.cfg.attention.kind, device=str(model.device),
            dtype=str(next(model.model.parameters()).dtype).replace("torch.", ""),
        )  # fmt: skip
    row.update(figures)
    return row


def records_target(path: str | Path) -> Path:
    """The file rows appended to `path` go to, refused (InputError, one line) unless it is a regular file or
    does not exist yet: a device (/dev/full), fifo or folder would be read without end or replaced by a file.
    A symlink is written through: the rows go to the file it points at and the link stays a link."""
    given = Path(path)
    target = given.resolve()
    if target.exists() and not target.is_file():
        what = "a folder" if target.is_dir() else "not a regular file (a device, fifo or socket)"
        via = f" (via the link {given})" if target != given.absolute() else ""
        raise InputError(f"{target}{via}: {what}: records are appended to a regular .jsonl file; give a file path")
    if target.is_file():  # rows are appended only to records: never to a user's YAML, notes or a binary file
        problem = _not_records(target)
        if problem:
            raise InputError(f"{given}: exists and is not a file of attnlab records ({problem}); records are "
                             "appended only to a .jsonl file of records: give a new file or a records one")  # fmt: skip
    return target


def _not_records(path: Path) -> str | None:
    """Why an existing file is not one records are appended to (one JSON object per line), or None."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    rows = json_objects(text.splitlines())
    return f"line {rows} is not a JSON object" if isinstance(rows, int) else None


def records_folder(folder: str | Path, *names: str, flag: str = "--out") -> list[Path]:
    """The records files `names` a command appends to in `folder` when it is done, checked before it starts, so that
    minutes of work are not lost to a path it cannot write: InputError (one line naming `flag`) when `folder` or one
    of its parents is not a folder, a records file is not a regular file (records_target), or the folder that would
    hold one may not be written (permissions, a read-only file system). Creates nothing."""
    folder = Path(folder)
    existing = next(p for p in [folder, *folder.parents] if os.path.lexists(p))  # "." or "/" at the latest
    if not existing.is_dir():
        what = "a file" if existing == folder else f"cannot be made: {existing} is a file"
        raise InputError(f"{flag} {folder}: {what}, not a folder (the records go to {folder / names[0]}; give a "
                         "folder's path)")  # fmt: skip
    targets = [records_target(folder / name) for name in names]
    for target in targets:
        holder = next(p for p in [target.parent, *target.parent.parents] if p.exists())
        if not os.access(holder, os.W_OK | os.X_OK):  # the file is written beside itself, then renamed
            raise InputError(f"{flag} {folder}: {target.name} cannot be written in {holder} (permission denied or a "
                             "read-only file system): make it writable, or give another folder")  # fmt: skip
    return targets


def append_records(path: str | Path, rows: list[dict]) -> Path:
    """Appends rows to a JSONL file atomically (old content + new rows to a temporary file, flushed to the disk,
    then renamed over it); see records_target for the paths refused."""
    path = records_target(path)
    old = path.read_text() if path.exists() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    atomic_write_text(path, old + "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), durable=True)
    return path


def read_records(path: str | Path, benchmark: str | None = None) -> list[dict]:
    rows = read_json_lines(path, fix="records are appended one JSON object per line")
    return [r for r in rows if benchmark is None or r.get("benchmark") == benchmark]
