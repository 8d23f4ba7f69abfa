"""How the attnlab command reports a user's mistake: one line, `attnlab <command>: error: ...`, exit code 2.
Typed errors (attnlab.errors) are printed as one line; the operating system's refusals a user can act on
(permissions, full or read-only disks; a missing path the user gave) are turned into one line naming the path
and the fix; warnings attnlab means for the user (AttnlabWarning) are one line too. The parser's usage errors
are one line (Parser)."""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import errno
import math
import os
import shlex
import sys
from pathlib import Path

from attnlab.data.files import TEMPORARY
from attnlab.data.sources import NAMED_SOURCES, download_plan
from attnlab.errors import AttnlabWarning, DataError, InputError
from attnlab.generate import greedy_problem
from attnlab.paths import system_folder

MAX_LINE = 2000  # characters of an error line; a longer message is cut (its start names the problem)


def one_line(text: object) -> str:
    """`text` on one line: its lines joined with spaces (blank lines and caret markers such as `^^^` dropped),
    cut to MAX_LINE characters."""
    lines = [line.strip() for line in str(text).splitlines()]
    joined = " ".join(line for line in lines if line.strip("^~ "))
    if len(joined) > MAX_LINE:
        cut = MAX_LINE - 40
        joined = joined[:cut].rstrip() + f" ... ({len(joined) - cut:,} more characters)"
    return joined


GIVEN = "_attnlab_given"  # the namespace's record of the single-value options given so far (removed after parsing)


