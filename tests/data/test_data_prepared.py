"""Prepared token files: published WikiText-2 counts, document joining, leak-free splits, dtype, cache, errors."""

import json
import os
import re

import numpy as np
import pytest

from attnlab.config import DataConfig
from attnlab.data import open_prepared, prepare, split_of, token_dtype
from attnlab.data import prepared as prepared_module
from attnlab.data.sources import paragraphs
from attnlab.data.tokenizers import EOS, UNK
from attnlab.errors import DataError

# Published WikiText-2 (v1) counts with one <eos> per line, as pytorch's word_language_model counts them
# (data README), and its article counts (600 / 60 / 60). Documents are joined with one end-of-text token
# *between* them, so each split holds (articles - 1) more tokens than the published count.
PUBLISHED = {"train": 2_088_628, "val": 217_646, "test": 245_569}
ARTICLES = {"train": 600, "val": 60, "test": 60}
UNK_COUNTS = {"train": 54_625, "val": 11_718, "test": 15_218}


def test_wikitext2_word_counts_match_the_published_ones(wikitext_word):
    p = wikitext_word
    assert p.vocab_size == 33_278 + 1  # the published vocabulary (with <eos>) + end-of-text
    assert p.meta["dtype"] == "uint16" and p.split("train").dtype == np.uint16
    for split, published in PUBLISHED.items():
        tokens = p.split(split)
        eot = int((tokens == p.eot_id).sum())
        assert eot == ARTICLES[split] - 1
        assert len(tokens) == published + eot
        assert p.meta["splits"][split] == {**p.meta["splits"][split], "tokens": len(tokens), "documents": eot + 1}
        # valid and test have no word outside the training vocabulary: every <unk> is WikiText's own.
        assert int((tokens == p.tokenizer.ids[UNK]).sum()) == UNK_COUNTS[split]
    assert p.tokenizer.tokens[:3] == [EOS, "=", "Valkyria"]  # pytorch Dictionary ids


def test_end_of_text_sits_between_articles(wikitext_word):
    p, tok = wikitext_word, wikitext_word.tokenizer
    train = np.asarray(p.split("train"))
    at = np.flatnonzero(train == p.eot_id)
    assert train[0] != p.eot_id and train[-1] != p.eot_id
    # Each article ends with a line end and the next starts with its title line " = Title = ".
    assert set(train[at - 1].tolist()) == {tok.ids[EOS]}
    assert set(train[at + 1].tolist()) == {tok.ids["="]}
    second = tok.decode(train[at[0] + 1 : at[0] + 12])
    assert second.startswith("= Tower Building of the Little Rock Arsenal =\n")


def test_meta_records_sources_and_token_files(wikitext_word):
    meta = wikitext_word.meta
    train_source = next(f for f in meta["source_files"] if f["path"].endswith("wiki.train.tokens.xz"))
    assert train_source["sha256"] == "706ddeb595fdf90aa45292dcb3a3a74a2e330738c662b71cf15fd3f27694e392"
    assert (meta["format_version"], meta["split_method"], meta["tokenizer"]["name"]) == (1, "dataset", "word")
    open_prepared(wikitext_word.path, verify=True)  # every .bin's sha256 equals meta.json's


def _documents(p, split):
    """The split's documents, decoded (byte tokenizer: exact) and cut at end-of-text."""
    return p.tokenizer.decode(p.split(split)).split("<|endoftext|>")


def test_hash_split_keeps_validation_text_out_of_training(shakespeare_byte, shared_data):
    p = shakespeare_byte
    train, val = _documents(p, "train"), _documents(p, "val")
    with open(shared_data / "tinyshakespeare" / "input.txt", encoding="utf-8") as f:
        source = list(paragraphs(f))
    assert sorted(train + val) == sorted(source)  # every document once, in exactly one split
    assert not set(train) & set(val)
    assert 0.04 < len(val) / len(source) < 0.06  # val_fraction = 0.05
    assert all(split_of(doc, 0.05, 0.0) == "val" for doc in val)
    train_text = "".join(train)
    assert not [doc for doc in val if len(doc) > 80 and doc in train_text]


def test_hash_split_is_the_same_when_prepared_again(shakespeare_byte, shared_data, tmp_path):
    again = prepare(DataConfig(source="tinyshakespeare", tokenizer="byte"), shared_data, tmp_path, download=False)
    assert again.path != shakespeare_byte.path
    for split in ("train", "val"):
        assert again.meta["splits"][split]["sha256"] == shakespeare_byte.meta["splits"][split]["sha256"]


def test_bpe_is_trained_on_the_training_split_only(tmp_path):
    # A word repeated 300 times in one document becomes a single BPE token -- if the tokenizer sees it.
    base = [f"the cat sat on the mat number {i} and the dog ran to the park {i}\n" for i in range(200)]
    docs = {}
    for word in ("zyxwvut", "qponmlk"):
        for i in range(1000):
            doc = f"{(' ' + word) * 300} {i}\n"
            docs.setdefault((word, split_of(doc, 0.1, 0.0)), doc)
    corpus = base + [docs[("zyxwvut", "val")], docs[("qponmlk", "train")]]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus))
    p = prepare(DataConfig(source=str(path), tokenizer="bpe:400", val_fraction=0.1), cache_dir=tmp_path / "prep")
    tok = p.tokenizer
    assert len(tok.encode(" qponmlk")) == 1  # the training-only word was learned
    assert len(tok.encode(" zyxwvut")) > 1  # the validation-only word was not
    assert (p.path / "tokenizer.json").exists() and tok.name == "bpe:400"


