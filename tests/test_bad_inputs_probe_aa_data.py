"""Probe AA's findings on data and --out (/work/probe_aa/REPORT.md): a --data-dir holding another
tinyshakespeare/input.txt (shortened, empty, binary) trained on the prepared data of the dataset's own file, its
checkpoints naming that file (AA1); a trainer.json whose data.source_files names another file resumed (AA2); the dry
run said "would train" into an --out the run cannot write (AA3); an --out inside attnlab's cache was taken (U2)."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
from pathlib import Path

import pytest
from helpers import dry_run, edit_trainer, fails, snapshot, stop_after_first_checkpoint

from attnlab.cli import main
from attnlab.config import DataConfig
from attnlab.data.prepared import cache_key, folder_name
from attnlab.data.source_identity import named_source_key

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")

TRAIN = ("{seq_len: 16, batch_size: 2, steps: 4, warmup_steps: 1, eval_every: 2, eval_tokens: 32, "
         "checkpoint_every: 2}")  # fmt: skip
DATA = {"source": "tinyshakespeare", "tokenizer": "char", "val_fraction": 0.2}
RUN = Path("m") / "base" / "seed0"


def data_folder(root: Path, words: str) -> Path:
    """root (a --data-dir) holding tinyshakespeare/input.txt: 60 short numbered paragraphs of `words`."""
    (root / "tinyshakespeare").mkdir(parents=True)
    (root / "tinyshakespeare" / "input.txt").write_text("\n\n".join(f"{words} number {i}" for i in range(60)))
    return root


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    """(manifest, --out, --data-dir, cache) of a tinyshakespeare run on a small input.txt of its own, stopped right
    after its step-2 checkpoint (of 4), made once: tests copy --out and the cache."""
    root = tmp_path_factory.mktemp("stopped")
    path = root / "m.yml"
    path.write_text("name: m\nseeds: [0]\ndefaults:\n  model: {d_model: 32, n_layers: 1, n_heads: 2, max_seq_len: 64}\n"
                    f"  data: {json.dumps(DATA)}\n  train: {TRAIN}\ntargets:\n  base: {{}}\n")  # fmt: skip
    data = data_folder(root / "a", "the cat is on the mat and this is the hat")
    with pytest.MonkeyPatch.context() as patch:
        argv = ["run", str(path), "--out", str(root / "out"), "--no-progress", "--data-dir", str(data)]
        stop_after_first_checkpoint(patch, argv)
    return path, root / "out", data, Path(os.environ["XDG_CACHE_HOME"])


@pytest.fixture
def copies(stopped, tmp_path, monkeypatch) -> tuple[Path, Path, Path, Path]:
    """(manifest, --out, --data-dir, prepared folders) of copies of the stopped run and of its cache."""
    path, out, data, cache = stopped
    shutil.copytree(out, tmp_path / "out", symlinks=True)
    shutil.copytree(cache, tmp_path / "cache", symlinks=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return path, tmp_path / "out", data, tmp_path / "cache" / "attnlab" / "prepared"


def source_files(out: Path, step: int) -> dict:
    trainer = out / RUN / "checkpoints" / f"step-{step:06d}" / "trainer.json"
    return json.loads(trainer.read_text())["data"]["source_files"]


def refused_alike(capsys, argv: list[str], *fragments: str) -> str:
    """The run is refused, --out left as it was, and its dry run says it would be with the run's own line: that
    line (after `attnlab run: error: `)."""
    out = Path(argv[argv.index("--out") + 1])
    before = snapshot(out) if out.exists() else None
    printed = dry_run(capsys, [*argv, "--dry-run"])
    line = fails(capsys, argv, *fragments).split("error: ", 1)[1]
    assert printed == f"[1/1] base seed0: would be refused: {line}\n", (printed, line)
    assert (snapshot(out) if out.exists() else None) == before
    return line


# ----------------------------------------------------------------------------- AA1: the files found now


def test_aa1_the_datasets_own_files_keep_their_cache_key_and_others_get_their_own(data_dir, tmp_path):
    """Folders prepared from the shared data stay valid (keyed by the name alone, as before), a decompressed copy of
    WikiText is the same data; a file of other bytes in a dataset's place is keyed by its sum."""
    for source in ("tinyshakespeare", "wikitext2", "wikitext2-nounk"):
        assert named_source_key(source, data_dir) == source
    plain = tmp_path / "plain" / "wikitext-2"
    plain.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        xz = data_dir / "wikitext-2" / f"wiki.{split}.tokens.xz"
        (plain / f"wiki.{split}.tokens").write_bytes(lzma.decompress(xz.read_bytes()))
    assert named_source_key("wikitext2", tmp_path / "plain") == "wikitext2"
    text = (data_dir / "tinyshakespeare" / "input.txt").read_bytes()
    (tmp_path / "short" / "tinyshakespeare").mkdir(parents=True)
    (tmp_path / "short" / "tinyshakespeare" / "input.txt").write_bytes(text[:200_000])
    key = named_source_key("tinyshakespeare", tmp_path / "short")
    assert key.startswith("tinyshakespeare:input.txt=") and len(key) == len("tinyshakespeare:input.txt=") + 64
    data = DataConfig(**DATA)
    assert cache_key(data, tmp_path / "short") != cache_key(data, data_dir)


