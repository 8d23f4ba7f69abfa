"""Probe N's findings: a kernel library damaged in the cache killed every later process in dlopen (SIGBUS, no
output; tests/test_cpu_kernels.py: now rebuilt over); with downloads off ($ATTNLAB_OFFLINE) lm-eval still reached
for the Hugging Face Hub five times (about 45 s of retries) before its one line; `export --hf LINK` to a symbolic link
to an empty folder blamed "a part of this path is a file", and a dangling link was called a file."""

from __future__ import annotations

import os

import pytest
from helpers import error_line

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


def test_with_downloads_off_a_hub_task_is_refused_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")
    model = tmp_path / "unloadable.gguf"  # (a missing one would be refused before the tasks are read)
    model.write_bytes(b"not a model")
    assert main(["lm-eval", str(model), "--tasks", "arc_easy", "--limit", "2"]) == 2
    line = error_line(capsys, "lm-eval", "'arc_easy' (Hub dataset allenai/ai2_arc)", "could not be reached",
                      "--tasks arc_easy_local")  # fmt: skip
    assert "Offline" in line  # datasets was told, rather than finding out from the network


def test_export_through_a_link_to_a_folder_writes_into_the_folder(tiny_run, tmp_path, capsys):
    run = tiny_run
    (tmp_path / "empty").mkdir()
    os.symlink("empty", tmp_path / "link")
    assert main(["export", str(run), "--hf", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "empty" / "config.json").is_file()
    os.symlink("nosuch", tmp_path / "dangling")
    assert main(["export", str(run), "--hf", str(tmp_path / "dangling")]) == 2
    error_line(capsys, "export", "dangling: is a symbolic link to nosuch, which does not exist")
