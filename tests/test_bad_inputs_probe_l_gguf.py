"""Probe L's findings in GGUF files (attnlab.interop.gguf, attnlab.interop.tokenizer): a tensor whose shape the
metadata does not imply (l8: `info` accepted it, `generate` ended in a reshape traceback), a BOS or EOS id past the
vocabulary (l16: accepted, so generation could never stop at its EOS), and tensors whose bytes overlap or start off
the file's alignment (l17: loaded from another tensor's bytes without a word). Each now ends in one line naming the
file, the tensor or key, the value and the fix. Every file is a tiny model written here."""

from __future__ import annotations

import pytest
from helpers import fails

from attnlab.cli import main
from attnlab.errors import DataError
from attnlab.interop.gguf import load_gguf, open_gguf
from attnlab.interop.references import model_config_of, tokenizer_of

gguf = pytest.importorskip("gguf")
from gguf_files import TOKENS, write_gguf  # noqa: E402  (needs gguf)

pytestmark = pytest.mark.usefixtures("one_thread")

Q = gguf.GGMLQuantizationType


@pytest.fixture
def good_gguf(tmp_path):
    return write_gguf(tmp_path / "m.gguf")


def edit(path, change) -> None:
    """Calls change(reader) on the file opened for writing (its fields' and tensors' parts are views of the file's
    bytes), then writes the file back."""
    reader = gguf.GGUFReader(path, "r+")
    change(reader)
    reader.data.flush()
    del reader


def tensor_field(reader, name):
    """(dims, offset): the writable parts of tensor `name`'s entry in the tensor table (dims innermost first; the
    offset from the start of the data)."""
    field = next(t.field for t in reader.tensors if t.name == name)
    _name_len, _name, _n_dims, dims, _type, offset = field.parts
    return dims, offset


def generate(path) -> list[str]:
    return ["generate", str(path), "ab", "--max-new-tokens", "1"]


def test_the_good_file_loads_and_generates(good_gguf, capsys):
    cfg, model, tokenizer = load_gguf(good_gguf)
    assert cfg.vocab_size == len(TOKENS) and tokenizer.eos_id == 0
    assert main(["info", str(good_gguf)]) == 0
    assert main(generate(good_gguf)) == 0


# ----------------------------------------------------------------------------- l8: a tensor of the wrong shape


def test_a_tensor_whose_shape_the_metadata_does_not_imply_is_refused_at_load_naming_both_shapes(good_gguf, capsys):
    """l8: blk.0.attn_q.weight's dims [64, 63] (was [64, 64]): info accepted it and generate ended in
    RuntimeError "shape '[2, 15, 2, -1]' is invalid" (the q rows regrouped per head)."""
    edit(good_gguf, lambda reader: tensor_field(reader, "blk.0.attn_q.weight")[0].__setitem__(1, 63))
    line = (f"{good_gguf} (blk.0.attn_q.weight): the tensor has shape (63, 64), but the file's metadata (llama.*) "
            "implies (64, 64): the file is damaged or its tensors are not its metadata's model; download or convert "
            "it again")  # fmt: skip
    pattern = (r"m\.gguf \(blk\.0\.attn_q\.weight\): the tensor has shape \(63, 64\), but the file's metadata "
               r"\(llama\.\*\) implies \(64, 64\): the file is damaged")  # fmt: skip
    with pytest.raises(DataError, match=pattern):
        load_gguf(good_gguf)
    with pytest.raises(DataError, match=r"has shape \(63, 64\), but the file's metadata \(llama\.\*\) implies"):
        load_gguf(good_gguf, weights="native")
    with pytest.raises(DataError, match=r"has shape \(63, 64\)"):
        model_config_of(good_gguf)
    assert fails(capsys, generate(good_gguf), line)
    assert fails(capsys, ["info", str(good_gguf)], line)


