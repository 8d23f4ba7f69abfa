"""Probe T's files trusted without a check, fixed in session T: a prepared folder's vocab.json (or any tokenizer file)
changed after it was prepared was used as it stood, and saved as the run's tokenizer beside ids made with the other
one (t1); an interrupted run's damaged config.json, config.yaml or tokenizer/ file was written over with no word when
it resumed, where a finished run's damaged config.json is refused (t2). Each is now refused in one line naming the
file."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
from helpers import dry_run, fails, hat_text, probe_manifest, stop_after_first_checkpoint

from attnlab.cli import main
from attnlab.config import DataConfig
from attnlab.data.prepared import default_cache_dir, open_prepared, prepare
from attnlab.errors import AttnlabWarning, DataError

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = "{seq_len: 16, batch_size: 2, steps: 4, lr: 1.0e-3, warmup_steps: 1, eval_every: 4, eval_tokens: 32, " \
        "log_every: 1, checkpoint_every: 2}"  # fmt: skip


def prepared_folder() -> Path:
    """The one prepared folder in the module's own cache."""
    (folder,) = default_cache_dir().iterdir()
    return folder


def swap_tokens(path: Path, a: str = "a", b: str = "e") -> None:
    """Swaps two tokens of a vocab.json: still valid JSON, still a vocabulary of the same size, another mapping."""
    data = json.loads(path.read_text(encoding="utf-8"))
    i, j = data["tokens"].index(a), data["tokens"].index(b)
    data["tokens"][i], data["tokens"][j] = b, a
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


# ----------------------------------------------------------------------------- t1: a prepared tokenizer file changed


def test_a_prepared_vocab_with_two_tokens_swapped_is_refused(tmp_path, capsys):
    """t1: was exit 0, the run trained on the unchanged train.bin and saved the swapped table as its tokenizer."""
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN)
    assert main(["run", str(path), "--out", str(tmp_path / "first"), "--no-progress"]) == 0
    folder = prepared_folder()
    vocab = folder / "vocab.json"
    swap_tokens(vocab)
    damaged = vocab.read_bytes()
    capsys.readouterr()
    out = tmp_path / "second"
    argv = ["run", str(path), "--out", str(out), "--no-progress"]
    line = fails(capsys, argv, f"{vocab}: sha256 differs from meta.json (the tokenizer file was damaged or changed "
                 f"after it was prepared); delete {folder} to prepare it again")  # fmt: skip
    # the dry run opens the prepared folder as the run does (probe U: it said "would train")
    assert dry_run(capsys, [*argv, "--dry-run"]) == f"[1/1] base seed0: would be refused: {line.split('error: ')[1]}\n"
    assert vocab.read_bytes() == damaged  # named, not replaced
    assert not (out / "m" / "base" / "seed0" / "tokenizer").exists()  # refused before anything is written
    shutil.rmtree(folder)
    assert main(argv) == 0


@pytest.mark.parametrize("tokenizer", ["char", "word", "bpe:300"])
def test_a_changed_prepared_tokenizer_file_is_refused_by_the_library(tmp_path, tokenizer):
    data = DataConfig(source=str(hat_text(tmp_path)), tokenizer=tokenizer, val_fraction=0.2)
    folder = prepare(data).path
    files = json.loads((folder / "meta.json").read_text())["tokenizer"]["files"]
    assert set(files) == {"tokenizer.json" if tokenizer.startswith("bpe") else "vocab.json"}
    (name,) = files
    with open(folder / name, "a", encoding="utf-8") as f:
        f.write(" ")  # still valid JSON: a file only its hash tells from the one prepared
    with pytest.raises(DataError, match=f"{name}: sha256 differs from meta.json"):
        _ = open_prepared(folder).tokenizer
    with pytest.raises(DataError, match=f"{name}: sha256 differs from meta.json"):
        prepare(data).verify()  # what the trainer calls before it writes anything
    (folder / name).unlink()
    with pytest.raises(DataError, match=f"{name}: missing, but meta.json records its sha256"):
        open_prepared(folder).verify()
    (folder / name).mkdir()
    with pytest.raises(DataError, match=f"{name} is a folder, not the tokenizer's file meta.json records"):
        open_prepared(folder).verify()


