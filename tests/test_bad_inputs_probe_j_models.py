"""Probe J's findings in loading and running models: an HF config.json whose rope_theta and
rope_parameters.rope_theta disagree loaded with one of them without a word; --chat on a local folder named as
`hf:<folder>`; a run whose tokenizer/ folder is gone re-fitting its tokenizer on text that has changed since and
generating with other ids; a memory whose model folder moved not pointing at --model; --top-k, --top-p and --seed
silently ignored without --temperature (greedy); a decoupled conversion refused over d_v, which the user never
gave; and generated text that stdout's encoding cannot hold ending in a UnicodeEncodeError traceback. Each ends in
one line naming the value, file or flag and the fix, or does what it says."""

from __future__ import annotations

import importlib
import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import PROBE_MODEL, fails, train_tiny_run

import attnlab
from attnlab.cli import main
from attnlab.config_io import model_config_from_dict
from attnlab.data.prepared import default_cache_dir
from attnlab.errors import ConfigError, InputError
from attnlab.interop.hf import config_from_hf

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

generate_module = importlib.import_module("attnlab.generate")  # the module (attnlab.generate is the function)
MEMORY_MODEL = {**PROBE_MODEL, "n_heads": 4, "attention": {"kind": "coda", "n_kv_heads": 2},
                "memory": {"kind": "bounded", "recent_window": 16, "exact_slots": 4, "summary_slots": 4}}  # fmt: skip
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 40, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}  # fmt: skip


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    # Each command loads its model anew: compiling its decode step would cost seconds per call, for nothing here.
    monkeypatch.setattr(generate_module, "can_compile_on_cpu", lambda: False)


@pytest.fixture(scope="module")
def run(tiny_run):
    return tiny_run


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory) -> Path:
    """A tiny trained run whose model has a bounded memory."""
    return train_tiny_run(tmp_path_factory.mktemp("memory"), MEMORY_MODEL, steps=4)


def ingested(folder: Path, model: Path) -> Path:
    """A store under `folder` holding the memory 'notes' of `model`."""
    doc, store = folder / "doc.txt", folder / "store"
    doc.write_text("the cat sat on the mat by the red door")
    assert main(["memory", "ingest", str(model), str(doc), "--name", "notes", "--store", str(store)]) == 0
    return store


@pytest.fixture(scope="module")
def memory_store(memory_run, tmp_path_factory) -> Path:
    return ingested(tmp_path_factory.mktemp("store"), memory_run)


def exported(run: Path, folder: Path, capsys) -> Path:
    assert main(["export", str(run), "--hf", str(folder)]) == 0
    capsys.readouterr()
    return folder


# ----------------------------------------------------------------------------- j5


