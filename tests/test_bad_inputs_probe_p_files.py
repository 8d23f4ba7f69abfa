"""Probe P's findings: `attnlab report` drew perplexity records that contradict themselves, a ppl that is not
exp(loss) (r1) and a loss outside its own loss_ci (r3); two exports of different models into one new --hf folder
at once both said they were done, the folder holding only one of them (cc2); a second convert into one new --out
said "checksums.json: Directory not empty" where another command had written --out meanwhile (cc3); and a task
file of lm-eval's --include-path with one Latin-1 byte made its task "unknown", naming neither the file nor its
encoding (le1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import fails, lm_task_folders, lm_task_yaml

from attnlab.data.files import sealed

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ----------------------------------------------------------------------------- cc2: two exports into one new folder


def test_an_export_into_a_folder_another_export_wrote_meanwhile_is_refused(tiny_run, tmp_path, monkeypatch, capsys):
    """cc2: the second export to finish moved the first one's folder aside as an earlier export, put its own there
    and deleted the first's files, both exiting 0. It is refused now, and the other's export stays as it is."""
    from attnlab.interop import export

    out, real, other = tmp_path / "hf", export.write_tokenizer, []

    def another_export_meanwhile(*args, **kwargs):
        if not other:  # this export is writing its temporary folder: another one into the same folder finishes now
            other.append("started")
            export.export_hf(tiny_run, out, "fp16")
        return real(*args, **kwargs)

    monkeypatch.setattr(export, "write_tokenizer", another_export_meanwhile)
    assert fails(capsys, ["export", str(tiny_run), "--hf", str(out)], f"{out}: another command wrote it while this "
                 "export ran", "this export was not put there", "give another folder")  # fmt: skip
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"  # the other export's
    before = snapshot(out)
    assert fails(capsys, ["export", str(tiny_run), "--hf", str(out)], "not empty")
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left behind


# ----------------------------------------------------------------------------- cc3: two converts into one new --out


def test_a_convert_into_an_out_another_command_wrote_meanwhile_says_so(tiny_run, tmp_path, monkeypatch, capsys):
    """cc3: the second convert to finish said "could not write .../cv: checksums.json: Directory not empty; nothing
    was written" (its complete folder could not be renamed over the other's)."""
    from attnlab.interop import export

    out, real = tmp_path / "cv", export.write_tokenizer

    def another_convert_meanwhile(*args, **kwargs):  # (save_conversion writes the tokenizer into its temporary)
        out.mkdir()
        (out / "config.json").write_text("another command's conversion")
        return real(*args, **kwargs)

    monkeypatch.setattr(export, "write_tokenizer", another_convert_meanwhile)
    argv = ["convert", str(tiny_run), "--attention", "kind=mha,n_kv_heads=1", "--eval-tokens", "0", "--out", str(out)]
    assert fails(capsys, argv, f"--out {out}: already exists: another command wrote it while this conversion ran",
                 "this conversion was not saved", "choose another --out")  # fmt: skip
    assert snapshot(out) == {"config.json": b"another command's conversion"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cv"]  # no temporary left behind


# ----------------------------------------------------------------------------- le1: a task file that is not UTF-8


def test_a_task_file_that_is_not_utf8_is_named_with_its_first_such_byte(tiny_run, tmp_path, monkeypatch, capsys):
    """le1: lm-eval skipped the file without a word, and its task was called unknown ("did you mean 'arc_ne'?")."""
    item = {"q": "a cat", "gold": 0, "choices": [" sat", " dog"]}
    tasks, data_folder = lm_task_folders(tmp_path, monkeypatch, lm_task_yaml(), [item])
    latin1 = lm_task_yaml().replace('"{{q}}"', '"Qu\xe9stion: {{q}}"').encode("latin-1")  # one byte 0xe9
    (tasks / "mytask.yaml").write_bytes(latin1)
    offset = latin1.index(b"\xe9")
    argv = ["lm-eval", str(tiny_run), "--tasks", "mytask", "--include-path", str(tasks), "--data-dir",
            str(data_folder), "--out", str(tmp_path / "out")]  # fmt: skip
    line = fails(capsys, argv, f"{tasks / 'mytask.yaml'}: not UTF-8 text (byte 0xe9 at offset "
                 f"{offset}): save it as UTF-8")  # fmt: skip
    assert "unknown" not in line
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------- r1, r3: records that contradict themselves


def perplexity_record() -> dict:
    from attnlab.eval.perplexity import summarize_losses

    windows = [(float(n * (2.6 + 0.05 * i)), n) for i, n in enumerate([6, 8, 5, 7, 8, 6])]
    return {"benchmark": "perplexity", "model": "m", "kind": "mha", "split": "val", **summarize_losses(windows)}


@pytest.mark.parametrize(
    "damage, fragment",
    [
        ({"ppl": 2.0}, "field 'ppl' is 2.0, which is impossible (it is exp(loss) = "),  # r1
        (
            {"loss": 9.0, "ppl": 8103.083927575384},
            "field 'loss' is 9.0, which is impossible (it lies outside its own interval, 'loss_ci' [",
        ),  # r3: ppl = exp(9), so only the interval says it
        ({"ppl_ci": [1.0, 1.5]}, "field 'ppl' is "),
    ],
)
def test_a_perplexity_record_that_contradicts_itself_is_refused(tmp_path, capsys, damage, fragment):
    """r1, r3: a ppl of 2.0 beside a loss of 2.63 (whose exp is 13.9), and a loss outside its own loss_ci, were drawn
    in the tables and plots as they were."""
    folder = tmp_path / "r"
    folder.mkdir()
    rows = [perplexity_record(), {**perplexity_record(), "model": "n", **damage}]
    (folder / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in rows))
    assert fails(capsys, ["report", str(folder)], "record 2 (perplexity, n): ", fragment, "(the file was changed)")
    assert not (folder / "report.md").exists() and not (folder / "tables").exists()


def test_figures_a_record_writes_rounded_still_agree(tmp_path):
    """exp(loss) and the interval are compared within the rounding of the figures as written (66.7 for
    exp(4.2) = 66.686...), and a diverged model's NaN or infinite figures are shown as such."""
    from attnlab.eval.report import build_report

    rounded = {"benchmark": "perplexity", "model": "m", "kind": "mha", "split": "val", "tokens": 64, "loss": 4.2,
               "loss_ci": [4.1, 4.3], "ppl": 66.7, "ppl_ci": [60.3, 73.7]}  # fmt: skip
    from attnlab.eval.perplexity import summarize_losses

    nan_windows = [(float("nan"), 6), (float("nan"), 8), (12.0, 5)]  # NaN windows: a NaN loss, interval and ppl
    diverged = {**perplexity_record(), "model": "d", **summarize_losses(nan_windows)}
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in (rounded, diverged)))
    assert build_report(tmp_path)["markdown"].is_file()
