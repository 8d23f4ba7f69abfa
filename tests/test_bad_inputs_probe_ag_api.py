"""Probe AG's findings on the library API: memory.ingest's replace='no' read as True, replacing a memory (AG1);
generate's callback that is not callable and a prompt on the meta device, tracebacks (AG11); load_config given a
dict, quantize_weights and set_activations given what is no model, open_source given no source or a data_dir of
another type, tracebacks (AG12); build_model of a model far beyond this machine's memory, the allocator's traceback
(AG13); memory.query given cache or kv_policy, a TypeError or a refusal of a cache the user never gave (AG14);
load_model's data_dir naming a file or nothing, read without a word where the CLI refuses both (AG15); decode of a
bool read as id 1 (AG16); train_tokenizer of no text, a tokenizer of its special tokens only (AG17); ingest's
documents given as one str, read as one-character paths (AG18). Each test fails with its fix backed out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import PROBE_MODEL, refused, snapshot, tiny_config, tiny_model

import attnlab
import attnlab.data
import attnlab.memory
from attnlab.errors import DataError
from attnlab.memory import MemoryStore

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


@pytest.fixture(scope="module")
def ingested(streaming_run, tmp_path_factory) -> tuple[MemoryStore, Path]:
    """A store holding memory 'notes' of streaming_run, and its document."""
    folder = tmp_path_factory.mktemp("store")
    doc = folder / "doc1.txt"
    doc.write_text("the cat sat on the mat " * 4)
    store = MemoryStore(folder / "store")
    attnlab.memory.ingest(store, streaming_run, [doc], "notes")
    return store, doc


# ----------------------------------------------------------------------------- AG1: ingest's flags


def test_ag1_ingest_refuses_a_replace_or_progress_that_is_not_true_or_false_touching_nothing(streaming_run, ingested):
    store, doc = ingested
    before = snapshot(store.root)
    for replace in ("no", "false", 0, 1, None):
        assert refused(lambda: attnlab.memory.ingest(store, streaming_run, [doc], "notes", replace=replace),  # noqa: B023
                       f"replace={replace!r} must be True or False")  # fmt: skip
    assert refused(lambda: attnlab.memory.ingest(store, streaming_run, [doc], "n2", progress="yes"),
                   "progress='yes' must be True or False")  # fmt: skip
    assert snapshot(store.root) == before  # the memory is not replaced, no other is made
    assert refused(lambda: MemoryStore(store.root, create="no"), "create='no' must be True or False")
    assert refused(lambda: attnlab.memory.ingest(str(store.root), streaming_run, [doc], "n3"),
                   "store must be a MemoryStore", "got str")  # fmt: skip


# ----------------------------------------------------------------------------- AG18: ingest's documents


def test_ag18_ingest_refuses_documents_that_are_not_a_list_of_paths(streaming_run, ingested):
    store, doc = ingested
    before = snapshot(store.root)
    assert refused(lambda: attnlab.memory.ingest(store, streaming_run, "doc1.txt", "n1"),
                   "documents must be a list of paths, got str 'doc1.txt' (give ['doc1.txt'])")  # fmt: skip
    assert refused(lambda: attnlab.memory.ingest(store, streaming_run, doc, "n1"), "documents must be a list of paths",
                   f"(give [{str(doc)!r}])")  # fmt: skip
    assert refused(
        lambda: attnlab.memory.ingest(store, streaming_run, 5, "n1"), "documents must be a list", "got int 5"
    )
    assert refused(lambda: attnlab.memory.ingest(store, streaming_run, [doc, 5], "n1"), "documents[1] is int 5",
                   "documents must be paths")  # fmt: skip
    assert snapshot(store.root) == before


# ----------------------------------------------------------------------------- AG14: query's own keywords


def test_ag14_query_refuses_the_keywords_it_sets_itself_in_one_line(ingested):
    store, _ = ingested
    said = "query reads the memory's state as the cache"
    assert refused(lambda: attnlab.memory.query(store, "notes", "the", cache=None), said, "cache cannot be given")
    assert refused(lambda: attnlab.memory.query(store, "notes", "the", kv_policy="k=q8_0"), said,
                   "kv_policy cannot be given (leave it out)")  # fmt: skip
    assert refused(lambda: attnlab.memory.query(store, "notes", "the", cache=None, kv_policy="k=q8_0"), said,
                   "cache and kv_policy cannot be given (leave them out)")  # fmt: skip
    assert refused(lambda: attnlab.memory.query(store, "notes", "the", model=None), said, "model cannot be given")
    assert refused(lambda: attnlab.memory.query(store, "notes", "the", fused=True), said, "fused cannot be given")
    answer = attnlab.memory.query(store, "notes", "the", max_new_tokens=2, fused=False, kv_policy=None)
    assert isinstance(answer, str) and len(answer) == 2  # (char tokenizer: one character a token)


# ----------------------------------------------------------------------------- AG11: generate's callback and prompt


def test_ag11_generate_refuses_a_callback_not_callable_and_a_prompt_on_the_meta_device():
    model = tiny_model()
    assert refused(lambda: attnlab.generate(model, [5, 6, 7], 2, callback=5), "callback must be callable",
                   "got int 5")  # fmt: skip
    assert refused(lambda: attnlab.generate(model, torch.tensor([5, 6], device="meta"), 2),
                   "prompt is on device meta; the model is on cpu")  # fmt: skip
    seen = []
    out = attnlab.generate(model, [5, 6, 7], 2, callback=seen.append, compile=False, fused=False)
    assert out.shape == (2,) and len(seen) == 2


# ----------------------------------------------------------------------------- AG12: the wrong kind of object


def test_ag12_api_functions_refuse_the_wrong_kind_of_object_in_one_line(tmp_path):
    assert refused(lambda: attnlab.load_config({"d_model": 32}), "load_config takes the path of a YAML file",
                   "got dict {'d_model': 32}", "attnlab.model_config_from_dict(data)")  # fmt: skip
    assert refused(lambda: attnlab.quantize_weights("model", "q8_0"), "quantize_weights takes a model",
                   "got str 'model'")  # fmt: skip
    model = tiny_model()
    assert refused(lambda: attnlab.quantize_weights((model.cfg, model, None), "q8_0"), "got tuple",
                   "returns (cfg, model, tokenizer): give its model")  # fmt: skip
    assert refused(lambda: attnlab.set_activations(None, "q8"), "set_activations takes a model", "got NoneType None")
    assert refused(lambda: attnlab.data.open_source("tinyshakespeare", 5), "data_dir must be the path of a folder",
                   "got int 5")  # fmt: skip
    assert refused(lambda: attnlab.data.open_source(None, tmp_path), "source must be a dataset name",
                   "tinyshakespeare", "or a file's path, got NoneType None")  # fmt: skip
    text = tmp_path / "t.txt"
    text.write_text("one\n\ntwo\n")
    assert attnlab.data.open_source(text).files == [text]  # a Path still reads
    assert attnlab.set_activations(model, "fp32") is model


# ----------------------------------------------------------------------------- AG13: a model beyond memory


def test_ag13_build_model_refuses_a_model_beyond_this_machines_memory_before_allocating():
    cfg = attnlab.model_config_from_dict({"vocab_size": 16_000_000, "d_model": 65536, "n_layers": 2, "n_heads": 1})
    total = attnlab.param_counts(cfg)["total"]  # (built on the meta device: nothing allocated, not refused)
    for init in (True, False):
        assert refused(lambda: attnlab.build_model(cfg, init=init), f"the model's {total:,} parameters",  # noqa: B023
                       "1,048,576,000,000 in the embedding", "in 2 blocks and the final norm", "TiB in float32",
                       "more than this machine's", "of RAM: make the model smaller")  # fmt: skip
    with torch.device("meta"):
        assert attnlab.build_model(cfg, init=False).embed.weight.device.type == "meta"
    from attnlab.model.transformer import parameter_parts

    small = tiny_config(tie_embeddings=False)
    model = attnlab.build_model(small)
    assert sum(parameter_parts(small).values()) == sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- AG15: load_model's data_dir


def test_ag15_load_model_refuses_a_data_dir_that_is_not_a_folder_as_the_cli_does(streaming_run, tmp_path):
    file = tmp_path / "some_file.yml"
    file.write_text("a: 1\n")
    with pytest.raises(DataError) as caught:
        attnlab.load_model(streaming_run, data_dir=file)
    assert (
        str(caught.value) == f"data_dir={str(file)!r}: a file, not a folder (name the folder that holds the data files)"
    )
    with pytest.raises(DataError) as caught:
        attnlab.load_model(streaming_run, data_dir=tmp_path / "nonexistent")
    assert str(caught.value).endswith("nonexistent': no such folder (name the folder that holds the data files)")
    assert refused(lambda: attnlab.load_model(streaming_run, data_dir=5), "data_dir must be the path of a folder",
                   "got int 5")  # fmt: skip
    assert attnlab.load_model(streaming_run, data_dir=tmp_path)[0].vocab_size == PROBE_MODEL["vocab_size"]


# ----------------------------------------------------------------------------- AG16: decode of bools


def test_ag16_decode_refuses_bools_as_it_refuses_floats():
    train = attnlab.data.train_tokenizer
    tokenizers = [train("char", ["hello"]), train("word", ["hello"]), train("bpe:260", ["hello hello"]),
                  attnlab.data.load_tokenizer("byte")]  # fmt: skip
    for tok in tokenizers:
        assert refused(lambda: tok.decode([True]), "decode takes token ids (whole numbers)", "got bool True")  # noqa: B023
        assert refused(lambda: tok.decode([1, False]), "got bool False")  # noqa: B023
        assert refused(lambda: tok.decode(torch.tensor([True, False])), "got Tensor tensor(True)")  # noqa: B023
        assert tok.decode(iter(tok.encode("hello"))) == "hello"  # ids, even from an iterator, still read


# ----------------------------------------------------------------------------- AG17: train_tokenizer of no text


def test_ag17_train_tokenizer_refuses_texts_that_hold_no_text():
    for name in ("char", "word", "bpe:260"):
        assert refused(lambda: attnlab.data.train_tokenizer(name, []), "texts hold no text to train on (no texts)")  # noqa: B023
        assert refused(lambda: attnlab.data.train_tokenizer(name, iter(["", ""])),  # noqa: B023
                       "texts hold no text to train on (2 texts, every one empty)")  # fmt: skip
    assert attnlab.data.train_tokenizer("char", iter(["", "ab", "c"])).vocab_size == 5  # the text after an empty one
