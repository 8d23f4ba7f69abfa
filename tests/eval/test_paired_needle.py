"""report --paired on passkey cells: two models' trials with the same key at the same token, head to head."""

from __future__ import annotations

import csv
import json

import pytest
from helpers import fails

from attnlab.data.files import sealed
from attnlab.eval.report import build_report

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS, DEPTHS = (64, 128, 256, 512), (0.1, 0.3, 0.5, 0.7, 0.9)


def cell(model: str, length: int, depth: float, right: bool, key: str = "60494", at: int | None = None) -> dict:
    at = int(length * depth) if at is None else at
    return {"benchmark": "needle", "scope": "cell", "model": model, "kind": "mha", "length": length, "depth": depth,
            "status": "ok", "filler": "wikitext2-raw:test", "trials": 1, "accuracy": float(right),
            "correct": int(right), "results": [{"correct": right, "key": key, "needle_at": at,
                                                "output": f" {key}." if right else " a key"}]}  # fmt: skip


def cells(model: str, right: set[tuple[int, float]], **kw) -> list[dict]:
    return [cell(model, n, d, (n, d) in right, **kw) for n in LENGTHS for d in DEPTHS]


def write(folder, rows):
    folder.mkdir(exist_ok=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in rows))
    return folder


def table(folder) -> list[dict]:
    with open(folder / "tables" / "needle_paired.csv") as f:
        return list(csv.DictReader(f))


def test_trials_pair_cell_by_cell_with_mcnemar_exact_p(tmp_path):
    full = {(n, d) for n in LENGTHS for d in DEPTHS[:3]} | {(64, 0.9)}  # 13 of 20
    banks = {(64, 0.9), (128, 0.9), (512, 0.1)}  # 64/0.9 and 512/0.1 shared with full, 128/0.9 alone
    folder = write(tmp_path / "r", cells("full", full) + cells("banks", banks))
    result = build_report(folder, [("banks", "full")])
    assert "needle_paired" in result["tables"] and "paired" not in result["tables"]
    (row,) = table(folder)
    counts = [row[k] for k in ("a", "b", "trials", "both right", "a alone", "b alone")]
    assert counts == ["banks", "full", "20", "2", "1", "11"]
    # exact two-sided binomial on the 12 discordant trials: 2 * P(X <= 1), X ~ Bin(12, 1/2)
    assert float(row["McNemar p"]) == pytest.approx(2 * (1 + 12) / 2**12, rel=1e-3)
    assert float(row["accuracy a"]) == pytest.approx(3 / 20) and float(row["accuracy b"]) == pytest.approx(13 / 20)


def test_trials_of_another_key_or_place_are_not_paired(tmp_path, capsys):
    """Another seed's key, or the key at another token (another tokenizer or text), is another question."""
    folder = write(tmp_path / "r", cells("a", {(64, 0.1)}) + cells("b", {(64, 0.1)}, key="11111")
                   + cells("c", set(), at=3) + cells("d", set()))  # fmt: skip
    for pair in ("a:b", "a:c"):
        assert fails(capsys, ["report", str(folder), "--paired", pair], f"--paired {pair}", "same passkey trial")
    assert not (folder / "report.md").exists()  # refused before anything is written
    build_report(folder, [("a", "d")])  # the same keys at the same tokens: every trial pairs
    (row,) = table(folder)
    assert row["trials"] == "20" and (row["a alone"], row["b alone"]) == ("1", "0")


def test_a_pair_with_perplexity_and_passkey_gets_both_tables_and_a_needle_only_pair_no_line(tmp_path, capsys):
    ppl = [{"benchmark": "perplexity", "model": m, "kind": "mha", "split": "test", "dataset": "wikitext2-raw",
            "seq_len": 8, "tokens": 16, "loss": 2.0, "ppl": 7.389, "loss_ci": [1.9, 2.1], "ppl_ci": [6.7, 8.2],
            "window_loss": [16.0, 16.0], "window_tokens": [8, 8], "status": "ok"} for m in ("x", "y")]  # fmt: skip
    folder = write(tmp_path / "r", ppl + cells("x", {(64, 0.1)}) + cells("y", {(64, 0.1)}) + cells("z", set()))
    result = build_report(folder, [("x", "y"), ("x", "z")])
    assert {"paired", "needle_paired"} <= set(result["tables"])
    assert [r["b"] for r in table(folder)] == ["y", "z"]
    assert not [n for n in result["notes"] if "--paired x:z" in n]  # z has no perplexity: its pair is the passkey's
