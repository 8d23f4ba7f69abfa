"""Probe AC's command-line findings (/work/probe_ac/REPORT.md): a dry run said "would train" with a bad
$ATTNLAB_CPU_KERNELS that the run refused at its first step (AC6), ..."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import fails, hat_text, probe_manifest

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 2, eval_tokens: 32, checkpoint_every: 2}"
MEMORY = "{kind: bounded, recent_window: 8, exact_slots: 2, summary_slots: 2}"


# ----------------------------------------------------------------------------- AC6: $ATTNLAB_CPU_KERNELS


@pytest.mark.parametrize("memory", [True, False])
def test_ac6_a_bad_cpu_kernels_value_is_refused_by_the_dry_run_and_before_the_run_starts(
    tmp_path, capsys, monkeypatch, memory
):
    """Was: the dry run of a memory model said "would train"; the run refused at its first step, its folder made."""
    model = f"{{d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64{', memory: ' + MEMORY if memory else ''}}}"
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN, model=model)
    monkeypatch.setenv("ATTNLAB_CPU_KERNELS", "nope")
    argv = ["run", str(manifest), "--out", str(tmp_path / "o"), "--no-progress"]
    said = "$ATTNLAB_CPU_KERNELS='nope' is not one of 0, false, no, off (kernels off) or 1, true, yes, on"
    line = fails(capsys, argv, said)
    assert fails(capsys, [*argv, "--dry-run"], said) == line
    assert not (tmp_path / "o").exists()
