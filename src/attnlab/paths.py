"""Where data files are looked up (an explicit directory, then $ATTNLAB_DATA, then the user cache), what a name
that becomes a folder or file name may be, where a path a user's name built may land, and which folders are runs'
(where no other command writes)."""

from __future__ import annotations

import os
import reprlib
import stat
import unicodedata
import warnings
from pathlib import Path

from attnlab.errors import AttnlabWarning, ConfigError, DataError, InputError, given
from attnlab.jsonio import loads_json

MAX_NAME_LENGTH = 100


_SHORT = reprlib.Repr()  # keyword arguments need Python 3.12
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict, _SHORT.maxset = 3, 8, 8, 8, 8
_SHORT.maxstring = _SHORT.maxother = 80


def brief(value: object, limit: int = 60) -> str:
    """repr(value) on one line, cut to about `limit` characters (how an error message shows a user's value)."""
    text = _SHORT.repr(value) if isinstance(value, list | tuple | dict | set) else repr(value)  # never a huge repr
    text = " ".join(text.split()) if "\n" in text else text
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_repeat(values):
    """The first value of `values` given a second time, or None: a list a flag or parameter names one value twice in
    is refused (it would be measured, merged or recorded twice)."""
    seen: list = []  # (a list, not a set: values may be unhashable)
    for value in values:
        if value in seen:
            return value
        seen.append(value)
    return None


IGNORED_CACHE_HOMES: set[str] = set()  # relative $XDG_CACHE_HOME values said to be ignored (once each, a process)


def cache_dir() -> Path:
    """The user cache, `$XDG_CACHE_HOME/attnlab` (else ~/.cache/attnlab): prepared data, downloads, kernels. An
    empty XDG_CACHE_HOME is unset, and a relative one ignored (said in a warning, once), as the XDG Base Directory
    spec says (not a cache of each working directory's own)."""
    given = os.environ.get("XDG_CACHE_HOME")
    if given and not os.path.isabs(given):
        if given not in IGNORED_CACHE_HOMES:
            IGNORED_CACHE_HOMES.add(given)
            warnings.warn(f"$XDG_CACHE_HOME={shown_value(given)} is a relative path, which the XDG Base Directory spec "
                          f"says to ignore: ignored, the cache is {Path.home() / '.cache' / 'attnlab'} (set it to an "
                          "absolute path to use another)", AttnlabWarning, stacklevel=2)  # fmt: skip
        given = None
    return Path(given or Path.home() / ".cache") / "attnlab"


def shown_value(value: str) -> str:
    """`value` as a line shows it: as it is, or quoted (repr) when spaces at its ends or control characters would
    hide in the line, saying where the spaces are ($ATTNLAB_DATA=' /data' (it starts with a space))."""
    if value == value.strip() and value.isprintable() and value:
        return value
    ends = " and ".join(end for end, space in (("starts", value[:1].isspace()), ("ends", value[-1:].isspace()))
                        if space)  # fmt: skip
    blanks = {c for c in (value[:1], value[-1:]) if c.isspace()}
    kind = "a space" if blanks <= {" "} else "whitespace"  # (a newline or a tab: repr shows \n, \t)
    return f"{value!r} (it {ends} with {kind})" if ends else repr(value)


def data_dirs(data_dir: str | Path | None = None) -> list[Path]:
    """Candidate data directories, in lookup order: `data_dir` (--data-dir), $ATTNLAB_DATA, the user cache, each
    folder once (--data-dir the same as $ATTNLAB_DATA is searched, and listed in a refusal, once). DataError when one
    of the first two names a file."""
    given = [(Path(data_dir), f"--data-dir {shown_value(str(data_dir))}")] if data_dir else []
    if os.environ.get("ATTNLAB_DATA"):
        given.append((Path(os.environ["ATTNLAB_DATA"]), f"$ATTNLAB_DATA={shown_value(os.environ['ATTNLAB_DATA'])}"))
    for path, what in given:
        if path.exists() and not path.is_dir():
            raise DataError(f"{what}: a file, not a folder (name the folder that holds the data files)")
    found: dict[str, Path] = {}
    for path in [*(path for path, _ in given), cache_dir()]:
        found.setdefault(os.path.realpath(path), path)  # (the first spelling of a folder named twice)
    return list(found.values())


