"""Probe AN's findings (/work/probe_an/REPORT.md): `attnlab run` read a summary.json that is a fifo or a link to
/dev/zero without end while looking for unsealed summaries (AN8); a changed summary of another target, a folder where
a summary goes and impossible figures under --unsealed were refused only after the training (AN1); the files written
with --unsealed did not say so (AN2); bench took unsealed records as measured without a word, then pointed to a report
that refuses them (AN3); records rewritten by jq (1.0 written 1) were refused as changed (AN4); a dry run into /proc
said it would train (AN5); report on the file `kv-eval --out` wrote gave no way on (AN6); the advice for an unsealed
summary that no target of the manifest writes (an old copy) was to delete it and run again, which does not write it
(AN7). Each test fails with its fix backed out."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import fails, probe_manifest

from attnlab.cli import main
from attnlab.data.files import SEAL, seal_kept, sealed

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 2, eval_every: 2, eval_tokens: 64}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A manifest of two targets (base, other) and its --out, both trained: (manifest, out)."""
    root = tmp_path_factory.mktemp("an")
    text = root / "text.txt"
    text.write_text("\n\n".join(f"a cat sat on mat {i} by the red door" for i in range(80)))
    manifest = probe_manifest(root, text, TRAIN, targets="  base: {}\n  other: {train: {lr: 1.0e-4}}\n")
    assert main(["run", str(manifest), "--out", str(root / "out"), "--no-progress"]) == 0
    return manifest, root / "out"


@pytest.fixture
def copy(trained, tmp_path) -> tuple[Path, Path]:
    """trained's --out copied, with base's run taken out (so `run --target base` would train it): (manifest, out)."""
    manifest, out = trained
    shutil.copytree(out, tmp_path / "out")
    shutil.rmtree(tmp_path / "out" / "m" / "base")
    return manifest, tmp_path / "out"


def _other(out: Path) -> Path:
    return out / "m" / "other" / "seed0" / "summary.json"


def _argv(manifest: Path, out: Path, *more: str) -> list[str]:
    return ["run", str(manifest), "--out", str(out), "--no-progress", "--target", "base", *more]


def _refused_before_training(capsys, manifest, out, *fragments, more=()) -> list[str]:
    """The lines `attnlab run` and its dry run refuse with (each holding every fragment), nothing trained."""
    lines = []
    for dry in ([], ["--dry-run"]):
        lines.append(fails(capsys, _argv(manifest, out, *more, *dry), *fragments))
        assert not (out / "m" / "base").exists()  # nothing trained, nothing made
    return lines


@pytest.mark.parametrize("what", ["a fifo", "a link to /dev/zero"])
def test_an8_a_summary_that_is_a_fifo_or_a_device_is_refused_before_training_without_reading_it(copy, capsys, what):
    manifest, out = copy
    _other(out).unlink()
    os.mkfifo(_other(out)) if what == "a fifo" else _other(out).symlink_to("/dev/zero")
    assert _refused_before_training(capsys, manifest, out, f"{_other(out)}: not a regular file")


def test_an1_a_changed_summary_of_another_target_is_refused_before_training(copy, capsys):
    manifest, out = copy
    saved = json.loads(_other(out).read_text())
    _other(out).write_text(json.dumps({**saved, "val_loss": saved["val_loss"] - 0.01}))
    assert _refused_before_training(capsys, manifest, out, f"{_other(out)}: changed after the run wrote it",
                                    "delete summary.json alone and `attnlab run` the manifest again")  # fmt: skip


def test_an1_impossible_figures_under_unsealed_are_refused_before_training(copy, capsys):
    manifest, out = copy
    saved = {k: v for k, v in json.loads(_other(out).read_text()).items() if k != SEAL}
    _other(out).write_text(json.dumps({**saved, "val_loss": 1.0}))
    assert _refused_before_training(capsys, manifest, out, f"{_other(out)}: field 'val_ppl' is ",
                                    "it was changed by hand", more=["--unsealed"])  # fmt: skip


def test_an1_a_folder_where_a_summary_goes_is_refused_before_training(copy, capsys):
    manifest, out = copy
    folder = out / "m" / "old" / "x" / "seed0" / "summary.json"
    folder.mkdir(parents=True)
    assert _refused_before_training(capsys, manifest, out, f"{folder}: a folder, where a run keeps its summary.json")


def test_an7_an_unsealed_summary_no_target_writes_is_told_to_move_out_and_that_works(copy, capsys):
    manifest, out = copy
    old = out / "m" / "old" / "other" / "seed0"
    shutil.copytree(_other(out).parent, old)
    saved = json.loads((old / "summary.json").read_text())
    (old / "summary.json").write_text(json.dumps({k: v for k, v in saved.items() if k != SEAL}))
    said = f"move its run folder ({old}) out of {out / 'm'}"
    assert _refused_before_training(capsys, manifest, out, f"{old / 'summary.json'}: no sha256 in it",
                                    "give --unsealed to show it unverified, or it is no run of this manifest, so "
                                    "`attnlab run` does not write it again: ", said)  # fmt: skip
    assert (old / "summary.json").exists()  # not to be deleted: nothing writes it again
    shutil.move(out / "m" / "old", out / "elsewhere")
    assert main(_argv(manifest, out)) == 0


