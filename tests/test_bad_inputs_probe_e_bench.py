"""Probe G's findings in bench, report and compare: two benches on one folder, kv_quant records no report showed,
stale records of a checkpoint retrained in place, two checkpoints with one label, --set and --benchmarks that add
benchmarks, parameters silently cut or measured twice, malformed attention-map regions, contradictory, non-finite
or oddly encoded records, '|' in names, deeply nested JSON, and compare averaging runs that are not seeds of one
target."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings

import pytest
from helpers import fails, train_tiny_run

from attnlab.cli import main
from attnlab.data.files import sealed
from attnlab.errors import AttnlabWarning, ConfigError
from attnlab.eval.records import read_records

pytestmark = pytest.mark.usefixtures("one_thread")

DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested past Python's recursion limit
MODEL = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}
PERPLEXITY = ["--benchmarks", "perplexity", "--set", "perplexity.split=val", "--set", "perplexity.seq_len=16",
              "--set", "perplexity.max_tokens=64"]  # fmt: skip


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """A tiny trained run (char tokenizer, max_seq_len 64, train seq_len 32) at <root>/runs/tiny/seed0."""
    return train_tiny_run(tmp_path_factory.mktemp("plain"), MODEL, steps=4)


@pytest.fixture(scope="module")
def other_run(tmp_path_factory):
    """The same config trained longer: other weights, and also labelled tiny/seed0."""
    return train_tiny_run(tmp_path_factory.mktemp("other"), MODEL, steps=6)


def write_records(folder, *rows, prefix: str = ""):
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(sealed(r)) + "\n" for r in rows)  # as bench writes them
    (folder / "records.jsonl").write_text(prefix + text, encoding="utf-8")
    return str(folder)


def ppl_record(model="m", loss=4.2, **extra):
    """A perplexity record whose figures agree (ppl = exp(loss), each inside its interval), rounded as a hand-made
    record would write them (loss 4.2: ppl 66.7, ppl_ci [60.3, 73.7]): a report refuses one that contradicts itself."""
    ci = [round(loss - 0.1, 6), round(loss + 0.1, 6)]
    return {"benchmark": "perplexity", "model": model, "kind": "mha", "split": "val", "tokens": 64, "loss": loss,
            "loss_ci": ci, "ppl": round(math.exp(loss), 1), "ppl_ci": [round(math.exp(c), 1) for c in ci],
            **extra}  # fmt: skip


def table_rows(markdown: str, first: str | None = None) -> list[list[str]]:
    """The cells of the Markdown table rows whose first cell is `first` (every row's when None; an escaped '|' kept
    inside its cell), header and separator lines left out."""
    import re

    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]] for line in markdown.splitlines()
            if line.startswith("|") and not set(line) <= set("|- ")]  # fmt: skip
    return [row for row in rows if row[0] == first or (first is None and row[0] not in ("model", "target"))]


# ----------------------------------------------------------------------------- CONC-bench: one bench per folder


def test_a_second_bench_on_one_out_folder_is_refused_and_a_killed_one_frees_it(plain_run, tmp_path, capsys):
    from attnlab.eval.harness import LOCK

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(out / LOCK)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode()); print('locked', flush=True)\n"
         "time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        argv = ["bench", str(plain_run), *PERPLEXITY, "--out", str(out)]
        assert fails(capsys, argv, str(out), f"another attnlab bench (pid {holder.pid})", "give another --out")
        assert not (out / "records.jsonl").exists()
    finally:
        holder.kill()  # a killed bench (SIGKILL: no clean-up) lets go of the folder
        holder.wait()
    assert main(argv) == 0
    assert [r["benchmark"] for r in read_records(out / "records.jsonl")] == ["perplexity"]


def test_the_lock_is_let_go_when_a_bench_ends(tmp_path):
    from attnlab.errors import InputError
    from attnlab.eval.harness import bench_lock

    with bench_lock(tmp_path / "o"):
        with pytest.raises(InputError, match="another attnlab bench"), bench_lock(tmp_path / "o"):
            pass
    with bench_lock(tmp_path / "o"):  # free again
        pass


def test_a_refused_bench_leaves_no_lock_file_in_a_folder_of_yours(tmp_path, monkeypatch):
    """Probe W: `mkdir bq; attnlab bench RUN --out bq` refused (after taking the lock) left bq/.bench.lock behind; an
    earlier bench's lock file (the folder's own) stays."""
    from attnlab.errors import InputError
    from attnlab.eval import harness

    def refuse(*args, **kwargs):
        raise InputError("benchmarks.perplexity: refused")

    monkeypatch.setattr(harness, "plan_labels", refuse)  # a refusal inside the lock
    plan = harness.BenchPlan(name="b", checkpoints=(str(tmp_path / "run"),), benchmarks={"perplexity": {}})
    mine = tmp_path / "bq"
    mine.mkdir()
    with pytest.raises(InputError, match="refused"):
        harness.run_plan(plan, mine, log=lambda line: None)
    assert os.listdir(mine) == []
    (mine / harness.LOCK).write_text("")  # an earlier bench's
    with pytest.raises(InputError, match="refused"):
        harness.run_plan(plan, mine, log=lambda line: None)
    assert os.listdir(mine) == [harness.LOCK]


# ----------------------------------------------------------------------------- RP-kv, RP-kvbench: kv_quant tables

KV = {"benchmark": "kv_quant", "model": "m", "kind": "mha", "policy": "k=q8_0,v=q4_0", "bytes_per_token": 98.0,
      "vs_full": 0.766, "dnll": 0.00123, "dnll_ci": [0.0004, 0.0021], "ppl_ratio": 1.00123, "kl": 0.000456,
      "top1": 0.991, "greedy": None, "tokens": 64, "seq_len": 16}  # fmt: skip


def test_kv_quant_records_get_a_table(tmp_path):
    from attnlab.eval.report import build_report

    folder = write_records(tmp_path / "r", KV, {**KV, "policy": "k=q4_0", "dnll_ci": None, "greedy": 0.5})
    result = build_report(folder)
    assert "kv_quant" in result["tables"]
    markdown = (tmp_path / "r" / "report.md").read_text()
    assert "## Quantized KV caches" in markdown
    rows = table_rows(markdown, "m")
    assert rows[0] == ["m", "k=q8_0,v=q4_0", "16", "98.0", "0.766", "+0.00123", "+0.00040 to +0.00210", "1.0012",
                       "0.000456", "0.991", "-"]  # fmt: skip
    assert rows[1][6] == "-" and rows[1][10] == "0.500"  # no interval recorded; a greedy figure


@pytest.mark.parametrize("damage, field", [({"dnll": "x"}, "'dnll'"), ({"policy": None}, "'policy'"),
                                           ({"dnll_ci": [1]}, "'dnll_ci'")])  # fmt: skip
def test_a_kv_quant_record_with_a_damaged_field_is_refused(tmp_path, capsys, damage, field):
    row = {k: v for k, v in {**KV, **damage}.items() if v is not None}
    assert fails(capsys, ["report", write_records(tmp_path / "r", KV, row)], "records.jsonl: record 2", field)


def test_kv_quant_from_bench_reaches_the_report(plain_run, tmp_path, capsys):
    out = str(tmp_path / "out")
    argv = ["bench", str(plain_run), "--benchmarks", "kv_quant", "--set", "kv_quant.policies=[k=q8_0]", "--set",
            "kv_quant.split=val", "--set", "kv_quant.seq_len=16", "--set", "kv_quant.max_tokens=64", "--out",
            out]  # fmt: skip
    assert main(argv) == 0
    assert main(["report", out]) == 0
    assert table_rows((tmp_path / "out" / "tables" / "kv_quant.md").read_text(), "tiny/seed0")[0][1] == "k=q8_0"


def test_records_of_a_benchmark_no_table_draws_are_counted_in_a_note(tmp_path):
    from attnlab.eval.report import build_report

    build_report(write_records(tmp_path / "r", ppl_record(), {"benchmark": "kv_tune", "model": "m"}))
    assert "Not in this report (no table or plot draws them): 1 kv_tune record." in (
        tmp_path / "r" / "report.md").read_text()  # fmt: skip


# ----------------------------------------------------------------------------- B2-stale2: weights retrained in place


def test_a_checkpoint_retrained_in_place_is_measured_again(tmp_path, capsys):
    from attnlab.eval.report import build_report

    checkpoint = train_tiny_run(tmp_path, MODEL, steps=4)
    out = tmp_path / "out"
    argv = ["bench", str(checkpoint), *PERPLEXITY, "--out", str(out)]
    assert main(argv) == 0
    assert main(argv) == 0 and "recorded already, skipped" in capsys.readouterr().out
    shutil.rmtree(tmp_path / "runs")
    assert train_tiny_run(tmp_path, MODEL, steps=6) == checkpoint  # retrained: same path and config, other weights
    assert main(argv) == 0
    assert "recorded for other weights at this path" in capsys.readouterr().out
    first, second = read_records(out / "records.jsonl")
    assert first["weights"] != second["weights"] and first["weights"].startswith("sha256:")
    assert first["loss"] != second["loss"]
    with pytest.warns(AttnlabWarning, match="with other figures"):  # the report shows the new figures, and says so
        build_report(out)
    assert [row[4] for row in table_rows((out / "report.md").read_text(), "tiny/seed0")] == [f"{second['loss']:.3f}"]


def test_records_without_the_weights_identity_are_kept_and_said(plain_run, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["bench", str(plain_run), *PERPLEXITY, "--out", str(out)]
    assert main(argv) == 0
    old = [{k: v for k, v in r.items() if k not in ("weights", "sha256")} for r in read_records(out / "records.jsonl")]
    write_records(out, *old)  # as an attnlab from before the weights were recorded wrote them
    capsys.readouterr()
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "recorded already by an older attnlab, which did not note the weights" in said and "skipped" in said
    assert len(read_records(out / "records.jsonl")) == 1  # hours of measurements are not redone


# ----------------------------------------------------------------------------- B2-collide: one label, two checkpoints


def test_two_checkpoints_that_would_share_a_label_are_told_apart(plain_run, other_run, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", str(plain_run), str(other_run), *PERPLEXITY, "--out", str(out)]) == 0
    labels = [r["model"] for r in read_records(out / "records.jsonl")]
    assert len(set(labels)) == 2 and all(label.endswith("runs/tiny/seed0") for label in labels)
    assert main(["report", str(out)]) == 0
    assert "2 records, 2 checkpoints" in (out / "report.md").read_text()


def test_a_new_checkpoint_with_a_recorded_label_gets_another(plain_run, other_run, tmp_path):
    out = tmp_path / "out"
    assert main(["bench", str(plain_run), *PERPLEXITY, "--out", str(out)]) == 0
    assert main(["bench", str(other_run), *PERPLEXITY, "--out", str(out)]) == 0
    first, second = (r["model"] for r in read_records(out / "records.jsonl"))
    assert first == "tiny/seed0" and second != first and second.endswith("/runs/tiny/seed0")


def test_a_report_tells_apart_checkpoints_older_records_gave_one_label(tmp_path, capsys):
    folder = write_records(tmp_path / "r", ppl_record("base/seed0", model_path="runs/tiny/base/seed0"),
                           ppl_record("base/seed0", 4.0, model_path="runs2/tiny/base/seed0"))  # fmt: skip
    assert main(["report", folder]) == 0
    assert "2 checkpoints share the label base/seed0" in capsys.readouterr().err
    markdown = (tmp_path / "r" / "report.md").read_text()
    assert table_rows(markdown, "runs/tiny/base/seed0") and table_rows(markdown, "runs2/tiny/base/seed0")


def test_distinct_labels_keep_as_few_folders_as_tell_them_apart():
    from attnlab.eval.records import distinct_labels

    labels = {"/a/runs/tiny/base/seed0": "base/seed0", "/a/runs2/tiny/base/seed0": "base/seed0",
              "/a/o/mem/base/seed0": "base/seed0", "/a/x/seed0": "x/seed0"}  # fmt: skip
    assert distinct_labels(labels) == {"/a/runs/tiny/base/seed0": "runs/tiny/base/seed0",
                                       "/a/runs2/tiny/base/seed0": "runs2/tiny/base/seed0",
                                       "/a/o/mem/base/seed0": "o/mem/base/seed0", "/a/x/seed0": "x/seed0"}  # fmt: skip


# ----------------------------------------------------------------------------- BS-*: what --set, --benchmarks select


@pytest.fixture
def run_folder(tmp_path):
    """A folder bench accepts as a checkpoint path (nothing is loaded before the plan is refused)."""
    folder = tmp_path / "run"
    folder.mkdir()
    return str(folder)


def test_a_set_for_a_benchmark_not_selected_is_refused(run_folder, tmp_path, capsys):
    argv = ["bench", run_folder, *PERPLEXITY, "--set", "needle.trials=1", "--out", str(tmp_path / "o")]
    assert fails(capsys, argv, "--set 'needle.trials=1'", "needle is not among the benchmarks to run (perplexity)",
                 "add needle to --benchmarks")  # fmt: skip
    argv = ["bench", run_folder, "--set", "needle.trials=1", "--out", str(tmp_path / "o")]  # the default set
    assert fails(capsys, argv, "needle is not among the benchmarks to run (perplexity, memory", "--benchmarks")
    assert not (tmp_path / "o").exists()


def bench_manifest(tmp_path, run_folder, benchmarks: str, extra: str = "") -> str:
    manifest = tmp_path / "b.yml"
    manifest.write_text(f"checkpoints: [{run_folder}]\nbenchmarks: {benchmarks}\n{extra}")
    return str(manifest)


def test_benchmarks_not_in_the_manifest_are_refused(run_folder, tmp_path, capsys):
    manifest = bench_manifest(tmp_path, run_folder, "{perplexity: {split: val}}")
    argv = ["bench", manifest, "--benchmarks", "needle", "--out", str(tmp_path / "o")]
    assert fails(capsys, argv, "--benchmarks needle: not among", "b.yml's benchmarks (perplexity)")
    argv = ["bench", manifest, "--set", "needle.trials=1", "--out", str(tmp_path / "o")]
    assert fails(capsys, argv, "needle is not among the benchmarks to run (perplexity)", "b.yml's benchmarks")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("where, what", [("nowhere", "no such folder"), ("afile", "a file, not a folder")])
def test_a_manifest_data_dir_that_is_no_folder_is_refused(run_folder, tmp_path, capsys, where, what):
    (tmp_path / "afile").write_text("x")
    manifest = bench_manifest(tmp_path, run_folder, "{perplexity: {split: val}}", f"data_dir: {tmp_path / where}\n")
    assert fails(capsys, ["bench", manifest, "--out", str(tmp_path / "o")], "b.yml", "data_dir=", what)
    assert main(["validate", manifest]) == 2  # validate makes the check bench makes
    err = capsys.readouterr().err
    assert err.startswith(f"{tmp_path / 'b.yml'}: data_dir=") and f": {what} (name the folder" in err


# ----------------------------------------------------------------------------- B-*: parameters cut, twice, malformed


@pytest.mark.parametrize(
    "sets, fragments",
    [
        (["kv_quant.policies=[k=q8_0, k=q8_0]"], ["kv_quant.policies=", "holds 'k=q8_0' twice"]),
        (["kv_quant.policies=['k=q8_0,v=q4_0', 'v=q4_0,k=q8_0']"], ["names one policy twice"]),
        (["kv_quant.policies=[k=q3_0]"], ["kv_quant.policies=", "not a KV policy"]),
        (["latency.prompt_lengths=[8, 8]"], ["latency.prompt_lengths=[8, 8] holds 8 twice: give each once"]),
        (["needle.depths=[0.5, 0.5]"], ["needle.depths=[0.5, 0.5] holds 0.5 twice"]),
        (["attention_maps.regions={a: [1.5, 3]}"], ["attention_maps.regions.a=[1.5, 3] holds 1.5", "whole numbers"]),
        (["attention_maps.regions={a: [5, 2]}"], ["attention_maps.regions.a=[5, 2] is reversed", "start < end"]),
        (["attention_maps.regions={a: [2, 2]}"], ["attention_maps.regions.a=[2, 2] is empty"]),
        (["attention_maps.regions=[[0, 3]]"], ["attention_maps.regions=[[0, 3]] must map each region's name"]),
        (["attention_maps.regions={a: x}"], ["attention_maps.regions.a='x' must be [start, end]"]),
        (["attention_maps.regions={a: [1, 2, 3]}"], ["attention_maps.regions.a=[1, 2, 3] must be [start, end]"]),
        (["attention_maps.regions={a: [-1, 2]}"], ["attention_maps.regions.a=[-1, 2]: start must be >= 0"]),
        (["attention_maps.unit=tokens", "attention_maps.regions={a: [0.5, 2]}"], ["tokens of the prompt"]),
    ],
)
def test_a_parameter_cut_measured_twice_or_malformed_is_refused_before_loading(run_folder, tmp_path, capsys, sets,
                                                                               fragments):  # fmt: skip
    benchmark = sets[0].partition(".")[0]
    argv = ["bench", run_folder, "--benchmarks", benchmark, "--out", str(tmp_path / "o")]
    for item in sets:
        argv += ["--set", item]
    assert fails(capsys, argv, *fragments)  # the empty run folder would fail to load: refused before it is


def test_a_probe_suite_that_is_a_folder_is_refused_before_loading(run_folder, tmp_path, capsys):
    argv = ["bench", run_folder, "--benchmarks", "probes", "--set", f"probes.suite={tmp_path}", "--out",
            str(tmp_path / "o")]  # fmt: skip
    assert fails(capsys, argv, "benchmarks.probes.suite=", "a folder, not a probe suite file")
    with pytest.raises(ConfigError, match="a folder, not a probe suite file"):
        from attnlab.eval.probes import load_suite

        load_suite(tmp_path)


def test_a_broken_probe_suite_is_refused_before_loading(run_folder, tmp_path, capsys):
    suite = tmp_path / "s.yml"
    suite.write_text("name: s\ndescription: d\ncases: []\n")
    argv = ["bench", run_folder, "--benchmarks", "probes", "--set", f"probes.suite={suite}", "--out",
            str(tmp_path / "o")]  # fmt: skip
    assert fails(capsys, argv, "benchmarks.probes.suite=", "cases must be a non-empty list")


def test_a_probe_max_new_tokens_past_the_context_is_refused_in_bench(plain_run, tmp_path, capsys):
    """PS-mnthuge as a benchmark: the case's max_new_tokens, not its 3-character prompt, is to blame."""
    suite = tmp_path / "s.yml"
    suite.write_text("name: s\ndescription: d\ncases:\n  - {id: big, category: c, kind: contains, prompt: 'a c', "
                     "expected: a, max_new_tokens: 100000}\n")  # fmt: skip
    argv = ["bench", str(plain_run), "--benchmarks", "probes", "--set", f"probes.suite={suite}", "--out",
            str(tmp_path / "o")]  # fmt: skip
    assert fails(capsys, argv, "case big: max_new_tokens=100,000", "max_seq_len 64", "give max_new_tokens 61 or less")