def check_data_dirs(data_dir: str | Path | None = None) -> None:
    """DataError unless --data-dir and $ATTNLAB_DATA, when given, name existing folders: a typo would otherwise
    fall back to the user cache (or a download) without a word."""
    data_dirs(data_dir)
    check_data_dir(data_dir)
    env = os.environ.get("ATTNLAB_DATA")
    if env and not Path(env).exists():
        raise DataError(f"$ATTNLAB_DATA={shown_value(env)}: no such folder (name the folder that holds the data "
                        "files, or unset ATTNLAB_DATA)")  # fmt: skip


def check_data_dir(data_dir: str | Path | None, flag: str = "--data-dir") -> None:
    """DataError unless `data_dir`, when given, names an existing folder: named as the CLI's --data-dir, or with
    flag="data_dir" as an API function's argument (InputError for what is no path)."""
    if data_dir is None or data_dir == "":  # (not given, as data_dirs reads it)
        return
    if not isinstance(data_dir, str | os.PathLike):
        raise InputError(f"{flag} must be the path of a folder of data files (or None), got {given(data_dir)}")
    shown = f"--data-dir {shown_value(str(data_dir))}" if flag == "--data-dir" else f"{flag}={str(data_dir)!r}"
    if not Path(data_dir).exists():
        raise DataError(f"{shown}: no such folder (name the folder that holds the data files)")
    if not Path(data_dir).is_dir():
        raise DataError(f"{shown}: a file, not a folder (name the folder that holds the data files)")


def in_data_dirs(path: str | Path, data_dir: str | Path | None = None) -> Path:
    """`path` as it is when it exists or is absolute, else the first data directory's `<dir>/<path>` that exists
    (models/X.gguf: a model reference is found where data files are); else `path` as given."""
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    return next((d / path for d in data_dirs(data_dir) if (d / path).exists()), path)


def data_file_problem(root: Path, relative: str) -> str | None:
    """Why what stands at `<root>/<relative>` cannot be read as the data file it is looked up as, or None when it is
    a regular file (a link to one included) or nothing is there (the lookup moves on to the next data folder). A
    dangling link, a folder, a FIFO (never opened: it would wait for a writer) or a file where one of the path's
    folders goes is named, rather than skipped for the next data folder's file or waited on."""
    path = root / relative
    for parent in reversed(path.relative_to(root).parents[:-1]):  # the folders between root and the file
        folder = root / parent
        if os.path.lexists(folder) and not folder.is_dir():
            return (f"{folder}: a file, not a folder, where the folder of the data file {relative} goes (move it "
                    f"away, or make it a folder that holds {path.name})")  # fmt: skip
    if not os.path.lexists(path):
        return None
    if path.is_symlink() and not path.exists():
        return (f"{path}: a link to {os.readlink(path)}, which does not exist (mount or restore it, or remove the "
                "link to use the next data folder's file)")  # fmt: skip
    try:
        mode = path.stat().st_mode
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror or e}); make it readable, or remove it"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return f"{path}: is a folder, where a file is expected (put the data file there, or remove the folder)"
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"{path}: is {kind}, not a regular file (put the data file there: it is not opened, or waited on)"


def first_data_file(relative: str, dirs: list[Path]) -> Path | None:
    """The first `<dir>/<relative>` of `dirs` that is a regular file, None when none is there; DataError naming the
    first thing in its place that is not one (see data_file_problem), where it would be looked for."""
    for directory in dirs:
        problem = data_file_problem(directory, relative)
        if problem:
            raise DataError(problem)
        if (directory / relative).is_file():
            return directory / relative
    return None


def find_data_file(relative: str, data_dir: str | Path | None = None) -> Path:
    """The first `<dir>/<relative>` that is a regular file (anything else in its place is refused, naming it); the
    error says where it looked and how to provide it."""
    dirs = data_dirs(data_dir)
    found = first_data_file(relative, dirs)
    if found is not None:
        return found
    tried = [d / relative for d in dirs]
    raise DataError(
        f"{relative} not found (looked in: {', '.join(map(str, tried))}); "
        "pass --data-dir DIR or set ATTNLAB_DATA to a directory that holds it"
    )


def unprintable_problem(name: str, what: str) -> str | None:
    """Why `name` (a name shown in lines: a manifest's, a model config's) would not read as one line: control
    characters, or white space at either end; None when it does."""
    if any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name):
        return f"{what} {brief(name)} must not contain control characters"
    if name != name.strip():
        return f"{what} {brief(name)} must not start or end with white space"
    return None


