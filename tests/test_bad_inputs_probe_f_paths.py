"""Probe F's path findings: a path with a part longer than the file system allows (or longer than PATH_MAX as a
whole) is one line naming it, in every command that reads or writes one, never an OSError traceback."""

from __future__ import annotations

import pytest
from helpers import fails

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = "z" * 300  # more than NAME_MAX (255 bytes) in one part


@pytest.mark.parametrize(
    "argv",
    [
        ["info", f"{LONG}/x.yaml"],
        ["validate", f"{LONG}.yaml"],
        ["generate", f"{LONG}.gguf", "a"],
        ["report", LONG],
        ["run", "tiny.yml", "--out", LONG, "--dry-run"],
        ["memory", "ls", "--store", LONG],
    ],
    ids=["info", "validate", "generate", "report", "run-out", "memory-store"],
)
def test_a_path_part_longer_than_the_file_system_allows_is_one_line(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yml").write_text(
        "name: tiny\ntargets:\n  base:\n    data: {source: tinyshakespeare, tokenizer: char}\n"
        "    model: {d_model: 32, n_layers: 1, n_heads: 2, "
        "max_seq_len: 64}\n    train: {steps: 2, batch_size: 2, seq_len: 16}\n"
    )
    line = fails(capsys, argv, "file name too long", "bytes, more than the file system allows", "give a shorter path")
    assert len(line) < 400  # the 300-byte part is shortened in the line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.yml"]  # nothing made


def test_a_path_longer_than_path_max_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    deep = "/".join(["y" * 200] * 25)  # 5,000+ bytes, each part within NAME_MAX
    assert fails(capsys, ["info", f"{deep}/x.yaml"], "file name too long", "the whole path is", "4096")


def test_first_repeat_names_the_first_value_given_again():
    from attnlab.paths import first_repeat

    assert first_repeat([3, 1, 2, 1, 3]) == 1  # the first one seen again, not the first one that repeats
    assert first_repeat([[8], [16], [8]]) == [8]  # unhashable values (a parameter's list of lists)
    assert first_repeat(["a", "b"]) is None and first_repeat([]) is None