@pytest.mark.parametrize(
    "sets, fragments",
    [
        (["effective_rank.seq_len=1000", "effective_rank.n_tokens=2000", "effective_rank.split=val"],
         ["benchmarks.effective_rank.seq_len=1000: 1000 exceeds", "max_seq_len 64", "give seq_len <= 64"]),
        (["effective_rank.seq_len=32", "effective_rank.n_tokens=16", "effective_rank.split=val"],
         ["benchmarks.effective_rank.seq_len=32 is more than", "n_tokens=16"]),
        (["rope_extrapolation.factors=[1, 2]", "rope_extrapolation.max_tokens=4"],
         ["benchmarks.rope_extrapolation.max_tokens=4 is fewer than the longest window scored, 64 tokens",
          "max_tokens >= 64"]),
    ],
)  # fmt: skip
def test_a_length_the_model_cannot_score_as_asked_is_refused(plain_run, tmp_path, capsys, sets, fragments):
    argv = ["bench", str(plain_run), "--benchmarks", sets[0].partition(".")[0], "--out", str(tmp_path / "o")]
    for item in sets:
        argv += ["--set", item]
    assert fails(capsys, argv, *fragments)


def test_attention_map_regions_are_checked_by_the_library_too(plain_run):
    from attnlab.eval import load_for_eval
    from attnlab.eval.analysis import run_attention_maps

    model = load_for_eval(plain_run)
    with pytest.raises(ConfigError, match=r"regions.a=\[3, 1\] is reversed"):
        run_attention_maps(model, "a cat and a dog", "unused.npz", {"a": [3, 1]})
    from attnlab.errors import InputError

    with pytest.raises(InputError, match="outside the prompt"):
        run_attention_maps(model, "a cat", "unused.npz", {"a": [1, 40]})


