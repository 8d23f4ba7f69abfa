"""The probe's findings (issue 13), one CLI case each: a damaged file, an odd value or a fault ends in exit code 2
and one line `attnlab <command>: error: ...` naming what is wrong, and the user's other files are unchanged."""

from __future__ import annotations

import errno
import gzip
import json
import os
import shutil

import pytest
import torch
from helpers import fails, train_tiny_run, unsealed

from attnlab.cli import main
from attnlab.errors import DataError
from attnlab.generate import sample

MODEL = {"vocab_size": 40, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("bad"), MODEL, steps=6)


def copy_run(run, tmp_path):
    target = tmp_path / "runs" / "tiny" / "seed0"
    shutil.copytree(run, target)
    return target


def test_a_damaged_summary_or_metrics_log_is_named(run, tmp_path, capsys):
    copied = copy_run(run, tmp_path)
    (copied / "summary.json").write_text("[]")
    assert fails(capsys, ["compare", str(tmp_path / "runs")], "summary.json", "not a JSON object")
    (copied / "summary.json").write_text(json.dumps({"params": 1, "kv_bytes_per_token_fp16": 2, "val_loss": "abc"}))
    assert fails(capsys, ["compare", str(tmp_path / "runs")], "val_loss='abc' is not a number")
    shutil.copy(run / "summary.json", copied / "summary.json")
    assert fails(capsys, ["compare", str(tmp_path / "runs"), "--baseline", "nope"], "baseline 'nope'")
    with open(copied / "metrics.jsonl", "a") as f:
        f.write("{broken\n")
    assert fails(capsys, ["compare", str(tmp_path / "runs")], "metrics.jsonl: line", "not a JSON object")


def test_a_damaged_records_file_is_named(tmp_path, capsys):
    (tmp_path / "records.jsonl").write_text('{"benchmark": "perplexity"}\n[1, 2]\n')
    assert fails(capsys, ["report", str(tmp_path)], "records.jsonl: line 2")
    (tmp_path / "records.jsonl").write_text('{"model": null, "benchmark": "perplexity"}\n')
    assert fails(capsys, ["report", str(tmp_path)], "records.jsonl: record 1")


def test_nan_weights_are_refused_even_with_a_matching_checksum(run, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from attnlab.data.files import sha256_file

    copied = copy_run(run, tmp_path)
    folder = next((copied / "checkpoints").glob("step-*"))
    weights = load_file(folder / "model.safetensors")
    name = next(iter(weights))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, folder / "model.safetensors", metadata={"attnlab.checksums": "1"})
    sums = json.loads((folder / "checksums.json").read_text())
    entry = sums["files"]["model.safetensors"]
    entry.update(sha256=sha256_file(folder / "model.safetensors"), bytes=(folder / "model.safetensors").stat().st_size)
    (folder / "checksums.json").write_text(json.dumps(sums))
    assert fails(capsys, ["generate", str(copied), "the", "--max-new-tokens", "2"], "NaN or infinity")


@pytest.mark.parametrize("kind", ["latin1", "not-gzip"])
def test_unreadable_data_files_are_named(tmp_path, kind):
    from attnlab.data.sources import file_texts

    path = tmp_path / ("a.txt" if kind == "latin1" else "a.txt.gz")
    path.write_bytes("caf\xe9 au lait\n".encode("latin-1") if kind == "latin1" else b"plain text, not gzip")
    with pytest.raises(DataError, match="a.txt") as error:
        list(file_texts(path))
    assert "\n" not in str(error.value)
    gzip.open(tmp_path / "b.txt.gz", "wt").write("fine\n")  # a real archive reads


def test_odd_values_and_files_are_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert fails(capsys, ["info", str(deep)], "nested too deeply")
    config = tmp_path / "m.yaml"
    config.write_text(
        "vocab_size: 97\nd_model: 64\nn_layers: 2\nn_heads: 4\nmax_seq_len: 64\n"
        "attention: {kind: coda, gate_bias: 1.0e+308}\n"
    )
    assert fails(capsys, ["info", str(config)], "gate_bias", "too large")
    assert fails(capsys, ["kv-tune", "x", "--budget", "10", "--formats", "q8_0,zz"], "'zz' is not a format")
    assert fails(capsys, ["kv-tune", "x", "--budget", "10", "--resids", "a,b"], "--resids")


