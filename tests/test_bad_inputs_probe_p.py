"""Probe P's findings (the helper's 341 cases): a Hugging Face folder whose eos_token_id was 500 of 18 ids, -1 or true
loaded without a word, true making token 1 (' ') the stop token (h1, h2, h14); num_key_value_heads: 0 read as unset
(h15); YAML 1.1's octal 010 and base-60 1:30 read as 8 and 90 (y24, y25, s1, s18); `--set train=null` dropped the
train section and blamed a default (s9); a FIFO as a memory state or a YAML file hung the command (n4, v1, v5-v7); a
folder or FIFO as a prepared token file was called truncated (b10, b11); lm-eval's --limit advised a fraction it
could not take (le2)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from helpers import PROBE_MODEL, at_most, fails, lm_task_folders, lm_task_yaml, train_tiny_run
from test_bad_inputs_probe_b import write_manifest

from attnlab.cli import item_limit, main
from attnlab.config_io import parse_yaml
from attnlab.data.prepared import open_prepared, prepare
from attnlab.errors import DataError

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


@pytest.fixture(scope="module")
def hf_folder(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "model"
    assert main(["export", str(tiny_run), "--hf", str(out)]) == 0
    return out


@pytest.mark.parametrize("value", [500, [-1], True], ids=["past-the-vocabulary", "negative", "true"])
def test_an_eos_token_id_that_is_no_token_is_refused(value, hf_folder, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("eos_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": value}))
    assert fails(capsys, ["generate", str(folder), "the cat", "--max-new-tokens", "2"],
                 f"{folder / 'config.json'}: eos_token_id={json.dumps(value)} is not a token id of the tokenizer",
                 "or remove the key")  # fmt: skip


def test_zero_kv_heads_in_a_config_json_are_zero_not_unset(hf_folder, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(hf_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 0}))
    line = fails(capsys, ["info", str(folder)], str(folder / "config.json"))
    assert "n_kv_heads" in line and "0" in line


@pytest.mark.parametrize(("text", "value"), [("010", 8), ("1:30", 90), ("-07", -7), ("1:30.5", 90.5)])
def test_yaml_numbers_that_read_as_another_number_are_refused(text, value, tmp_path, capsys):
    with pytest.raises(Exception, match=f"reads in YAML 1.1 as .*the number {value}"):
        parse_yaml(f"steps: {text}")
    config = tmp_path / "model.yaml"
    config.write_text(f"vocab_size: 97\nd_model: 64\nn_layers: 2\nn_heads: 4\nmax_seq_len: {text}\n")
    assert main(["validate", str(config)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"{config}: ") and f"{text} reads in YAML 1.1 as" in line and f"the number {value}" in line
    assert parse_yaml("a: [10, 0, -0, 0x1f, 0.5, 00.5]") == {"a": [10, 0, 0, 31, 0.5, 0.5]}  # (1_000: probe Z, U6)


def test_a_set_of_a_whole_section_to_a_value_is_refused(tmp_path, capsys):
    manifest = write_manifest(tmp_path)
    base = ["run", str(manifest), "--dry-run", "--out", str(tmp_path / "runs")]
    fails(capsys, [*base, "--set", "train=null"], "train=null", "train is a section, not a value",
          "--set train.KEY=VALUE")  # fmt: skip
    fails(capsys, [*base, "--set", "train.steps=010"], "010 reads in YAML 1.1 as octal")
    assert main([*base, "--set", "train={steps: 3}"]) == 0


def test_a_fifo_where_a_yaml_file_goes_is_refused_not_waited_on(tmp_path, capsys):
    fifo = tmp_path / "m.yml"
    os.mkfifo(fifo)
    for argv in (["validate", str(fifo)], ["run", str(fifo), "--dry-run"], ["info", str(fifo)]):
        with at_most(20):
            assert main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert str(fifo) in line and "is not a regular file (a FIFO, socket or device)" in line


@pytest.fixture(scope="module")
def bounded_run(tmp_path_factory):
    memory = {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4}
    return train_tiny_run(tmp_path_factory.mktemp("bounded"), {**PROBE_MODEL, "memory": memory}, steps=2)


def test_a_fifo_as_a_memory_state_is_refused_not_waited_on(bounded_run, tmp_path, capsys):
    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("the cat sat on the mat " * 20)
    assert main(["memory", "ingest", str(bounded_run), str(doc), "--store", str(store), "--name", "notes",
                 "--no-progress"]) == 0  # fmt: skip
    (state,) = (store / "states").iterdir()
    state.unlink()
    os.mkfifo(state)
    with at_most(30):
        fails(capsys, ["memory", "query", "notes", "the cat", "--store", str(store), "--max-new-tokens", "2"],
              f"{state}: is a FIFO", "not a memory state file")  # fmt: skip


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_prepared_token_file_of_another_kind_is_named_as_such(kind, tmp_path):
    from attnlab.config import DataConfig

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"the cat sat on mat {i} " * 8 for i in range(40)))
    prepared = prepare(DataConfig(source=str(corpus), tokenizer="char", val_fraction=0.3), cache_dir=tmp_path / "c")
    train = prepared.path / "train.bin"
    train.unlink()
    train.mkdir() if kind == "folder" else os.mkfifo(train)
    with pytest.raises(DataError, match=f"train.bin is a {'folder' if kind == 'folder' else 'FIFO'}.*not a token file"):
        open_prepared(prepared.path)


def test_lm_eval_takes_the_fraction_its_limit_advises(tiny_run, tmp_path, monkeypatch, capsys):
    assert item_limit("3") == 3 and isinstance(item_limit("3"), int) and item_limit("0.5") == 0.5
    items = [{"q": "a cat", "gold": 0, "choices": [" sat", " dog"]}, {"q": "a dog", "gold": 1, "choices": [" x", " y"]}]
    tasks, data_folder = lm_task_folders(tmp_path, monkeypatch, lm_task_yaml(), items)
    argv = ["lm-eval", str(tiny_run), "--tasks", "mytask", "--include-path", str(tasks), "--data-dir", str(data_folder)]
    assert main([*argv, "--limit", "0.5"]) == 0
    for bad in ("nan", "inf", "x"):
        with pytest.raises(SystemExit) as done:
            main([*argv, "--limit", bad])
        assert done.value.code == 2
    assert "is not a number (give N items, or a fraction in (0, 1))" in capsys.readouterr().err
