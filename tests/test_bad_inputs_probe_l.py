"""Probe L's findings (issue 13): each one line naming what is wrong and how to fix it."""

from __future__ import annotations

import random

import pytest

from attnlab.data.sources import file_texts
from attnlab.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
WORDS = "the cat sat on a mat while dogs ran over green hills and birds sang in tall old trees".split()


def write_parquet(path, texts, **options):
    pq.write_table(pa.table({"text": texts}), path, **options)
    return path


def test_a_parquet_file_damaged_inside_a_compressed_page_is_one_line(tmp_path):
    """l5: flipped bytes inside a snappy page raised pyarrow's OSError ("Corrupt snappy compressed data.") with a
    traceback, where a cut-short file got one line."""
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(400)]
    good = write_parquet(
        tmp_path / "good.parquet", texts, row_group_size=100, use_dictionary=False, compression="snappy"
    )
    data = bytearray(good.read_bytes())
    middle = len(data) // 3
    data[middle] ^= 0xFF
    data[middle + 1] ^= 0xFF
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file \(.*\); replace the file"):
        list(file_texts(bad))


def test_null_cells_of_a_parquet_text_column_are_refused_naming_the_row(tmp_path):
    """l6: null cells were dropped without a word, where a .jsonl {"text": null} is refused naming its line."""
    path = write_parquet(tmp_path / "docs.parquet", ["one", None, "three", None])
    with pytest.raises(DataError, match=r"docs\.parquet: row 1 of column 'text' is null \(2 of 4 rows\): give every "
                                        r"row a text \(an empty string for none\), or drop those rows"):  # fmt: skip
        list(file_texts(path))
    assert list(file_texts(write_parquet(tmp_path / "fine.parquet", ["one", "", "three"]))) == ["one", "three"]
