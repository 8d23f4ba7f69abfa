"""Probe T's files trusted without a check, fixed in session T: a prepared folder's vocab.json (or any tokenizer file)
changed after it was prepared was used as it stood, and saved as the run's tokenizer beside ids made with the other
one (t1). It is now refused in one line naming the file."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from helpers import fails, hat_text, probe_manifest

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
    fails(capsys, argv, f"{vocab}: sha256 differs from meta.json (the tokenizer file was damaged or changed after it "
          f"was prepared); delete {folder} to prepare it again")  # fmt: skip
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