def test_a_norm_or_mlp_tensor_of_the_wrong_shape_is_refused_too(good_gguf):
    edit(good_gguf, lambda reader: tensor_field(reader, "blk.0.ffn_down.weight")[0].__setitem__(1, 32))
    pattern = r"\(blk\.0\.ffn_down\.weight\): the tensor has shape \(32, \d+\), but the file's metadata \(llama\.\*\)"
    with pytest.raises(DataError, match=pattern + r" implies \(64, \d+\)"):
        load_gguf(good_gguf)


# ----------------------------------------------------------------------------- l16: BOS / EOS ids past the vocabulary


@pytest.mark.parametrize("which", ["eos", "bos"])
def test_a_special_token_id_past_the_vocabulary_is_refused_naming_the_key_value_and_size(good_gguf, capsys, which):
    """l16: tokenizer.ggml.eos_token_id = 999999 with 97 tokens was accepted: generation could never stop at it."""
    key = f"tokenizer.ggml.{which}_token_id"
    edit(good_gguf, lambda reader: reader.fields[key].parts[-1].__setitem__(0, 999999))
    line = (f"{good_gguf}: {key}=999999 is not a token id: the vocabulary (tokenizer.ggml.tokens) holds 97 tokens, "
            f"ids 0 .. 96; the file is damaged: set the key to the model's {which.upper()} token (gguf-set-metadata "
            f"FILE {key} ID) or download the file again")  # fmt: skip
    with pytest.raises(DataError, match=rf"{key}=999999 is not a token id: the vocabulary \(tokenizer\.ggml\.tokens\) "
                                        r"holds 97 tokens, ids 0 \.\. 96; the file is damaged"):  # fmt: skip
        load_gguf(good_gguf)
    with pytest.raises(DataError, match=rf"{key}=999999 is not a token id"):
        tokenizer_of(good_gguf)
    assert fails(capsys, generate(good_gguf), line)


def test_the_last_token_is_a_valid_eos(good_gguf):
    edit(good_gguf, lambda reader: reader.fields["tokenizer.ggml.eos_token_id"].parts[-1].__setitem__(0, 96))
    assert load_gguf(good_gguf)[2].eos_id == 96


# ----------------------------------------------------------------------------- l17: overlapping or unaligned tensors


def test_tensors_whose_bytes_overlap_are_refused_naming_both(good_gguf, capsys):
    """l17: attn_q's data offset set to attn_k's: the file loaded and generated from wrong weights without a word."""

    def overlap(reader):
        k_offset = tensor_field(reader, "blk.0.attn_k.weight")[1][0]
        tensor_field(reader, "blk.0.attn_q.weight")[1][0] = k_offset

    edit(good_gguf, overlap)
    pattern = (r"tensors 'blk\.0\.attn_k\.weight' \(data bytes \d+ \.\. \d+\) and 'blk\.0\.attn_q\.weight' \(from "
               r"byte \d+\) overlap: the tensor table is damaged, so one of them would be read from the other's bytes "
               r"\(llama\.cpp refuses it too\); download or convert the file again")  # fmt: skip
    with pytest.raises(DataError, match=pattern):
        open_gguf(good_gguf)
    line = fails(capsys, generate(good_gguf), f"{good_gguf}: tensors 'blk.0.attn_k.weight' (data bytes ")
    assert "and 'blk.0.attn_q.weight' (from byte" in line
    assert fails(capsys, ["info", str(good_gguf)], "overlap: the tensor table is damaged")


def test_a_tensor_starting_off_the_alignment_is_refused(good_gguf):
    """l17's aside: an unaligned offset was caught only when the bytes it pointed at happened to decode as NaN."""

    def shift(reader):
        tensor_field(reader, "blk.0.attn_q.weight")[1][0] += 4

    edit(good_gguf, shift)
    with pytest.raises(DataError, match=r"tensor 'blk\.0\.attn_q\.weight' starts at data offset \d+, not a multiple of "
                                        r"the file's alignment 32: the tensor table is damaged"):  # fmt: skip
        load_gguf(good_gguf)
