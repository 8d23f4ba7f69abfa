"""Probe AL's findings (/work/probe_al/REPORT.md): a memory table whose rows of one model and length, measured with
and without a KV policy, looked alike, and a policy that quantizes nothing went unsaid (AL1); an unsealed summary's
negative token count (AL3); compare's 134-digit perplexity (AL4); read-only advice that named no way out (AL7); and
bench skipping a record changed by hand, which report then refused, so "run the benchmark again" did nothing (AL8);
a memory model's memory bench past its context refused without saying why (AL6); `run` and `memory ingest` calling a
read-only file system "permission denied" (AL7).
Each test fails with its fix backed out."""

from __future__ import annotations

import argparse
import errno
import json
import math
import shutil
from pathlib import Path

import pytest
from helpers import fails, hat_text, probe_manifest, unsealed

from attnlab.cli import main
from attnlab.cli_errors import os_error_line
from attnlab.data.files import sealed

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


def _bench(run: Path, out: Path, *sets: str) -> list[str]:
    argv = ["bench", str(run), "--benchmarks", "memory", "--set", "memory.lengths=[16]", "--out", str(out)]
    return [*argv, *(part for s in sets for part in ("--set", s))]


def test_al1_the_memory_table_tells_a_policys_rows_from_the_plain_caches(tiny_run, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(_bench(tiny_run, out)) == 0
    assert main(_bench(tiny_run, out, "memory.kv_policy=k=q4_0,v=q4_0")) == 0
    assert main(["report", str(out)]) == 0
    table = (out / "tables" / "memory.md").read_text().splitlines()
    assert table[0].startswith("| model | kind | cache | tokens |"), table
    assert any("| fp32 | 16 |" in row for row in table) and any("| k=q4_0,v=q4_0 | 16 |" in row for row in table)


def test_al1_a_policy_whose_residual_window_holds_every_token_is_said(tiny_run, tmp_path, capsys):
    assert main(_bench(tiny_run, tmp_path / "b", "memory.kv_policy=k=q8_0,v=q8_0,resid=999")) == 0
    said = capsys.readouterr().out
    assert "kv_policy k=q8_0,v=q8_0,resid=999: resid=999 >= 16 tokens keeps every token in the full-precision " \
           "residual window, so nothing is quantized (give resid below 16)" in said, said  # fmt: skip


@pytest.fixture
def runs(tiny_run, tmp_path) -> Path:
    shutil.copytree(tiny_run.parent.parent, tmp_path / "runs")
    return tmp_path / "runs"


def _summary_edit(runs: Path, **fields) -> Path:
    path = runs / "tiny" / "seed0" / "summary.json"
    saved = {k: v for k, v in json.loads(path.read_text()).items() if k != "sha256"}
    path.write_text(json.dumps(fields.pop("seal")({**saved, **fields})))
    return path


def test_al3_an_unsealed_summarys_negative_token_count_is_refused(runs, tmp_path, capsys):
    _summary_edit(runs, val_tokens=-5, seal=unsealed)
    assert fails(capsys, ["compare", str(runs), "--out", str(tmp_path / "c")], "field 'val_tokens' is -5, which is "
                 "impossible (a whole number >= 0)")  # fmt: skip


def test_al4_compare_shows_a_diverged_runs_perplexity_in_exponent_form(runs, tmp_path, capsys):
    _summary_edit(runs, val_loss=306.79, val_ppl=math.exp(306.79), seal=sealed)  # as a diverged run writes it
    assert main(["compare", str(runs), "--out", str(tmp_path / "c")]) == 0
    row = next(line for line in (tmp_path / "c" / "compare.md").read_text().splitlines() if line.startswith("| tiny"))
    assert "| 306.7900 | 1.727e+133 |" in row and len(row) < 200, row


@pytest.mark.parametrize(("command", "fields", "said"), [
    ("report", {"dir": "bench"}, "or copy the folder somewhere writable and report the copy"),
    ("compare", {"runs": "runs", "out": None}, "or choose another folder with --out"),
])  # fmt: skip
def test_al7_a_read_only_folder_is_told_with_a_way_out_the_command_has(tmp_path, monkeypatch, command, fields, said):
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(command=command, **fields)
    folder = next(v for v in fields.values() if v)
    (tmp_path / folder).mkdir()
    line = os_error_line(OSError(errno.EROFS, "Read-only file system", str(tmp_path / folder / "x.md")), args)
    assert line.endswith(f"on a read-only file system (write it somewhere else, {said})"), line


def test_al8_bench_refuses_a_records_file_with_a_changed_record_rather_than_skip_it(tiny_run, tmp_path, capsys):
    out = tmp_path / "b"
    assert main(_bench(tiny_run, out)) == 0
    record = json.loads((out / "records.jsonl").read_text())
    (out / "records.jsonl").write_text(json.dumps({**record, "kv_bytes": record["kv_bytes"] // 2}) + "\n")
    again = "take that line out, then run the benchmark again (attnlab bench measures what the file lacks)"
    assert fails(
        capsys, _bench(tiny_run, out), "record 1 (memory, tiny/seed0) was changed after attnlab wrote it", again
    )
    assert fails(
        capsys, ["report", str(out)], "record 1 (memory, tiny/seed0) was changed after attnlab wrote it", again
    )
    (out / "records.jsonl").write_text("")  # the advice, followed
    assert main(_bench(tiny_run, out)) == 0 and "memory ..." in capsys.readouterr().out
    assert main(["report", str(out)]) == 0


def test_al6_a_memory_models_memory_bench_past_its_context_says_why_and_where_to_read_past_it(
    streaming_run, tmp_path, capsys
):
    argv = ["bench", str(streaming_run), "--benchmarks", "memory", "--set", "memory.lengths=[128]", "--out",
            str(tmp_path / "b")]  # fmt: skip
    assert fails(capsys, argv, "benchmarks.memory.lengths=[128]: 128 exceeds tiny/seed0's max_seq_len 64",
                 "this benchmark fills the cache in one pass of at most max_seq_len tokens, memory or not: "
                 "stream_loss reads a memory model past it")  # fmt: skip


def test_al7_run_and_memory_ingest_name_a_read_only_file_system(unwritable, streaming_run, tmp_path, capsys,
                                                                monkeypatch):  # fmt: skip
    """A read-only mount was "permission denied" (making it writable is not the fix). As root only `chattr +i` makes
    a folder unwritable here, so the mount's flag is stood in for."""
    import attnlab.memory.store
    import attnlab.run_checks

    for module in (attnlab.run_checks, attnlab.memory.store):
        monkeypatch.setattr(module, "read_only_file_system", lambda path: Path(path) == unwritable)
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), "{seq_len: 16, steps: 2}")
    assert fails(capsys, ["run", str(manifest), "--out", str(unwritable)], f"{unwritable}/m: on a read-only file "
                 "system (write it somewhere else, or choose another folder with --out)")  # fmt: skip
    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat on the mat")
    argv = ["memory", "ingest", str(streaming_run), str(doc), "--name", "n", "--store", str(unwritable / "s")]
    assert fails(capsys, argv, "cannot use as a memory store (Read-only file system")
