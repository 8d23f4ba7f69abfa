"""Probe AF's findings on the library API (/work/probe_af/REPORT.md): the model's forward given a cache of another
batch or not a cache (AF10); new_cache's sizes, device (AF11) and dtype (AF12); tokenizers' encode and decode of what
is not text or token ids (AF15); API functions given the wrong kind of object (AF13); generate's compile (AF18);
memory.save_state to a folder (AF14); train_tokenizer's texts and vocabulary (AF16); open_source's fractions (AF17).
Each test fails with its fix backed out."""

from __future__ import annotations

import pytest
import torch
from helpers import refused, tiny_model

import attnlab
import attnlab.memory
from attnlab.errors import ConfigError, VocabularyWarning

pytestmark = pytest.mark.usefixtures("one_thread", "own_cache")


# ----------------------------------------------------------------------------- AF10: forward's cache


def test_af10_forward_refuses_a_cache_of_another_batch_or_no_cache_in_one_line():
    model = tiny_model()
    cache = model(torch.tensor([[5, 6]]))[1]
    assert refused(lambda: model(torch.tensor([[5], [6]]), cache=cache), "made for batch 1", "tokens has batch 2",
            "model.new_cache(2)")  # fmt: skip
    assert refused(lambda: model(torch.tensor([[5]]), cache="abc"), "cache must be a ModelCache", "got str")
    assert model(torch.tensor([[7]]), cache=cache)[0].shape == (1, 1, 97)  # its own batch still reads on


# ----------------------------------------------------------------------------- AF11, AF12: new_cache's arguments


def test_af11_new_cache_refuses_sizes_and_devices_it_cannot_make_in_one_line():
    model = tiny_model()  # max_seq_len 64, no memory
    assert refused(lambda: model.new_cache(1, 10**9), "max_len=1000000000", "max_seq_len=64", "at most 64")
    assert refused(lambda: model.new_cache(1, 16.5), "max_len=16.5", "whole number")
    assert refused(lambda: model.new_cache(0, 16), "batch=0", ">= 1")
    assert refused(lambda: model.new_cache(True, 16), "batch=True")
    assert refused(lambda: model.new_cache(1, 16, device="tpu"), "device='tpu'", "not a torch device")
    assert model.new_cache(2, 64).batch == 2


def test_af12_new_cache_refuses_a_dtype_that_is_not_floating():
    model = tiny_model()
    assert refused(lambda: model.new_cache(1, 16, dtype=torch.int32), "dtype=torch.int32", "floating dtype")
    cache = model.new_cache(1, 16, dtype=torch.float32)
    ref = model(torch.tensor([[5, 6, 7, 8]]))[0]
    assert torch.allclose(model(torch.tensor([[5, 6, 7, 8]]), cache=cache)[0], ref, atol=1e-5)


# ----------------------------------------------------------------------------- AF15: tokenizer encode and decode


def test_af15_tokenizers_refuse_what_is_not_text_or_token_ids_in_one_line():
    train = attnlab.data.train_tokenizer
    tokenizers = [train("char", ["hello"]), train("word", ["hello"]), attnlab.data.load_tokenizer("byte")]
    for tok in [*tokenizers, train("bpe:260", ["hello hello"])]:
        assert refused(lambda: tok.encode(5), "encode takes a str", "got int 5")  # noqa: B023
        assert refused(lambda: tok.encode_batch("abc"), "texts must be a list of strings", "give [text]")  # noqa: B023
        assert refused(lambda: tok.decode("abc"), "decode takes a sequence of token ids", "got str 'abc'")  # noqa: B023
        assert refused(lambda: tok.decode([1, 2.5]), "token ids (whole numbers)", "got float 2.5")  # noqa: B023
        assert refused(lambda: tok.decode([1, -1]), "token id -1 is negative")  # noqa: B023
        assert tok.decode(torch.tensor(tok.encode("hello"))) == "hello"  # a 1-D tensor of ids still reads
    byte = attnlab.data.load_tokenizer("byte")
    assert byte.decode([104, 256, 100000]) == "h<|endoftext|>\ufffd"  # past the vocabulary: not end-of-text


# ----------------------------------------------------------------------------- AF13: the wrong kind of object