def test_aa1_another_input_txt_is_prepared_from_itself_and_recorded(copies, tmp_path, capsys):
    """Was: trained on the prepared data of the other input.txt, silently, its checkpoints naming that file."""
    path, _, data, prepared = copies
    other = data_folder(tmp_path / "b", "the dog is in the fog and that is the log")
    argv = ["run", str(path), "--out", str(tmp_path / "fresh"), "--no-progress", "--data-dir", str(other)]
    assert "would train 4 steps" in dry_run(capsys, [*argv, "--dry-run"])
    assert main(argv) == 0
    file = other / "tinyshakespeare" / "input.txt"
    assert source_files(tmp_path / "fresh", 4) == {str(file): hashlib.sha256(file.read_bytes()).hexdigest()}
    assert len(list(prepared.iterdir())) == 2  # the first input.txt's folder, and this one's


@pytest.mark.parametrize("content,said", [(b"", "holds no document (it is empty"), (bytes(range(128, 256)) * 8,
                                          "not UTF-8 text (byte 0x80 at offset 0)")])  # fmt: skip
def test_aa1_an_empty_or_binary_input_txt_is_refused_naming_it_dry_run_alike(copies, tmp_path, capsys, content, said):
    """Was: "would train" and trained on the prepared data of another file."""
    path, _, _, _ = copies
    (tmp_path / "bad" / "tinyshakespeare").mkdir(parents=True)
    (tmp_path / "bad" / "tinyshakespeare" / "input.txt").write_bytes(content)
    argv = ["run", str(path), "--out", str(tmp_path / "fresh"), "--no-progress", "--data-dir", str(tmp_path / "bad")]
    line = refused_alike(capsys, argv, said)
    assert str(tmp_path / "bad" / "tinyshakespeare" / "input.txt") in line
    assert not (tmp_path / "fresh" / RUN).exists()


def test_aa1_a_resume_on_another_input_txt_is_refused_by_the_run_and_its_dry_run(copies, tmp_path, capsys):
    """Was: resumed on the data it was trained on, while the data folder given holds another text."""
    path, out, _, _ = copies
    other = data_folder(tmp_path / "b", "the dog is in the fog and that is the log")
    argv = ["run", str(path), "--out", str(out), "--no-progress", "--data-dir", str(other)]
    before = snapshot(out)
    printed = dry_run(capsys, [*argv, "--dry-run"])
    assert "would be refused" in printed and "the data tinyshakespeare changed since this run started" in printed
    assert "input.txt's sha256 is now" in printed
    fails(capsys, argv, "the data tinyshakespeare changed since this run started")
    assert snapshot(out) == before


