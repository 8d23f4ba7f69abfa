"""Probe Y's findings on reports: `report` drew records a hand edit made impossible (a NaN interval bound beside a
finite loss, a seq_len of 0, an empty model label, a label holding a newline) (y3); `compare` showed a summary's
params of -5 (y4); a killed report's temporary stayed until it was ten minutes old (y5); and a records file whose
last line was cut short was called not a file of records (u7)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from helpers import fails, unsealed
from test_integrity import dead_pid

from attnlab.cli import main
from attnlab.data.files import sealed

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

PERPLEXITY = {"benchmark": "perplexity", "model": "m", "kind": "mha", "split": "val", "tokens": 64, "loss": 4.2,
              "loss_ci": [4.1, 4.3], "ppl": 66.7, "ppl_ci": [60.3, 73.7], "seq_len": 32, "stride": 32}  # fmt: skip
MEMORY = {"benchmark": "memory", "model": "m", "kind": "mha", "length": 64, "kv_bytes": 4096, "batch_size": 1}


def bench_folder(folder: Path, *rows) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in rows))
    return folder


# ----------------------------------------------------------------------------- y3: impossible records


@pytest.mark.parametrize(
    "record, fragment",
    [
        (PERPLEXITY | {"loss_ci": [float("nan"), 4.3]}, "field 'loss_ci' is [NaN, 4.3], which is impossible"),
        (PERPLEXITY | {"ppl_ci": [60.3, float("inf")]}, "field 'ppl_ci' is [60.3, Infinity], which is impossible"),
        (PERPLEXITY | {"seq_len": 0}, "field 'seq_len' is 0, which is impossible (a length or count"),
        (PERPLEXITY | {"stride": -4}, "field 'stride' is -4, which is impossible"),
        (PERPLEXITY | {"model": ""}, "field 'model' is \"\", which is impossible (an empty label)"),
        (PERPLEXITY | {"model": "a\nb"}, "field 'model' is \"a\\nb\", which is impossible (a label holding a control"),
        (PERPLEXITY | {"split": "va\tl"}, "field 'split' is \"va\\tl\", which is impossible"),
        (MEMORY | {"kv_bytes": float("inf")}, "field 'kv_bytes' is Infinity, which is impossible (it is a finite"),
        (MEMORY | {"batch_size": 0}, "field 'batch_size' is 0, which is impossible"),
    ],
)
def test_an_impossible_record_is_refused_in_one_line(tmp_path, capsys, record, fragment):
    folder = bench_folder(tmp_path / "b", PERPLEXITY | {"model": "ok"}, record)
    line = fails(capsys, ["report", str(folder)], f"{folder}/records.jsonl: record 2 (", fragment,
                 "(the file was changed): take that line out, then run the benchmark again")  # fmt: skip
    assert "\n" not in line
    assert not (folder / "report.md").exists() and not (folder / "tables").exists()


def test_a_diverged_models_nan_interval_is_still_drawn(tmp_path, capsys):
    nan = float("nan")
    diverged = PERPLEXITY | {"loss": nan, "ppl": nan, "loss_ci": [nan, nan], "ppl_ci": [nan, nan]}
    assert main(["report", str(bench_folder(tmp_path / "b", diverged))]) == 0


# ----------------------------------------------------------------------------- y4: impossible summary figures


@pytest.mark.parametrize(
    "key, value, said",
    [("params", -5, "a whole number >= 1"), ("params", 2.5, "a whole number"), ("steps", -1, "a whole number >= 0"),
     ("tokens", 1.5, "a whole number >= 0"), ("kv_bytes_per_token_fp16", -8, "a finite number >= 0"),
     ("train_tok_per_s", float("inf"), "a finite number >= 0")],
)  # fmt: skip
def test_compare_refuses_an_impossible_summary_figure(tiny_run, tmp_path, capsys, key, value, said):
    copied = tmp_path / "runs" / "tiny" / "seed0"
    shutil.copytree(tiny_run, copied, ignore=shutil.ignore_patterns("*.lock"))
    summary = json.loads((copied / "summary.json").read_text()) | {key: value}
    (copied / "summary.json").write_text(json.dumps(unsealed(summary)))  # an older attnlab's: checked by its figures
    assert fails(capsys, ["compare", str(tmp_path / "runs")], f"{copied / 'summary.json'}: field '{key}' is ",
                 said, "changed by hand")  # fmt: skip


# ----------------------------------------------------------------------------- y5: a killed report's temporary


def test_a_killed_reports_temporary_is_removed_by_the_next(tmp_path, capsys):
    folder = bench_folder(tmp_path / "b", PERPLEXITY)
    stale = folder / f".report.{dead_pid()}.0123456789ab.tmp"
    (stale / "tables").mkdir(parents=True)
    (stale / "tables" / "perplexity.md").write_text("| half |")
    minutes_ago = time.time() - 120  # killed two minutes ago: a report writes its files within seconds
    for path in (stale / "tables" / "perplexity.md", stale / "tables", stale):
        os.utime(path, (minutes_ago, minutes_ago))
    recent = folder / f".report.{dead_pid()}.0123456789ac.tmp"  # maybe a report on another machine: still writing
    recent.mkdir()
    assert main(["report", str(folder)]) == 0
    assert not stale.exists() and recent.exists() and (folder / "report.md").exists()


# ----------------------------------------------------------------------------- u7: a torn last line


def test_a_torn_last_record_is_named_as_torn(tmp_path, capsys):
    folder = bench_folder(tmp_path / "b", PERPLEXITY)
    with open(folder / "records.jsonl", "a") as f:
        f.write('{"benchmark": "perp')
    fails(capsys, ["report", str(folder)], f"{folder}/records.jsonl: line 2 was cut short (a write interrupted",
          "remove that line: the next `attnlab bench` into this folder measures it again")  # fmt: skip
    from attnlab.errors import InputError
    from attnlab.eval.records import records_target

    with pytest.raises(InputError, match="line 2 was cut short"):
        records_target(folder / "records.jsonl")  # `bench --out` appending to it


def test_a_damaged_line_that_is_not_the_last_is_not_called_torn(tmp_path, capsys):
    folder = bench_folder(tmp_path / "b", PERPLEXITY)
    text = (folder / "records.jsonl").read_text()
    (folder / "records.jsonl").write_text('{"benchmark": "perp\n' + text.rstrip("\n"))
    line = fails(capsys, ["report", str(folder)], "line 1 is not a JSON object")
    assert "cut short" not in line
