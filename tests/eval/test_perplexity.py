"""Perplexity: a perfect predictor scores 1, a uniform one scores V, each target counts once per stride."""

import math

import numpy as np
import pytest
import torch
from torch import nn

import attnlab
from attnlab.errors import InputError
from attnlab.eval.perplexity import summarize_losses, window_losses


class NextTokenOracle(nn.Module):
    """Logits that put (almost) all mass on (x + 1) % V: a perfect predictor of an arange sequence."""

    def __init__(self, vocab: int, sharpness: float = 60.0):
        super().__init__()
        self.vocab, self.sharpness = vocab, sharpness
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, tokens, use_cache=False):
        return one_hot((tokens + 1) % self.vocab, self.vocab) * self.sharpness, None


def one_hot(x, n):
    return torch.nn.functional.one_hot(x, n).float()


class Uniform(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, tokens, use_cache=False):
        return torch.zeros(*tokens.shape, self.vocab), None


def test_perfect_predictor_has_perplexity_one():
    tokens = np.arange(1000, dtype=np.uint16) % 50
    summary = summarize_losses(window_losses(NextTokenOracle(50), tokens, seq_len=64))
    assert summary["ppl"] == pytest.approx(1.0, abs=1e-6) and summary["tokens"] == 999


def test_uniform_predictor_has_perplexity_vocab():
    tokens = np.random.default_rng(0).integers(0, 37, 500).astype(np.uint16)
    summary = summarize_losses(window_losses(Uniform(37), tokens, seq_len=32, stride=8))
    assert summary["ppl"] == pytest.approx(37.0, rel=1e-5)
    assert summary["ppl_ci"][0] == pytest.approx(37.0, rel=1e-5)  # no spread: every token costs ln 37


@pytest.mark.parametrize("seq_len, stride, budget", [(16, 16, None), (16, 5, None), (16, 1, 40), (10, 10, 33)])
def test_each_target_scored_once_with_its_context(seq_len, stride, budget):
    """Against a brute-force reference: target t is scored once, by the first window that contains it,
    reading that window's tokens before it."""
    torch.manual_seed(0)
    cfg = attnlab.model_config_from_dict(
        {"vocab_size": 20, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": 32}
    )
    model = attnlab.build_model(cfg).eval()
    tokens = np.random.default_rng(1).integers(0, 20, 57).astype(np.uint16)
    windows = window_losses(model, tokens, seq_len, stride, budget)
    n_targets = min(budget or len(tokens), len(tokens) - 1)
    assert sum(n for _, n in windows) == n_targets
    expected, begin, done = 0.0, 0, 0
    while done < n_targets:
        for target in range(done + 1, min(begin + seq_len, len(tokens) - 1, n_targets) + 1):
            context = torch.tensor(tokens[begin:target].astype(np.int64))[None]
            logits, _ = model(context, use_cache=False)
            expected -= logits[0, -1].log_softmax(-1)[int(tokens[target])].item()
            done = target
        begin += stride
    assert sum(s for s, _ in windows) == pytest.approx(expected, rel=1e-5)


def test_bootstrap_interval_is_reproducible_and_covers_the_mean():
    windows = [(float(v), 10) for v in np.random.default_rng(2).uniform(20, 40, 50)]
    a, b = summarize_losses(windows, seed=3), summarize_losses(windows, seed=3)
    assert a == b
    assert a["loss_ci"][0] < a["loss"] < a["loss_ci"][1]
    assert a["ppl"] == pytest.approx(math.exp(a["loss"]))


def test_bad_stride_is_an_error():
    with pytest.raises(InputError, match="stride=20 must be between 1 and seq_len=16"):
        window_losses(Uniform(5), np.zeros(50, dtype=np.uint16), 16, 20)


def test_a_dataset_split_is_tokenized_once_per_tokenizer_and_each_caller_gets_its_own_ids(tmp_path):
    from attnlab.data.tokenizers import ByteTokenizer
    from attnlab.eval.perplexity import STREAMS_KEPT, dataset_tokens

    class Counting(ByteTokenizer):
        calls = 0

        def encode(self, text):
            Counting.calls += 1
            return super().encode(text)

    text = tmp_path / "a.txt"
    text.write_text("the cat sat on the mat\n" * 50)
    tokenizer, plain = Counting(), dataset_tokens(ByteTokenizer(), str(text), "train")
    first = dataset_tokens(tokenizer, str(text), "train")
    first[:] = 0  # the caller's own array: the next caller's ids are unchanged
    again = dataset_tokens(tokenizer, str(text), "train")
    assert Counting.calls == 1 and again.tolist() == plain.tolist() and again.any()
    text.write_text("another text\n" * 50)  # a changed file is read and tokenized again
    changed = dataset_tokens(tokenizer, str(text), "train")
    assert Counting.calls == 2 and changed.tolist() == dataset_tokens(ByteTokenizer(), str(text), "train").tolist()
    assert dataset_tokens(Counting(), str(text), "train").tolist() == changed.tolist()
    assert Counting.calls == 3  # another tokenizer tokenizes for itself
    for i in range(STREAMS_KEPT + 1):  # a few texts are kept, not every one
        text.write_text(f"text {i}\n" * 9)
        dataset_tokens(tokenizer, str(text), "train")
    assert len(tokenizer._stream_ids) == STREAMS_KEPT