def test_af13_api_functions_refuse_the_wrong_kind_of_object_in_one_line():
    assert refused(lambda: attnlab.kv_report({"d_model": 32}, "fp16", 16), "kv_report takes a ModelConfig",
            "got dict {'d_model': 32}", "model_config_from_dict")  # fmt: skip
    assert refused(lambda: attnlab.param_counts("configs/models/tiny-mha.yaml"),
                   "param_counts takes a ModelConfig or a model", "got str 'configs/models/tiny-mha.yaml'",
                   "attnlab.load_config(path)")  # fmt: skip
    assert refused(lambda: attnlab.build_model({"d_model": 32}), "build_model takes a ModelConfig", "got dict")
    assert refused(lambda: attnlab.load_model(5), "model reference must be a path or a name", "got int 5")
    assert refused(lambda: attnlab.data.load_tokenizer(None), "tokenizer name must be a str", "got NoneType None")
    assert refused(lambda: attnlab.generate(torch.nn.Linear(2, 2), [5, 6], 2), "model must be an attnlab model",
                   "got Linear")  # fmt: skip
    assert refused(lambda: attnlab.from_hf_llama("x"), "from_hf_llama takes a transformers model", "got str 'x'")
    model = tiny_model()
    assert attnlab.param_counts(model)["total"] == attnlab.param_counts(model.cfg)["total"]


# ----------------------------------------------------------------------------- AF18: generate's compile


def test_af18_generate_refuses_a_compile_that_is_not_true_false_or_none():
    model = tiny_model()
    for compile in ("no", "auto", 0, 1):
        assert refused(lambda: attnlab.generate(model, [5, 6], 2, compile=compile), f"compile={compile!r}",  # noqa: B023
                "must be True, False or None")  # fmt: skip
    assert attnlab.generate(model, [5, 6], 2, compile=False).shape == (2,)


# ----------------------------------------------------------------------------- AF14: save_state to a folder


def test_af14_save_state_refuses_a_folder_in_one_line(tmp_path):
    model = tiny_model(memory={"kind": "bounded", "recent_window": 8, "exact_slots": 4, "summary_slots": 4})
    cache = model(torch.tensor([[5, 6]]))[1]
    state = tmp_path / "s.safetensors"
    assert refused(lambda: attnlab.memory.save_state(tmp_path, model, cache), f"{tmp_path} is a folder",
                   "give a file path")  # fmt: skip
    assert refused(lambda: attnlab.memory.save_state(state, model, "abc"), "cache must be a ModelCache")
    attnlab.memory.save_state(tmp_path / "s.safetensors", model, cache)
    assert (tmp_path / "s.safetensors").is_file()


# ----------------------------------------------------------------------------- AF16: train_tokenizer


def test_af16_train_tokenizer_refuses_a_bare_str_and_warns_of_a_smaller_vocabulary():
    assert refused(lambda: attnlab.data.train_tokenizer("char", "hello"), "texts must be a list", "got str 'hello'",
            "give [text]")  # fmt: skip
    assert refused(lambda: attnlab.data.train_tokenizer("word", ["a b", 5]), "texts[1] is int 5")
    with pytest.warns(VocabularyWarning, match="allowed only 258 of the 300 ids asked"):
        assert attnlab.data.train_tokenizer("bpe:300", ["ab"]).vocab_size == 258
    assert attnlab.data.train_tokenizer("char", iter(["ab", "c"])).vocab_size == 5  # an iterator still reads


# ----------------------------------------------------------------------------- AF17: open_source's fractions


def test_af17_open_source_refuses_the_fractions_a_data_config_refuses(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("one\n\ntwo\n")
    for fraction, shown in ((2.0, "val_fraction=2.0 must be in [0, 1)"), (float("nan"), "val_fraction=nan must be"),
                            ("0.1", "val_fraction='0.1' must be a number")):  # fmt: skip
        for source in ("tinyshakespeare", str(text)):
            with pytest.raises(ConfigError) as caught:
                attnlab.data.open_source(source, tmp_path, val_fraction=fraction)
            assert shown in str(caught.value) and "\n" not in str(caught.value), caught.value
    with pytest.raises(ConfigError, match="val_fraction \\+ test_fraction = 1.0 must be < 1"):
        attnlab.data.open_source(str(text), val_fraction=0.5, test_fraction=0.5)
    assert attnlab.data.open_source(str(text), val_fraction=0.1).files == [text]