def test_rope_theta_that_disagrees_with_rope_parameters_is_refused(run, tmp_path, capsys):
    """transformers takes rope_parameters' theta silently; attnlab said nothing either and loaded 10000."""
    both = {**HF_CONFIG, "rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    with pytest.raises(ConfigError, match=r"rope_theta=500000.0 and rope_parameters.rope_theta=10000.0 disagree"):
        config_from_hf(both)
    agreeing = {**both, "rope_theta": 10000}  # the same value, written as an int: one theta
    assert config_from_hf(agreeing).rope_base == 10000.0
    only_parameters = {**HF_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert config_from_hf(only_parameters).rope_base == 500000.0  # not the class default (10000) beside it
    nulled = {**HF_CONFIG, "rope_theta": 20000.0, "rope_parameters": {"rope_type": "default", "rope_theta": None}}
    assert config_from_hf(nulled).rope_base == 20000.0  # a null is an absent field (was a TypeError)

    folder = exported(run, tmp_path / "hf", capsys)  # export writes both spellings, which agree
    assert main(["info", str(folder)]) == 0
    capsys.readouterr()
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 500000.0
    (folder / "config.json").write_text(json.dumps(config))
    assert fails(capsys, ["info", str(folder)], "config.json", "rope_theta=500000.0",
                 "rope_parameters.rope_theta=10000.0", "disagree")  # fmt: skip


# ----------------------------------------------------------------------------- j6


def test_chat_on_a_local_folder_names_the_folder_as_given(run, tmp_path, capsys, monkeypatch):
    exported(run, tmp_path / "myexport", capsys)
    monkeypatch.chdir(tmp_path)
    line = fails(capsys, ["generate", "./myexport", "ab", "--chat", "--max-new-tokens", "2"],
                 "./myexport: the model has no chat template", "leave it out")  # fmt: skip
    assert "hf:" not in line  # it is no Hub reference
    assert fails(capsys, ["generate", str(run), "ab", "--chat"], f"{run}: the model has no chat template")


# ----------------------------------------------------------------------------- j7


def drop_prepared(corpus: Path) -> None:
    """Deletes the prepared data made from `corpus` (this module's cache only)."""
    for meta in default_cache_dir().glob("*/meta.json"):
        if json.loads(meta.read_text())["data"]["source"] == str(corpus):
            shutil.rmtree(meta.parent)


@pytest.mark.parametrize(("change", "named"), [
    (lambda text: text.replace("g", ""), "vocab_size"),  # fewer characters
    (lambda text: text.replace("g", "G"), "vocab.json"),  # as many, other ones
], ids=["fewer-characters", "other-characters"])  # fmt: skip
def test_a_tokenizer_fitted_again_on_changed_text_is_refused(tmp_path, capsys, change, named):
    run = train_tiny_run(tmp_path, PROBE_MODEL, steps=2)
    corpus = tmp_path / "text.txt"
    command = ["generate", str(run), "a cat", "--max-new-tokens", "6"]
    assert main(command) == 0
    before = capsys.readouterr().out
    shutil.rmtree(run / "tokenizer")
    drop_prepared(corpus)
    assert main(command) == 0  # fitted again on the same text: the same tokenizer, the same text out
    assert capsys.readouterr().out == before
    corpus.write_text(change(corpus.read_text()))
    drop_prepared(corpus)
    line = fails(capsys, command, str(run), "tokenizer/ folder is gone", named, "restore tokenizer/")
    assert str(corpus) in line


# ----------------------------------------------------------------------------- j9


def test_a_memory_whose_model_moved_says_to_give_model(memory_run, tmp_path, capsys):
    model = tmp_path / "first" / "seed0"
    shutil.copytree(memory_run, model)
    store = ingested(tmp_path, model)
    moved = tmp_path / "moved" / "seed0"
    moved.parent.mkdir()
    model.rename(moved)
    query = ["memory", "query", "notes", "the ", "--store", str(store), "--max-new-tokens", "2"]
    assert fails(capsys, query, "memory 'notes' was made with", str(model), "which is gone", "--model")
    assert main([*query, "--model", str(moved)]) == 0


def test_a_memory_records_where_a_data_directory_model_was_found(memory_run, tmp_path, monkeypatch, capsys):
    """Found by the lead beside j9: a model named relative to the data directory was recorded relative to the
    working directory of the ingest (and hf:ORG/NAME as <cwd>/hf:ORG/NAME), so a later query could not find it."""
    data = tmp_path / "data"
    shutil.copytree(memory_run, data / "models" / "mem")
    doc, store = tmp_path / "doc.txt", tmp_path / "store"
    doc.write_text("the cat sat on the mat by the red door")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ingest = ["memory", "ingest", "models/mem", str(doc), "--name", "notes", "--store", str(store)]
    assert main([*ingest, "--data-dir", str(data)]) == 0
    monkeypatch.chdir(tmp_path)
    assert main(["memory", "query", "notes", "the ", "--store", str(store), "--max-new-tokens", "2"]) == 0
    capsys.readouterr()


# ----------------------------------------------------------------------------- j10


@pytest.mark.parametrize(("flags", "named"), [
    (["--top-k", "40"], "--top-k 40 only applies when sampling"),
    (["--top-p", "0.5", "--seed", "7"], "--top-p 0.5, --seed 7 only apply"),
    (["--temperature", "0", "--top-k", "3"], "--top-k 3 only applies"),
    (["--seed", "1"], "--seed 1 only applies"),
], ids=["top-k", "top-p-seed", "temperature-0", "seed"])  # fmt: skip
def test_sampling_flags_without_a_temperature_are_refused(run, memory_store, capsys, flags, named):
    assert fails(capsys, ["generate", str(run), "the", *flags], named, "--temperature > 0")
    query = ["memory", "query", "notes", "the", "--store", str(memory_store)]
    assert fails(capsys, [*query, *flags], named, "--temperature > 0")


def test_sampling_arguments_of_a_greedy_generate_are_refused(run, capsys):
    model = attnlab.load_model(run)[1]
    with pytest.raises(InputError, match=r"top_k=5, seed=0 only apply when sampling: give temperature > 0"):
        attnlab.generate(model, [1, 2], max_new_tokens=2, top_k=5, seed=0)
    with pytest.raises(InputError, match=r"top_p=0.9 only applies"):
        attnlab.generate(model, [1, 2], max_new_tokens=2, temperature=0.0, top_p=0.9)
    # With a temperature they sample, reproducibly.
    command = ["generate", str(run), "the", "--temperature", "1", "--top-k", "5", "--seed", "1",
               "--max-new-tokens", "8"]  # fmt: skip
    assert main(command) == 0
    first = capsys.readouterr().out
    assert main(command) == 0
    assert capsys.readouterr().out == first


# ----------------------------------------------------------------------------- j16


def test_a_decoupled_attention_does_not_name_an_unset_d_v(run, tmp_path, capsys):
    model = {**PROBE_MODEL, "attention": {"kind": "decoupled", "d_sem": 4, "d_geo": 7}}
    with pytest.raises(ConfigError) as raised:
        model_config_from_dict(model)
    assert "attention.d_geo=7" in str(raised.value) and "d_v" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"attention.d_v=7 must be a positive multiple"):  # given, it is named
        model_config_from_dict({**PROBE_MODEL, "attention": {"kind": "decoupled", "d_sem": 4, "d_geo": 8, "d_v": 7}})
    line = fails(capsys, ["convert", str(run), "--attention", "kind=decoupled,d_sem=4,d_geo=7", "--out",
                          str(tmp_path / "c"), "--eval-tokens", "0", "--calibration-tokens", "0"],
                 "attention.d_geo=7 must be a positive multiple of n_heads=2")  # fmt: skip
    assert "d_v" not in line


# ----------------------------------------------------------------------------- j20


def narrow_stdout(monkeypatch, encoding: str) -> io.TextIOWrapper:
    """sys.stdout as PYTHONIOENCODING=<encoding> makes it (strict errors)."""
    stream = io.TextIOWrapper(io.BytesIO(), encoding=encoding, errors="strict")
    monkeypatch.setattr(sys, "stdout", stream)
    return stream


def written(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("latin-1")


def test_text_stdout_cannot_encode_is_escaped_not_a_traceback(run, memory_store, capsys, monkeypatch):
    stream = narrow_stdout(monkeypatch, "ascii")
    assert main(["generate", str(run), "the \u2713", "--max-new-tokens", "2"]) == 0
    assert written(stream).startswith("the \\u2713")
    assert stream.errors == "strict"  # as it was
    assert "<unk>" in capsys.readouterr().err  # the one warning: the character the vocabulary lacks

    stream = narrow_stdout(monkeypatch, "latin-1")
    assert main(["memory", "query", "notes", "the \u2713", "--store", str(memory_store), "--max-new-tokens", "2"]) == 0
    assert written(stream).startswith("the \\u2713")
