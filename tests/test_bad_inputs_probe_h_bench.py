"""Probe H's findings in bench and report: `bench --set BENCH.PARAM` without `=VALUE` silently set the parameter to
null (its default) where `run --set` refuses the same form, a refused bench left a new --out folder holding only
its lock file, and report printed matplotlib's own warning lines (or a traceback) for extreme figures and drew
impossible ones (a negative loss or byte count) silently. Each ends in one line naming the key, record or plot."""

from __future__ import annotations

import json
import warnings

import pytest
from helpers import fails, unsealed

from attnlab.cli import main
from attnlab.data.files import sealed
from attnlab.errors import AttnlabWarning
from attnlab.eval.harness import load_plan
from attnlab.eval.report import build_report


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


pytestmark = pytest.mark.usefixtures("one_thread", "offline")


@pytest.fixture(scope="module")
def records(run, tmp_path_factory):
    """The records of a perplexity and a memory benchmark of `run` (read as dicts)."""
    out = tmp_path_factory.mktemp("b") / "b"
    argv = ["bench", str(run), "--benchmarks", "perplexity,memory", "--set", "perplexity.split=val",
            "--set", "perplexity.seq_len=16", "--set", "memory.lengths=[16,32]", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------ h10: --set without a value


def test_bench_set_without_a_value_is_refused_like_run_set(run, tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["bench", str(run), "--benchmarks", "perplexity", "--set", "perplexity.seq_len", "--out", str(out)]
    assert fails(capsys, argv, "--set 'perplexity.seq_len' must look like BENCHMARK.PARAM=VALUE")
    assert not out.exists()
    with pytest.raises(Exception, match="must look like"):
        load_plan([str(run)], ["perplexity"], [".seq_len=3"])
    plan = load_plan([str(run)], ["perplexity"], ["perplexity.seq_len="])  # `=` with nothing: null, as run reads it
    assert plan.benchmarks["perplexity"]["seq_len"] is None


# ---------------------------------------------------------------- h17: a refused bench leaves no new --out folder


def test_a_refused_bench_leaves_no_new_out_folder(run, tmp_path, capsys):
    out = tmp_path / "new" / "out"
    argv = ["bench", str(run), "--benchmarks", "memory", "--set", "memory.lengths=[1000]", "--out", str(out)]
    assert fails(capsys, argv, "benchmarks.memory.lengths=[1000]")
    assert not (tmp_path / "new").exists()
    out.mkdir(parents=True)  # a folder that was there stays
    assert fails(capsys, argv, "benchmarks.memory.lengths=[1000]")
    assert out.is_dir()


# ---------------------------------------------------------------------- h15: extreme and impossible figures


def write(folder, rows) -> None:
    folder.mkdir()
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize(
    "benchmark, field, value, fragment",
    [
        ("memory", "kv_bytes", -5, "field 'kv_bytes' is -5, which is impossible (it is >= 0)"),
        ("perplexity", "loss", -0.5, "field 'loss' is -0.5, which is impossible (it is >= 0)"),
        ("perplexity", "ppl", 0.5, "field 'ppl' is 0.5, which is impossible (it is >= 1)"),
    ],
)  # fmt: skip
def test_impossible_figures_are_refused_naming_the_record(records, tmp_path, capsys, benchmark, field, value,
                                                          fragment):  # fmt: skip
    rows = [dict(r) for r in records]
    number = next(i for i, r in enumerate(rows, 1) if r["benchmark"] == benchmark)
    rows[number - 1] = unsealed({**rows[number - 1], field: value})  # an older attnlab's: checked by its figures
    write(tmp_path / "r", rows)
    assert fails(capsys, ["report", str(tmp_path / "r"), "--unsealed"], f"record {number} ({benchmark}, tiny/seed0): "
                 f"{fragment}")  # fmt: skip
    assert not (tmp_path / "r" / "report.md").exists()
    row = rows[number - 1]
    if benchmark == "memory":  # bytes of tensors are never NaN, whatever the model does (probe AJ1)
        row[field] = float("nan")
        (tmp_path / "r" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert fails(capsys, ["report", str(tmp_path / "r"), "--unsealed"], f"field '{field}' is NaN, which is "
                     "impossible")  # fmt: skip
        return
    nan = float("nan")  # a diverged model's figures (its windows', so its loss, perplexity and intervals): shown
    row.update(loss=nan, ppl=nan, loss_ci=[nan, nan], ppl_ci=[nan, nan], window_loss=[nan] * len(row["window_loss"]))
    rows[number - 1] = sealed(row)  # as bench writes a diverged model's record
    (tmp_path / "r" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert build_report(tmp_path / "r")["markdown"].exists()


def test_figures_no_plot_can_show_are_one_warning_line_and_a_note(records, tmp_path, capsys):
    rows = [dict(r) for r in records]
    for r in rows:
        if r["benchmark"] == "perplexity":
            r["loss"], r["ppl"] = 709.0, 1e308  # each inside its interval (else refused as contradictory)
            r["loss_ci"], r["ppl_ci"] = [709.0, 709.0], [1e308, 1e308]
            r["window_loss"] = [709.0 * n for n in r["window_tokens"]]  # (the windows' loss, as the loss says)
    write(tmp_path / "r", [sealed(r) for r in rows])  # as bench would write such figures
    assert main(["report", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab report: warning: ") and "Traceback" not in err[0], err
    assert "pareto.png is not drawn: its figures are beyond what a plot can show" in err[0]
    assert "Note: pareto.png is not drawn" in (tmp_path / "r" / "report.md").read_text()
    assert not (tmp_path / "r" / "pareto.png").exists()


def test_matplotlib_warnings_become_one_attnlab_warning(records, tmp_path):
    rows = [dict(r) for r in records]
    for r in rows:
        if r["benchmark"] == "memory":
            r["kv_bytes"] = 0  # possible, but nothing to draw on a log axis
            r["kv_matches_analytic"] = False  # (as measured beside the analytic figure: else refused, probe AD7)
    write(tmp_path / "r", [sealed(r) for r in rows])  # as bench would write such figures
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = build_report(tmp_path / "r")
    said = [str(w.message) for w in caught]
    assert all(issubclass(w.category, AttnlabWarning) for w in caught), said
    assert any("pareto.png: Data has no positive values" in s and "(matplotlib, drawing its figures)" in s
               for s in said), said  # fmt: skip
    assert any(n.startswith("pareto.png: Data has no positive values") for n in result["notes"])
