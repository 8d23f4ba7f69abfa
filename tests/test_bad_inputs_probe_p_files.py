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
