"""Probe AK's findings (/work/probe_ak/REPORT.md) on files attnlab wrote and then refused: a diverged run's summary
(training wrote exp(min(loss, 50)) as its perplexity, which compare, and so the run's own table, refused as not
exp(loss): AK11). (AK1, a genuine kv_quant record of a memory model refused, is tested in
test_bad_inputs_probe_aj.py.) Each test fails with its fix backed out."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from attnlab.cli import main
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
    summary = finished_copy / "tiny" / "seed0" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "val_loss": loss, "val_ppl": ppl}))
    assert main(["compare", str(finished_copy), "--out", str(tmp_path / "cmp")]) == 0, capsys.readouterr().err