def test_memory_names_must_be_utf8(run, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("hello")
    assert fails(
        capsys,
        ["memory", "ingest", str(run), str(doc), "--name", "\udcff", "--store", str(tmp_path / "s")],
        "not valid UTF-8",
    )


def test_sampling_at_extreme_settings_stays_a_distribution():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    generator = torch.Generator().manual_seed(0)
    assert sample(logits, 1e-300, None, None, generator).item() == 1  # tends to greedy, never NaN
    assert sample(logits, 1.0, None, 1e-300, generator).item() == 1  # the most likely token always stays


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA has the device")
def test_a_device_this_machine_lacks_is_refused_before_training():
    from attnlab.errors import ConfigError
    from attnlab.train.loop import pick_device

    with pytest.raises(ConfigError, match="train.device=cuda:7: this machine has no CUDA"):
        pick_device("cuda:7")


def test_the_probes_smaller_findings(run, tmp_path, capsys):
    """--out naming a file, a file as the memory store, a target named like a file attnlab writes, an empty bench
    manifest, a negative bootstrap seed; a byte-order mark is not read as text."""
    from attnlab.data.files import open_text

    afile = tmp_path / "afile"
    afile.write_text("x")
    manifest = tmp_path / "m.yml"
    manifest.write_text("name: m\nseeds: [0]\ntargets:\n  base:\n    model: {vocab_size: 64, d_model: 32, n_layers: 1, "
                        "n_heads: 2, max_seq_len: 64}\n    data: {source: tinyshakespeare, tokenizer: char}\n"
                        "    train: {seq_len: 32, batch_size: 2, steps: 2}\n")  # fmt: skip
    assert fails(capsys, ["run", str(manifest), "--out", str(afile), "--dry-run"], "a file, not a folder")
    assert fails(capsys, ["memory", "ls", "--store", str(afile)], "a file, not a memory store folder")
    manifest.write_text(manifest.read_text().replace("  base:", "  compare.md:"))
    assert fails(capsys, ["run", str(manifest), "--dry-run"], "compare.md")
    bench = tmp_path / "b.yml"
    bench.write_text("name: b\ncheckpoints: []\n")
    assert fails(capsys, ["bench", str(bench), "--out", str(tmp_path / "o")], "no benchmarks named")
    assert fails(
        capsys,
        ["probes", "configs/probes/core.yml", str(run), "--seed", "-1", "--out", str(tmp_path / "p")],
        "--seed -1",
    )
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfhello\n")
    with open_text(tmp_path / "bom.txt") as f:
        assert f.read() == "hello\n"
    assert afile.read_text() == "x"


def test_options_that_would_be_ignored_and_unsubstituted_names_are_refused():
    from helpers import tiny_config

    from attnlab.errors import ConfigError
    from attnlab.paths import name_problem

    with pytest.raises(ConfigError, match="rope_semantic needs rope: true"):
        tiny_config({"kind": "decoupled", "d_sem": 16, "d_geo": 32, "rope": False, "rope_semantic": True})
    assert "not substituted" in name_problem("run-${lr}", "target name")


# ------------------------------------------------------------------------------ the second probe's findings


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be created")
def test_an_output_that_cannot_be_created_is_named_not_its_temporary(run, tmp_path, capsys):
    argv = ["kv-eval", str(run), "--policies", "k=q8_0", "--split", "val", "--seq-len", "16", "--tokens", "32"]
    line = fails(capsys, [*argv, "--out", "/proc/attnlab.jsonl"], "/proc/attnlab.jsonl: no such file")
    assert ".tmp" not in line


def test_an_atomic_writes_os_error_names_the_file_not_its_temporary(tmp_path):
    from attnlab.data.files import atomic_path

    target = tmp_path / "out" / "records.jsonl"
    with pytest.raises(OSError) as error, atomic_path(target) as tmp:
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp))
    assert error.value.filename == str(target)
    with pytest.raises(OSError) as error, atomic_path(target):
        raise OSError(errno.ENOSPC, "No space left on device")  # a write() on a full disk names no file
    assert error.value.filename == str(target) and list(target.parent.iterdir()) == []


