"""Probe U's findings fixed at once: `run --out` a link loop ended in pathlib's RuntimeError (and a dangling link was
written through) (u1); bytes that are not UTF-8 in an interrupted run's metrics.jsonl ended in a UnicodeDecodeError
when it resumed (u2); `memory ls` listed a row whose name was edited into a path as intact (u3)."""

from __future__ import annotations

import os

import pytest
from helpers import fails, hat_text, probe_manifest, snapshot

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 2, eval_tokens: 32, checkpoint_every: 2}"


@pytest.mark.parametrize("case", ["loop", "dangling"])
def test_u1_run_out_a_broken_link_is_refused_naming_it(tmp_path, capsys, case):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN)
    out = tmp_path / "out"
    os.symlink(out if case == "loop" else tmp_path / "nowhere", out)
    said = "a symbolic link loop" if case == "loop" else f"a symbolic link to {tmp_path / 'nowhere'}, which is not"
    for extra in ([], ["--dry-run"]):
        assert fails(capsys, ["run", str(manifest), "--out", str(out), "--no-progress", *extra], f"--out {out}: ", said)
    assert not (tmp_path / "nowhere").exists()


def test_u2_a_metrics_log_damaged_into_other_bytes_is_named_on_resume(tmp_path, capsys):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN)
    out = tmp_path / "runs"
    argv = ["run", str(manifest), "--out", str(out), "--no-progress"]
    run = out / "m" / "base" / "seed0"
    assert main(argv) == 0
    (run / "summary.json").unlink()  # an interrupted run, as far as the resume can tell
    log = run / "metrics.jsonl"
    log.write_bytes(log.read_bytes() + b'{"step": 3, "loss": \xff\xfe}\n')
    before = snapshot(run)
    line = fails(capsys, argv, f"{log}: line ", "is not UTF-8 text (the metrics log was damaged)")
    lines = log.read_bytes().count(b"\n")
    assert f"line {lines} is not UTF-8" in line
    assert snapshot(run) == before


def test_u3_ls_marks_a_row_whose_name_was_edited_into_a_path(tmp_path, capsys, monkeypatch):
    """A hand edit that makes a row's name a path ('../evil'), a name ingest never takes, is marked by `memory ls`
    as the other columns' edits are, not listed as intact (probe U)."""
    import sqlite3

    from helpers import PROBE_MODEL, train_tiny_run

    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")
    memory = {"kind": "window", "recent_window": 8}
    (tmp_path / "run").mkdir()
    run = train_tiny_run(tmp_path / "run", {**PROBE_MODEL, "memory": memory}, steps=2)
    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("the cat sat on the mat " * 20)
    ingest = ["memory", "ingest", str(run), str(doc), "--store", str(store), "--no-progress", "--name", "notes"]
    assert main(ingest) == 0
    with sqlite3.connect(store / "index.sqlite") as index:
        index.execute("UPDATE states SET name = '../evil' WHERE name = 'notes'")
    capsys.readouterr()
    assert main(["memory", "ls", "--store", str(store)]) == 0
    listed = capsys.readouterr().out
    assert "name='../evil' (not a plain name)" in listed and "changed by hand" in listed, listed