def name_problem(name: object, what: str) -> str | None:
    """Why `name` cannot be a manifest, target, phase or memory name (it becomes a folder or file name), or None.

    A name is a non-empty string of at most MAX_NAME_LENGTH characters, without path separators, `..`,
    control characters, a leading dot (hidden files, `.` and `..`) or white space at either end.
    """
    if not isinstance(name, str):
        return f"{what}={brief(name)} must be a string (a name), got {type(name).__name__}"
    if not name:
        return f"{what} must not be empty"
    shown = brief(name)
    if len(name) > MAX_NAME_LENGTH:
        return f"{what} {shown} is {len(name)} characters long (at most {MAX_NAME_LENGTH})"
    if "/" in name or "\\" in name:
        return f"{what} {shown} must not contain a path separator ('/' or '\\'): it names one folder or file"
    if ".." in name:
        return f"{what} {shown} must not contain '..'"
    if name.startswith("."):
        return f"{what} {shown} must not start with '.'"
    problem = unprintable_problem(name, what)
    if problem:
        return problem
    if "${" in name:
        return f"{what} {shown}: variables are not substituted in names (write the name out)"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # bytes that were not UTF-8 (a shell argument): surrogates
        return f"{what} {shown} is not valid UTF-8 text"
    return None


def check_name(name: object, what: str, error: type[Exception] = ConfigError) -> str:
    """`name` when it is a usable name (see name_problem), else `error` with the reason."""
    problem = name_problem(name, what)
    if problem:
        raise error(problem)
    return name


def inside(path: str | Path, root: str | Path, what: str) -> Path:
    """`path` when it resolves inside `root` (both resolved: `..` and symbolic links followed), else ConfigError."""
    resolved, base = Path(path).resolve(), Path(root).resolve()
    if not resolved.is_relative_to(base):
        for link in reversed([Path(path), *Path(path).parents]):  # a link the user made, the shallowest first
            if link.is_symlink() and not link.resolve().is_relative_to(base):
                thing = "" if link == Path(path) else f": {link}"
                raise ConfigError(f"{what} {path}{thing} is a link to {link.resolve()}, outside {root}: move the "
                                  f"folder it links to into {root} in place of the link, or give --out where it "
                                  "really is")  # fmt: skip
        raise ConfigError(f"{what} {path} resolves to {resolved}, outside {base} (use plain names, without '..')")
    return Path(path)


def nearest_existing(path: str | Path) -> Path:
    """The nearest of `path`'s parents that is there (the root is): where making `path` starts."""
    return next(p for p in Path(os.path.abspath(path)).parents if os.path.lexists(p))


def blocking_file(path: str | Path) -> Path | None:
    """The file that stands where one of `path`'s folders goes (so that nothing can be made at `path`), or None."""
    parent = nearest_existing(path)
    return None if parent.is_dir() else parent


def system_folder(path: str | Path) -> Path | None:
    """The nearest existing parent of `path` when it is on a virtual file system (/proc, /sys: no blocks of
    storage), which takes no new files: why making `path` failed with 'No such file or directory' though its
    folder is there. None otherwise."""
    parent = nearest_existing(path)
    try:
        return parent if parent.is_dir() and os.statvfs(parent).f_blocks == 0 else None
    except OSError:
        return None


SUMMARY_STATUS = "complete"  # a run's summary.json's status: the only one written (no summary until it finishes)


