"""Records files: appended atomically, readable by others, rows in order."""

import os

from attnlab.eval.records import append_records, make_record, read_records


def test_append_records_keeps_old_rows_and_leaves_a_shareable_file(tmp_path):
    path = tmp_path / "results" / "records.jsonl"
    previous = os.umask(0o022)
    try:
        assert append_records(path, [make_record("a", value=1)]) == path
        path.write_text(path.read_text().rstrip("\n"))  # an old file without its last newline
        append_records(path, [make_record("b", value=2), make_record("a", value=3)])
    finally:
        os.umask(previous)
    assert [r["value"] for r in read_records(path)] == [1, 2, 3]
    assert [r["value"] for r in read_records(path, "a")] == [1, 3]
    assert path.stat().st_mode & 0o777 == 0o644  # readable by others (a private temporary file would be 0o600)
    assert os.listdir(path.parent) == ["records.jsonl"]
