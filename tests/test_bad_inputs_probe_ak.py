"""Probe AK's findings (/work/probe_ak/REPORT.md) on files attnlab wrote: a diverged run's summary (training wrote
exp(min(loss, 50)) as its perplexity, which compare, and so the run's own table, refused as not exp(loss): AK11),
and the report's table showed such a perplexity with 134 digits (AK12). AK1 (a genuine kv_quant record of a memory
model refused) is tested in test_bad_inputs_probe_aj.py, AK15 (the advice for a records line cut short) in
test_bad_inputs_probe_y_report.py. Each test fails with its fix backed out."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from helpers import unsealed

from attnlab.cli import main
from attnlab.data.files import sealed
from attnlab.train.evaluate import _result

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


def test_ak11_the_evaluation_perplexity_is_exp_of_the_loss_as_a_record_holds_it():
    assert _result(306.79 * 10, 10)["ppl"] == pytest.approx(math.exp(306.79), rel=1e-12)  # was exp(50)
    assert _result(800.0 * 10, 10)["ppl"] == math.inf  # past a float's range


@pytest.fixture
def finished_copy(tiny_run, tmp_path) -> Path:
    shutil.copytree(tiny_run.parent.parent, tmp_path / "runs")
    return tmp_path / "runs"


@pytest.mark.parametrize(("loss", "ppl"), [(306.79, math.exp(306.79)), (800.0, math.inf), (306.79, math.exp(50.0))],
                         ids=["diverged", "past exp's range", "an older attnlab's cap"])  # fmt: skip
def test_ak11_compare_takes_a_diverged_runs_summary(finished_copy, tmp_path, capsys, loss, ppl):
    """The summary as the run wrote it, sealed (an older attnlab's capped ppl unsealed, as that attnlab wrote it)."""
    summary = finished_copy / "tiny" / "seed0" / "summary.json"
    older = ppl == math.exp(50.0)
    data = {**json.loads(summary.read_text()), "val_loss": loss, "val_ppl": ppl}
    summary.write_text(json.dumps(unsealed(data) if older else sealed(data)))
    argv = ["compare", str(finished_copy), "--out", str(tmp_path / "cmp"), *(["--unsealed"] if older else [])]
    assert main(argv) == 0, capsys.readouterr().err
    warned = [line for line in capsys.readouterr().err.splitlines() if "no sha256" in line]
    said = (
        f"attnlab compare: warning: {summary}: no sha256 in it (an older attnlab wrote it, or it was taken out): "
        "attnlab cannot tell whether it changed since the run wrote it, so its figures are shown unverified "
        "(--unsealed)"
    )
    assert warned == ([said] if older else []), warned


def test_ak12_a_diverged_models_perplexity_is_shown_in_exponent_form(tmp_path):
    from attnlab.eval.report import build_report

    loss = 306.79
    record = {"benchmark": "perplexity", "model": "div/seed0", "kind": "mha", "split": "val", "tokens": 20,
              "windows": 2, "loss": loss, "loss_ci": [300.0, 310.0], "ppl": math.exp(loss),
              "ppl_ci": [math.exp(300.0), math.exp(310.0)], "ci_level": 0.95, "window_loss": [loss * 10] * 2,
              "window_tokens": [10, 10], "attnlab": "0.1.0", "time": "2026-12-07T00:00:00"}  # fmt: skip
    (tmp_path / "records.jsonl").write_text(json.dumps(sealed(record)) + "\n")  # as bench writes it
    build_report(tmp_path)
    table = tmp_path / "tables" / "perplexity.md"
    row = next(line for line in table.read_text().splitlines() if line.startswith("| div/seed0"))
    assert "| 1.727e+133 | 1.94e+130 to 4.28e+134 |" in row, row  # not 134 digits each
    assert len(row) < 120, row