def test_a_prepared_folder_from_before_the_tokenizer_checksums_is_used_with_a_warning(tmp_path, capsys):
    """A folder whose meta.json records no tokenizer files (an older attnlab's) is still read, and says once that
    its tokenizer files cannot be checked."""
    data = DataConfig(source=str(hat_text(tmp_path)), tokenizer="char", val_fraction=0.2)
    folder = prepare(data).path
    meta = json.loads((folder / "meta.json").read_text())
    del meta["tokenizer"]["files"]
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(AttnlabWarning, match=f"{folder}: meta.json records no sha256 of the tokenizer's files"):
        assert open_prepared(folder).tokenizer.vocab_size == meta["vocab_size"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ = open_prepared(folder).tokenizer  # said once per process
    byte = prepare(DataConfig(source=str(hat_text(tmp_path)), tokenizer="byte", val_fraction=0.2))
    meta = json.loads((byte.path / "meta.json").read_text())
    assert meta["tokenizer"]["files"] == {}  # byte saves no file: nothing to check, nothing to warn of
    del meta["tokenizer"]["files"]
    (byte.path / "meta.json").write_text(json.dumps(meta))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ = open_prepared(byte.path).tokenizer


@pytest.mark.parametrize("files", [[], {"vocab.json": "abc"}, {"../vocab.json": "0" * 64}, {"vocab.json": 1}])
def test_a_meta_json_with_a_malformed_tokenizer_files_record_is_named(tmp_path, files):
    data = DataConfig(source=str(hat_text(tmp_path)), tokenizer="char", val_fraction=0.2)
    folder = prepare(data).path
    meta = json.loads((folder / "meta.json").read_text())
    meta["tokenizer"]["files"] = files
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=rf"meta.json: 'tokenizer.files.*; delete {folder} to prepare it again"):
        open_prepared(folder)


# ----------------------------------------------------------------------------- t2: an interrupted run's files


def interrupted_run(tmp_path: Path, monkeypatch) -> tuple[list[str], Path]:
    """(the argv that resumes it, the run's folder) of a run stopped after its first checkpoint (step 2 of 4)."""

    path, out = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN), tmp_path / "out"
    argv = ["run", str(path), "--out", str(out), "--no-progress"]
    stop_after_first_checkpoint(monkeypatch, argv)
    return argv, out / "m" / "base" / "seed0"