# ----------------------------------------------------------------------------- RP-*: what a report shows


@pytest.mark.parametrize("loss, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (None, "-")])
def test_a_non_finite_loss_is_shown_as_such_not_as_missing(tmp_path, loss, shown):
    from attnlab.eval.report import build_report

    row = ppl_record(loss=4.0)
    if loss is not None:  # (exp(nan) is nan, exp(inf) inf; a diverged model's interval is as its point: probe AJ1)
        row = {**row, "loss": loss, "ppl": loss, "loss_ci": [loss, loss], "ppl_ci": [loss, loss]}
    build_report(write_records(tmp_path / "r", row))
    cells = table_rows((tmp_path / "r" / "report.md").read_text(), "m")[0]
    assert cells[4] == (shown if loss is not None else "4.000")
    if loss is not None:
        assert f"<td>{shown}</td>" in (tmp_path / "r" / "report.html").read_text()


def test_contradictory_records_of_one_checkpoint_show_the_latest_and_say_so(tmp_path, capsys):
    folder = write_records(tmp_path / "r", ppl_record(loss=4.2, model_path="ck"), ppl_record(loss=1.0, model_path="ck"),
                           ppl_record(loss=1.0, model_path="ck", split="test"))  # fmt: skip
    assert main(["report", folder]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "record 1 measured the same checkpoint and settings as a later record (2)" in err
    markdown = (tmp_path / "r" / "report.md").read_text()
    assert [row[2] + " " + row[4] for row in table_rows(markdown, "m")] == ["val 1.000", "test 1.000"]
    assert "Note: record 1 measured the same checkpoint" in markdown


def test_repeated_records_with_the_same_figures_are_shown_once_without_a_warning(tmp_path):
    from attnlab.eval.report import build_report

    folder = write_records(tmp_path / "r", sealed(ppl_record(time="t1")), sealed(ppl_record(time="t2")))  # bench's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = build_report(folder)
    assert result["notes"] and "with the same figures" in result["notes"][0]
    assert len(table_rows((tmp_path / "r" / "report.md").read_text(), "m")) == 1


def test_a_pipe_in_a_model_name_stays_in_its_cell(tmp_path):
    from attnlab.eval.report import build_report

    build_report(write_records(tmp_path / "r", ppl_record("a|b")))
    rows = table_rows((tmp_path / "r" / "report.md").read_text(), "a\\|b")
    assert rows == [["a\\|b", "mha", "val", "64", "4.200", "4.100 to 4.300", "66.700", "60.30 to 73.70"]]
    assert "<td>a|b</td><td>mha</td>" in (tmp_path / "r" / "report.html").read_text()


@pytest.mark.parametrize(
    "name, fragments",
    [
        ("tiny.yml", ["tiny.yml: a file, not a folder", "bench --out"]),
        ("records.jsonl", ["a file, not a folder", "give the folder that"]),
    ],
)
def test_report_on_a_file_says_to_give_the_folder(tmp_path, capsys, name, fragments):
    (tmp_path / name).write_text(json.dumps(ppl_record()) + "\n")
    assert fails(capsys, ["report", str(tmp_path / name)], *fragments)


def test_records_with_a_byte_order_mark_are_read(tmp_path, capsys):
    folder = write_records(tmp_path / "r", ppl_record(), prefix="\ufeff")
    assert main(["report", folder]) == 0
    from attnlab.eval.records import append_records

    append_records(tmp_path / "r" / "records.jsonl", [ppl_record(split="test")])  # appended to, not refused
    assert [r["split"] for r in read_records(tmp_path / "r" / "records.jsonl")] == ["val", "test"]


def test_records_nested_too_deeply_are_one_line(tmp_path, capsys):
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "records.jsonl").write_text(json.dumps(ppl_record()) + "\n" + DEEP + "\n")
    assert fails(capsys, ["report", str(folder)], "records.jsonl: line 2 is not valid JSON: nested too deeply")
    argv = ["bench", str(tmp_path), "--benchmarks", "perplexity", "--out", str(folder)]
    assert fails(capsys, argv, "records.jsonl", "line 2 is not valid JSON: nested too deeply")


def test_a_damaged_training_log_of_a_reported_run_is_one_line(plain_run, tmp_path, capsys):
    run = tmp_path / "runs" / "tiny" / "seed0"
    shutil.copytree(plain_run, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(DEEP + "\n")
    folder = write_records(tmp_path / "r", sealed(ppl_record("tiny/seed0", model_path=str(run))))  # as bench wrote it
    assert fails(capsys, ["report", folder], "metrics.jsonl: line", "nested too deeply", "repair it")


# ----------------------------------------------------------------------------- compare: what is averaged as seeds


def fake_run(folder, val_loss: float, seed: int = 0, lr: float = 1e-3, d_model: int = 32):
    """A finished run's files as compare reads them (no training)."""
    folder.mkdir(parents=True)
    summary = {"status": "complete", "params": 1000, "kv_bytes_per_token_fp16": 128, "val_loss": val_loss,
               "val_ppl": math.exp(val_loss)}  # fmt: skip
    (folder / "summary.json").write_text(json.dumps(sealed(summary)))
    config = {"model": {"d_model": d_model}, "data": {"source": "x"}, "train": {"lr": lr, "seed": seed}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "metrics.jsonl").write_text(json.dumps({"tokens": 10, "val_loss": val_loss}) + "\n")
    return folder


def compare_rows(capsys, folder, *options) -> dict[str, list[str]]:
    assert main(["compare", str(folder), *options]) == 0
    out = capsys.readouterr().out
    return {row[0]: row for row in table_rows(out)}


def test_compare_keeps_runs_of_different_manifests_apart(tmp_path, capsys):
    fake_run(tmp_path / "o" / "tiny" / "base" / "seed0", 4.0)
    fake_run(tmp_path / "o" / "mem" / "base" / "seed0", 3.0, d_model=64)
    fake_run(tmp_path / "o" / "mem" / "base" / "seed1", 3.2, seed=1, d_model=64)
    rows = compare_rows(capsys, tmp_path / "o")
    assert set(rows) == {"tiny/base", "mem/base"}
    assert rows["mem/base"][1] == "2" and rows["mem/base"][5] == "3.1000 ± 0.1414"  # seeds of one config: averaged
    assert "shown apart: mem/base, tiny/base" in (tmp_path / "o" / "compare.md").read_text()


def test_compare_does_not_average_seeds_trained_with_different_configs(tmp_path, capsys):
    fake_run(tmp_path / "m" / "base" / "seed0", 3.4, lr=3e-2)
    fake_run(tmp_path / "m" / "base" / "seed1", 4.1, seed=1)
    rows = compare_rows(capsys, tmp_path / "m")
    assert set(rows) == {"base (train.lr=0.03)", "base (train.lr=0.001)"}
    assert all(row[1] == "1" for row in rows.values())
    text = (tmp_path / "m" / "compare.md").read_text()
    assert "base: its seeds were trained with different configs (seed0: train.lr 0.03; seed1: train.lr 0.001)" in text


@pytest.mark.parametrize("below", ["base", "base/seed0"])
def test_compare_on_a_target_or_run_folder_reads_its_runs(tmp_path, capsys, below):
    fake_run(tmp_path / "m" / "base" / "seed0", 3.4)
    rows = compare_rows(capsys, tmp_path / "m" / below, "--out", str(tmp_path / "out"))  # (not into a run: probe T)
    assert list(rows) == ["base"] and rows["base"][5] == "3.4000"


def test_compare_on_a_folder_without_runs_or_a_file_says_what_to_give(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert fails(capsys, ["compare", str(tmp_path / "empty")], "no finished runs", "runs/quickstart")
    (tmp_path / "f.yml").write_text("x: 1\n")
    assert fails(capsys, ["compare", str(tmp_path / "f.yml")], "f.yml: a file, not a folder")


@pytest.mark.parametrize("name, said", [("summary.json", "not valid JSON (nested too deeply"),
                                        ("config.json", "not valid JSON (nested too deeply"),
                                        ("metrics.jsonl", "line 1 is not valid JSON: nested too deeply")])  # fmt: skip
def test_compare_names_a_run_file_nested_too_deeply(tmp_path, capsys, name, said):
    run = fake_run(tmp_path / "m" / "base" / "seed0", 3.4)
    (run / name).write_text(DEEP)
    assert fails(capsys, ["compare", str(tmp_path / "m")], f"{run / name}: {said}")


def test_the_run_commands_table_still_averages_seeds_of_one_config(tmp_path):
    from attnlab.compare import collect_runs, compare_table

    for seed in (0, 1):
        fake_run(tmp_path / "m" / "gqa" / f"seed{seed}", 3.0 + seed, seed=seed)
    rows = compare_table(collect_runs(tmp_path / "m"))
    assert [(r["target"], r["seeds"], r["val_loss"]) for r in rows] == [("gqa", 2, 3.5)]
    assert os.path.exists(tmp_path / "m" / "gqa" / "seed1" / "summary.json")


def test_a_checkpoint_whose_benchmarks_are_all_recorded_is_not_loaded(plain_run, tmp_path, capsys, monkeypatch):
    from attnlab.eval import harness

    out = tmp_path / "out"
    argv = ["bench", str(plain_run), *PERPLEXITY, "--out", str(out)]
    assert main(argv) == 0

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded though nothing was left to measure")

    monkeypatch.setattr(harness, "load_for_eval", no_load)
    assert main(argv) == 0 and "recorded already, skipped" in capsys.readouterr().out
    assert len(read_records(out / "records.jsonl")) == 1