@pytest.mark.parametrize(
    "damage",
    [b"[1", b'{"a": "b"}', b"", json.dumps({"name": "char", "tokens": ["a", "a"]}).encode(), None],
    ids=["not-json", "not-a-vocabulary", "emptied", "duplicates", "removed"],
)
def test_a_damaged_run_tokenizer_is_refused_never_replaced(run, tmp_path, capsys, damage):
    copied = copy_run(run, tmp_path)
    vocab = copied / "tokenizer" / "vocab.json"
    vocab.unlink() if damage is None else vocab.write_bytes(damage)
    phrase = "missing" if damage is None else "not a valid char tokenizer file"
    assert fails(
        capsys,
        ["generate", str(copied), "the", "--max-new-tokens", "2"],
        f"{vocab}: {phrase}",
        f"delete {copied / 'tokenizer'} to make it again",
    )


def test_compare_refuses_a_summary_whose_loss_is_nan(run, tmp_path, capsys):
    """A run whose loss turns NaN stops there (DivergedError) and writes no summary: a NaN loss in one was written by
    hand (probe AG8; it used to be shown as a diverged run's)."""
    copied = copy_run(run, tmp_path)
    summary = json.loads((copied / "summary.json").read_text()) | {"val_loss": float("nan"), "val_ppl": float("nan")}
    (copied / "summary.json").write_text(json.dumps(unsealed(summary)))  # an older attnlab's: checked by its figures
    assert fails(capsys, ["compare", str(tmp_path / "runs")], "field 'val_loss' is nan, which a run never writes")


def test_a_data_folder_that_is_a_file_is_named(run, tmp_path, capsys, monkeypatch):
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    fix = "a file, not a folder (name the folder that holds the data files)"
    assert fails(capsys, ["generate", str(run), "the", "--data-dir", str(afile)], f"--data-dir {afile}: {fix}")
    monkeypatch.setenv("ATTNLAB_DATA", str(afile))
    assert fails(capsys, ["mc", "piqa", str(run), "--limit", "1"], f"$ATTNLAB_DATA={afile}: {fix}")


def test_a_damaged_or_read_only_memory_index_says_what_to_do(tmp_path, capsys, monkeypatch):
    import sqlite3

    from attnlab.memory.store import Entry, MemoryStore

    store = MemoryStore(tmp_path / "store")
    store.put(Entry("notes", "states/notes.safetensors", [], 1, 1, "hash", "model", "now", "sha"))
    connect = sqlite3.connect  # a read-only index: every connection opened read-only, as the OS would allow
    monkeypatch.setattr(sqlite3, "connect", lambda name, **kw: connect(name.replace("mode=rwc", "mode=ro"), **kw))
    assert fails(
        capsys,
        ["memory", "rm", "notes", "--store", str(store.root)],
        f"{store.index}: read-only (attempt to write "
        f"a readonly database): make {store.root} and its index writable, or choose another store",
    )
    monkeypatch.undo()
    store.index.write_bytes(b"not a database" * 100)
    assert fails(
        capsys,
        ["memory", "ls", "--store", str(store.root)],
        f"{store.index}: not a readable memory index (file is not a database)",
        "restore it from a copy",
    )


def test_usage_errors_name_the_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["list", "extra"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "attnlab list: error: unrecognized arguments: extra (see attnlab list --help)\n"
    with pytest.raises(SystemExit):
        main(["memory", "query", "notes", "hi", "--kv-policy", "k=q8_0"])
    assert capsys.readouterr().err.startswith("attnlab memory query: error: unrecognized arguments: --kv-policy")


def test_a_max_tokens_that_stops_before_any_validation_document_is_named(tmp_path):
    from attnlab.config import DataConfig
    from attnlab.data import prepare
    from attnlab.data.sources import split_of

    docs = [f"document {i}: " + "the cat sat on the mat " * 4 for i in range(40)]
    first = next(doc for doc in docs if split_of(doc, 0.1, 0.0) == "train")  # the budget is spent on it
    (tmp_path / "corpus.txt").write_text("\n\n".join([first, *docs]) + "\n")
    data = DataConfig(source=str(tmp_path / "corpus.txt"), tokenizer="byte", val_fraction=0.1, max_tokens=40)
    with pytest.raises(DataError) as error:
        prepare(data, cache_dir=tmp_path / "cache")
    assert str(error.value) == (
        f"{tmp_path / 'corpus.txt'}: no document fell in the 'val' split before data.max_tokens=40 stopped the "
        "reading (1 training documents read); raise data.max_tokens, or use more, shorter documents (blank-line "
        "separated)"
    )
