"""Probe Q's findings (618 cases through the CLI): `memory rm` and `ingest --replace` deleted whatever file a row of
the index named, outside the store too (q1, MEM42-46); an empty `--kv-policy` ran generate and lm-eval with the
full-precision cache without a word (q4, G28/G34/LE11); a run whose last.json was gone started over and deleted its
intact checkpoints (q5)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from helpers import PROBE_MODEL, error_line, train_tiny_run

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
