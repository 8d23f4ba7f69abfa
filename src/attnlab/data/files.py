"""Small file helpers shared by the data modules: atomic writes, hashing, reading compressed text."""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from attnlab.errors import DataError, InputError
from attnlab.jsonio import IntegerTooLong, loads_json

try:
    import fcntl
except ImportError:  # not on Windows: folders are not locked there
    fcntl = None


def temp_path_beside(path: Path) -> Path:
    """A unique temporary name in the same directory as `path` (so os.replace is atomic); not created, so
    the file gets the usual permissions when written. Unique per process and call: concurrent writers of
    the same file never share a temporary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent / f".{temporary_stem(path.name)}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"


NAME_ROOM = 255 - 29  # NAME_MAX less a temporary's own bytes: ".", ".<pid, up to 10 digits>.<12 hex>.tmp"


def temporary_stem(name: str) -> str:
    """`name` as its temporaries (temp_path_beside) carry it: as it is, or, when a temporary's name would pass the
    255 bytes a file system takes in one name (a name the user may give: 227 to 255 bytes), its first bytes, `~` and
    a hash of the whole name (the same for every temporary of one name, and its own)."""
    raw = os.fsencode(name)
    if len(raw) <= NAME_ROOM:
        return name
    head = raw[: NAME_ROOM - 13].decode("utf-8", "ignore")  # (a character cut in two is left out)
    return f"{head}~{hashlib.sha256(raw).hexdigest()[:12]}"


@contextlib.contextmanager
def atomic_path(path: str | Path, durable: bool = False) -> Iterator[Path]:
    """Yields a temporary path beside `path` to create a file or a folder at (directly, or by a library that
    writes to a path: safetensors, torch.save, a compiler); when the block ends it is renamed over `path`.

    Readers see either the old `path` or the complete new one, never a partial file. If the block raises, the
    temporary (a folder with all it holds) is removed and `path` is left as it was. `durable` flushes the new
    file, or every file of the new folder, to the disk (fsync) before the rename. The new file gets the usual
    permissions (0o644 under the common umask 022), whatever the old file had.
    """
    path = Path(path)
    tmp = temp_path_beside(path)
    try:
        yield tmp
        if durable:
            for file in sorted(tmp.rglob("*")) if tmp.is_dir() else [tmp]:
                if file.is_file():
                    _fsync(file)
        os.replace(tmp, path)  # a folder replaces only a missing (or empty) folder
    except OSError as e:
        _name_the_path(e, tmp, path)
        raise
    finally:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, over a file size limit (ulimit -f)


def as_os_error(error: Exception, path: str | Path) -> OSError | None:
    """The OSError a library's own error wraps (safetensors' "I/O error: File too large (os error 27)"), naming
    `path`; None when it wraps none."""
    found = re.search(r"os error (\d+)", str(error))
    if not found:
        return None
    code = int(found[1])
    return OSError(code, os.strerror(code), str(path))


def short_write_error(error: Exception, path: Path) -> OSError | None:
    """The OSError behind a library's write of `path` that stopped short, naming it: the one the error wraps
    (as_os_error), else, for a writer that says only where it stopped (torch.save's "unexpected pos A vs B"), EFBIG
    when the file reached this process's file size limit (ulimit -f), ENOSPC when its disk has no space left; None
    when neither is so. Called while the partial file is still there."""
    wrapped = as_os_error(error, path)
    if wrapped is not None:
        return wrapped
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    try:
        size, free = path.stat().st_size, shutil.disk_usage(path.parent).free
    except OSError:
        return None
    code = errno.EFBIG if limit != resource.RLIM_INFINITY and size >= limit else errno.ENOSPC if free < 1 << 20 else 0
    return OSError(code, os.strerror(code), str(path)) if code else None


def failure_words(error: BaseException) -> str:
    """What stopped a read or write, in the OS's words (a library's error: the OSError it wraps), never a library's
    internals (torch's "[enforce fail at inline_container.cc:N] . unexpected pos A vs B")."""
    error = error if isinstance(error, OSError) else as_os_error(error, "") or error
    if isinstance(error, OSError) and error.errno == errno.EFBIG:
        return f"{error.strerror}: a file size limit was hit (`ulimit -f`, or the file system's largest file)"
    if isinstance(error, OSError):
        return str(error.strerror or error)
    return "the write stopped short (the disk is full, or a file size limit was hit)"


def _name_the_path(error: OSError, tmp: Path, path: Path) -> None:
    """An error of an atomic write names the file the caller asked for, not its temporary: the temporary (or a
    file in it) becomes `path` (or that file in it); a write() on a full disk, which names no file, names `path`."""
    if error.filename is None and error.errno in DISK_FULL:
        error.filename = str(path)
    elif isinstance(error.filename, str | os.PathLike) and Path(error.filename).is_relative_to(tmp):
        error.filename = str(path / Path(error.filename).relative_to(tmp))


TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{12}\.tmp")  # temp_path_beside's names


def remove_stale_temporaries(folder: str | Path, names: str = r".+", idle_seconds: float = 600.0) -> list[Path]:
    """Removes the temporaries atomic_path left in `folder` (for files or folders whose name matches the regex
    `names`) when their writer died before it could (killed, out of memory, the machine went down): its process
    is gone from this machine and nothing in the temporary was written for `idle_seconds` (so a writer on
    another machine sharing the folder, whose process cannot be seen from here, is left alone). Returns them."""
    folder, removed, now = Path(folder), [], time.time()
    if not folder.is_dir():
        return removed
    for path in folder.iterdir():
        match = TEMPORARY.fullmatch(path.name)
        if not match or not re.fullmatch(names, match["name"]) or _process_alive(int(match["pid"])):
            continue
        try:
            inside = path.rglob("*") if path.is_dir() and not path.is_symlink() else []
            last_write = max((p.lstat().st_mtime for p in [path, *inside]), default=0.0)
        except OSError:  # removed meanwhile
            continue
        if now - last_write < idle_seconds:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _fsync(file: Path) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes, durable: bool = False) -> None:
    """`data` to `path` atomically; `durable` also flushes it to the disk (fsync) before the rename."""
    with atomic_path(path, durable) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str, durable: bool = False) -> None:
    """`text` (UTF-8) to `path` atomically; `durable` also flushes it to the disk (fsync) before the rename."""
    with atomic_path(path, durable) as tmp:
        tmp.write_text(text, encoding="utf-8")