def is_run_folder(folder: Path) -> bool:
    """Whether folder holds a run train() wrote: its config.json (model, data and train), and checkpoints/ or
    summary.json."""
    if not ((folder / "checkpoints").is_dir() or (folder / "summary.json").is_file()):
        return False
    try:
        config = loads_json((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(config, dict) and {"model", "data", "train"} <= set(config)


def cache_folder_problem(path: str | Path, flag: str = "--out") -> str | None:
    """The line refusing `path` (given as `flag`: a folder or file a command makes) inside attnlab's own cache
    (cache_dir(): prepared data, downloads, compiled kernels), which one clears to free space or start afresh,
    deleting what was written there with it; else None. The default memory store (cache_dir()/memory) is a store's."""
    try:
        resolved, cache = Path(path).resolve(), cache_dir().resolve()
    except (OSError, RuntimeError):  # a link loop (RuntimeError before Python 3.13): named by the checks after this
        return None
    store = flag in ("--store", "$ATTNLAB_MEMORY", "the store")
    if not resolved.is_relative_to(cache) or (store and resolved.is_relative_to(cache / "memory")):
        return None
    return (f"{flag} {path} is inside attnlab's cache {cache_dir()} (prepared data, downloads, compiled kernels), "
            "which clearing the cache deletes: give a folder of your own")  # fmt: skip


def as_reached(path: str | Path) -> Path:
    """`path` made absolute, and with its '..' parts taken as the system takes them (RUN/../seed1 is not inside
    RUN): resolved when it holds any, else as given (a link's own place, not its target's)."""
    absolute = Path(path).absolute()
    try:
        return absolute.resolve() if ".." in absolute.parts else absolute
    except (OSError, RuntimeError):  # a link loop (RuntimeError before Python 3.13): named by the checks after
        return absolute


def new_name_problem(path: str | Path, flag: str = "--out") -> str | None:
    """The line refusing `path` when a folder or file it would make (a part not there yet) has a name that would not
    read as one line (unprintable_problem: a control character, white space at an end), as names are refused."""
    made, absolute = [], Path(path).absolute()
    while not os.path.lexists(absolute) and absolute != absolute.parent:
        made, absolute = [absolute.name, *made], absolute.parent
    problem = next((p for p in (unprintable_problem(name, "the name") for name in made) if p), None)
    return f"{flag} {shown_value(str(path))}: {problem} (it names a folder or file this makes)" if problem else None


def run_folder_problem(path: str | Path, why: str, flag: str = "--out") -> str | None:
    """The line refusing `path` (given as `flag`) when it is inside attnlab's cache (cache_folder_problem), or a
    run's folder or inside one, where another command's output would be mixed with the run's own files (`why` says
    what would happen there, and the fix); else None. Every command's --out (--hf, --store) that makes a folder or
    file is checked here."""
    problem = cache_folder_problem(path, flag) or new_name_problem(path, flag)
    if problem:
        return problem
    absolute = as_reached(path)
    for folder in (absolute, *absolute.parents):
        if is_run_folder(folder):
            shown = folder.relative_to(Path.cwd()) if folder.is_relative_to(Path.cwd()) else folder
            where = "is" if folder == absolute else f"is inside {shown}, which is"
            return f"{flag} {path} {where} a run's folder (it holds config.json and its checkpoints): {why}"
    return None


def temporary_directory_problem() -> str | None:
    """None when Python's `tempfile` finds a temporary directory it can write (importing torch needs one); else
    why not, on one line: the folders tried and what writing the first of them said (a file-size limit of 0, a
    full disk, no permission). Standard library only: the CLI asks before torch is imported."""
    import errno
    import tempfile

    try:
        tempfile.gettempdir()
        return None
    except OSError:
        pass
    given = [(name, os.environ[name]) for name in ("TMPDIR", "TEMP", "TMP") if os.environ.get(name)]
    try:
        here = [os.getcwd()]
    except OSError:
        here = []
    tried = list(dict.fromkeys([value for _, value in given] + ["/tmp", "/var/tmp", "/usr/tmp"] + here))
    probe = os.path.join(tried[0], f".attnlab-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.unlink(probe)
        why = "it can be written now (try again)"
    except OSError as e:
        why = {
            errno.EFBIG: "a file-size limit (ulimit -f) of 0 stops every write: raise it (ulimit -f unlimited)",
            errno.ENOSPC: "the disk is full: free some space",
            errno.EDQUOT: "the disk quota is used up: free some space",
            errno.EROFS: "a read-only file system",
            errno.EACCES: "no permission to write there",
            errno.EPERM: "no permission to write there",
            errno.ENOENT: "it does not exist",
            errno.ENOTDIR: "it is not a folder",
        }.get(e.errno, e.strerror or str(e))
    named = ", ".join(f"{name}={value}" for name, value in given) or "TMPDIR is not set"
    return (f"no usable temporary directory ({named}): Python can write none of {', '.join(tried)}, and torch "
            f"needs one; writing to {tried[0]}: {why} (or set TMPDIR to a writable folder on a disk with "
            "room)")  # fmt: skip
