"""Probe W's findings, fixed after it: `run --dry-run --target X` said "would train" a target whose init_from target
was not trained, where the run refused it (S3). Its Ctrl-C findings (T4, T5) are tested in tests/test_entry.py."""

from __future__ import annotations

import pytest
from helpers import dry_run, fails, hat_text, probe_manifest

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

# ----------------------------------------------------------------------------- S3: init_from not trained, dry run

TRAIN = "{seq_len: 16, batch_size: 2, steps: 2, warmup_steps: 1, eval_every: 2, eval_tokens: 32}"
TARGETS = "  base: {}\n  more: {init_from: base, train: {steps: 3}}\n"


def test_s3_a_dry_run_of_a_target_alone_refuses_an_untrained_init_from_with_the_runs_line(tmp_path, capsys):
    """Was: "[1/1] more seed0: would train 3 steps ... from OUT/m/base/seed0", exit 0; the run refused."""
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, TARGETS)
    argv = ["run", str(manifest), "--out", str(tmp_path / "out"), "--target", "more", "--no-progress"]
    printed = dry_run(capsys, [*argv, "--dry-run"])
    line = fails(capsys, argv, "targets.more.init_from: ", "is not trained yet (run target base first, or run the "
                 "whole manifest)").split("error: ", 1)[1]  # fmt: skip
    assert printed == f"[1/1] more seed0: would be refused: {line}\n"
    assert not (tmp_path / "out").exists()


def test_s3_the_whole_manifest_or_a_trained_init_from_would_train(tmp_path, capsys):
    """The earlier target trained first (the whole manifest, or both targets named), or trained already: would
    train, in the dry run as in the run."""
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, TARGETS)
    out = tmp_path / "out"
    base = out / "m" / "base" / "seed0"
    argv = ["run", str(manifest), "--out", str(out), "--no-progress"]
    for targets in ([], ["--target", "base", "--target", "more"]):
        printed = dry_run(capsys, [*argv, *targets, "--dry-run"])
        assert f"[2/2] more seed0: would train 3 steps into {out / 'm' / 'more' / 'seed0'} from {base}\n" in printed
    assert main([*argv, "--target", "base"]) == 0
    capsys.readouterr()
    printed = dry_run(capsys, [*argv, "--target", "more", "--dry-run"])
    assert printed == f"[1/1] more seed0: would train 3 steps into {out / 'm' / 'more' / 'seed0'} from {base}\n"
    assert main([*argv, "--target", "more"]) == 0
