"""Probe X's findings: a refused `memory rm` had already deleted the memory's index row, leaving its state file
orphaned (L2; `ingest --replace` had the same order); a GGUF whose tokenizer.ggml.token_type array was shorter than
its tokens was read with the tokens past its end typeless, a control token no longer special (S3)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from helpers import PROBE_MODEL, fails, snapshot, train_tiny_run

from attnlab.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


# ------------------------------------------------------------------ L2: a refused store change changes nothing


@pytest.fixture(scope="module")
def bounded_run(tmp_path_factory) -> Path:
    memory = {"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4}
    return train_tiny_run(tmp_path_factory.mktemp("bounded"), {**PROBE_MODEL, "memory": memory}, steps=2)


def index_rows(store: Path) -> list[tuple]:
    with sqlite3.connect(store / "index.sqlite") as db:
        return db.execute("SELECT * FROM states ORDER BY name").fetchall()


def undeletable(monkeypatch, file: Path) -> None:
    """Deleting `file` fails, as in a folder made read-only (chmod a-w) or for a file made immutable (chattr +i)."""
    unlink = Path.unlink

    def refuse(self, missing_ok=False):
        if Path(self) == file:
            raise PermissionError(13, "Permission denied", str(self))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)


@pytest.fixture
def store(bounded_run, tmp_path) -> Path:
    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("the cat sat on the mat " * 20)
    assert main(["memory", "ingest", str(bounded_run), str(doc), "--name", "d1", "--store", str(store),
                 "--no-progress"]) == 0  # fmt: skip
    return store


def test_l2_a_refused_rm_keeps_the_row_and_its_file(store, capsys, monkeypatch):
    rows, files = index_rows(store), snapshot(store / "states")
    [state] = files
    undeletable(monkeypatch, store / "states" / state)
    capsys.readouterr()
    fails(capsys, ["memory", "rm", "d1", "--store", str(store)], f"{store / 'states' / state}: permission denied")
    assert index_rows(store) == rows and snapshot(store / "states") == files  # nothing changed
    monkeypatch.undo()
    assert main(["memory", "rm", "d1", "--store", str(store)]) == 0  # once it can, rm removes both
    assert index_rows(store) == [] and list((store / "states").iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder chmod made read-only")
def test_l2_rm_in_a_read_only_states_folder_changes_nothing(store, capsys):
    rows, files = index_rows(store), snapshot(store / "states")
    (store / "states").chmod(0o555)
    try:
        fails(capsys, ["memory", "rm", "d1", "--store", str(store)], "permission denied")
    finally:
        (store / "states").chmod(0o755)
    assert index_rows(store) == rows and snapshot(store / "states") == files


def test_l2_a_refused_ingest_replace_keeps_the_old_memory(store, bounded_run, tmp_path, capsys, monkeypatch):
    rows, files = index_rows(store), snapshot(store / "states")
    other = tmp_path / "other.txt"
    other.write_text("a dog by the red door")
    [state] = files
    undeletable(monkeypatch, store / "states" / state)
    capsys.readouterr()
    fails(capsys, ["memory", "ingest", str(bounded_run), str(other), "--name", "d1", "--replace", "--store",
                   str(store), "--no-progress"], "permission denied")  # fmt: skip
    monkeypatch.undo()
    assert index_rows(store) == rows and snapshot(store / "states") == files  # the new state file went too


# ------------------------------------------------- S3: a GGUF per-token array of another length than the tokens


def test_s3_a_gguf_token_type_array_shorter_than_the_tokens_is_refused(tmp_path, capsys):
    pytest.importorskip("gguf")
    from gguf_files import TOKENS, write_gguf

    path = write_gguf(tmp_path / "m.gguf", types=[3] + [1] * 9)  # 10 types for 97 tokens
    assert fails(capsys, ["generate", str(path), "ab", "--max-new-tokens", "1"],
          f"{path}: tokenizer.ggml.token_type holds 10 entries, tokenizer.ggml.tokens {len(TOKENS)} tokens",
          "the file is damaged")  # fmt: skip


@pytest.mark.parametrize(
    "key, extra",
    [
        ("tokenizer.ggml.token_type", lambda n: {"types": [1] * (n + 1)}),  # one more type than tokens
        ("tokenizer.ggml.scores", lambda n: {"extra": lambda writer: writer.add_token_scores([0.0] * (n - 1))}),
    ],
)
def test_s3_any_per_token_array_of_another_length_is_refused(tmp_path, key, extra):
    pytest.importorskip("gguf")
    from gguf_files import TOKENS, write_gguf

    from attnlab.errors import DataError
    from attnlab.interop.references import tokenizer_of

    path = write_gguf(tmp_path / "m.gguf", **extra(len(TOKENS)))
    with pytest.raises(DataError, match=rf"{key} holds [0-9]+ entries, tokenizer\.ggml\.tokens {len(TOKENS)} tokens"):
        tokenizer_of(path)


# ---------------------------------------------------------- info --memory on a model with a memory of its own

MEMORY_MODEL = ("vocab_size: 64\nd_model: 32\nn_layers: 1\nn_heads: 2\nmax_seq_len: 64\n"
                "memory: {kind: bounded, recent_window: 16, exact_slots: 4, summary_slots: 4}\n")  # fmt: skip


def test_info_memory_in_place_of_the_model_s_own_says_so(tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(MEMORY_MODEL)
    assert main(["info", str(config), "--memory", "kind=bounded,recent_window=8,exact_slots=4,summary_slots=4"]) == 0
    captured = capsys.readouterr()
    assert "bounded memory: 16 slots per layer" in captured.out  # the given memory's figures
    [warning] = captured.err.strip().splitlines()
    assert warning == ("attnlab info: warning: --memory replaces this model's own memory (bounded, 24 slots per "
                       "layer) with bounded, 16 slots per layer: the figures are those of the model with the given "
                       "memory (leave out --memory for its own)")  # fmt: skip
    assert main(["info", str(config)]) == 0  # its own, with no word
    captured = capsys.readouterr()
    assert "bounded memory: 24 slots per layer" in captured.out and captured.err == ""
    config.write_text(MEMORY_MODEL.split("memory:")[0])  # a model without a memory: --memory adds one, with no word
    assert main(["info", str(config), "--memory", "kind=window,recent_window=8"]) == 0
    captured = capsys.readouterr()
    assert "window memory: 8 slots per layer" in captured.out and captured.err == ""


def test_info_memory_that_is_the_model_s_own_is_refused(tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(MEMORY_MODEL)
    own = "kind=bounded,recent_window=16,exact_slots=4,summary_slots=4"
    assert fails(capsys, ["info", str(config), "--memory", own],
          "--memory kind=bounded,recent_window=16,exact_slots=4,summary_slots=4 is this model's own memory already "
          "(bounded, 24 slots per layer): it changes nothing; leave out --memory")  # fmt: skip


# ------------------------------------------------------------------ a value given twice in a list-valued flag


def test_bench_benchmarks_named_twice_is_refused(tmp_path, capsys):
    before = snapshot(tmp_path)
    fails(capsys, ["bench", str(tmp_path), "--benchmarks", "perplexity,perplexity", "--out", str(tmp_path / "b")],
          "--benchmarks perplexity,perplexity: holds 'perplexity' twice: give each once")  # fmt: skip
    fails(capsys, ["bench", "--list", "--benchmarks", "needle,memory,needle"],
          "--benchmarks needle,memory,needle: holds 'needle' twice")  # fmt: skip
    assert snapshot(tmp_path) == before


def test_info_devices_naming_a_count_twice_is_refused(tmp_path, capsys):
    config = tmp_path / "model.yaml"
    config.write_text(MEMORY_MODEL.split("memory:")[0])
    assert fails(capsys, ["info", str(config), "--train-memory", "--devices", "1,2,1"],
          "--devices '1,2,1': 1 is given twice: give each once")  # fmt: skip


def test_lm_eval_tasks_naming_a_task_twice_is_refused(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    assert fails(capsys, ["lm-eval", str(tmp_path), "--tasks", "arc_easy,piqa,arc_easy"],
          "--tasks 'arc_easy,piqa,arc_easy': arc_easy is given twice: give each once")  # fmt: skip


# ------------------------------------------------------------ a tokenizer.json vocab giving two tokens one id


def test_a_tokenizer_json_vocab_with_two_tokens_on_one_id_is_refused(tmp_path):
    import json

    from tokenizers import Tokenizer, models

    from attnlab.data.pretrained import tokenizer_from_folder
    from attnlab.errors import DataError

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "c": 3}
    data = json.loads(Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).to_str())
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "[UNK]"}')
    assert tokenizer_from_folder(tmp_path).decode([1, 2, 3]).split() == ["a", "b", "c"]  # as written: read
    data["model"]["vocab"]["b"] = 3  # "b" and "c" on id 3: decoding 3 gives one of them
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"tokenizer\.json: the tokens 'b' and 'c' both have id 3 in model\.vocab"):
        tokenizer_from_folder(tmp_path)
