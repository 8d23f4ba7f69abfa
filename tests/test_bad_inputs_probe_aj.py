"""Probe AJ's findings (/work/probe_aj/REPORT.md): `report` took hand-edited records whose figures contradict each
other or cannot be (an infinite loss beside its finite interval, a NaN byte count or KL, a loss not its windows',
tokens or windows not theirs, a ci_level of 1.5, a cache holding more than it was filled with, bytes per token that
do not add up: AJ1, AJ7; AJ6's bytes at seq_len are not checked: they count the tokens a memory holds, which the
record does not say); `compare` took an infinite loss and a summary that `run` calls not the run's own
(AJ2, AJ8); unclear lines for a probe suite without cases (AJ3) and a kind's case slip in `convert` (AJ5). Each test
fails with its fix backed out."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from helpers import fails, unsealed

from attnlab.cli import main
from attnlab.eval.records import record_problem

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

LOSSES = [70.0, 66.0, 74.0, 70.0]  # four windows of 20 tokens: a mean loss of 3.5
PERPLEXITY = {"benchmark": "perplexity", "model": "m/seed0", "kind": "mha", "split": "val", "tokens": 80, "windows": 4,
              "loss": 3.5, "loss_ci": [3.4, 3.6], "ppl": math.exp(3.5), "ppl_ci": [math.exp(3.4), math.exp(3.6)],
              "ci_level": 0.95, "window_loss": LOSSES, "window_tokens": [20] * 4}  # fmt: skip
MEMORY = {"benchmark": "memory", "model": "m/seed0", "kind": "mha", "status": "ok", "length": 16, "batch_size": 1,
          "held_tokens": 16, "capacity": None, "kv_policy": None, "kv_bytes": 8192, "kv_bytes_analytic": 8192,
          "kv_matches_analytic": True, "kv_bytes_per_token": 512, "peak_rss_bytes": 1 << 28}  # fmt: skip
KV_QUANT = {"benchmark": "kv_quant", "model": "m/seed0", "kind": "mha", "policy": "k=q4_0,v=q4_0", "seq_len": 32,
            "bytes_per_token": 72, "bytes_at_seq_len": 2304, "vs_full": 0.28125, "dnll": 1e-5,
            "ppl_ratio": math.exp(1e-5), "kl": 2e-6, "top1": 1.0, "greedy": 1.0, "tokens": 195}  # fmt: skip

EDITS = {
    "an infinite loss beside its finite interval (AJ1)": (PERPLEXITY, {"loss": math.inf, "ppl": math.inf},
                                                          "field 'loss' is Infinity, which is impossible beside the "
                                                          "finite interval 'loss_ci'"),
    "a NaN byte count (AJ1)": (MEMORY, {"peak_rss_bytes": math.nan}, "field 'peak_rss_bytes' is NaN, which is "
                               "impossible (it is a finite number)"),
    "a NaN KL beside a finite dNLL (AJ1)": (KV_QUANT, {"kl": math.nan}, "field 'kl' is NaN, which is impossible "
                                            "beside 'dnll' 1e-05"),
    "window losses doubled (AJ7)": (PERPLEXITY, {"window_loss": [2 * v for v in LOSSES]}, "field 'loss' is 3.5, "
                                    "which is impossible beside 'window_loss' (the windows' total loss over their "
                                    "tokens is 7)"),
    "tokens not the windows' (AJ7)": (PERPLEXITY, {"tokens": 9999}, "field 'tokens' is 9999, which is impossible "
                                      "beside 'window_tokens' (which add up to 80)"),
    "a windows count not the entries' (AJ7)": (PERPLEXITY, {"windows": 3}, "field 'windows' is 3, which is "
                                               "impossible beside 4 'window_loss' entries"),
    "a ci_level of 1.5 (AJ7)": (PERPLEXITY, {"ci_level": 1.5}, "field 'ci_level' is 1.5, which is impossible"),
    "a cache holding more than it was filled with (AJ7)": (MEMORY, {"held_tokens": 99}, "field 'held_tokens' is 99, "
                                                           "which is impossible beside 'length' 16"),
    "a full cache's bytes not its tokens' (AJ7)": (MEMORY, {"kv_bytes": 1, "kv_bytes_analytic": 1}, "field "
                                                   "'kv_bytes_analytic' is 1, which is impossible beside "
                                                   "'kv_bytes_per_token' 512 x 'held_tokens' 16"),
}  # fmt: skip


@pytest.mark.parametrize("record", [PERPLEXITY, MEMORY, KV_QUANT], ids=["perplexity", "memory", "kv_quant"])
def test_the_records_as_a_benchmark_writes_them_are_taken(record):
    assert record_problem(dict(record)) is None
    windowed = {**MEMORY, "capacity": 8, "held_tokens": 8}  # a window cache allocates its capacity: not compared
    assert record_problem(windowed) is None
    held = {**KV_QUANT, "bytes_at_seq_len": 72 * 16}  # a memory's cache holding 16 of the 32 tokens (probe AK)
    assert record_problem(held) is None


@pytest.mark.parametrize("case", sorted(EDITS))
def test_report_refuses_a_record_whose_figures_cannot_be(case):
    record, edit, said = EDITS[case]
    problem = record_problem({**record, **edit})
    assert problem is not None and said in problem, problem


def test_report_refuses_the_edited_record_in_one_line(tmp_path, capsys):
    folder = tmp_path / "results"
    folder.mkdir()
    edited = {**PERPLEXITY, "window_loss": [2 * v for v in LOSSES], "attnlab": "0.1.0", "time": "2026-12-07T00:00:00"}
    (folder / "records.jsonl").write_text(json.dumps(edited) + "\n")
    assert fails(capsys, ["report", str(folder), "--unsealed"], "record 1 (perplexity, m/seed0): field 'loss' is "
                 "3.5, which is "
                 "impossible beside 'window_loss'")  # fmt: skip
    assert not (folder / "report.md").exists()


@pytest.fixture
def finished_copy(tiny_run, tmp_path) -> Path:
    shutil.copytree(tiny_run.parent.parent, tmp_path / "runs")
    return tmp_path / "runs"


SUMMARY_EDITS = {
    "an infinite loss (AJ2)": ({"val_loss": math.inf, "val_ppl": math.inf}, "field 'val_loss' is inf, which a run "
                               "never writes"),
    "a status not complete (AJ8)": ({"status": "running"}, "status='running', where a finished run's summary has "
                                    "status 'complete'"),
    "another run's step count (AJ8)": ({"steps": 7}, "not this run's summary (steps 7, the config's train.steps 4)"),
    "a loss over no tokens (AJ8)": ({"val_tokens": 0}, "field 'val_loss' is given over 'val_tokens' 0"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(SUMMARY_EDITS))
def test_compare_refuses_a_summary_run_would_refuse(finished_copy, tmp_path, capsys, case):
    summary = finished_copy / "tiny" / "seed0" / "summary.json"
    edit, said = SUMMARY_EDITS[case]
    summary.write_text(json.dumps(unsealed({**json.loads(summary.read_text()), **edit})))  # an older attnlab's
    line = fails(capsys, ["compare", str(finished_copy), "--out", str(tmp_path / "cmp")], f"{summary}: ", said)
    assert line.endswith("delete summary.json alone and `attnlab run` the manifest again: it writes the summary "
                         "again from the run's last checkpoint"), line  # fmt: skip


def test_validate_says_a_file_with_another_files_keys_but_none_of_its_own_in_one_line(tmp_path, capsys):
    suite = tmp_path / "nocases.yml"
    suite.write_text("name: t\ndescription: d\ndefaults: {kind: first_line}\n")
    assert main(["validate", str(suite)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"{suite}: not a model config, nor a manifest (targets:), benchmark manifest (benchmarks:) or "
                     "probe suite (cases:), whose keys it lacks (it has name, description, defaults): `attnlab "
                     "validate` takes model configs, experiment and benchmark manifests and probe suites"]  # fmt: skip


def test_convert_says_a_kinds_case_slip_is_no_kind(tiny_run, tmp_path, capsys):
    argv = ["convert", str(tiny_run), "--calibration-tokens", "0", "--eval-tokens", "0", "--out", str(tmp_path / "c")]
    line = fails(capsys, [*argv, "--attention", "kind=MHA"], "attention.kind='MHA' is not an attention kind (did "
                 "you mean 'mha'?)")  # fmt: skip
    assert "yet" not in line