OUTPUTS_IDLE = 60.0  # seconds without a write after which a dead writer's outputs_together stage (or a records
# file's temporary, eval.records) is stale


@contextlib.contextmanager
def outputs_together(folder: str | Path, command: str) -> Iterator[Path]:
    """Yields a temporary folder inside `folder` in which a command writes every file of its outputs, each at the
    path it has under `folder` (stage/tables/x.md for folder/tables/x.md); when the block ends, every one is
    renamed into place. A write that fails (a full disk, a file size limit) leaves `folder` as it was: the earlier
    outputs whole, never some new files beside old ones. The temporary goes in any case (one a killed process left
    is removed by the next call); a folder made for the outputs goes when the block raises. `command` names the
    temporary (.<command>.<pid>.<random>.tmp)."""
    folder = Path(folder)
    made = [f for f in (folder, *folder.parents) if not os.path.lexists(f)]  # deepest first
    stage = temp_path_beside(folder / command)
    # a killed report's (or compare's) stage: its writer is gone and it was not written for OUTPUTS_IDLE seconds (a
    # command writes each of its files within seconds: one of another machine, whose pid cannot be seen, still is)
    remove_stale_temporaries(folder, re.escape(command), idle_seconds=OUTPUTS_IDLE)
    try:
        stage.mkdir()
        yield stage
        for file in sorted(p for p in stage.rglob("*") if p.is_file()):  # every one written in full: now renamed
            target = folder / file.relative_to(stage)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(file, target)
    except BaseException as e:
        if isinstance(e, OSError):
            _name_the_path(e, stage, folder)
        shutil.rmtree(stage, ignore_errors=True)
        for f in made:
            with contextlib.suppress(OSError):  # (not empty: something else wrote there meanwhile)
                f.rmdir()
        raise
    shutil.rmtree(stage, ignore_errors=True)


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file's stored bytes (compressed files are hashed as stored)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


SEAL = "sha256"  # the field of a record (or a run's summary.json) holding the sha256 of its other fields


