"""Probe Q's findings (618 cases through the CLI): `memory rm` and `ingest --replace` deleted whatever file a row of
the index named, outside the store too (q1, MEM42-46); an empty `--kv-policy` ran generate and lm-eval with the
full-precision cache without a word (q4, G28/G34/LE11); a run whose last.json was gone started over and deleted its
intact checkpoints (q5); an integer of more than 4,300 digits in a YAML or JSON file or a --set value ended in
Python's ValueError (q2); a path whose bytes are not UTF-8 crashed `run` half-way and `report` (q3); the items of a
one-line arc_easy array were all named `F:1:` (q6); a finished run whose data changed was blamed on
model.vocab_size, or skipped with its old results (q7)."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
from helpers import (
    PROBE_MODEL,
    dry_run,
    edit_one_word,
    error_line,
    fails,
    hat_text,
    probe_manifest,
    snapshot,
    train_tiny_run,
)

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


@pytest.fixture(scope="module")
def bounded_run(tmp_path_factory) -> Path:
    memory = {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4}
    return train_tiny_run(tmp_path_factory.mktemp("bounded"), {**PROBE_MODEL, "memory": memory}, steps=2)


def point_row_at(store: Path, name: str, file: str) -> None:
    with sqlite3.connect(store / "index.sqlite") as index:  # what a hand edit (or a hostile index) does
        index.execute("UPDATE states SET file = ? WHERE name = ?", (file, name))


@pytest.mark.parametrize("outside", ["absolute", "relative"])
def test_memory_rm_and_replace_never_delete_a_file_outside_the_store(bounded_run, tmp_path, capsys, outside):
    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("the cat sat on the mat " * 20)
    ingest = ["memory", "ingest", str(bounded_run), str(doc), "--store", str(store), "--no-progress"]
    assert main([*ingest, "--name", "notes"]) == 0 and main([*ingest, "--name", "other"]) == 0
    victims = [tmp_path / "victim.txt", tmp_path / "victim2.txt"]
    for victim in victims:
        victim.write_text("the user's own file")
    names = [str(v) if outside == "absolute" else f"../{v.name}" for v in victims]
    point_row_at(store, "notes", names[0])
    capsys.readouterr()
    assert main(["memory", "rm", "notes", "--store", str(store)]) == 0
    assert "a file outside the store: left where it is" in capsys.readouterr().out
    assert victims[0].read_text() == "the user's own file"
    assert main(["memory", "query", "notes", "x", "--store", str(store)]) == 2  # the row is gone
    point_row_at(store, "other", names[1])
    detached = sorted((store / "states").iterdir())  # the files the edited rows no longer name
    assert main([*ingest, "--name", "other", "--replace"]) == 0
    assert victims[1].read_text() == "the user's own file"
    assert len(list((store / "states").iterdir())) == 3
    assert main(["memory", "rm", "other", "--store", str(store)]) == 0
    assert sorted((store / "states").iterdir()) == detached  # the store's own file does go


def test_a_row_naming_a_file_outside_the_store_is_refused_when_read(bounded_run, tmp_path, capsys):
    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("the cat sat on the mat " * 20)
    assert main(["memory", "ingest", str(bounded_run), str(doc), "--store", str(store), "--name", "notes",
                 "--no-progress"]) == 0  # fmt: skip
    point_row_at(store, "notes", str(tmp_path / "doc.txt"))
    capsys.readouterr()
    assert main(["memory", "query", "notes", "the cat", "--store", str(store), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "names the file" in err and "not a state file of" in err, err


@pytest.mark.parametrize("command", ["generate", "lm-eval"])
@pytest.mark.parametrize("policy", ["", "  "])
def test_an_empty_kv_policy_is_refused(tiny_run, capsys, command, policy):
    argv = [command, str(tiny_run), "the cat"] if command == "generate" else [command, str(tiny_run), "--tasks", "x"]
    with pytest.raises(SystemExit) as exited:  # argparse's refusal, as for any other bad flag
        main([*argv, "--kv-policy", policy])
    assert exited.value.code == 2
    error_line(capsys, command, "argument --kv-policy: is empty", "leave the flag out")


def test_a_run_whose_pointer_is_gone_is_refused_and_keeps_its_checkpoints(tmp_path):
    import attnlab
    from attnlab.config import DataConfig, TrainConfig
    from attnlab.train import train
    from attnlab.train.checkpoint import CheckpointError

    run = train_tiny_run(tmp_path, PROBE_MODEL, steps=4)
    root = run / "checkpoints"
    folders = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    (root / "last.json").unlink()
    (root / "best.json").unlink(missing_ok=True)
    data = DataConfig(source=str(tmp_path / "text.txt"), tokenizer="char", val_fraction=0.2)
    more = TrainConfig(seq_len=32, batch_size=4, steps=8, eval_every=2, eval_tokens=256)
    with pytest.raises(CheckpointError, match=r"no last.json in .*, but step-000004 is there: to resume from it write"):
        train(attnlab.model_config_from_dict(PROBE_MODEL), data, more, run, progress=False)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == folders


# ----------------------------------------------------------------------------- q2: integers of more than 4,300 digits

BIG = "7" * 5000  # Python converts at most 4,300 digits (sys.get_int_max_str_digits())


def test_a_yaml_integer_too_long_is_refused_at_its_line_and_column(tmp_path, capsys):
    config = tmp_path / "big.yaml"
    config.write_text(f"vocab_size: 40\nd_model: {BIG}\n")
    assert main(["validate", str(config)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = (captured.err + captured.out).strip().splitlines()  # validate: one line per file with problems
    assert len(lines) == 1 and str(config) in lines[0] and "line 2, column 10" in lines[0], lines
    assert "an integer of 5000 digits, far too large for any setting" in lines[0]


def test_a_set_value_too_long_is_refused(tmp_path, capsys):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), "{seq_len: 16, batch_size: 2, steps: 2}")
    line = fails(capsys, ["run", str(manifest), "--set", f"train.steps={BIG}", "--dry-run"],
                 "--set 'train.steps=777", "an integer of 5000 digits, far too large for any setting")  # fmt: skip
    assert "stray quote" not in line  # (quoting would not make it a number of steps)


def test_json_integers_too_long_are_refused_where_they_are():
    from attnlab.jsonio import loads_json

    text = f'{{"text": "{BIG}", "n": 1, "m": -{BIG}}}'  # digits in a string are text, not an integer
    with pytest.raises(json.JSONDecodeError, match="an integer of 5000 digits, far too large") as refused:
        loads_json(text)
    assert refused.value.pos == text.index(f'"m": -{BIG}') + 5
    assert loads_json(f'{{"text": "{BIG}", "x": 1.5, "n": 12}}') == {"text": BIG, "x": 1.5, "n": 12}


def test_an_hf_config_json_integer_too_long_is_named(tmp_path, capsys):
    folder = tmp_path / "h"
    folder.mkdir()
    (folder / "config.json").write_text(f'{{"model_type": "llama", "vocab_size": {BIG}}}')
    assert fails(capsys, ["info", str(folder)], "config.json: not valid JSON", "an integer of 5000 digits", "column 39")


def test_a_records_line_or_a_summary_with_an_integer_too_long_is_named(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "records.jsonl").write_text(f'{{"benchmark": "perplexity"}}\n{{"benchmark": "x", "n": {BIG}}}\n')
    report = ["report", str(tmp_path / "r")]
    assert fails(capsys, report, "records.jsonl: line 2 is not valid JSON", "an integer of 5000")
    run = tmp_path / "runs" / "t" / "seed0"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(f'{{"val_loss": {BIG}}}')
    compare = ["compare", str(tmp_path / "runs")]
    assert fails(capsys, compare, "summary.json", "an integer of 5000 digits, far too large")


def test_a_jsonl_data_source_with_an_integer_too_long_is_named(tmp_path, capsys):
    source = tmp_path / "d.jsonl"
    source.write_text(f'{{"text": "the cat sat"}}\n{{"text": "on the mat", "id": {BIG}}}\n')
    manifest = probe_manifest(tmp_path, source, "{seq_len: 8, batch_size: 1, steps: 1}")
    out = tmp_path / "out"
    fails(capsys, ["run", str(manifest), "--out", str(out), "--no-progress"], f"{source}:2:", "an integer of 5000")
    assert not out.exists()


# ----------------------------------------------------------------------------- q3: paths that are not UTF-8


def test_a_run_into_a_folder_named_in_bytes_that_are_not_utf8_writes_nothing(tmp_path, capsys):
    manifest = probe_manifest(tmp_path, hat_text(tmp_path), "{seq_len: 16, batch_size: 2, steps: 2}")
    out = os.fsdecode(os.fsencode(tmp_path) + b"/runs\xff")
    for dry in ([], ["--dry-run"]):
        fails(capsys, ["run", str(manifest), "--out", out, "--no-progress", *dry],
              "--out ", "runs\\xff is not valid UTF-8 text", "rename the file or folder")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.yml", "text.txt"]  # no folder, no lock


def test_a_report_of_a_folder_or_a_manifest_named_in_bytes_that_are_not_utf8_is_one_line(tmp_path, capsys):
    folder = os.fsencode(tmp_path) + b"/bench\xff"
    os.mkdir(folder)
    with open(folder + b"/records.jsonl", "w") as f:
        f.write('{"benchmark": "perplexity"}\n')
    assert fails(capsys, ["report", os.fsdecode(folder)], "dir ", "bench\\xff", "rename the file or folder")
    manifest = os.fsencode(probe_manifest(tmp_path, hat_text(tmp_path), "{steps: 2}"))
    os.rename(manifest, manifest[:-4] + b"\xff.yml")
    argv = ["run", os.fsdecode(manifest[:-4] + b"\xff.yml"), "--dry-run"]
    assert fails(capsys, argv, "manifest ", "m\\xff.yml is not valid UTF-8")


# ----------------------------------------------------------------------------- q6: the items of a one-line array


def test_the_items_of_a_one_line_arc_file_are_told_apart(tiny_run, tmp_path, capsys):
    good = {"id": "a", "question": "q", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "A"}
    path = tmp_path / "arc.json"
    path.write_text(json.dumps([good, dict(good, id="b"), {k: v for k, v in good.items() if k != "question"}]))
    mc = ["mc", "arc_easy", str(tiny_run), "--file", str(path)]
    assert fails(capsys, mc, f"{path}:1 (item 3): field 'question' is")


# ----------------------------------------------------------------------------- q7: a finished run on changed data

TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 4, eval_tokens: 64, checkpoint_every: 2}"


@pytest.mark.parametrize("edit", ["a new character", "one word"])
def test_a_finished_run_whose_data_changed_is_refused_naming_the_data(tmp_path, capsys, edit):
    text = hat_text(tmp_path)
    manifest, out = probe_manifest(tmp_path, text, TRAIN), tmp_path / "runs"
    command = ["run", str(manifest), "--out", str(out), "--no-progress"]
    assert main(command) == 0
    run_dir = out / "m" / "base" / "seed0"
    if edit == "a new character":  # the char tokenizer's vocabulary grows: model.vocab_size 1 more
        text.write_text(text.read_text() + "\n\nthe zebra")
    else:
        edit_one_word(text)
    before = snapshot(run_dir)
    fix = "restore the data as it was, or train into a new --out (or delete the run's folder to train it again)"
    said = ("text.txt changed since this run was trained", "text.txt's sha256 is now", fix)
    capsys.readouterr()
    for real in (False, True, False):  # dry run before the data is prepared again, the run (preparing it), dry run
        if real:
            line = fails(capsys, command, str(run_dir), *said)
        else:
            line = dry_run(capsys, [*command, "--dry-run"])
            assert "would be refused: " in line and all(fragment in line for fragment in said), line
        assert "another config" not in line and "done already" not in line
    assert snapshot(run_dir) == before
    if edit == "a new character":  # a difference of the config besides the vocabulary is still the config's line
        fails(capsys, [*command, "--set", "train.lr=0.005"], "holds a finished run made with another config")