class Once(argparse.Action):
    """argparse's `store`, refusing an option given twice (`--out a.jsonl --out b.jsonl`): argparse would keep the
    last one without a word. Options meant to repeat use action="append"."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, GIVEN, None)
        if given is None:
            given = {}
            setattr(namespace, GIVEN, given)
        if self.dest in given:
            first, then = given[self.dest], f"{option_string} {_shown(values)}"
            raise argparse.ArgumentError(self, f"given twice ({first}, then {then}): give it once")
        given[self.dest] = f"{option_string} {_shown(values)}"
        setattr(namespace, self.dest, values)


def _shown(values) -> str:
    return " ".join(map(str, values)) if isinstance(values, list) else str(values)


# The command line the root parser read, for a subcommand's error() hint: per thread and context, not a class's
# state (two parses at once in one process, as tests and library callers make, each see their own).
COMMAND_LINE: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("attnlab_command_line", default=())


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors (`--top-p abc`) are one line too, with exit code 2, from the (sub)command
    they concern: `attnlab list extra` is refused by `attnlab list`. An option that takes one value refuses to
    be given twice (Once)."""

    def add_argument(self, *names, **kwargs):
        if names and names[0].startswith("-") and kwargs.get("action", "store") == "store":
            kwargs["action"] = Once
        return super().add_argument(*names, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)}{self._dash_hint(message)} (see {self.prog} --help)\n")

    def _dash_hint(self, message: str) -> str:
        """For a command that takes a prompt, given a word starting with '-' that is none of its options: argparse
        read it as options (`-hello` as -h with 'ello'); the way to give it as the prompt."""
        if not any(action.dest == "prompt" for action in self._actions):
            return ""
        options = {name for action in self._actions for name in action.option_strings}
        given = COMMAND_LINE.get()
        words = given[: given.index("--")] if "--" in given else given
        # (-5 is a number, which argparse reads as a value)
        dashed = [w for w in words if w.startswith("-") and w.split("=")[0] not in options and not w[1:2].isdigit()]
        if not dashed or not ("prompt" in message or "ignored explicit argument" in message):
            return ""  # (a mistyped option beside a prompt: "unrecognized arguments" says it)
        return (f"; to give {dashed[0]!r} as the prompt, put -- before it and every option before the -- ({self.prog} "
                f"... -- {shlex.quote(dashed[0])}: what follows -- is read as the prompt)")  # fmt: skip

    def parse_args(self, args=None, namespace=None):
        COMMAND_LINE.set(tuple(sys.argv[1:] if args is None else args))
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._command_of(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        vars(parsed).pop(GIVEN, None)  # subcommands' records are copied up into this namespace
        return parsed

    def argument_names(self, parsed) -> dict[str, str]:
        """dest -> the argument as a user names it (its long option, or a positional's name) for every argument of
        this parser and of the subcommands `parsed` went through."""
        names = {}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(parsed, action.dest, None))
                if isinstance(sub, Parser):
                    names.update(sub.argument_names(parsed))
            elif action.option_strings:
                names[action.dest] = max(action.option_strings, key=len)
            else:
                names[action.dest] = action.metavar if isinstance(action.metavar, str) else action.dest
        return names

    def _command_of(self, parsed) -> argparse.ArgumentParser:
        """The innermost subcommand's parser `parsed` went through (`attnlab memory query`)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
                sub = action.choices[getattr(parsed, action.dest)]
                return sub._command_of(parsed) if isinstance(sub, Parser) else sub
        return self


# The operating system's refusals a user can act on. Permissions, read-only and full disks, on any path: they
# are never attnlab's bugs. A missing path, or a file where a folder belongs (and the reverse), only on a path
# the user gave (an argument, $ATTNLAB_DATA, $ATTNLAB_MEMORY), one inside it or one of its folders: elsewhere they
# are bugs and keep their traceback.
ANY_PATH = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
GIVEN_PATH = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG}
OPTIONS = {"out": "--out", "store": "--store", "data_dir": "--data-dir"}  # where a user chooses a folder
ENVIRONMENT = ("ATTNLAB_DATA", "ATTNLAB_MEMORY")  # folders a user names in the environment
CACHE = "XDG_CACHE_HOME"  # the user cache (prepared data, compiled kernels, memories): ~/.cache by default
NOT_PATHS = {
    "func",
    "command",
    "verb",
    "prompt",
    "name",
    "set",
    "target",
    "policies",
    "kv_policy",
    "benchmarks",
    "formats",
    "resids",
    "split",
    "dtype",
    "task",
    "baseline",
}  # string arguments that never name a path


def _absolute(path: str | os.PathLike) -> list[Path]:
    """The path made absolute, as given and with symbolic links resolved."""
    return list(dict.fromkeys([Path(os.path.abspath(path)), Path(os.path.realpath(path))]))


def _given_paths(args, cache: bool) -> list[tuple[str, list[Path]]]:
    """(where it came from: an argument's dest or $VARIABLE, its absolute forms) for every path the user gave:
    the string arguments that may be paths and the environment's folders; with `cache`, the user cache too
    (chosen by the user or not)."""
    given = []
    for dest, value in vars(args).items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, (str, os.PathLike)) and str(item) and dest not in NOT_PATHS:
                given.append((dest, _absolute(item)))
    given += [(f"${name}", _absolute(os.environ[name])) for name in ENVIRONMENT if os.environ.get(name)]
    if cache:
        given.append((f"${CACHE}", _absolute(os.environ.get(CACHE) or Path.home() / ".cache")))
    return given


def _origin(path: str | os.PathLike, args, cache: bool = False) -> str | None:
    """Where `path` came from: the argument dest or $VARIABLE of the given path it is, is inside, or is a folder
    of (making `--out a/b` makes `a`), else None. The working folder, the home folder and the root hold
    everything: they match only themselves."""
    broad = {Path.cwd(), Path("/"), Path.home()}
    mine = _absolute(path)
    for origin, forms in _given_paths(args, cache):
        for given in forms:
            for p in mine:
                if p == given or (given not in broad and p.is_relative_to(given)):
                    return origin
                if p not in broad and given.is_relative_to(p):
                    return origin
    return None


def _elsewhere(origin: str | None, args=None) -> str:
    """How to point attnlab at another place, for a path that came from `origin`: the command's --out when it has
    one (compare writes beside the runs it reads unless given --out); `report` writes into the folder it reads."""
    if origin in OPTIONS:
        return f", or choose another folder with {OPTIONS[origin]}"
    if origin is not None and getattr(args, "command", None) == "report":
        return ", or copy the folder somewhere writable and report the copy"
    if origin is not None and not origin.startswith("$") and hasattr(args, "out"):
        return f", or choose another folder with {OPTIONS['out']}"
    if origin is not None and origin.startswith("$"):
        return f", or set {origin[1:]} to another folder"
    if origin is not None:
        return ", or give another path"
    return ""


def _shortened(path: Path, keep: int = 60) -> str:
    """`path` as text, its middle cut to `…` when it is longer than 2 * keep characters (a line stays readable)."""
    text = str(path)
    return text if len(text) <= 2 * keep else f"{text[:keep]}…{text[-keep:]}"


def _name_limit(path: Path) -> str:
    """Which limit `path` passes, with the file system's own figures (NAME_MAX bytes a part, PATH_MAX a path)."""
    folder = next((p for p in Path(os.path.abspath(path)).parents if os.path.isdir(p)), Path("/"))
    limits = []
    for name, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
        try:
            limits.append(os.pathconf(folder, name))
        except (OSError, ValueError):
            limits.append(default)
    longest = max(len(os.fsencode(part)) for part in path.parts)
    whole = len(os.fsencode(os.path.abspath(path)))
    if longest > limits[0]:
        return (f"a part of it is {longest} bytes, more than the file system allows ({limits[0]} bytes a part); "
                "give a shorter path")  # fmt: skip
    if whole >= limits[1]:
        return f"the whole path is {whole} bytes, more than the system allows ({limits[1]}); give a shorter path"
    return (f"a name made there is too long for its file system (the path is {whole} bytes, its longest part "
            f"{longest}); give a shorter name")  # fmt: skip


def os_error_line(e: OSError, args) -> str | None:
    """One line for an error of the operating system the user can act on (see ANY_PATH, GIVEN_PATH), naming
    the path and what to do; None for any other (a bug: it keeps its traceback)."""
    code = errno.EACCES if isinstance(e, PermissionError) and e.errno not in ANY_PATH else e.errno
    path = Path(e.filename) if isinstance(e.filename, (str, os.PathLike)) else None
    temporary = path and TEMPORARY.fullmatch(path.name)
    if temporary:  # a file written under a temporary name, then renamed: name the file it becomes
        path = path.with_name(temporary["name"])
    cache = os.environ.get(CACHE)
    if code == errno.ENOENT and path is not None and cache and not os.path.isdir(cache):
        if any(p.is_relative_to(root) for p in _absolute(path) for root in _absolute(cache)):
            return (f"{path}: cannot be created: the cache folder {cache} (${CACHE}) does not exist and cannot be "
                    f"made there; set {CACHE} to a writable folder")  # fmt: skip
    if code not in ANY_PATH and not (code in GIVEN_PATH and path is not None and _origin(path, args)):
        return None
    if path is None:  # e.g. a write() on a full disk: no path to name
        fix = "free some space" if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "check the permissions"
        out = f" (or write elsewhere with {OPTIONS['out']})" if getattr(args, "out", None) else ""
        return f"{e.strerror or e}: {fix}{out}"
    hint = _elsewhere(_origin(path, args, cache=True), args)
    if code in (errno.EACCES, errno.EPERM):
        if os.path.lexists(path):
            return f"{path}: permission denied (check its permissions{hint})"
        folder = next(p for p in path.parents if os.path.lexists(p))  # the root exists
        return f"{path}: permission denied: cannot create it in {folder} (make that folder writable{hint})"
    if code == errno.EROFS:
        return f"{path}: on a read-only file system (write it somewhere else{hint})"
    if code == errno.EFBIG:
        return (f"{path}: file too large: the disk is full or a file size limit is reached (see `ulimit -f`; free "
                f"some space or raise the limit{hint})")  # fmt: skip
    if code in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on the device" if code == errno.ENOSPC else "disk quota exceeded"
        return f"{path}: {what} (free some space{hint})"
    if code == errno.ENOENT:
        system = None if os.path.lexists(path) else system_folder(path)
        if system is not None:  # making a file there fails as if its folder were missing
            return (f"{path}: no such file or folder, and none can be made there: {system} is on a virtual file "
                    f"system (such as /proc or /sys), which takes no new files (give a path in another "
                    f"folder{hint})")  # fmt: skip
        return f"{path}: no such file or folder (check the path)"
    if code == errno.ENAMETOOLONG:
        return f"{_shortened(path)}: file name too long: {_name_limit(path)}"
    if code == errno.ENOTDIR:
        return f"{path}: a part of this path is a file, not a folder (check the path)"
    if code == errno.EISDIR:
        return f"{path}: is a folder, where a file is expected (give a file's path)"
    if os.path.isdir(path):  # EEXIST
        return f"{path}: already exists (give another path)"
    return f"{path}: is a file, where a folder is expected (give a folder's path)"


def too_deep_line(e: RecursionError, command: str) -> str | None:
    """One line for a file nested too deeply to read (JSON such as `[[[[...]]]]` 100,000 levels deep exhausts
    Python's recursion in the json module's decoder), naming the file when a reader of attnlab's holds it in a
    variable `path`; None for any other RecursionError (a bug: it keeps its traceback). The readers of the files
    a user gives catch it themselves (a typed error naming the file); this is the net under the others."""
    frames, tb = [], e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    parsing = "decoding a JSON" in str(e) or any(
        Path(f.f_code.co_filename).parent.name in ("json", "yaml") for f in frames[-8:]
    )  # fmt: skip
    if not parsing:
        return None
    package = Path(__file__).resolve().parent
    for frame in reversed(frames):  # the innermost reader of attnlab's that names its file
        if not Path(frame.f_code.co_filename).resolve().is_relative_to(package):
            continue
        path = frame.f_locals.get("path")
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
            return (f"{path}: nested too deeply to read (JSON or YAML thousands of levels deep: the file is damaged "
                    "or not the file expected); restore or replace it")  # fmt: skip
    return (f"a file `attnlab {command}` read is nested too deeply to read (JSON or YAML thousands of levels deep: "
            "damaged, or not the file expected); check the files it reads")  # fmt: skip


def check_utf8_arguments(args, names: dict[str, str]) -> None:
    """InputError naming the first string argument that is not UTF-8 text (names: dest -> how the user names it).
    On Linux a path's bytes that are not UTF-8 reach Python as surrogate escapes: such a path cannot be written
    into a run's config or records (UTF-8 files), nor printed, so it is refused before anything is made."""
    for dest, value in vars(args).items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and not _is_utf8(item):
                fix = ("write it as UTF-8 text" if dest in NOT_PATHS else
                       "rename the file or folder to a UTF-8 name, or choose another")  # fmt: skip
                raise InputError(f"{names.get(dest, dest)} {_bytes_shown(item)} is not valid UTF-8 text (the bytes "
                                 "shown as \\xNN are not UTF-8), and attnlab writes the paths and values it is given "
                                 f"into UTF-8 files: {fix}")  # fmt: skip


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bytes_shown(text: str) -> str:
    """`text` as the bytes it was given as, those that are not UTF-8 shown as \\xNN."""
    try:
        return os.fsencode(text).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no byte made (given to main() by a caller)
        return text.encode("utf-8", "backslashreplace").decode("ascii")


def fail(command: str, message: str) -> int:
    print(f"attnlab {command}: error: {one_line(message)}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def escaped_stdout():
    """stdout writes what its encoding cannot hold as backslash escapes (`\\u2713`), as Python's stderr does, rather
    than end a finished generation or query in a UnicodeEncodeError (PYTHONIOENCODING=ascii, a C or latin-1
    locale): the text, all of it that can be shown, is still printed. Restored on the way out."""
    stream = sys.stdout
    errors = getattr(stream, "errors", None)
    if errors != "strict" or not hasattr(stream, "reconfigure"):
        yield
        return
    stream.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        with contextlib.suppress(ValueError, OSError):  # closed (a broken pipe), nothing left to restore
            stream.reconfigure(errors=errors)


def warning_printer(command: str, show):
    """warnings.showwarning that prints an AttnlabWarning (e.g. a LengthWarning) as one line (`attnlab generate:
    warning: ...`)."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, AttnlabWarning):
            print(f"attnlab {command}: warning: {one_line(message)}", file=sys.stderr if file is None else file)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout", "timed out")


def peer_lost_line(error: RuntimeError) -> str | None:
    """The one line for a process of a torchrun launch whose peer stopped (a bad input it refused in its own line,
    or a kill) while this one waited for it in a collective; None for any other RuntimeError (a bug)."""
    import torch.distributed as dist

    text = str(error)
    if not (dist.is_available() and dist.is_initialized()) or not any(s in text for s in PEER_LOST):
        return None
    rank = dist.get_rank()
    return (f"process {rank} of this torchrun launch stopped waiting: another process ended first (its own error, "
            "if it had one, is the line above; a killed process has none): fix that, then run the same command "
            "again (a run resumes from its last checkpoint)")  # fmt: skip


def echoed_by_rank0(error: Exception) -> bool:
    """True in the processes of a torchrun launch other than rank 0 for a ConfigError or InputError: those come from
    the command line, the config and the environment the processes share, so rank 0 says the same line, and N
    copies of it (then torchrun's own summary) said nothing more. A DataError (a file one process read) is said by
    every process that met it."""
    from attnlab.errors import ConfigError

    return (
        isinstance(error, (ConfigError, InputError))
        and several_torchrun_processes()
        and (os.environ.get("RANK", "0").strip() not in ("", "0"))
    )


def several_torchrun_processes() -> bool:
    """Whether this process is one of several that torchrun started."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and os.environ.get("WORLD_SIZE", "1").strip() != "1"


def check_greedy_flags(args) -> None:
    """InputError for --top-k, --top-p or --seed given without a --temperature > 0 (`generate`, `memory query`):
    temperature 0, the default, is greedy, which they would not change, and the same text every time would pass
    for a sample. Checked before the model loads; attnlab.generate refuses the same (greedy_problem)."""
    problem = greedy_problem(args.temperature, args.top_k, args.top_p, args.seed, flags=True)
    if problem:
        raise InputError(problem)


def check_torchrun(command: str) -> None:
    """Under torchrun (several processes) only `attnlab run` shares its work: any other command would run whole in
    every process, and the twins race for the same outputs. InputError."""
    if command != "run" and several_torchrun_processes():
        raise InputError(f"only `attnlab run` shares its work among torchrun's processes: every process would run "
                         f"`attnlab {command}` whole (start it without torchrun)")  # fmt: skip


def calibration_error(args, e: DataError) -> DataError:
    """The one line for calibration text that could not be read (`e`): missing, or there but damaged."""
    if not text_found(args.calibrate_on, args.data_dir):
        return DataError(f"calibration text for the factorisations (--calibrate-on {args.calibrate_on}, train split) "
                         f"was not found: give --data-dir, or --calibration-tokens 0 to fit the weights alone "
                         f"({one_line(e)})")  # fmt: skip
    return DataError(f"--calibrate-on {args.calibrate_on} (the factorisations' calibration text, its train split): "
                     f"{one_line(e)}; or give --calibration-tokens 0 to fit the weights alone")  # fmt: skip


def text_found(source: str, data_dir) -> bool:
    """Whether the files of `source` (a named dataset or a file) are here: a reading error is then damage, not a
    missing file."""
    if source not in NAMED_SOURCES:
        return Path(source).expanduser().is_file()
    try:
        return download_plan(source, data_dir) is None
    except DataError:  # (a download it cannot make: the files are not here)
        return False


def kv_policy_text(text: str) -> str:
    """--kv-policy: a policy string; an empty one is refused (read as no policy, it ran the full-precision cache)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (give a policy, e.g. k=q8_0,v=q4_0, or leave the flag out)")
    return text


def item_limit(text: str) -> int | float:
    """--limit of lm-eval: a whole number of items (as an int), or a fraction of them (lm-eval's limit below 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (give N items, or a fraction in (0, 1))")
    return int(value) if value.is_integer() else value
