"""Probe AM's findings (/work/probe_am/REPORT.md): a records file with a byte that is not UTF-8 named no line (AM1);
a bench manifest given to `run`, and a run manifest to `bench`, were not told as the other command's (AM5); the
unsealed-record warning promised checks it does not make (AM2, AM3: now it says the figures are unverified, in
test_bad_inputs_probe_f_runs.py and _ak.py); the `--` hint for a prompt starting with '-' did not say the options go
before it (AM4, in test_bad_inputs_probe_ai.py). Each test fails with its fix backed out."""

from __future__ import annotations

import pytest
from helpers import fails, hat_text, probe_manifest

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


def test_am1_a_byte_that_is_not_utf8_in_records_names_its_line(tmp_path, capsys):
    (tmp_path / "records.jsonl").write_bytes(b'{"benchmark": "memory"}\n{"model": "caf\xe9"}\n')
    assert fails(capsys, ["report", str(tmp_path)], "records.jsonl: line 2 is not UTF-8 text (byte 0xe9; the file was "
                 "damaged); repair or remove that line")  # fmt: skip


def test_am5_a_bench_manifest_given_to_run_is_told_as_one(tmp_path, capsys):
    manifest = tmp_path / "b.yml"
    manifest.write_text("name: b\ncheckpoints: [runs/x/seed0]\nbenchmarks:\n  perplexity: {}\n")
    assert fails(capsys, ["run", str(manifest)], "a benchmark manifest (checkpoints, benchmarks), not a run manifest: "
                 f"run it with `attnlab bench {manifest}`")  # fmt: skip


def test_am5_a_run_manifest_given_to_bench_is_told_as_one(tmp_path, capsys):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), "{seq_len: 16, steps: 2}")
    assert fails(capsys, ["bench", str(manifest), "--out", str(tmp_path / "o")], "a run manifest (targets), not a "
                 f"benchmark manifest: train it with `attnlab run {manifest}`, then bench its runs")  # fmt: skip
