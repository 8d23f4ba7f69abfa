"""The one atomic writer: a failure at any point leaves the old file (or folder) and no temporary behind."""

import os

import pytest

from attnlab.config import DataConfig
from attnlab.data import files, prepare
from attnlab.errors import DataError


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_a_new_file_replaces_the_old_with_the_usual_permissions(tmp_path, umask_022):
    path = tmp_path / "sub" / "rows.jsonl"
    files.atomic_write_text(path, "first\n")
    path.chmod(0o600)
    files.atomic_write_bytes(path, b"second\n")
    assert path.read_bytes() == b"second\n"
    assert path.stat().st_mode & 0o777 == 0o644  # readable by others, whatever the old file had
    assert os.listdir(path.parent) == ["rows.jsonl"]


def test_a_failure_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"):
        with files.atomic_path(path, durable=True) as tmp:
            assert tmp.parent == path.parent and tmp.name != path.name
            tmp.write_text("half of the new cont")
            raise RuntimeError("interrupted")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["meta.json"]


def test_an_interrupt_mid_write_of_a_new_file_leaves_nothing(tmp_path):
    path = tmp_path / "train.bin"
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_path(path) as tmp:
            tmp.write_bytes(b"\0" * 100)
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_a_folder_is_renamed_whole_or_removed_whole(tmp_path):
    final = tmp_path / "step-000002"
    with pytest.raises(OSError, match="No space left"):
        with files.atomic_path(final) as tmp:
            (tmp / "nested").mkdir(parents=True)
            (tmp / "nested" / "model.safetensors").write_bytes(b"weights")
            raise OSError(28, "No space left on device")
    assert os.listdir(tmp_path) == []
    with files.atomic_path(final) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    assert os.listdir(tmp_path) == ["step-000002"] and (final / "config.json").read_text() == "{}"


def test_a_failed_rename_removes_the_temporary(tmp_path):
    final = tmp_path / "step-000003"
    (final / "kept").mkdir(parents=True)  # a folder cannot replace a folder that holds something
    with pytest.raises(OSError):
        with files.atomic_path(final) as tmp:
            tmp.mkdir()
            (tmp / "new").write_text("x")
    assert os.listdir(tmp_path) == ["step-000003"] and os.listdir(final) == ["kept"]


def test_durable_flushes_every_file_before_the_rename(tmp_path, monkeypatch):
    flushed = []
    real_fsync = os.fsync

    def fsync(fd):
        flushed.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        assert not (tmp_path / "folder").exists()  # before the rename
        real_fsync(fd)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name the flushed files")
    monkeypatch.setattr(os, "fsync", fsync)
    files.atomic_write_text(tmp_path / "plain.txt", "not durable")
    assert flushed == []
    with files.atomic_path(tmp_path / "folder", durable=True) as tmp:
        (tmp / "sub").mkdir(parents=True)
        (tmp / "a.json").write_text("{}")
        (tmp / "sub" / "b.bin").write_bytes(b"b")
    assert sorted(flushed) == ["a.json", "b.bin"]


def test_prepare_failing_midway_leaves_no_token_file_or_temporary(tmp_path):
    corpus = tmp_path / "one.txt"
    corpus.write_text("a single document, so one split stays empty")
    cache = tmp_path / "prepared"
    with pytest.raises(DataError, match=r"no document fell in the '(train|val)' split"):
        prepare(DataConfig(source=str(corpus), tokenizer="byte", val_fraction=0.5), cache_dir=cache, download=False)
    assert not any(cache.iterdir())  # no token file, no temporary, and no empty folder left behind
