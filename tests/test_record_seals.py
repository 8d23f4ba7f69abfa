"""Seals on what attnlab writes and later trusts: each record `attnlab bench` appends (read by `attnlab report`) and
a run's summary.json (read by `attnlab compare` and `attnlab run`) carry the sha256 of their other fields. A hand edit
of any figure, however plausible (probe AK: a latency median beside its own samples, a best_step past the steps), is
refused in one line; an older attnlab's unsealed file is refused too, unless --unsealed is given: then it is read
with one warning line saying its figures are unverified."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
from helpers import fails, probe_manifest

from attnlab.cli import main
from attnlab.compare import markdown_now
from attnlab.data.files import SEAL, seal_kept, sealed
from attnlab.errors import DataError
from attnlab.runner import finished_run

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


def test_a_seal_survives_json_and_every_change_breaks_it():
    row = {
        "benchmark": "x",
        "pair": (1, 2),
        "by_layer": {2: "a", 10: "b"},
        "nan": math.nan,
        "low": -math.inf,
        "f": 0.1 + 0.2,
        "text": 'é\u2028"',
        "none": None,
        "big": 10**30,
        "nested": [{"b": 1, "a": [0.5]}],
    }
    back = json.loads(json.dumps(sealed(row), sort_keys=True))
    assert seal_kept(back) is True and seal_kept(json.loads(json.dumps(sealed(row)))) is True  # (key order apart)
    for changed in (
        {**back, "f": 0.3},
        {**back, "extra": 1},
        {k: v for k, v in back.items() if k != "none"},
        {**back, "nested": [{"b": 1, "a": [0.5, 0.5]}]},
        {**back, SEAL: 5},
        {**back, "big": 10**30 + 1},
    ):
        assert seal_kept(changed) is False
    assert seal_kept(row) is None


@pytest.fixture(scope="module")
def bench_folder(tiny_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sealed") / "bench"
    argv = ["bench", str(tiny_run), "--benchmarks", "perplexity,latency", "--set", "latency.prompt_lengths=[8]",
            "--set", "latency.repeats=1", "--set", "latency.new_tokens=4", "--set", "perplexity.split=val", "--out",
            str(out)]  # fmt: skip
    assert main(argv) == 0
    return out


def _edited(bench_folder: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "edited"  # (the records alone: no report yet)
    folder.mkdir(parents=True)
    rows = [json.loads(line) for line in (bench_folder / "records.jsonl").read_text().splitlines()]
    (folder / "records.jsonl").write_text("".join(json.dumps(edit(r)) + "\n" for r in rows))
    return folder


def test_bench_seals_every_record_and_report_takes_them_quietly(bench_folder, capsys):
    rows = [json.loads(line) for line in (bench_folder / "records.jsonl").read_text().splitlines()]
    assert {r["benchmark"] for r in rows} == {"perplexity", "latency"} and all(seal_kept(r) for r in rows)
    assert main(["report", str(bench_folder)]) == 0
    assert "warning" not in capsys.readouterr().err


def _latency_median(row: dict) -> dict:  # AK2: a median beside its only sample, which no figure check caught
    if row["benchmark"] == "latency":
        return {**row, "decode_tokens_per_s": row["decode_tokens_per_s"] * 3}
    return row


@pytest.mark.parametrize("edit", [
    _latency_median,
    lambda r: {**r, "note": "checked"},  # a field added
    lambda r: {k: v for k, v in r.items() if k != "threads"},  # one taken out
], ids=["a figure changed", "a field added", "a field taken out"])  # fmt: skip
def test_report_refuses_a_record_changed_after_bench_wrote_it(bench_folder, tmp_path, capsys, edit):
    folder = _edited(bench_folder, tmp_path, edit)
    assert fails(
        capsys,
        ["report", str(folder)],
        "records.jsonl: record ",
        "was changed after attnlab wrote it",
        "take that line out, then run the benchmark again (attnlab bench measures what the file lacks)",
    )
    assert not (folder / "report.md").exists()


def test_unsealed_records_are_refused_unless_unsealed_is_given_then_reported_with_one_warning(
    bench_folder, tmp_path, capsys
):
    """An older attnlab's records (or records whose seal was taken out, then maybe edited: probe AM2) are not shown
    as if verified: refused in one line saying both ways on; --unsealed reports them with one warning line."""
    folder = _edited(bench_folder, tmp_path, lambda r: {k: v for k, v in r.items() if k != SEAL})
    assert fails(capsys, ["report", str(folder)], "records.jsonl: its records carry no sha256 (the first: record 1 (",
                 "cannot tell whether their figures were changed", "give --unsealed to report them unverified",
                 "or take those lines out and run the benchmark again")  # fmt: skip
    assert not (folder / "report.md").exists()
    assert main(["report", str(folder), "--unsealed"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and "its records carry no sha256" in err[0], err
    assert "shown unverified (--unsealed)" in err[0] and (folder / "report.md").exists()
    # one record of many unsealed: counted; and an unsealed record is still checked by its figures
    records = (folder / "records.jsonl").read_text().splitlines()
    (folder / "records.jsonl").write_text("\n".join([*(json.dumps(sealed(json.loads(r))) for r in records[:-1]),
                                                     records[-1]]) + "\n")  # fmt: skip
    assert fails(capsys, ["report", str(folder)], f"1 of its {len(records)} records carry no sha256 (the first: "
                 f"record {len(records)} (")  # fmt: skip
    folder = _edited(
        bench_folder,
        tmp_path / "more",
        lambda r: {**{k: v for k, v in r.items() if k != SEAL}, **({"ci_level": 1.5} if "ci_level" in r else {})},
    )
    assert fails(capsys, ["report", str(folder), "--unsealed"], "ci_level")


@pytest.fixture
def runs(tiny_run, tmp_path) -> Path:
    shutil.copytree(tiny_run.parent.parent, tmp_path / "runs")
    return tmp_path / "runs"


def _summary(runs: Path) -> Path:
    return runs / "tiny" / "seed0" / "summary.json"


def test_a_runs_summary_is_sealed_and_compare_takes_it_quietly(runs, tmp_path, capsys):
    assert seal_kept(json.loads(_summary(runs).read_text())) is True
    assert main(["compare", str(runs), "--out", str(tmp_path / "cmp")]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(("key", "value"), [("best_step", 999), ("kv_bytes_per_token_fp16", 1), ("val_loss", None)])
def test_compare_and_run_refuse_a_summary_changed_after_the_run_wrote_it(runs, tmp_path, capsys, key, value):
    """AK10: best_step past the steps, KV bytes per token 1 (a table 256x off); a val_loss a little lower."""
    saved = json.loads(_summary(runs).read_text())
    value = saved["val_loss"] - 0.01 if value is None else value
    _summary(runs).write_text(json.dumps({**saved, key: value}))
    assert fails(capsys, ["compare", str(runs), "--out", str(tmp_path / "cmp")], "summary.json: changed after the "
                 "run wrote it", "delete summary.json alone and `attnlab run`")  # fmt: skip
    config = json.loads((_summary(runs).parent / "config.json").read_text())
    with pytest.raises(DataError, match="changed after the run wrote it"):
        finished_run(_summary(runs).parent, config)


def test_an_unsealed_summary_is_refused_by_compare_unless_unsealed_is_given(runs, tmp_path, capsys):
    saved = json.loads(_summary(runs).read_text())
    _summary(runs).write_text(json.dumps({k: v for k, v in saved.items() if k != SEAL}))
    argv = ["compare", str(runs), "--out", str(tmp_path / "cmp")]
    assert fails(capsys, argv, f"{_summary(runs)}: no sha256 in it (an older attnlab wrote it, or it was taken out)",
                 "give --unsealed to show it unverified, or delete that summary.json alone and `attnlab run` the "
                 "manifest again (it writes it again, sealed, from the run's last checkpoint)")  # fmt: skip
    assert not (tmp_path / "cmp").exists()
    assert main([*argv, "--unsealed"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "summary.json: no sha256 in it" in err[0] and "unverified (--unsealed)" in err[0], err
    with warnings.catch_warnings(record=True) as said:  # `attnlab run`'s look before it trains: compare says it after
        warnings.simplefilter("always")
        assert markdown_now(runs)
    assert not said, [str(w.message) for w in said]


def test_run_refuses_an_unsealed_summary_before_it_trains_unless_unsealed_is_given(tmp_path, capsys):
    """`attnlab run` compares its runs when they are done: an unsealed summary under the manifest's folder (here
    another target's, not selected) is refused before anything trains, not after; --unsealed takes it."""
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(f"a cat sat on mat {i} by the red door" for i in range(80)))
    manifest = probe_manifest(tmp_path, text, "{seq_len: 16, batch_size: 2, steps: 2, eval_every: 2, eval_tokens: 64}",
                              targets="  base: {}\n  other: {train: {lr: 1.0e-4}}\n")  # fmt: skip
    out = tmp_path / "out"
    assert main(["run", str(manifest), "--out", str(out), "--no-progress", "--target", "base"]) == 0
    summary = out / "m" / "base" / "seed0" / "summary.json"
    summary.write_text(json.dumps({k: v for k, v in json.loads(summary.read_text()).items() if k != SEAL}))
    capsys.readouterr()
    argv = ["run", str(manifest), "--out", str(out), "--no-progress", "--target", "other"]
    for dry in ([], ["--dry-run"]):
        assert fails(capsys, [*argv, *dry], f"{summary}: no sha256 in it", "give --unsealed")
        assert not (out / "m" / "other").exists()
    assert main([*argv, "--unsealed"]) == 0
    assert (out / "m" / "other" / "seed0" / "summary.json").exists()
    assert "no sha256 in it" in capsys.readouterr().err