def test_aa1_a_folder_under_the_datasets_name_made_from_another_file_is_refused(copies, data_dir, tmp_path, capsys):
    """A folder an older attnlab prepared from another input.txt under the dataset's name (its key then) is not
    taken for the dataset's: its meta.json names the file it was made from."""
    path, _, _, prepared = copies
    (made,) = prepared.iterdir()
    made.rename(prepared / folder_name(DataConfig(**DATA), cache_key(DataConfig(**DATA), data_dir)))
    argv = ["run", str(path), "--out", str(tmp_path / "fresh"), "--no-progress", "--data-dir", str(data_dir)]
    line = refused_alike(capsys, argv, "meta.json: source_files records input.txt sha256 ")
    assert f"but the run reads {data_dir / 'tinyshakespeare' / 'input.txt'} (sha256 86c4e6aa9db7...)" in line
    assert line.endswith("to prepare it again")


# ----------------------------------------------------------------------------- AA2: the checkpoint's record


def test_aa2_a_trainer_json_naming_another_source_file_is_refused_naming_it(copies, capsys):
    """Was: resumed with no word (the splits' sums agree, the source files were not compared)."""
    path, out, data, _ = copies
    checkpoint = out / RUN / "checkpoints" / "step-000002"
    edit_trainer(checkpoint, lambda t: t["data"].update(source_files={"/etc/hostname": "0" * 64}))
    argv = ["run", str(path), "--out", str(out), "--no-progress", "--data-dir", str(data)]
    line = refused_alike(capsys, argv, f"{checkpoint / 'trainer.json'}: data.source_files records /etc/hostname "
                         "(sha256 000000000000...), but the prepared data the run reads was made from "
                         f"{data / 'tinyshakespeare' / 'input.txt'} (sha256 ")  # fmt: skip
    assert "restore the file (or the data) from a copy" in line


def test_aa2_a_data_folder_moved_with_the_same_file_still_resumes(copies, tmp_path, capsys, monkeypatch):
    """The record is compared by sha256 alone: the same file elsewhere (prepared again there too) is the same data."""
    path, out, data, _ = copies
    shutil.copytree(data, tmp_path / "moved")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh-cache"))
    argv = ["run", str(path), "--out", str(out), "--no-progress", "--data-dir", str(tmp_path / "moved")]
    assert "would resume from step 2 of 4" in dry_run(capsys, [*argv, "--dry-run"])
    assert main(argv) == 0
    assert list(source_files(out, 4)) == [str(tmp_path / "moved" / "tinyshakespeare" / "input.txt")]


# ----------------------------------------------------------------------------- AA3, U2: --out


def test_aa3_the_dry_run_refuses_an_out_it_cannot_write_with_the_runs_line(copies, unwritable, capsys):
    """Was: "would train 4 steps into ro/m/base/seed0"; the run refused."""
    path, _, data, _ = copies
    argv = ["run", str(path), "--out", str(unwritable), "--no-progress", "--data-dir", str(data)]
    said = f"{unwritable / 'm'}: permission denied: cannot create it in {unwritable} (make that folder writable"
    assert fails(capsys, [*argv, "--dry-run"], said) == fails(capsys, argv, said)
    assert list(unwritable.iterdir()) == []


def test_u2_an_out_inside_attnlabs_cache_is_refused(copies, capsys):
    """Was: runs written among the prepared data, which clearing the cache deletes."""
    path, _, data, prepared = copies
    before = snapshot(prepared)
    argv = ["run", str(path), "--out", str(prepared), "--no-progress", "--data-dir", str(data)]
    said = f"--out {prepared} is inside attnlab's cache {prepared.parent} (prepared data, downloads, compiled kernels)"
    assert fails(capsys, [*argv, "--dry-run"], said) == fails(capsys, argv, said)
    assert snapshot(prepared) == before and not (prepared / "m").exists()


def test_u2_an_out_inside_a_hugging_face_model_folder_is_one_warning_line(copies, tmp_path, capsys):
    path, _, data, _ = copies
    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"")
    argv = ["run", str(path), "--out", str(export / "runs"), "--dry-run", "--data-dir", str(data)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "would train 4 steps" in captured.out
    assert captured.err.splitlines() == [f"attnlab run: warning: --out {export / 'runs'} is inside {export}, a Hugging "
                                         "Face model folder (config.json, model.safetensors): the runs are mixed with "
                                         "its files; give a folder of their own"]  # fmt: skip
