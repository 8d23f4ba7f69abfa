"""A real trained model: karpathy's stories260K (llama2.c), GQA with interleaved RoPE.

The data README records llama2.c's own greedy output from BOS; reproducing it exactly checks the
import, interleaved RoPE, GQA, the cache and greedy decoding against an independent implementation.
"""

import pytest

import attnlab
from attnlab.errors import DataError
from attnlab.interop import decode_llama2c, from_llama2c, load_llama2c_vocab
from attnlab.paths import find_data_file

REFERENCE_START = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
REFERENCE_END = "Lily didn't want to help her mom, so she"


def test_stories260k_greedy_matches_llama2c(data_dir):
    folder = data_dir / "llama2c-stories260K"
    cfg, model = from_llama2c(folder / "stories260K.bin")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.attention.n_kv_heads, cfg.vocab_size) == (64, 5, 8, 4, 512)
    pieces = load_llama2c_vocab(folder / "tok512.bin")
    text = decode_llama2c(pieces, attnlab.generate(model, [1], max_new_tokens=200))  # 1 = BOS
    assert text.startswith(REFERENCE_START)
    assert text.endswith(REFERENCE_END)


def test_truncated_checkpoint_is_a_clear_error(tmp_path, data_dir):
    short = tmp_path / "short.bin"
    short.write_bytes((data_dir / "llama2c-stories260K" / "stories260K.bin").read_bytes()[:5000])
    with pytest.raises(DataError, match="file ends early"):
        from_llama2c(short)


def test_missing_data_file_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match=r"stories\.bin not found \(looked in: .*nowhere.*ATTNLAB_DATA"):
        find_data_file("stories.bin", data_dir=tmp_path)
