"""Ctrl-C during a run: the first SIGINT stops it; the ones right after it are ignored while it stops.

An impatient double Ctrl-C would otherwise interrupt the clean-up of the first (a temporary file left behind)
or an interpreter exit hook (torch's prints a 15-line KeyboardInterrupt traceback after the CLI's one line).
The first SIGINT raises KeyboardInterrupt as Python's own handler does; every further one is ignored for
GRACE_SECONDS after it, which covers the unwinding, and from the interpreter's exit on (its exit hooks and
shutdown), so the exit code stays the CLI's 130. A library caller (a notebook) that carries on after the interrupt
gets Ctrl-C back once GRACE_SECONDS have passed. Under the `attnlab` command the entry point's handler (attnlab.entry,
which does the same for every command) is installed already, and this one stands aside.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
import time
from collections.abc import Iterator

GRACE_SECONDS = 10.0
_exit_hook: list = []  # registered once: the exit hooks run last-registered first, so this one before the others


def _handler(first: list[float]):
    def handle(signum, frame):
        if first and time.monotonic() - first[0] < GRACE_SECONDS:
            return  # a second Ctrl-C while the first is being handled
        first[:] = [time.monotonic()]
        raise KeyboardInterrupt

    return handle


@contextlib.contextmanager
def first_interrupt_only() -> Iterator[None]:
    """Within the block (and for GRACE_SECONDS after an interrupt ended it) a SIGINT raises KeyboardInterrupt
    once; further ones in the next GRACE_SECONDS are ignored. Leaves a handler someone else installed alone (and
    does nothing outside the main thread, where Python delivers no signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:  # ignored, or another program's handler: theirs to decide
        yield
        return
    first: list[float] = []
    signal.signal(signal.SIGINT, _handler(first))
    try:
        yield
    finally:
        if not first:
            signal.signal(signal.SIGINT, previous)
        elif not _exit_hook:  # keep ignoring a second Ctrl-C: now, and (SIG_IGN) once the interpreter exits
            _exit_hook.append(atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN))
