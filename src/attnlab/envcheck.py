"""Environment variables read by the libraries under attnlab, checked before they are imported (standard library
only: no torch here). libgomp, torch's OpenMP runtime, reads $OMP_NUM_THREADS when torch is imported; a value it
cannot read gets its own raw line on stderr ("libgomp: Invalid value for environment variable OMP_NUM_THREADS") and
is then ignored, so the command would carry on with another thread count than asked for."""

from __future__ import annotations

import os
import re

# What libgomp reads: a whole number >= 1, or a comma-separated list of them (threads per nesting level), with
# spaces around each and an optional `+`; `0`, `-1`, `abc`, `1e3`, an empty value or a trailing comma are not.
_THREAD_COUNT = re.compile(r"\s*\+?([0-9]+)\s*")
_MAX_COUNT = 2**64 - 1  # libgomp parses an unsigned long


def thread_env_problem(environ: dict[str, str] | None = None) -> str | None:
    """What is wrong with $OMP_NUM_THREADS (None when it is unset or libgomp reads it): one line naming the variable,
    its value and the fix."""
    environ = os.environ if environ is None else environ
    value = environ.get("OMP_NUM_THREADS")
    if value is None:
        return None
    items = [_THREAD_COUNT.fullmatch(item) for item in value.split(",")]
    if all(items) and all(1 <= int(item[1]) <= _MAX_COUNT for item in items):
        return None
    return (f"$OMP_NUM_THREADS={value!r} is not a number of threads: set it to a whole number >= 1 (e.g. "
            "OMP_NUM_THREADS=4), or unset it to use every core")  # fmt: skip


KERNELS_OFF, KERNELS_ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def kernels_env_problem(environ: dict[str, str] | None = None) -> str | None:
    """What is wrong with $ATTNLAB_CPU_KERNELS (None when it is unset, empty or one of KERNELS_OFF / KERNELS_ON, in
    any case and with spaces around): one line naming the variable, its value and the values it takes. Every command
    checks it at its start, so that a dry run refuses what its run would (the run reads it at the first kernel)."""
    environ = os.environ if environ is None else environ
    value = environ.get("ATTNLAB_CPU_KERNELS", "")
    if not value.strip() or value.strip().lower() in KERNELS_OFF + KERNELS_ON:
        return None
    return (f"$ATTNLAB_CPU_KERNELS={value!r} is not one of {', '.join(KERNELS_OFF)} (kernels off) or "
            f"{', '.join(KERNELS_ON)} (on, the default)")  # fmt: skip
