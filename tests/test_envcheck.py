"""attnlab.envcheck: $OMP_NUM_THREADS checked before torch's OpenMP runtime reads it (probe X: `abc` or `0` got
libgomp's raw line on stderr, and the command carried on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.envcheck import thread_env_problem


@pytest.mark.parametrize("value", ["abc", "0", "-1", "", "1e3", "2,", "2,0", "1.5", "99999999999999999999"])
def test_a_thread_count_libgomp_cannot_read_is_named_with_its_fix(value):
    problem = thread_env_problem({"OMP_NUM_THREADS": value})
    assert problem == (f"$OMP_NUM_THREADS={value!r} is not a number of threads: set it to a whole number >= 1 (e.g. "
                       "OMP_NUM_THREADS=4), or unset it to use every core")  # fmt: skip


@pytest.mark.parametrize("value", ["1", "4", " 2", "2 ", "+2", "4,2"])
def test_what_libgomp_reads_is_accepted(value):
    assert thread_env_problem({"OMP_NUM_THREADS": value}) is None


def test_unset_is_accepted():
    assert thread_env_problem({}) is None


def test_the_check_imports_no_torch():
    """The module alone (the package's __init__ aside), so that an entry point can call it before torch loads."""
    import attnlab.envcheck

    code = ("import importlib.util as u, sys; spec = u.spec_from_file_location('envcheck', sys.argv[1]); "
            "spec.loader.exec_module(u.module_from_spec(spec)); print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", code, attnlab.envcheck.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def test_the_cli_refuses_it_in_one_line(monkeypatch, capsys):
    from attnlab.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "abc")
    assert main(["validate", "nothing.yml"]) == 2
    err = capsys.readouterr().err
    assert err == ("attnlab validate: error: $OMP_NUM_THREADS='abc' is not a number of threads: set it to a whole "
                   "number >= 1 (e.g. OMP_NUM_THREADS=4), or unset it to use every core\n")  # fmt: skip


def test_the_console_script_refuses_it_before_torch_so_libgomp_says_nothing():
    """Through attnlab.entry (the console script): the check runs before torch is imported, so libgomp never reads
    the value and its raw 'Invalid value for environment variable' line is not printed: stderr is the one line."""
    import attnlab

    env = {**os.environ, "OMP_NUM_THREADS": "abc", "PYTHONPATH": str(Path(attnlab.__file__).parents[1])}
    code = "import sys; from attnlab.entry import main; sys.argv = ['attnlab', 'info', 'x']; sys.exit(main())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "attnlab info: error: $OMP_NUM_THREADS='abc' is not a number of threads: set it to a whole number >= 1 "
        "(e.g. OMP_NUM_THREADS=4), or unset it to use every core"
    ]