def test_an2_files_written_with_unsealed_say_which_figures_are_unverified(trained, tmp_path, capsys):
    _, out = trained
    shutil.copytree(out / "m", tmp_path / "m")
    summary = _other(tmp_path)
    summary.write_text(json.dumps({k: v for k, v in json.loads(summary.read_text()).items() if k != SEAL}))
    assert main(["compare", str(tmp_path / "m"), "--out", str(tmp_path / "cmp"), "--unsealed"]) == 0
    text = (tmp_path / "cmp" / "compare.md").read_text()
    assert "Note: Unverified: other: its summary.json carries no sha256" in text and "(--unsealed)" in text, text
    assert main(["compare", str(tmp_path / "m"), "--out", str(tmp_path / "cmp2"), "--unsealed"]) == 0
    capsys.readouterr()
    summary.write_text(json.dumps(sealed(json.loads(summary.read_text()))))  # as the run writes it: no note
    assert main(["compare", str(tmp_path / "m"), "--out", str(tmp_path / "cmp3")]) == 0
    assert "Unverified" not in (tmp_path / "cmp3" / "compare.md").read_text()


@pytest.fixture(scope="module")
def bench_folder(trained, tmp_path_factory) -> Path:
    _, out = trained
    folder = tmp_path_factory.mktemp("anb") / "bench"
    assert main(["bench", str(out / "m" / "base" / "seed0"), "--benchmarks", "perplexity", "--set",
                 "perplexity.split=val", "--out", str(folder)]) == 0  # fmt: skip
    return folder


def _unsealed_copy(bench_folder: Path, tmp_path: Path) -> Path:
    shutil.copytree(bench_folder, tmp_path / "b")
    rows = [json.loads(line) for line in (tmp_path / "b" / "records.jsonl").read_text().splitlines()]
    (tmp_path / "b" / "records.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != SEAL}) + "\n"
                                                          for r in rows))  # fmt: skip
    return tmp_path / "b"


def test_an2_a_report_with_unsealed_says_so_in_its_files(bench_folder, tmp_path):
    folder = _unsealed_copy(bench_folder, tmp_path)
    assert main(["report", str(folder), "--unsealed"]) == 0
    for name in ("report.md", "report.html"):
        text = (folder / name).read_text()
        assert "Unverified: 1 of the 1 records carry no sha256" in text and "base/seed0 (perplexity)" in text, name


def test_an3_bench_says_it_takes_unsealed_records_as_measured_and_how_to_report_them(trained, bench_folder, tmp_path,
                                                                                       capsys):  # fmt: skip
    _, out = trained
    folder = _unsealed_copy(bench_folder, tmp_path)
    argv = ["bench", str(out / "m" / "base" / "seed0"), "--benchmarks", "perplexity", "--set", "perplexity.split=val",
            "--out", str(folder)]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    warned = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warned) == 1 and "1 of its 1 records carry no sha256" in warned[0], captured.err
    assert "report shows them only with --unsealed (take those lines out to have them measured again)" in warned[0]
    assert f"(render them with: attnlab report {folder} --unsealed)" in captured.out, captured.out
    assert main(["report", str(folder), "--unsealed"]) == 0  # the hint works


def test_an4_records_rewritten_with_whole_numbers_as_integers_keep_their_seal(bench_folder, tmp_path):
    shutil.copytree(bench_folder, tmp_path / "b")
    rows = [json.loads(line) for line in (tmp_path / "b" / "records.jsonl").read_text().splitlines()]
    rows = [{**r, "ci_level": 0.95, "whole": 1.0} for r in rows]
    rows = [sealed(r) for r in rows]  # attnlab writes 1.0; jq writes it 1

    def jq(value):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return {k: jq(v) for k, v in value.items()} if isinstance(value, dict) else value

    (tmp_path / "b" / "records.jsonl").write_text("".join(json.dumps(jq(r)) + "\n" for r in rows))
    assert all(seal_kept(json.loads(line)) for line in (tmp_path / "b" / "records.jsonl").read_text().splitlines())
    assert main(["report", str(tmp_path / "b")]) == 0
    assert seal_kept({**jq(rows[0]), "whole": 2}) is False  # (another number is still a change)


def test_an4_a_record_sealed_before_whole_numbers_were_read_alike_keeps_its_seal():
    import hashlib

    row = {"benchmark": "perplexity", "ppl": 2.0, "tokens": 5}
    legacy = hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest()  # the first seals' digest
    assert seal_kept({**row, SEAL: legacy}) is True and seal_kept({**row, "ppl": 3.0, SEAL: legacy}) is False


def test_an5_a_dry_run_into_a_virtual_file_system_is_refused_as_the_run_is(copy, capsys):
    manifest, _ = copy
    argv = ["run", str(manifest), "--out", "/proc/attnlab-an5", "--no-progress"]
    line = fails(capsys, argv, "/proc/attnlab-an5: no such file or folder, and none can be made there: /proc is on a "
                 "virtual file system")  # fmt: skip
    assert fails(capsys, [*argv, "--dry-run"]) == line


def test_an6_report_on_a_records_file_says_to_put_it_in_a_folder_as_records_jsonl(bench_folder, tmp_path, capsys):
    (tmp_path / "kv").write_bytes((bench_folder / "records.jsonl").read_bytes())  # as `kv-eval --out res/kv` writes
    assert fails(capsys, ["report", str(tmp_path / "kv")], "a file `kv-eval --out` or `kv-tune --out` wrote: put it "
                 "in a folder of its own as records.jsonl, and give that folder")  # fmt: skip
    (tmp_path / "r").mkdir()
    shutil.move(tmp_path / "kv", tmp_path / "r" / "records.jsonl")
    assert main(["report", str(tmp_path / "r")]) == 0


def test_the_plural_refusal_reads_they(copy, capsys):
    """SE08: "cannot tell whether them changed"."""
    manifest, out = copy
    shutil.copytree(out / "m" / "other", out / "m" / "third")
    for path in (_other(out), out / "m" / "third" / "seed0" / "summary.json"):
        path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != SEAL}))
    line = fails(capsys, ["compare", str(out / "m"), "--out", str(out / "c")], "and 1 more: no sha256 in them")
    assert "cannot tell whether they changed" in line
