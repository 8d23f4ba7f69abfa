"""Probe Z's findings: where the dry run said "would train" or "would resume" and the run refused (Z1: an --out below
a file; Z2: a run.lock that is a folder). Each test fails with its fix backed out."""

from __future__ import annotations

import pytest
from helpers import fails

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

import test_bad_inputs_probe_v_runs as v_runs  # noqa: E402

RUN, interrupted, refused_alike, stopped = v_runs.RUN, v_runs.interrupted, v_runs.refused_alike, v_runs.stopped


@pytest.mark.parametrize("below", ["x", "a/b"])
def test_z1_an_out_below_a_file_is_refused_by_the_run_and_its_dry_run_alike(stopped, tmp_path, capsys, below):
    """Was: the dry run exit 0, "would train 4 steps into doc.txt/x/...", the run "a part of this path is a file"."""
    manifest, _ = stopped
    (tmp_path / "doc.txt").write_text("mine\n")
    out = tmp_path / "doc.txt" / below
    argv = ["run", str(manifest), "--out", str(out), "--no-progress"]
    line = fails(capsys, [*argv, "--dry-run"])
    assert line == fails(capsys, argv), line
    assert line.endswith(f"error: --out {out}: {tmp_path / 'doc.txt'} is a file, not a folder: choose another --out")
    assert (tmp_path / "doc.txt").read_text() == "mine\n"


def test_z2_a_run_lock_that_is_a_folder_is_refused_by_the_run_and_its_dry_run_alike(stopped, tmp_path, capsys):
    """Was: the dry run "would resume from step 2", the run "run.lock: is a folder, where a file is expected"."""
    argv, out = interrupted(stopped, tmp_path)
    lock = out / RUN / "run.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    (lock / "note.txt").write_text("mine\n")
    line = refused_alike(capsys, argv, out)
    assert line == f"{lock}: a folder, where attnlab keeps its lock file: move it away and start again", line
    assert (lock / "note.txt").read_text() == "mine\n"
    lock.rename(tmp_path / "moved")
    assert main(argv) == 0


from test_bad_inputs_probe_e_cli import plain_run  # noqa: E402,F401 (a module fixture: a tiny trained run)


def test_z3_convert_refuses_an_out_below_a_file_before_loading(plain_run, tmp_path, capsys, data_dir):  # noqa: F811
    """Was: the model loaded and scored first (its <unk> warning printed), then the refusal: two lines."""
    (tmp_path / "doc.txt").write_text("mine\n")
    out = tmp_path / "doc.txt" / "x"
    argv = ["convert", str(plain_run), "--attention", "kind=mha,n_kv_heads=1", "--out", str(out),
            "--eval-tokens", "64", "--seq-len", "16", "--data-dir", str(data_dir)]  # fmt: skip
    assert fails(capsys, argv).endswith(f"--out {out}: {tmp_path / 'doc.txt'} is a file, not a folder: choose another "
                                        "--out")  # fmt: skip
    assert (tmp_path / "doc.txt").read_text() == "mine\n"
