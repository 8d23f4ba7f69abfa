"""Sources: WikiText article splitting, plain-text/jsonl/parquet documents, hash splits, lookup errors."""

import json
import lzma
import sys

import pytest

from attnlab.data.sources import hash_unit, open_source, paragraphs, split_of, split_wikitext
from attnlab.errors import DataError

WIKI = (
    " \n = First = \n \n Text one . \n \n = = Section = = \n \n More . \n"
    " Key : Pld \n = Played , W = \n Wins \n \n"  # a bare " = X = " line inside a table: not a title
    " = Second = \n \n Text two . \n \n \n = Third = \n \n Last . \n \n"
)


def test_wikitext_splits_at_titles_between_blank_lines():
    docs = split_wikitext(WIKI)
    assert "".join(docs) == WIKI  # nothing lost or duplicated
    assert [doc.split("\n")[1 if i == 0 else 0] for i, doc in enumerate(docs)] == [
        " = First = ",
        " = Second = ",
        " = Third = ",
    ]
    assert " = = Section = = " in docs[0] and " = Played , W = " in docs[0]


def test_wikitext2_valid_has_the_published_60_articles(shared_data):
    with lzma.open(shared_data / "wikitext-2" / "wiki.valid.tokens.xz", "rt", encoding="utf-8") as f:
        text = f.read()
    docs = split_wikitext(text)
    assert len(docs) == 60 and "".join(docs) == text
    assert docs[0].startswith(" \n = Homarus gammarus = \n")


def test_paragraphs_are_separated_by_blank_lines():
    lines = ["a\n", "b\n", "\n", "  \n", "c\n", " \t\n", "d"]
    assert list(paragraphs(lines)) == ["a\nb\n", "c\n", "d\n"]


def test_hash_split_is_stable_and_follows_the_fractions():
    # sha256("hello") = 2cf24dba5fb0a30e...: the unit value is fixed by the text alone, on any machine.
    assert hash_unit("hello") == int("2cf24dba5fb0a30e", 16) / 2**64
    texts = [f"document number {i}" for i in range(20_000)]
    splits = [split_of(t, 0.1, 0.05) for t in texts]
    assert splits == [split_of(t, 0.1, 0.05) for t in texts]
    shares = {s: splits.count(s) / len(texts) for s in ("train", "val", "test")}
    assert shares["val"] == pytest.approx(0.10, abs=0.01) and shares["test"] == pytest.approx(0.05, abs=0.01)
    # A larger val_fraction only moves documents from train/test into val, never out of it.
    wider = [split_of(t, 0.2, 0.05) for t in texts]
    assert all(w == "val" for s, w in zip(splits, wider, strict=True) if s == "val")


def test_local_txt_and_jsonl_sources(tmp_path):
    txt = tmp_path / "notes.txt"
    txt.write_text("one\nline\n\ntwo\n\n\nthree\n")
    docs = [text for _, text in open_source(str(txt), val_fraction=0.0).documents()]
    assert docs == ["one\nline\n", "two\n", "three\n"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["a b", "", "c"])) + "\n")
    assert [t for _, t in open_source(str(jsonl)).documents()] == ["a b", "c"]
    jsonl.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2: no 'text'"):
        list(open_source(str(jsonl)).documents())


def test_parquet_needs_pyarrow(tmp_path, monkeypatch):
    path = tmp_path / "docs.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match="pip install pyarrow"):
        list(open_source(str(path)).documents())


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["first doc", "", "second doc"], "score": [1, 2, 3]}), path)
    assert [t for _, t in open_source(str(path)).documents()] == ["first doc", "second doc"]


def test_wikitext2_raw_names_the_missing_files(shared_data, monkeypatch):
    monkeypatch.delenv("ATTNLAB_DATA", raising=False)
    with pytest.raises(DataError) as info:
        open_source("wikitext2-raw", shared_data, download=False)
    message = str(info.value)
    assert "wiki.train.raw, wiki.valid.raw not found" in message
    assert "found " + str(shared_data / "wikitext-2" / "wiki.test.raw.xz") in message


def test_missing_dataset_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_DATA", str(tmp_path / "env-data"))
    with pytest.raises(DataError) as info:
        open_source("wikitext2", tmp_path / "explicit", download=False)
    message = str(info.value)
    for where in ("explicit/wikitext-2", "env-data/wikitext-2", "xdg-cache/attnlab/wikitext-2"):
        assert where in message
    assert "ATTNLAB_DATA" in message and "allow downloads" in message
    with pytest.raises(DataError, match=r"tinyshakespeare/input\.txt not found .*explicit"):
        open_source("tinyshakespeare", tmp_path / "explicit", download=False)
    with pytest.raises(DataError, match="fineweb-edu: no local files"):
        open_source("fineweb-edu", tmp_path / "explicit", download=False)


def test_unknown_source_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="not a known dataset"):
        open_source("wikitext3", tmp_path)
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown file kind '.csv'"):
        open_source(str(tmp_path / "table.csv"))


def test_wikitext2_nounk_is_v1_without_unk_which_is_the_raw_form(data_dir):
    """v1 and raw share their spacing: every v1 test line without <unk> is the raw line; wikitext2-nounk removes each
    <unk> and the space after it, and keeps the splits and their articles."""
    import lzma

    from attnlab.data.sources import open_source

    def lines(name):
        with lzma.open(data_dir / "wikitext-2" / name, "rt", encoding="utf-8") as f:
            return f.read().split("\n")

    v1, raw = lines("wiki.test.tokens.xz"), lines("wiki.test.raw.xz")
    kept = [(a, b) for a, b in zip(v1, raw, strict=True) if "<unk>" not in a]
    assert len(kept) > 2000 and all(a == b for a, b in kept)
    docs = [text for split, text in open_source("wikitext2-nounk", data_dir, splits=("test",)).documents()]
    plain = [text for split, text in open_source("wikitext2", data_dir, splits=("test",)).documents()]
    assert len(docs) == len(plain) == 60 and not any("<unk>" in d for d in docs)
    assert docs[0] == plain[0].replace("<unk> ", "").replace("<unk>", "")
    assert "Robert is an English film" in docs[0] and "Robert Boulter is" in "\n".join(raw[:5])