def flip_a_byte(path: Path, at: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x20
    path.write_bytes(bytes(data))


def damage_json(path: Path) -> str:
    flip_a_byte(path)  # "{" becomes "[": no longer JSON
    return "unreadable ("


def change_json(path: Path) -> str:
    text = path.read_text()
    path.write_text(text.replace('"lr": 0.001', '"lr": 0.002'))  # a flipped digit: JSON still, another config
    return "train.lr: saved 0.002, now 0.001"


def damage_yaml(path: Path) -> str:
    path.write_text("garbage: [\n")
    return "not valid YAML"


def change_yaml(path: Path) -> str:
    path.write_text(path.read_text().replace("lr: 0.001", "lr: 0.002"))
    return "train.lr: saved 0.002, now 0.001"


@pytest.mark.parametrize(
    "name, damage",
    [("config.json", damage_json), ("config.json", change_json), ("config.yaml", damage_yaml),
     ("config.yaml", change_yaml)],
    ids=["json-damaged", "json-changed", "yaml-damaged", "yaml-changed"],
)  # fmt: skip
def test_a_damaged_config_of_an_interrupted_run_is_refused_not_rewritten(tmp_path, capsys, monkeypatch, name, damage):
    """t2: was exit 0, the file rewritten from the config with no word (a finished run's is refused)."""
    argv, folder = interrupted_run(tmp_path, monkeypatch)
    path = folder / name
    said = damage(path)
    damaged, metrics = path.read_bytes(), (folder / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    fails(capsys, argv, str(path), said, "delete it alone and run again: the run resumes from its last checkpoint "
          "(step 2) and writes it again from that checkpoint's config")  # fmt: skip
    assert path.read_bytes() == damaged and (folder / "metrics.jsonl").read_bytes() == metrics
    dry = ["run", argv[1], "--out", argv[3], "--dry-run"]
    assert main(dry) == 2
    assert f"would be refused: {path}" in capsys.readouterr().out
    path.unlink()
    assert main(argv) == 0
    assert json.loads((folder / "summary.json").read_text())["steps"] == 4
    assert path.exists()


def test_a_damaged_config_of_a_finished_run_is_refused(tmp_path, capsys):
    path = probe_manifest(tmp_path, hat_text(tmp_path), TRAIN)
    argv = ["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 0
    config = tmp_path / "out" / "m" / "base" / "seed0" / "config.json"
    damage_json(config)
    capsys.readouterr()
    fails(capsys, argv, str(config))


def test_a_damaged_tokenizer_file_of_an_interrupted_run_is_refused_not_rewritten(tmp_path, capsys, monkeypatch):
    """t2: the run's tokenizer/vocab.json was saved over from the prepared folder with no word."""
    argv, folder = interrupted_run(tmp_path, monkeypatch)
    vocab = folder / "tokenizer" / "vocab.json"
    swap_tokens(vocab)
    damaged = vocab.read_bytes()
    capsys.readouterr()
    fails(capsys, argv, f"{vocab}: not the file the run was trained with", "delete it alone and run again: the run "
          "resumes from its last checkpoint (step 2) and writes it again from the prepared data")  # fmt: skip
    assert vocab.read_bytes() == damaged
    vocab.unlink()
    assert main(argv) == 0
    assert vocab.exists()


def test_an_interrupted_run_resumes_with_its_files_as_written(tmp_path, capsys, monkeypatch):
    argv, folder = interrupted_run(tmp_path, monkeypatch)
    os.utime(folder / "config.json")
    assert main(argv) == 0
    assert json.loads((folder / "summary.json").read_text())["steps"] == 4


def test_a_checkpoint_write_stopped_short_is_said_without_torch_internals():
    """torch's writer reports a short write as "[enforce fail at inline_container.cc:N] . unexpected pos A vs B": the
    line says what happened and its likely cause, not the C++ file and line nor torch's positions (probes T, V)."""
    from attnlab.data.files import failure_words

    said = failure_words(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 118784 vs 118672"))
    assert said == "the write stopped short (the disk is full, or a file size limit was hit)"
    assert failure_words(OSError(28, "No space left on device")) == "No space left on device"


@pytest.mark.parametrize(
    "name, text", [("c.json", '{"d_model": 32, "d_model": 64}'), ("c.yaml", "d_model: 32\nd_model: 64\n")]
)
def test_a_key_given_twice_is_not_said_as_invalid_yaml(tmp_path, name, text):
    """A duplicate key is valid YAML and JSON (their loaders keep the last value): attnlab refuses it, naming the key
    and both lines, without calling the file invalid YAML (a .json file was said to be "not valid YAML") (probe T)."""
    from attnlab.config_io import load_config
    from attnlab.errors import ConfigError

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    line = str(caught.value)
    assert "key 'd_model' is given twice (first at line 1; keep one)" in line and "not valid YAML" not in line, line


@pytest.mark.parametrize("content", ["", "\n\n   \n\n"])
def test_an_empty_data_file_is_said_to_be_empty(tmp_path, capsys, content):
    """An empty text file (or blank lines only) holds no document: said so, not as an empty 'train' split of 0
    training documents, by the run and by validate (probe T)."""
    from helpers import fails, probe_manifest

    from attnlab.cli import main

    source = tmp_path / "empty.txt"
    source.write_text(content)
    manifest = probe_manifest(tmp_path, source, "{seq_len: 16, batch_size: 2, steps: 1}")
    said = f"{source}: holds no document (it is empty, or blank lines only): give a file with text"
    assert fails(capsys, ["run", str(manifest), "--out", str(tmp_path / "runs"), "--no-progress"]).endswith(said)
    assert main(["validate", str(manifest)]) == 2
    assert capsys.readouterr().err == f"{manifest}: {said}\n"