def _whole(value):
    """value with every float that is a whole number (below 2**53, where a float holds every integer) as an int:
    1.0 and 1 are one number, which tools that rewrite JSON (jq) write either way."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    return [_whole(v) for v in value] if isinstance(value, list) else value


def _fields_digest(fields: dict, whole: bool = True) -> str:
    # over the fields as they read back from JSON (a tuple reads as a list, an integer key as a string): the form in
    # which a reader sees them; whole numbers as integers (whole=False: as the first sealed records were, 2026-12-07)
    read = json.loads(json.dumps(fields, sort_keys=True))
    text = json.dumps(_whole(read) if whole else read, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def sealed(row: dict) -> dict:
    """row with SEAL, the sha256 of its other fields as canonical JSON (sorted keys; a float as Python writes it,
    which reads back as the same float): a copy changed after it was written no longer matches (seal_kept)."""
    fields = {k: v for k, v in row.items() if k != SEAL}
    return {**fields, SEAL: _fields_digest(fields)}


def seal_kept(row: dict) -> bool | None:
    """True when row's SEAL matches its other fields, False when it does not (a field changed, added or taken out
    after it was written), None when it has none (an older attnlab's, before records were sealed, or taken out)."""
    if SEAL not in row:
        return None
    fields = {k: v for k, v in row.items() if k != SEAL}
    return row[SEAL] == _fields_digest(fields) or row[SEAL] == _fields_digest(fields, whole=False)  # (older: rare)


def open_text(path: str | Path) -> IO[str]:
    """Opens a UTF-8 text file for reading, decompressing `.xz` and `.gz` transparently; a leading byte-order mark
    (some editors write one) is dropped, not read as text."""
    path = Path(path)
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8-sig")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def base_suffix(path: str | Path) -> str:
    """The suffix that says what a file holds, ignoring a compression suffix: `a.jsonl.gz` -> `.jsonl`."""
    path = Path(path)
    return Path(path.stem).suffix if path.suffix in (".xz", ".gz") else path.suffix


OFFLINE_ENV = ("ATTNLAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def downloads_allowed(download: bool | None = None) -> bool:
    """Whether a missing file may be downloaded: `download` when given, else no when any of
    $ATTNLAB_OFFLINE, $HF_HUB_OFFLINE or $HF_DATASETS_OFFLINE is set to 1/true/yes/on."""
    if download is not None:
        return download
    for key in OFFLINE_ENV:  # a value that is neither yes nor no would otherwise mean online, silently
        value = os.environ.get(key, "").strip().lower()
        if value not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
            raise InputError(f"${key}={os.environ[key]!r} is neither yes nor no (use 1 to stay offline, 0 or unset "
                             "to allow downloads)")  # fmt: skip
    return not any(os.environ.get(key, "").strip().lower() in ("1", "true", "yes", "on") for key in OFFLINE_ENV)


def read_json_object(path: str | Path, fix: str = "") -> dict:
    """The JSON object in file `path` (a summary, a config a run wrote); DataError naming the file when it is
    unreadable or not an object. fix: what to do, said after the problem."""
    path = Path(path)
    try:
        value = loads_json(path.read_text(encoding="utf-8-sig"))  # a byte-order mark is read past
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: unreadable ({' '.join(str(e).split())}){'; ' + fix if fix else ''}") from None
    except RecursionError:  # thousands of nested brackets: a damaged file, not a bug of ours
        raise DataError(f"{path}: not valid JSON (nested too deeply to read: the file was damaged or changed)"
                        f"{'; ' + fix if fix else ''}") from None  # fmt: skip
    if not isinstance(value, dict):
        raise DataError(f"{path}: not a JSON object (it was changed){'; ' + fix if fix else ''}")
    return value


def read_json_lines(path: str | Path, fix: str = "") -> list[dict]:
    """The JSON objects of a .jsonl file (a UTF-8 byte-order mark at its start is read past), one per non-blank
    line; DataError naming the file and line of the first that is not one (a damaged records or metrics file)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as e:  # (the line the byte is on: the one to repair or take out)
        line = e.object[: e.start].count(b"\n") + 1
        raise DataError(
            f"{path}: line {line} is not UTF-8 text (byte {e.object[e.start]:#04x}; the file was "
            f"damaged); repair or remove that line{'; ' + fix if fix else ''}"
        ) from None
    rows = json_objects(lines)
    if isinstance(rows, tuple):
        raise DataError(f"{path}: line {rows[0]} {rows[1]} (the file was damaged); repair or remove that line"
                        f"{'; ' + fix if fix else ''}")  # fmt: skip
    return rows


def json_objects(lines: list[str]) -> list[dict] | tuple[int, str]:
    """The JSON object on each non-blank line, or (the 1-based number of the first line that holds none, what it
    is). A line nested too deeply for the json module (thousands of brackets) is such a line, not a
    RecursionError."""
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = loads_json(line)
        except IntegerTooLong as e:  # an object, but not one to read
            return number, f"is not valid JSON: {e.msg} at column {e.colno}"
        except json.JSONDecodeError:
            row = None
        except RecursionError:
            return number, "is not valid JSON: nested too deeply to read"
        if not isinstance(row, dict):
            return number, "is not a JSON object"
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- one process at a time in a folder
#
# A run folder (train/) and a bench's --out folder (eval/harness) are each written by one process at a time: an
# exclusive fcntl.flock on a small file in the folder, taken without waiting, so a second process is refused with
# one line naming the first one's pid. The kernel lets go of the lock when its holder exits, however it exits
# (killed too): there is no stale lock to remove; the file stays, holding the last holder's pid.
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _holder_pid(fd: int) -> str:
    """' (pid N)' of the process that wrote its pid into the lock file, else ''."""
    pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return f" (pid {pid})" if pid.isdigit() else ""


def lock_holder(path: Path) -> str | None:
    """' (pid N)' (or '') when another process holds the lock file `path`, None when it is free or missing: a
    look that takes the lock for an instant only when it is free (a dry run's)."""
    if fcntl is None or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return _holder_pid(fd) if e.errno in _BUSY else None
    finally:
        os.close(fd)
    return None


@contextlib.contextmanager
def appending_in(folder: str | Path) -> Iterator[None]:
    """Waits for, then holds for the block, an exclusive lock on `folder` itself (its directory's fd, so no file is
    left there): a read of a file, then its atomic replacement with more rows, is one step for every process that
    appends in the folder this way (attnlab.eval.records.append_records); two at once would each write the old rows
    plus their own, and the first one's rows would be lost. A file system without locks appends unlocked."""
    if fcntl is None:
        yield
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for a read and a write: milliseconds
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)  # lets go of the lock


FILE_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket",
              stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}  # fmt: skip


# The words for a path whose symbolic links point at each other: ls shows it, so "not found" would be wrong.
LINK_LOOP = "a symbolic link loop (too many levels of symbolic links)"


def link_loop(path: str | os.PathLike) -> bool:
    """Whether `path` cannot be reached because its symbolic links point at each other (Path.exists() says False)."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def broken_link(path: str | os.PathLike) -> str | None:
    """What a symbolic link at `path` that reaches nothing is, in words ("a symbolic link to X, which is not there",
    or LINK_LOOP), for a path something is to be made at (made through the link, or failing late, "Not a
    directory"); None for anything else."""
    if not os.path.islink(path):
        return None
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return LINK_LOOP
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"a symbolic link to {os.readlink(path)}, which is not there"
    return None


def unreachable(path: str | os.PathLike) -> str | None:
    """Why nothing can be read at `path`, in words for a one-line error, or None when something is there: not
    found, a symbolic link to nothing (ls shows it: not "not found"), or a link loop."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"{LINK_LOOP}: point the link at the file itself"
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            return None  # (permissions: whatever reads it says so)
        if os.path.islink(path):
            return f"a symbolic link to {os.readlink(path)}, which is not there (point it at the file itself)"
        return "file not found (check the path)"
    return None


def read_only_file_system(path: str | os.PathLike) -> bool:
    """Whether `path` is on a file system mounted read-only (where os.access says "not writable" too, but making it
    writable is not the fix)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # (no statvfs on Windows)
        return False


def file_kind(path: str | Path) -> str | None:
    """What is at `path` when it is not a regular file (symbolic links followed): "a folder", "a FIFO (named
    pipe)", a socket or a device (FILE_KINDS); None for a regular file. os.stat's OSError when nothing is there.
    Reading a fifo waits for a writer without end, and a device is no file to keep."""
    mode = os.stat(path).st_mode
    return None if stat.S_ISREG(mode) else FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")


def special_file(path: str | Path) -> str | None:
    """file_kind in a task file's or lock file's words: "a folder" or "not a regular file (a fifo, device or
    socket)"; None when it is a regular file or nothing (reachable) is there, which whatever opens it says."""
    try:
        kind = file_kind(path)
    except OSError:
        return None
    if kind is None or kind == "a folder":
        return kind
    return "not a regular file (a fifo, device or socket)"


def lock_file_problem(path: str | Path) -> str | None:
    """Why `path` cannot be a lock file (folder_lock): something other than a regular file is there; or None."""
    what = special_file(path)
    if what is None:
        return None
    if what == "a folder":  # (it may hold files of the user's: moved, not deleted)
        return f"{path}: a folder, where attnlab keeps its lock file: move it away and start again"
    return f"{path}: {what}, where attnlab keeps its lock file: delete it (it holds nothing of yours) and start again"


@contextlib.contextmanager
def folder_lock(folder: str | Path, name: str, busy: Callable[[str], str]) -> Iterator[None]:
    """Holds the lock file folder/name (the folder made if needed) for the block. When another process holds it,
    InputError(busy(holder)), holder being ' (pid N)' or ''; InputError too when something other than a regular
    file is there (lock_file_problem). A file system without locks (some network ones) runs unlocked."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    problem = lock_file_problem(folder / name)  # (the dry run says the same line)
    if problem:
        raise InputError(problem)
    # O_NONBLOCK: opening a fifo (or a device) must not wait; it is refused once open (fstat: no race)
    fd = os.open(folder / name, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError(lock_file_problem(folder / name) or f"{folder / name}: not a regular file")
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _BUSY:
                raise InputError(busy(_holder_pid(fd))) from None
            locked = False  # no locks on this file system
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # lets go of the lock
