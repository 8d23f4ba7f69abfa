"""Paired perplexity differences: two models scored on the same windows, the windows resampled together."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import fails

from attnlab.data.files import sealed
from attnlab.errors import InputError
from attnlab.eval.perplexity import paired_difference, summarize_losses
from attnlab.eval.report import build_report

pytestmark = pytest.mark.usefixtures("one_thread")


def record(model: str, windows: list[tuple[float, int]], **extra) -> dict:
    return {"benchmark": "perplexity", "model": model, "kind": "mha", "split": "test", "dataset": "wikitext2-raw",
            "seq_len": 8, **summarize_losses(windows), **extra}  # fmt: skip


def noisy_windows(seed: int = 0, n: int = 24) -> list[tuple[float, int]]:
    rng = np.random.default_rng(seed)
    counts = rng.integers(4, 9, size=n)
    return [(float(c * rng.uniform(2.0, 5.0)), int(c)) for c in counts]  # windows of very different difficulty


def test_a_per_token_shift_is_the_difference_exactly_with_a_zero_width_interval():
    base = noisy_windows()
    shifted = [(s + 0.25 * n, n) for s, n in base]  # every token 0.25 nats worse
    d = paired_difference(record("a", shifted), record("b", base))
    assert d["dloss"] == pytest.approx(0.25)
    assert d["dloss_ci"] == pytest.approx([0.25, 0.25])  # every resample shifts by the same amount
    loss = sum(s for s, _ in base) / sum(n for _, n in base)
    assert d["dppl"] == pytest.approx(np.exp(loss + 0.25) - np.exp(loss))
    assert d["windows"] == len(base) and d["tokens"] == sum(n for _, n in base)


def test_pairing_removes_what_the_windows_share():
    base = noisy_windows()
    rng = np.random.default_rng(1)
    other = [(s + n * (0.1 + rng.normal(0, 0.02)), n) for s, n in base]
    paired = paired_difference(record("a", other), record("b", base))
    a, b = record("a", other), record("b", base)
    unpaired_width = (a["loss_ci"][1] - a["loss_ci"][0]) + (b["loss_ci"][1] - b["loss_ci"][0])
    low, high = paired["dloss_ci"]
    assert low < paired["dloss"] < high and 0.05 < low and high < 0.15
    assert high - low < unpaired_width / 10  # the window-to-window spread cancels in the pairs


def test_swapping_a_and_b_negates_the_difference_and_its_interval():
    base, other = noisy_windows(0), [(s * 1.1, n) for s, n in noisy_windows(0)]
    ab = paired_difference(record("a", other), record("b", base))
    ba = paired_difference(record("b", base), record("a", other))
    assert ba["dloss"] == pytest.approx(-ab["dloss"])
    assert ba["dloss_ci"] == pytest.approx([-ab["dloss_ci"][1], -ab["dloss_ci"][0]])


def test_records_of_other_windows_or_without_window_losses_are_refused():
    a = record("a", noisy_windows(0, 24))
    with pytest.raises(InputError, match="not scored on the same windows"):
        paired_difference(a, record("b", noisy_windows(0, 20)))
    old = {k: v for k, v in record("b", noisy_windows(0, 24)).items() if k != "window_loss"}
    with pytest.raises(InputError, match=r"b\).*no per-window losses"):
        paired_difference(a, old)


def write(folder, *rows):
    """folder/records.jsonl of rows, sealed as attnlab writes its records."""
    folder.mkdir(exist_ok=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in rows))
    return folder


def test_the_report_draws_the_paired_table_for_the_pairs_asked(tmp_path):
    base = noisy_windows()
    folder = write(tmp_path / "r", record("x/seed0", [(s + 0.5 * n, n) for s, n in base]), record("y/seed0", base),
                   record("y/seed0", base[:12], max_tokens=12))  # fmt: skip
    result = build_report(folder, [("x/seed0", "y/seed0")])
    assert "paired" in result["tables"]
    table = (folder / "tables" / "paired.csv").read_text().splitlines()
    assert len(table) == 2  # the header and the one setting both were scored at
    assert table[1].startswith("x/seed0,y/seed0,perplexity,8,") and ",0.5," in table[1]
    assert "paired" not in build_report(folder)["tables"]  # only when asked


def test_report_paired_names_a_missing_model_or_a_malformed_pair(tmp_path, capsys):
    folder = str(write(tmp_path / "r", record("x/seed0", noisy_windows())))
    assert fails(capsys, ["report", folder, "--paired", "x/seed0:z/seed0"], "'z/seed0'", "x/seed0")
    assert fails(capsys, ["report", folder, "--paired", "x/seed0"], "--paired", "A:B")


def test_the_frontier_has_a_panel_per_pair_of_figures_some_model_has():
    from attnlab.eval.report import pareto_panels

    rows = [record("a", noisy_windows()), record("b", noisy_windows(1)),
            {"benchmark": "memory", "model": "a", "kind": "mha", "length": 100, "kv_bytes": 5000.0, "status": "ok"},
            {"benchmark": "multiple_choice", "model": "a", "task": "arc_easy", "n": 10, "acc": 0.6},
            {"benchmark": "multiple_choice", "model": "b", "task": "arc_easy", "n": 10, "acc": 0.5}]  # fmt: skip
    panels = pareto_panels(rows)
    assert [(x, y) for x, y, _ in panels] == [("KV bytes per token (measured)", "held-out perplexity"),
                                              ("KV bytes per token (measured)", "arc_easy accuracy")]  # fmt: skip
    assert panels[0][2] == {"a": (50.0, rows[0]["ppl"])} and panels[1][2] == {"a": (50.0, 0.6)}  # b has no bytes
    assert pareto_panels(rows[:2]) == []  # no efficiency figure: no frontier


@pytest.mark.parametrize("spread, log", [(1.5, False), (40.0, True)])
def test_the_frontier_draws_perplexity_on_a_log_axis_where_it_spans_more_than_10x(tmp_path, monkeypatch, spread, log):
    """A conversion that failed (perplexity 40x the others) would flatten the rest on a linear axis."""
    import matplotlib.axes

    from attnlab.eval.report import pareto_plot

    scales = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_yscale", lambda ax, value, **k: scales.append(value))
    rows = [{"benchmark": "perplexity", "model": m, "ppl": ppl, "loss": float(np.log(ppl))}
            for m, ppl in (("a", 12.0), ("b", 12.0 * spread))]  # fmt: skip
    rows += [{"benchmark": "memory", "model": m, "kind": "mha", "length": 10, "kv_bytes": b, "status": "ok"}
             for m, b in (("a", 500.0), ("b", 250.0))]  # fmt: skip
    assert pareto_plot(rows, tmp_path / "p.png").is_file()
    assert scales == (["log"] if log else [])
