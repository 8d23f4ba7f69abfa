"""Tokenizers: round trips, specials, save/load, the offline GPT-2 files, errors."""

import shutil

import pytest

from attnlab.data.tokenizers import (
    EOS,
    EOT,
    UNK,
    _ranks_from_encoder_json,
    _read_tiktoken_file,
    load_tokenizer,
    needs_training,
    train_tokenizer,
)
from attnlab.errors import ConfigError, DataError

TEXT = "Hello wörld, naïve café 🙂\n\n  two  spaces\tand a tab <|endoftext|> inside.\n"
CORPUS = [
    " = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : <unk> Chronicles \n",
    " The game began development in 2010 , carrying over a large portion of the work . \n",
    " It met with positive sales in Japan , and was praised by both Japanese and western critics . \n",
] * 20


def test_byte_round_trip_and_specials():
    tok = load_tokenizer("byte")
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert 256 not in ids  # the text "<|endoftext|>" is plain bytes, never the end-of-text id
    assert tok.decode(ids) == TEXT
    assert tok.decode([104, 105, 256, 0xC3]) == "hi" + EOT + "\ufffd"  # a cut UTF-8 sequence does not raise


def test_char_round_trip_unknown_and_save_load(tmp_path):
    tok = train_tokenizer("char", ["hello world\n", "held"])
    assert tok.tokens == sorted(set("hello world\nheld")) + [UNK, EOT]
    assert (tok.vocab_size, tok.eot_id, tok.unk_id) == (len(tok.tokens), len(tok.tokens) - 1, len(tok.tokens) - 2)
    assert tok.decode(tok.encode("hello\nworld")) == "hello\nworld"
    assert tok.encode("hz") == [tok.ids["h"], tok.unk_id]
    assert tok.decode(tok.encode("hz")) == "h\ufffd"
    assert tok.decode([tok.ids["h"], tok.vocab_size]) == "h\ufffd"  # an id past the vocabulary (a padded model)
    tok.save(tmp_path)
    loaded = load_tokenizer("char", tmp_path)
    assert loaded.tokens == tok.tokens and loaded.encode("hello") == tok.encode("hello")


def test_word_vocabulary_order_eos_and_unk(tmp_path):
    tok = train_tokenizer("word", CORPUS)
    # pytorch word_language_model order: first occurrence, with <eos> at the first line end.
    assert tok.tokens[:6] == ["=", "Valkyria", "Chronicles", "III", EOS, "Senjō"]
    assert tok.tokens[-1] == EOT and tok.eot_id == tok.vocab_size - 1
    assert tok.ids[UNK] < tok.eot_id  # WikiText's own <unk> keeps its first-occurrence id
    ids = tok.encode(" The game began zorblax . \n")
    assert ids == [tok.ids[w] for w in ("The", "game", "began")] + [tok.unk_id, tok.ids["."], tok.ids[EOS]]
    assert tok.decode(ids) == f"The game began {UNK} .\n"
    assert tok.decode([tok.ids["The"], tok.vocab_size + 3]) == "The \ufffd"
    assert tok.encode(EOT) == [tok.unk_id]  # the text of the end-of-text token is an unknown word
    tok.save(tmp_path)
    assert load_tokenizer("word", tmp_path).encode(CORPUS[1]) == tok.encode(CORPUS[1])


def test_word_adds_unk_and_eos_when_the_corpus_has_none():
    tok = train_tokenizer("word", ["to be or not to be"])
    assert tok.tokens == ["to", "be", "or", "not", EOS, UNK, EOT]
    assert tok.encode("to die\n") == [0, tok.unk_id, tok.ids[EOS]]


def test_gpt2_offline_files(shared_data, tmp_path):
    tok = load_tokenizer("gpt2", data_dir=shared_data, download=False)
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert 50256 not in tok.encode(TEXT)
    assert tok.decode([15496, 50257, 995]) == "Hello\ufffd world"  # past the vocabulary
    tok.save(tmp_path)  # the prepared folder gets its own copy: loading it needs no data directory
    assert (tmp_path / "gpt2.tiktoken").read_bytes() == (shared_data / "gpt2-bpe" / "r50k_base.tiktoken").read_bytes()
    assert load_tokenizer("gpt2", tmp_path, download=False).encode(TEXT) == tok.encode(TEXT)


def test_gpt2_ranks_from_encoder_json_equal_tiktoken_file(shared_data):
    folder = shared_data / "gpt2-bpe"
    from_json = _ranks_from_encoder_json(folder / "encoder.json", folder / "vocab.bpe")
    assert from_json == _read_tiktoken_file(folder / "r50k_base.tiktoken")
    assert len(from_json) == 50256


def test_gpt2_missing_files_say_where_they_looked(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNLAB_DATA", raising=False)
    with pytest.raises(DataError, match=rf"gpt2-bpe/encoder\.json.*{tmp_path / 'empty'}.*downloads are off"):
        load_tokenizer("gpt2", data_dir=tmp_path / "empty", download=False)


def test_gpt2_corrupt_file_is_a_data_error(shared_data, tmp_path):
    folder = tmp_path / "gpt2-bpe"
    shutil.copytree(shared_data / "gpt2-bpe", folder)
    folder.joinpath("encoder.json").write_text("{}")
    with pytest.raises(DataError, match=r"encoder\.json has sha256"):
        load_tokenizer("gpt2", data_dir=tmp_path, download=False)


def test_bpe_round_trip_and_save_load(tmp_path):
    tok = train_tokenizer("bpe:300", CORPUS)
    assert tok.name == "bpe:300" and 257 <= tok.vocab_size <= 300
    assert tok.decode(tok.encode(TEXT)) == TEXT  # byte-level: any text, no unknowns
    assert tok.eot_id not in tok.encode(TEXT)
    assert len(tok.encode(" Valkyria")) < len(b" Valkyria")  # it learned merges
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    loaded = load_tokenizer("bpe:300", tmp_path)
    assert loaded.encode(TEXT) == tok.encode(TEXT) and loaded.eot_id == tok.eot_id


def test_tokenizer_name_errors(tmp_path):
    with pytest.raises(ConfigError, match="needs 257 to 16,777,216 ids"):
        train_tokenizer("bpe:100", CORPUS)
    with pytest.raises(ConfigError, match="not known"):
        load_tokenizer("sentencepiece")
    with pytest.raises(DataError, match="fitted to a dataset"):
        load_tokenizer("word")
    with pytest.raises(DataError, match="vocab.json: missing"):
        load_tokenizer("char", tmp_path)
    assert [needs_training(n) for n in ("gpt2", "byte", "word", "char", "bpe:512")] == [False, False, True, True, True]
