"""Probe G's findings on the commands that make or measure one model (convert, kv-eval, kv-tune, memory ingest): an
option that would do nothing, a width the source cannot fill, advice that cannot be followed, or a file too large
ends in exit code 2 and one line naming the flag or file and the fix; nothing is written."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import torch
from helpers import fails, tiny_config, tiny_model, train_tiny_run

from attnlab.cli import main
from attnlab.errors import ConfigError
from attnlab.interop.convert import convert_model

MODEL = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 4, "max_seq_len": 64}
MEMORY = {"kind": "bounded", "recent_window": 16, "exact_slots": 4, "summary_slots": 4}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("g_base"), MODEL, steps=4)


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("g_mem"), {**MODEL, "memory": MEMORY}, steps=4)


def convert(run, out, *extra) -> list[str]:
    return ["convert", str(run), "--out", str(out), *extra]


# ---------------------------------------------------------------------------------------------- convert


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--rope-pairs", "high"], ["--rope-pairs high applies to bottleneck/decoupled/mla conversions"]),
        (["--calibration-tokens", "100"], ["--calibration-tokens 100 applies to bottleneck/decoupled/mla"]),
        (["--calibrate-on", "tinyshakespeare"], ["--calibrate-on tinyshakespeare applies to bottleneck/decoupled"]),
        (["--seq-len", "64", "--calibration-tokens", "0"], ["--seq-len 64", "--eval-tokens 0 skips"]),
        (["--dataset", "wikitext2"], ["--dataset wikitext2", "--eval-tokens 0 skips"]),
        # given at their default values: still given, still doing nothing here
        (["--rope-pairs", "energy"], ["--rope-pairs energy applies to bottleneck/decoupled/mla conversions"]),
        (["--seq-len", "512"], ["--seq-len 512", "--eval-tokens 0 skips"]),
    ],
)
def test_convert_options_that_would_do_nothing_are_refused(run, tmp_path, capsys, extra, fragments):
    out = tmp_path / "converted"
    argv = convert(run, out, "--attention", "kind=mha,n_kv_heads=2", "--eval-tokens", "0", *extra)
    assert fails(capsys, argv, *fragments)
    assert not out.exists()


def test_convert_calibrate_on_without_calibration_tokens_is_refused(run, tmp_path, capsys):
    out = tmp_path / "converted"
    argv = convert(run, out, "--attention", "kind=bottleneck,d_attn=16", "--eval-tokens", "0",
                   "--calibration-tokens", "0", "--calibrate-on", "tinyshakespeare")  # fmt: skip
    assert fails(capsys, argv, "--calibrate-on tinyshakespeare does nothing with --calibration-tokens 0")
    assert not out.exists()


def test_convert_calibration_tokens_0_on_an_mha_conversion_is_accepted(run, tmp_path, capsys):
    out = tmp_path / "converted"
    argv = convert(run, out, "--attention", "kind=mha,n_kv_heads=2", "--eval-tokens", "0", "--calibration-tokens", "0")
    assert main(argv) == 0
    assert (out / "config.json").is_file()


def test_convert_seq_len_past_the_models_context_is_refused(run, tmp_path, capsys):
    out = tmp_path / "converted"
    argv = convert(run, out, "--attention", "kind=mha,n_kv_heads=2", "--seq-len", "1000", "--eval-tokens", "200")
    assert fails(capsys, argv, "--seq-len 1000 is more than", "max_seq_len=64", "--seq-len 64 or less")
    assert not out.exists()


def test_a_decoupled_conversion_wider_than_the_source_is_refused():
    cfg = tiny_config()  # 4 heads of 16
    model = tiny_model()
    with pytest.raises(ConfigError, match=r"attention.d_v=128 gives 32 value channels per head.*use at most d_v=64"):
        convert_model(cfg, model, {"kind": "decoupled", "d_sem": 16, "d_geo": 16, "d_v": 128})
    with pytest.raises(ConfigError, match=r"attention.d_sem=64 .* 12 of the source's head_dim 16.*at most d_sem=48"):
        convert_model(cfg, model, {"kind": "decoupled", "d_sem": 64, "d_geo": 16})
    widest = convert_model(cfg, model, {"kind": "decoupled", "d_sem": 48, "d_geo": 16, "d_v": 64})
    values = widest.model.blocks[0].attn.proj.weight[-64:]  # the V rows: none of them all zeros
    assert bool((values.abs().sum(dim=1) > 0).all())


def test_a_sliding_window_that_covers_the_context_is_refused(run, tmp_path, capsys):
    out = tmp_path / "converted"
    argv = convert(run, out, "--attention", "kind=sliding,window=100000", "--eval-tokens", "0")
    assert fails(capsys, argv, "attention.window=100000 is not less than", "max_seq_len=64", "plain mha")
    assert not out.exists()
    with torch.no_grad():  # a window below the context still converts
        assert convert_model(tiny_config(), tiny_model(), {"kind": "sliding", "window": 16}).cfg.attention.window == 16


@pytest.mark.parametrize(("content", "damage"), [(b"PAR1garbage\n", "not a readable parquet file"),
                                                 (b"a\xffb\n", "not UTF-8 text")])  # fmt: skip
def test_a_damaged_calibration_file_is_named_as_damaged_not_missing(run, tmp_path, capsys, content, damage):
    path = tmp_path / ("calib.parquet" if content.startswith(b"PAR1") else "calib.txt")
    path.write_bytes(content)
    out = tmp_path / "converted"
    argv = convert(run, out, "--attention", "kind=bottleneck,d_attn=16", "--calibrate-on", str(path),
                   "--eval-tokens", "0")  # fmt: skip
    line = fails(capsys, argv, f"--calibrate-on {path}", damage, "--calibration-tokens 0")
    assert "was not found" not in line and "--data-dir" not in line
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- --dataset


@pytest.mark.parametrize("kind", ["folder", "device"])
@pytest.mark.parametrize("command", ["kv-eval", "convert"])
def test_a_dataset_that_is_not_a_file_is_said_before_its_splits(run, tmp_path, capsys, kind, command):
    dataset = tmp_path if kind == "folder" else "/dev/null"
    what = "is a folder" if kind == "folder" else "is not a regular file"
    if command == "kv-eval":
        argv = ["kv-eval", str(run), "--policies", "k=q8_0", "--dataset", str(dataset), "--seq-len", "16",
                "--tokens", "32"]  # fmt: skip
    else:
        argv = convert(run, tmp_path / "converted", "--attention", "kind=mha,n_kv_heads=2", "--dataset", str(dataset))
    line = fails(capsys, argv, f"--dataset {dataset}", what)
    assert "split" not in line


def test_fineweb_edu_in_an_evaluation_names_no_config_key(run, tmp_path, capsys, monkeypatch):
    for key in ("ATTNLAB_OFFLINE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    empty = tmp_path / "data"
    empty.mkdir()
    argv = ["kv-eval", str(run), "--policies", "k=q8_0", "--dataset", "fineweb-edu", "--split", "val",
            "--seq-len", "16", "--tokens", "32", "--data-dir", str(empty)]  # fmt: skip
    line = fails(capsys, argv, "fineweb-edu", "reads a whole split", "*.parquet / *.jsonl", "another dataset")
    assert "max_tokens" not in line


def test_a_text_shorter_than_one_window_names_the_file_and_the_given_seq_len(run, tmp_path, capsys):
    doc = tmp_path / "doc1.txt"
    doc.write_text("The quick brown fox. It was a dark night.\n")
    argv = ["kv-tune", str(run), "--budget", "150", "--dataset", str(doc), "--split", "train", "--seq-len", "50",
            "--tokens", "100"]  # fmt: skip
    line = fails(capsys, argv, str(doc), "seq_len 50 inputs", "give a longer text", "seq_len 41 or less")
    assert "seq_len=51" not in line


# ---------------------------------------------------------------------------------------------- kv-tune


def test_kv_tune_on_a_memory_model_refuses_residual_windows_before_measuring(memory_run, capsys):
    """(Given: with no --resids such a model takes 0 alone, probe Y's U6.)"""
    argv = ["kv-tune", str(memory_run), "--budget", "150", "--split", "val", "--seq-len", "32", "--tokens", "64",
            "--resids", "0,32,128"]  # fmt: skip
    line = fails(capsys, argv, "--resids 0,32,128", "memory.kind=bounded", "takes --resids 0")
    assert "kv policy" not in line
    assert "measuring" not in capsys.readouterr().out


def test_kv_tune_on_a_memory_model_refuses_kivi_formats_in_its_own_words(memory_run, capsys):
    """Probe AE's U1: was "kv policy k=kivi2 quantizes 32 tokens together ..." (a candidate it built, no --formats)."""
    argv = ["kv-tune", str(memory_run), "--budget", "150", "--split", "val", "--seq-len", "32", "--tokens", "64",
            "--formats", "q8_0,kivi2"]  # fmt: skip
    line = fails(capsys, argv, "--formats q8_0,kivi2", "memory.kind=bounded", "(kivi2) do not apply", "leave them out")
    assert "kv policy" not in line


def test_kv_tune_picks_a_policy_whose_shown_bytes_fit_the_budget(memory_run, capsys):
    argv = ["kv-tune", str(memory_run), "--budget", "150", "--split", "val", "--seq-len", "32", "--tokens", "64",
            "--resids", "0"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "B/tok@32" in out
    best = re.search(r"best under 150 bytes/token held at seq_len 32 \(column B/tok@32\): (\S+)", out).group(1)
    row = next(line for line in out.splitlines() if line.startswith(best + " "))
    assert float(row.split()[1].replace(",", "")) <= 150


# ---------------------------------------------------------------------------------------------- out of memory


def test_kv_eval_out_of_memory_reading_a_dataset_names_the_file(run, tmp_path, capsys, monkeypatch):
    doc = tmp_path / "huge.txt"
    doc.write_text("a cat sat on the mat\n" * 200)

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr("attnlab.eval.kvquant.eval_tokens", no_memory)
    argv = ["kv-eval", str(run), "--policies", "k=q8_0", "--dataset", str(doc), "--split", "train", "--seq-len", "16",
            "--tokens", "32"]  # fmt: skip
    line = fails(capsys, argv, str(doc), "out of memory reading and tokenizing it", "smaller file")
    assert "train.batch_size" not in line


def test_memory_ingest_out_of_memory_names_the_document(memory_run, tmp_path, capsys, monkeypatch):
    doc = tmp_path / "huge.txt"
    doc.write_text("a cat sat on the mat\n" * 200)

    def no_memory(self, text):
        raise MemoryError

    monkeypatch.setattr("attnlab.data.tokenizers.CharTokenizer.encode", no_memory)
    store = tmp_path / "store"
    argv = ["memory", "ingest", str(memory_run), str(doc), "--name", "sp", "--store", str(store)]
    line = fails(capsys, argv, str(doc), "out of memory reading and tokenizing it", "ingest less text")
    assert "train.batch_size" not in line
    assert not list(store.glob("states/*.safetensors"))


# ---------------------------------------------------------------------------------------------- --out


@pytest.fixture
def locked(tmp_path, monkeypatch) -> Path:
    """A folder this user may not write to, as os.access sees it (the tests run as root, for whom modes do nothing)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != folder and access(path, mode))
    return folder


@pytest.mark.parametrize("command", ["kv-eval", "convert"])
def test_an_out_that_cannot_be_written_is_refused_before_the_work(run, locked, capsys, monkeypatch, command):
    loaded = []
    monkeypatch.setattr("attnlab.cli_models.load_for_eval", lambda *a, **k: loaded.append(a))
    if command == "kv-eval":
        argv = ["kv-eval", str(run), "--policies", "k=q8_0", "--seq-len", "16", "--tokens", "32", "--out",
                str(locked / "records.jsonl")]  # fmt: skip
    else:
        argv = convert(run, locked / "converted", "--attention", "kind=mha,n_kv_heads=2", "--eval-tokens", "0")
    assert fails(capsys, argv, f"--out {locked}", "not writable")
    assert not loaded


def test_convert_removes_the_temporary_folder_a_killed_conversion_left(run, tmp_path, capsys):
    stale = tmp_path / ".converted.999999999.0123456789ab.tmp"
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model.safetensors").write_bytes(b"partial")
    for path in (stale / "sub" / "model.safetensors", stale / "sub", stale):
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    argv = convert(run, tmp_path / "converted", "--attention", "kind=mha,n_kv_heads=2", "--eval-tokens", "0")
    assert main(argv) == 0
    assert not stale.exists() and mine.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted", "notes.txt"]


def test_lm_eval_refuses_an_out_it_cannot_write_before_loading(run, locked, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr("attnlab.eval.lmeval.run_lm_eval", lambda *a, **k: ran.append(a))
    assert fails(capsys, ["lm-eval", str(run), "--tasks", "arc_easy", "--out", str(locked)], f"--out {locked}",
                 "not writable")  # fmt: skip
    assert not ran


def test_out_of_memory_outside_run_gives_no_training_advice(tmp_path, capsys, monkeypatch):
    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr("attnlab.cli.info", exhausted)
    config = tmp_path / "m.yaml"
    config.write_text("vocab_size: 97\nd_model: 32\nn_layers: 1\nn_heads: 2\nmax_seq_len: 64\n")
    line = fails(capsys, ["info", str(config)], "out of memory", "smaller inputs")
    assert "train.batch_size" not in line
