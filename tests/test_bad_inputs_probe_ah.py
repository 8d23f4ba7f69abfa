"""Probe AH's findings (/work/probe_ah/REPORT.md): `memory ingest` read a document given twice twice (AH2); a BPE of
99,999,999,999 ids asked of train_tokenizer aborted the process in the trainer's allocator (AH4; tested just past
the bound, where the trainer still returns); a model took another model's cache (a memory model the plain model's,
its logits off by up to 0.125) without a word (AH5). Each test fails with its fix backed out."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import refused, snapshot

import attnlab
import attnlab.data
import attnlab.memory
from attnlab.errors import ConfigError
from attnlab.memory import MemoryStore

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


def test_ah2_ingest_refuses_a_document_given_twice_touching_nothing(streaming_run, tmp_path, monkeypatch):
    doc = tmp_path / "doc1.txt"
    doc.write_text("the cat sat on the mat " * 4)
    store = MemoryStore(tmp_path / "store")
    attnlab.memory.ingest(store, streaming_run, [doc], "notes")
    before = snapshot(store.root)
    monkeypatch.chdir(tmp_path)
    for documents in ([doc, doc], ["doc1.txt", "./doc1.txt"], [doc, "doc1.txt"]):
        assert refused(lambda documents=documents: attnlab.memory.ingest(store, streaming_run, documents, "twice"),
                       f"documents: {os.path.realpath(doc)} is given twice", "give each document once")  # fmt: skip
    assert snapshot(store.root) == before


def test_ah4_a_bpe_of_more_ids_than_a_model_holds_is_refused_before_training():
    with pytest.raises(ConfigError, match="a byte-level BPE needs 257 to 16,777,216 ids"):
        attnlab.data.train_tokenizer("bpe:16777217", ["ab"])


def test_ah5_a_model_refuses_a_cache_another_model_made():
    config = dict(vocab_size=40, d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
    plain = attnlab.build_model(attnlab.ModelConfig(**config)).eval()
    memory = attnlab.model_config_from_dict({**config, "memory": {"kind": "window", "recent_window": 8}})
    with_memory = attnlab.build_model(memory).eval()
    x = torch.randint(0, 40, (1, 4))
    said = "the cache was made by another model"
    assert refused(lambda: with_memory(x, cache=plain.new_cache(1)), said, "memory none; this one: 1, mha, window")
    assert refused(lambda: plain(x, cache=with_memory.new_cache(1)), said, "memory window; this one: 1, mha, none")
    twin = attnlab.build_model(attnlab.ModelConfig(**config)).eval()  # the same config: its caches fit
    with torch.no_grad():
        logits, _ = twin(x, cache=plain.new_cache(1))
    assert logits.shape == (1, 4, 40)