def test_token_dtype_switches_to_uint32_above_65536_ids(tmp_path):
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    docs = [" ".join(f"w{d}x{i}" for i in range(800)) + "\n" for d in range(100)]  # 80,000 distinct words
    path = tmp_path / "many-words.txt"
    path.write_text("\n".join(docs))
    p = prepare(DataConfig(source=str(path), tokenizer="word", val_fraction=0.1), cache_dir=tmp_path / "prep")
    train = p.split("train")
    assert p.vocab_size > 65_536 and p.meta["dtype"] == "uint32" and train.dtype == np.uint32
    assert int(train.max()) > 65_535
    # Ids above 16 bits survive the file: the training documents decode back word for word.
    expected = [word for doc in docs if split_of(doc, 0.1, 0.0) == "train" for word in doc.split()]
    assert p.tokenizer.decode(train).replace("<|endoftext|>", " ").split() == expected


def test_second_prepare_reuses_the_files(shared_data, tmp_path, monkeypatch):
    cfg = DataConfig(source="tinyshakespeare", tokenizer="char")
    first = prepare(cfg, shared_data, tmp_path, download=False)
    files = sorted(first.path.iterdir())
    mtimes = [f.stat().st_mtime_ns for f in files]

    def no_rebuild(*args, **kwargs):
        raise AssertionError("prepared again instead of reusing the folder")

    monkeypatch.setattr(prepared_module, "_build", no_rebuild)
    second = prepare(cfg, shared_data, tmp_path, download=False)
    assert second.path == first.path and second.meta == first.meta
    assert sorted(second.path.iterdir()) == files and [f.stat().st_mtime_ns for f in files] == mtimes
    assert np.array_equal(second.split("val"), first.split("val"))
    # Another split fraction is another folder.
    monkeypatch.undo()
    other = prepare(DataConfig(source="tinyshakespeare", tokenizer="char", val_fraction=0.1), shared_data, tmp_path)
    assert other.path != first.path and len(other.split("val")) > len(first.split("val"))


def test_truncated_token_file_is_a_clear_error(shared_data, tmp_path):
    cfg = DataConfig(source="tinyshakespeare", tokenizer="byte")
    p = prepare(cfg, shared_data, tmp_path, download=False)
    train_bin = p.path / "train.bin"
    size = train_bin.stat().st_size
    with open(train_bin, "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(
        DataError, match=rf"train\.bin is {size - 2:,} bytes.*truncated or corrupt; delete .*{p.path.name}"
    ):
        prepare(cfg, shared_data, tmp_path, download=False)
    with open(train_bin, "r+b") as f:  # the size again, last bytes now zeros: only sha256 sees it
        f.truncate(size)
    with pytest.raises(DataError, match=r"train\.bin: sha256 differs"):
        open_prepared(p.path, verify=True)
    os.remove(train_bin)
    with pytest.raises(DataError, match=r"train\.bin is missing"):
        open_prepared(p.path)


def test_folder_without_meta_is_prepared_again(shared_data, tmp_path):
    cfg = DataConfig(source="tinyshakespeare", tokenizer="byte")
    p = prepare(cfg, shared_data, tmp_path, download=False)
    expected = p.meta["splits"]
    (p.path / "meta.json").unlink()  # as if interrupted before the last write
    (p.path / "train.bin").write_bytes(b"partial")
    again = prepare(cfg, shared_data, tmp_path, download=False)
    assert again.path == p.path and again.meta["splits"] == expected
    assert not [f for f in again.path.iterdir() if f.name.endswith(".tmp")]


def test_max_tokens_cuts_the_training_split(shared_data, tmp_path):
    cfg = DataConfig(source="tinyshakespeare", tokenizer="byte", max_tokens=20_000)
    p = prepare(cfg, shared_data, tmp_path, download=False)
    assert len(p.split("train")) == 20_000
    # The stream stops where the training budget is spent: validation holds the documents seen until then.
    with open(shared_data / "tinyshakespeare" / "input.txt", encoding="utf-8") as f:
        source = list(paragraphs(f))
    train_tokens, seen_val = -1, []  # -1: no <eot> before the first document
    for doc in source:
        if split_of(doc, 0.05, 0.0) == "val":
            seen_val.append(doc)
        else:
            train_tokens += len(doc.encode()) + 1
            if train_tokens >= 20_000:
                break
    assert _documents(p, "val") == seen_val
    with pytest.raises(DataError, match="no 'test' split.*test_fraction"):
        p.split("test")


def test_max_tokens_keeps_a_datasets_own_validation_split_whole(shared_data, tmp_path):
    p = prepare(DataConfig(source="wikitext2", tokenizer="byte", max_tokens=5_000), shared_data, tmp_path)
    counts = {split: entry["tokens"] for split, entry in p.meta["splits"].items()}
    assert counts == {"train": 5_000, "val": 1_121_681 + 59, "test": 1_256_449 + 59}  # README bytes + <eot>s


def test_gpt2_prepared_from_the_offline_files(shared_data, tmp_path):
    p = prepare(DataConfig(source="tinyshakespeare", tokenizer="gpt2"), shared_data, tmp_path, download=False)
    assert (p.vocab_size, p.eot_id, p.meta["dtype"]) == (50_257, 50_256, "uint16")
    val = p.tokenizer.decode(p.split("val")).split("<|endoftext|>")
    byte_level = prepare(DataConfig(source="tinyshakespeare", tokenizer="byte"), shared_data, tmp_path)
    assert val == _documents(byte_level, "val")  # same documents, same split, whatever the tokenizer
    assert json.loads((p.path / "meta.json").read_text())["tokenizer"]["name"] == "gpt2"


def test_missing_dataset_fails_before_writing_anything(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNLAB_DATA", raising=False)
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "nowhere" / "wikitext-2"))):
        prepare(DataConfig(source="wikitext2", tokenizer="byte"), tmp_path / "nowhere", tmp_path / "prep")
    assert not (tmp_path / "prep").exists()
