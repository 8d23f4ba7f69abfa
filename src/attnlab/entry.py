"""The `attnlab` command's entry point ([project.scripts] in pyproject.toml): a Ctrl-C is one line and exit code 130
wherever it lands, during the imports (torch's take seconds) as well as during a command.

attnlab.cli imports torch at its top, and a SIGINT before cli.main() had installed its handling printed a
KeyboardInterrupt traceback from inside torch, importlib or dataclasses. This module imports only the standard
library (and `import attnlab` imports nothing else, see attnlab/__init__.py), so its main() holds every import
of the command.

Some libraries do not let a KeyboardInterrupt through: torch imports numpy from C++ and carries on without it when
that import fails (leaving a half-imported numpy: `module 'numpy' has no attribute 'intp'` later); numpy's C code
turns one into an ImportError; mpmath (imported by sympy, which torch imports on first use of some operations)
imports gmpy under a bare `except:`. So main() notes every SIGINT itself: once one came, the next import raises
KeyboardInterrupt again, and a command that still ends (or fails in its own words) ends as interrupted. During the
imports of attnlab.cli (torch's) a SIGINT is only noted, and raised once they are done: torch's import runs Python
from C++, and a KeyboardInterrupt raised there ended the process in C++'s `terminate called ...` (rc -6).

What it cannot cover: a SIGINT while the interpreter starts, before the console script has called main() (Python's
own start-up and the script's first two imports, a few milliseconds), which ends in Python's own traceback.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator

INTERRUPTED = 130  # the shell's exit code of a command stopped by SIGINT (128 + 2)
TERMINATED = 143  # ... and by SIGTERM (128 + 15): `kill`, a service manager, a job scheduler's stop
RESUMABLE = {"run": "run the same command again to resume from the last checkpoint"}  # what an interrupted one does
# ... and one given --no-resume, whose same command would start over rather than resume
STARTS_OVER = {"run": "run it again without --no-resume to resume from the last checkpoint (with it, the run starts "
               "over)"}  # fmt: skip
GRACE_SECONDS = 10.0  # as train.signals: a second Ctrl-C this soon after the first is ignored while the first stops


def command_name(argv: list[str]) -> str:
    """The command that the lines of `attnlab ...` name, from its arguments as given: `info`, `memory ingest` (as
    cli.main names it once they are parsed); '' for none."""
    words = [arg for arg in argv[:2] if not arg.startswith("-")]
    return " ".join(words[:2] if words[:1] == ["memory"] else words[:1])


class Terminated(KeyboardInterrupt):
    """Raised by the entry point's SIGTERM handler: a KeyboardInterrupt, so that a command stops (and cleans up) as
    for Ctrl-C, said as `terminated`, exit code 143."""


def interrupted(command: str, no_resume: bool = False, dry_run: bool = False, terminated: bool = False) -> int:
    """One line for a command stopped with Ctrl-C (KeyboardInterrupt), no traceback; exit code 130 (terminated, by
    SIGTERM: `attnlab <command>: terminated`, exit code 143).
    `attnlab run: interrupted; run the same command again to resume from the last checkpoint` (no_resume: the command
    was given --no-resume, so that the same command would start over: run it again without it; dry_run: a dry run
    trains nothing, so there is nothing to resume)."""
    said = {} if dry_run else STARTS_OVER if no_resume else RESUMABLE
    how = f"; {said[command]}" if command in said else ""
    print(f"attnlab{' ' + command if command else ''}: {'terminated' if terminated else 'interrupted'}{how}",
          file=sys.stderr)  # fmt: skip
    return TERMINATED if terminated else INTERRUPTED


def given(flag: str, shortest: str, argv: list[str]) -> bool:
    """Whether the arguments as given hold `flag` (or an abbreviation argparse takes for it, from `shortest` on:
    --no-r... for --no-resume, --dr... for --dry-run)."""
    return any(arg.startswith(shortest) and flag.startswith(arg) for arg in argv)


def main() -> int:
    """Runs `attnlab` with sys.argv: its exit code, which the console script exits with (SIGINT is left ignored:
    the process is ending; in-process callers want attnlab.cli.main)."""
    from attnlab.envcheck import thread_env_problem  # (standard library only)

    problem = thread_env_problem()  # before torch's import, where libgomp would print its own raw line first
    if problem:
        command = command_name(sys.argv[1:])
        print(f"attnlab{' ' + command if command else ''}: error: {problem}", file=sys.stderr)
        return 2
    try:
        with _noting_interrupts() as seen:
            try:
                seen.defer = True  # torch's import runs Python from C++: an exception raised there can abort
                try:
                    from attnlab.cli import main as run_command
                finally:
                    seen.defer = False
                if seen:
                    raise _stop(seen)  # a Ctrl-C during the imports, raised once they are done
                code = run_command()  # (a Ctrl-C it meets is its own one line, and code 130; SIGTERM's 143)
            except Exception:
                if not seen:
                    raise
                raise _stop(seen) from None  # the failure of something a Ctrl-C stopped, in its own words
            if seen and code not in (INTERRUPTED, TERMINATED):  # a library took the KeyboardInterrupt and went on
                raise _stop(seen)
    except KeyboardInterrupt as e:
        argv = sys.argv[1:]
        return interrupted(command_name(argv), given("--no-resume", "--no-r", argv), given("--dry-run", "--dr", argv),
                           isinstance(e, Terminated))  # fmt: skip
    finally:
        _ignore_interrupts()  # the command is done: a Ctrl-C now would end the interpreter's exit hooks in a traceback
    return code


def _stop(seen: list[float]) -> KeyboardInterrupt:
    """The exception of the signal noted last in `seen` (a SIGTERM's time is noted negative)."""
    return Terminated() if seen[-1] < 0 else KeyboardInterrupt()


class _Noted(list):
    """The times of the signals noted (a SIGTERM's negative); while `defer`, a signal is only noted: the code that
    set it raises once it is done (torch's import calls Python from C++, where a KeyboardInterrupt raised by the
    handler can end the process in C++'s `terminate called after throwing ...`, rc -6, seen under load)."""

    defer = False


@contextlib.contextmanager
def _noting_interrupts() -> Iterator[_Noted]:
    """Within the block a SIGINT raises KeyboardInterrupt, as Python's own handler does, and is noted (its time) in
    the list yielded; once one came, every import raises KeyboardInterrupt again (_StopImports). Further SIGINTs in
    the GRACE_SECONDS after one are ignored, as train.signals ignores them during a run (whose handler then stands
    aside: this one is installed). A handler someone else installed (or SIGINT ignored) is left alone. A SIGTERM
    (its default action kept so far) is handled alike, raising Terminated; its time is noted negative."""
    seen = _Noted()
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    handled = [sig for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL))
               if signal.getsignal(sig) is default]  # fmt: skip
    if not handled:
        yield seen
        return

    def note(signum, frame):
        if seen and time.monotonic() - abs(seen[-1]) < GRACE_SECONDS:
            return  # a second Ctrl-C (or SIGTERM) while the first is being handled
        seen.append(-time.monotonic() if signum == signal.SIGTERM else time.monotonic())
        if not seen.defer:
            raise _stop(seen)

    stop = _StopImports(seen)
    sys.meta_path.insert(0, stop)
    for sig in handled:
        signal.signal(sig, note)
    try:
        yield seen
    finally:
        sys.meta_path.remove(stop)
        if signal.SIGTERM in handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (a SIGTERM from now on ends the exit hooks, silently)


class _StopImports:
    """A finder first on sys.meta_path: once a SIGINT was noted, the next import raises KeyboardInterrupt again (one
    that was swallowed would otherwise leave the program running on), but for one made while a KeyboardInterrupt is
    still being handled (the clean-up of one that was not swallowed)."""

    def __init__(self, seen: list[float]):
        self.seen = seen

    def find_spec(self, name, path, target=None):
        if self.seen and not self.seen.defer and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
            raise _stop(self.seen)
        return None  # (the other finders find the module)


def _ignore_interrupts() -> None:
    if threading.current_thread() is threading.main_thread():  # (only the main thread may set a handler)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
