"""The `attnlab` command's entry point (attnlab.entry): Ctrl-C is one line and exit code 130 wherever it lands
(probe W, T4: during the imports it was a KeyboardInterrupt traceback from inside torch, importlib or dataclasses,
rc -2; T5: one that landed while torch imported numpy was swallowed by torch, and the command went on to fail with
`module 'numpy' has no attribute 'intp'`, rc 1). Each test starts the command as its console script does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import attnlab

SRC = str(Path(attnlab.__file__).parents[1])
MODEL = str(Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny-mha.yaml")

# The console script (pyproject.toml: attnlab = "attnlab.entry:main"), with a SIGINT sent to itself at a chosen
# moment: as the import of module argv[1] starts, or ("command") once the command runs, every import done.
CONSOLE = """
import atexit, importlib.abc, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job inherits it ignored)
moment, sys.argv = sys.argv[1], ["attnlab", *sys.argv[2:]]

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)  # (raised here; during the imports noted, raised once they are done)

class CtrlC(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == moment:
            sys.meta_path.remove(self)
            ctrl_c()

if moment == "command":
    import attnlab.cli
    attnlab.cli.cmd_info = lambda args: ctrl_c()
elif moment == "ready":  # the test sends the SIGINT itself, some time after this line
    print("ready", flush=True)
else:
    finder = CtrlC()
    sys.meta_path.insert(0, finder)
    atexit.register(lambda: finder in sys.meta_path and print(f"{moment} was never imported", file=sys.stderr))
from attnlab.entry import main
sys.exit(main())
"""


def start(moment: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CONSOLE, moment, "info", MODEL], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


@pytest.mark.parametrize(
    "moment",
    [
        "torch",  # the first import of the command's: torch (T4)
        "numpy._core._add_newdocs_scalars",  # numpy, imported by torch's C++ code, which swallowed it (T5)
        "attnlab.config",  # attnlab's own modules, their dataclasses made (T4's traceback was inside dataclasses)
        "attnlab.eval.harness",  # late in attnlab.cli's imports
        "command",  # every import done
        "gmpy2",  # during the command: torch imports sympy on first use, whose mpmath imports gmpy under a bare except
    ],
)
def test_ctrl_c_is_one_line_and_exit_code_130_wherever_it_lands(moment):
    process = start(moment)
    out, err = process.communicate(timeout=60)
    if err == f"{moment} was never imported\n":  # (another torch: the swallowing import is not on this path)
        pytest.skip(err)
    assert (process.returncode, err) == (130, "attnlab info: interrupted\n"), err[-3000:]
    assert out == ""  # nothing of the command's: it never ran, or stopped


@pytest.mark.parametrize("delay", [0.05, 0.3, 1.0])
def test_a_ctrl_c_at_any_time_ends_in_one_line_or_not_at_all(delay):
    """A real Ctrl-C, `delay` seconds after the entry point has control (before it, during Python's start-up, it
    cannot help). Whichever statement it lands in, the command finished, or said one line and exited 130."""
    process = start("ready")
    assert process.stdout.readline() == "ready\n"
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert "Traceback" not in err, err[-3000:]
    if process.returncode == 0:  # done before the signal came
        assert err == "" and "parameters:" in out
    else:
        assert (process.returncode, err) == (130, "attnlab info: interrupted\n")
