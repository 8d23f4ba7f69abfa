"""Long-context benchmarks with known answers: an induction oracle finds every passkey, a windowed one only
those within its window, a unigram model gains nothing from the needle; the sweep's last-chunk loss equals a
full forward; lengths past max_seq_len (or that run out of memory) become records, never crashes."""

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import tiny_model
from torch import nn

import attnlab
from attnlab.config import MemoryConfig
from attnlab.data.tokenizers import CharTokenizer
from attnlab.errors import DataError, InputError
from attnlab.eval import EvalModel
from attnlab.eval.longctx import (
    FILLER,
    INTRO,
    NEEDLE,
    QUESTION,
    context_sweep,
    heldout_tokens,
    passkey_prompt,
    run_extrapolation,
    run_needle,
)
from attnlab.eval.perplexity import summarize_losses, window_losses

STORY = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
    "once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations "
    "in it, and what is the use of a book, thought Alice, without pictures or conversations?"
)
TOKENIZER = CharTokenizer.fit([FILLER, INTRO, NEEDLE, QUESTION, STORY, "0123456789\n"])
V = TOKENIZER.vocab_size


class HistoryCache:
    """The stubs' cache: every token seen so far, (B, S)."""

    def __init__(self, batch: int):
        self.tokens = torch.zeros(batch, 0, dtype=torch.long)
        self.seen = 0

    def nbytes(self) -> int:
        return self.tokens.nbytes


class StubLM(nn.Module):
    """A language model given by a rule over the whole history (`history_logits`), with the Transformer's
    call signature and cache protocol, so `generate` and `continuation_logprobs` run it unchanged."""

    def __init__(self, max_seq_len: int = 512):
        super().__init__()
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len, vocab_size=V, memory=MemoryConfig())
        self.dummy = nn.Parameter(torch.zeros(()))

    def new_cache(self, batch, max_len=None, dtype=None, device=None):
        return HistoryCache(batch)

    def forward(self, tokens, cache=None, use_cache=None):
        history = tokens if cache is None else torch.cat([cache.tokens, tokens], dim=1)
        if cache is not None:
            cache.tokens, cache.seen = history, history.shape[1]
        return self.history_logits(history)[:, -tokens.shape[1] :], cache


class InductionOracle(StubLM):
    """Predicts the token that followed the most recent earlier occurrence of the last `n` tokens, if that
    token lies within `window` positions back (None = anywhere); uniform when there is no such occurrence."""

    def __init__(self, n: int = 8, window: int | None = None, sharpness: float = 40.0, max_seq_len: int = 512):
        super().__init__(max_seq_len)
        self.n, self.window, self.sharpness = n, window, sharpness

    def history_logits(self, x):
        batch, length = x.shape
        logits = torch.zeros(batch, length, V)
        if length <= self.n:
            return logits
        grams = x.unfold(1, self.n, 1)  # (B, G, n): gram g ends at position g + n - 1
        same = (grams[:, :, None, :] == grams[:, None, :, :]).all(-1)  # (B, G, G)
        now, earlier = torch.arange(grams.shape[1])[:, None], torch.arange(grams.shape[1])[None, :]
        visible = earlier < now
        if self.window is not None:
            visible &= now - earlier <= self.window  # the copied token (earlier + n) is within the window
        source = torch.where(same & visible, earlier, -1).max(dim=-1).values  # (B, G) most recent match
        found = source[:, :-1] >= 0  # (B, G - 1); the last gram's successor is not in the history
        copied = x.gather(1, (source[:, :-1] + self.n).clamp(min=0, max=length - 1))  # (B, G - 1)
        hits = torch.nn.functional.one_hot(copied, V).float() * self.sharpness * found[..., None]
        logits[:, self.n - 1 : length - 1] = hits
        last = source[:, -1]  # the newest position's prediction
        has = last >= 0
        if has.any():
            nxt = x.gather(1, (last + self.n).clamp(max=length - 1)[:, None])[:, 0]  # (B,)
            logits[has, length - 1] = torch.nn.functional.one_hot(nxt[has], V).float() * self.sharpness
        return logits


class Unigram(StubLM):
    """The same distribution at every position, whatever the context."""

    def __init__(self, max_seq_len: int = 512):
        super().__init__(max_seq_len)
        self.bias = nn.Parameter(torch.randn(V, generator=torch.Generator().manual_seed(0)))

    def history_logits(self, x):
        return self.bias.expand(*x.shape, V)


def eval_model(module, tmp_path, config=None, tokenizer=TOKENIZER):
    max_seq_len = module.cfg.max_seq_len
    if isinstance(module, StubLM):
        cfg = attnlab.ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_seq_len=max_seq_len)
    else:
        cfg = module.cfg
    return EvalModel("stub", tmp_path, cfg, module, tokenizer, config or {})


def tiny(attention=None):
    return tiny_model(attention, vocab_size=50, d_model=32, init_std=0.2)


def cells(rows):
    return {(r["length"], r["depth"]): r for r in rows if r["scope"] == "cell"}


# ----------------------------------------------------------------------------- needle


def test_prompt_layout_puts_the_needle_at_the_depth_and_fills_the_length():
    filler = np.array(TOKENIZER.encode(" " + FILLER))
    for depth in (0.0, 0.5, 1.0):
        prompt = passkey_prompt(TOKENIZER, filler, 300, depth, "71432", intro="")
        assert len(prompt.with_needle) + len(prompt.answer) == 300
        assert TOKENIZER.decode(prompt.needle) == " " + NEEDLE.format(key="71432")
        assert TOKENIZER.decode(prompt.answer) == " 71432"
        assert TOKENIZER.decode(prompt.with_needle).endswith("\n" + QUESTION)
        n_filler = 300 - len(prompt.needle) - len(TOKENIZER.encode("\n" + QUESTION)) - len(prompt.answer)
        assert len(prompt.before) == round(depth * n_filler)
        assert prompt.without_needle == prompt.before + prompt.after
    assert passkey_prompt(TOKENIZER, filler, 40, 0.5, "71432") is None  # cannot hold the needle


def test_induction_oracle_retrieves_every_key_with_a_positive_gain(tmp_path):
    model = eval_model(InductionOracle(), tmp_path)
    rows = run_needle(model, lengths=[300, 500], depths=[0.1, 0.5, 0.9], trials=3, intro="")
    grid = cells(rows)
    assert sorted(grid) == [(300, 0.1), (300, 0.5), (300, 0.9), (500, 0.1), (500, 0.5), (500, 0.9)]
    for row in grid.values():
        assert row["status"] == "ok" and row["accuracy"] == 1.0 and row["trials"] == 3
        # With the needle the key costs ~0 nats; without it each of its 6 characters costs ln V.
        assert row["gain_mean"] == pytest.approx(6 * math.log(V), rel=1e-3)
    keys = [t["key"] for t in grid[(300, 0.1)]["results"]]
    assert len(set(keys)) == 3 and all(len(k) == 5 for k in keys)
    assert [t["key"] for t in grid[(500, 0.9)]["results"]] == keys  # the same keys in every cell
    assert grid[(500, 0.1)]["results"][0]["needle_at"] < grid[(500, 0.9)]["results"][0]["needle_at"]
    overall = rows[-1]
    assert overall["scope"] == "overall" and overall["accuracy"] == 1.0 and overall["trials"] == 18


def test_a_model_that_sees_only_a_window_back_fails_at_deep_needles(tmp_path):
    # length 400: the needle's "...key is" ends 111 positions before the question's end at depth 0.9, 348 at 0.1.
    model = eval_model(InductionOracle(window=150), tmp_path)
    grid = cells(run_needle(model, lengths=[400], depths=[0.1, 0.9], trials=2, intro=""))
    assert grid[(400, 0.9)]["accuracy"] == 1.0 and grid[(400, 0.9)]["gain_mean"] > 10
    assert grid[(400, 0.1)]["accuracy"] == 0.0
    assert grid[(400, 0.1)]["gain_mean"] == pytest.approx(0.0, abs=1e-6)  # it never sees the needle


def test_retrieval_only_reads_each_prompt_once_and_finds_what_the_full_needle_finds(tmp_path):
    model = eval_model(InductionOracle(window=150), tmp_path)
    full = cells(run_needle(model, lengths=[400], depths=[0.1, 0.9], trials=2, intro=""))
    calls = []
    forward = model.model.forward
    model.model.forward = lambda tokens, cache=None, use_cache=None: calls.append(cache) or forward(tokens, cache)
    rows = run_needle(model, lengths=[400], depths=[0.1, 0.9], trials=2, intro="", gain=False)
    assert all(cache is not None for cache in calls)  # generation only: no uncached scoring pass
    quick = cells(rows)
    for cell, row in quick.items():
        assert row["gain"] is False and "gain_mean" not in row and full[cell]["gain"] is True
        assert row["accuracy"] == full[cell]["accuracy"] and row["trials"] == 2
        assert [t["output"] for t in row["results"]] == [t["output"] for t in full[cell]["results"]]
        assert all("logp_with" not in t for t in row["results"])
    assert quick[(400, 0.9)]["accuracy"] == 1.0 and quick[(400, 0.1)]["accuracy"] == 0.0
    assert rows[-1]["scope"] == "overall" and rows[-1]["accuracy"] == 0.5 and "gain_mean" not in rows[-1]


def test_a_model_that_ignores_context_gains_nothing_from_the_needle(tmp_path):
    rows = run_needle(eval_model(Unigram(), tmp_path), lengths=[200, 300], depths=[0.2, 0.8], trials=2, intro="")
    for row in cells(rows).values():
        assert row["accuracy"] == 0.0
        assert all(t["gain"] == pytest.approx(0.0, abs=1e-9) for t in row["results"])
        assert row["logp_with_mean"] < 0


def test_heldout_filler_and_lengths_that_do_not_fit(tmp_path):
    story = np.array(TOKENIZER.encode(STORY))
    model = eval_model(InductionOracle(max_seq_len=256), tmp_path)
    rows = run_needle(model, lengths=[30, 256, 400], depths=[0.5], trials=2, filler="heldout", text=story, intro="")
    grid = cells(rows)
    assert grid[(30, 0.5)]["status"] == "too_short" and grid[(400, 0.5)]["status"] == "too_long"
    assert grid[(256, 0.5)]["status"] == "ok" and grid[(256, 0.5)]["accuracy"] == 1.0
    assert grid[(256, 0.5)]["filler"] == "given"
    with pytest.raises(InputError, match="filler"):
        run_needle(model, filler="lorem")
    with pytest.raises(InputError, match="depths"):
        run_needle(model, depths=[1.5])


# ----------------------------------------------------------------------------- held-out text


def test_heldout_tokens_from_ids_a_file_or_the_models_own_split(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    from attnlab.data.tokenizers import ByteTokenizer

    model = eval_model(tiny(), tmp_path, tokenizer=ByteTokenizer())
    tokens, origin = heldout_tokens(model, [3, 4, 5])
    assert tokens.tolist() == [3, 4, 5] and origin == "given"
    (tmp_path / "a.txt").write_text("hello")
    tokens, origin = heldout_tokens(model, tmp_path / "a.txt")
    assert tokens.tolist() == list(b"hello") and origin.startswith("file:")
    with pytest.raises(DataError, match="no data config"):
        heldout_tokens(model)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"paragraph number {i} " * 5 for i in range(60)))
    model.config = {"data": {"source": str(corpus), "tokenizer": "byte", "val_fraction": 0.2}}
    tokens, origin = heldout_tokens(model, cache_dir=tmp_path / "prep")
    assert origin.endswith(":val") and len(tokens) > 100
    from attnlab.config import DataConfig
    from attnlab.data import prepare

    val = prepare(DataConfig(**model.config["data"]), cache_dir=tmp_path / "prep").split("val")
    assert np.array_equal(tokens, val)


# ----------------------------------------------------------------------------- context sweep


@pytest.mark.parametrize(
    "attention",
    [{"kind": "mha"}, {"kind": "sliding", "window": 6}, {"kind": "mla", "d_latent": 16}],
    ids=lambda a: a["kind"],
)
def test_sweep_last_chunk_loss_equals_the_full_forward(attention, tmp_path):
    module = tiny(attention)
    model = eval_model(module, tmp_path)
    text = np.random.default_rng(0).integers(0, 50, 300)
    rows = context_sweep(model, lengths=[100, 10, 37, 64], chunk_size=16, decode_tokens=4, text=text, offset=5)
    assert [(r["length"], r["status"]) for r in rows] == [(10, "ok"), (37, "ok"), (64, "ok"), (100, "too_long")]
    for row in rows[:3]:
        length = row["length"]
        ids = torch.tensor(text[5 : 5 + length + 1])[None]  # (1, L + 1)
        last = (length - 1) // 16 * 16
        with torch.no_grad():
            logits, _ = module(ids[:, :length], use_cache=False)  # (1, L, V)
        reference = torch.nn.functional.cross_entropy(logits[0, last:], ids[0, last + 1 :]).item()
        assert row["last_chunk_loss"] == pytest.approx(reference, rel=1e-4)
        assert row["last_chunk_tokens"] == length - last and row["chunks"] == math.ceil(length / 16)
    assert rows[1]["decode_steps"] == 4 and len(rows[1]["decode_ms"]) == 4
    assert rows[2]["decode_steps"] == 0 and rows[2]["decode_ms_per_token"] is None  # no room left at max_seq_len


class RunsOutOfMemory(nn.Module):
    """A model that raises the CPU allocator's error once its cache would pass `limit` tokens."""

    def __init__(self, inner, limit, error=RuntimeError):
        super().__init__()
        self.inner, self.limit, self.error, self.cfg = inner, limit, error, inner.cfg

    def new_cache(self, *args, **kwargs):
        return self.inner.new_cache(*args, **kwargs)

    def forward(self, tokens, cache=None, use_cache=None):
        if cache is not None and cache.seen + tokens.shape[1] > self.limit:
            raise self.error("DefaultCPUAllocator: not enough memory: you tried to allocate 1099511627776 bytes.")
        return self.inner(tokens, cache=cache, use_cache=use_cache)


def test_sweep_records_oom_short_text_and_budget_instead_of_crashing(tmp_path):
    model = eval_model(RunsOutOfMemory(tiny(), limit=40), tmp_path)
    text = np.random.default_rng(0).integers(0, 50, 60)
    rows = context_sweep(model, lengths=[16, 48, 64], chunk_size=16, decode_tokens=2, text=text)
    assert [r["status"] for r in rows] == ["ok", "oom", "not_enough_text"]
    assert "not enough memory" in rows[1]["error"]
    budget = context_sweep(
        eval_model(tiny(), tmp_path),
        lengths=[16, 32],
        chunk_size=16,
        decode_tokens=0,
        text=text,
        max_kv_bytes=kv_bytes_at(24),
    )
    assert [r["status"] for r in budget] == ["ok", "over_budget"]
    other = eval_model(RunsOutOfMemory(tiny(), limit=0, error=lambda _: RuntimeError("shape mismatch")), tmp_path)
    with pytest.raises(RuntimeError, match="shape mismatch"):  # only out-of-memory errors become records
        context_sweep(other, lengths=[16], text=text)


def kv_bytes_at(length):
    return attnlab.kv_report(tiny().cfg, "fp32", length)["kv_bytes"]


# ----------------------------------------------------------------------------- RoPE extrapolation


def test_extrapolation_marks_too_long_and_matches_held_out_perplexity(tmp_path):
    module = tiny()
    model = eval_model(module, tmp_path, config={"train": {"seq_len": 16}})
    text = np.random.default_rng(1).integers(0, 50, 700)
    rows = run_extrapolation(model, factors=(1, 2, 4, 8), max_tokens=256, text=text)
    assert [(r["factor"], r["seq_len"], r["status"]) for r in rows] == [
        (1, 16, "ok"), (2, 32, "ok"), (4, 64, "ok"), (8, 128, "too_long")
    ]  # fmt: skip
    for row in rows[:3]:
        assert math.isfinite(row["loss"]) and row["tokens"] == 256 and row["windows"] == 256 // row["seq_len"]
        assert len(row["segment_loss"]) == row["factor"] and all(math.isfinite(s) for s in row["segment_loss"])
        assert np.mean(row["segment_loss"]) == pytest.approx(row["loss"], rel=1e-5)
    reference = summarize_losses(window_losses(module, text, 16, max_tokens=256))
    assert rows[0]["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    short = run_extrapolation(model, factors=(1, 4), text=text[:40])
    assert [r["status"] for r in short] == ["ok", "not_enough_text"]


# ----------------------------------------------------------------------------- loss by position over streams


def test_stream_loss_buckets_are_the_per_position_losses_and_a_window_memory_forgets_past_its_window(tmp_path):
    """Full cache: each bucket is the mean of a direct forward's per-position losses and the buckets average to the
    streams' loss. A window memory of 12 tokens, same weights: the same losses where the window holds the whole
    context (the first 12 positions), others later; it reads streams past max_seq_len, the plain model cannot."""
    from attnlab.eval.longctx import run_stream_loss

    text = np.random.default_rng(2).integers(0, 50, 400)
    full = tiny()
    rows = run_stream_loss(eval_model(full, tmp_path), length=48, streams=3, bucket=12, text=text)
    (row,) = rows
    assert (row["status"], row["streams"], row["positions"], row["memory"]) == ("ok", 3, [0, 12, 24, 36], "none")
    windows = torch.from_numpy(text[: 3 * 48 + 1].astype(np.int64))
    with torch.no_grad():
        direct = torch.stack([
            torch.nn.functional.cross_entropy(full(windows[w * 48 : (w + 1) * 48][None], use_cache=False)[0][0],
                                              windows[w * 48 + 1 : (w + 1) * 48 + 1], reduction="none")
            for w in range(3)
        ])  # fmt: skip
    want = direct.unflatten(1, (4, 12)).mean(dim=(0, 2))
    assert row["bucket_loss"] == pytest.approx(want.tolist(), rel=1e-5)
    assert np.mean(row["bucket_loss"]) == pytest.approx(row["loss"], rel=1e-5)
    assert all(low <= mean <= high for mean, (low, high) in zip(row["bucket_loss"], row["bucket_ci"], strict=True))
    windowed = tiny_model(None, {"kind": "window", "recent_window": 12, "block": 4}, vocab_size=50, d_model=32,
                          init_std=0.2)  # fmt: skip
    (memory_row,) = run_stream_loss(eval_model(windowed, tmp_path), length=48, streams=3, bucket=12, text=text)
    assert (memory_row["memory"], memory_row["memory_slots"]) == ("window", 12)
    assert memory_row["bucket_loss"][0] == pytest.approx(row["bucket_loss"][0], rel=1e-5)
    assert all(abs(a - b) > 1e-4 for a, b in zip(memory_row["bucket_loss"][1:], row["bucket_loss"][1:], strict=True))
    long = full.cfg.max_seq_len * 2
    assert run_stream_loss(eval_model(full, tmp_path), length=long, streams=1, text=text)[0]["status"] == "too_long"
    longer = np.random.default_rng(3).integers(0, 50, long + 1)
    ok = run_stream_loss(eval_model(windowed, tmp_path), length=long, streams=1, bucket=long // 2, text=longer)[0]
    assert ok["status"] == "ok" and len(ok["bucket_loss"]) == 2


def test_stream_loss_says_when_the_text_holds_fewer_streams_than_asked(tmp_path):
    """Probe M m8: 8 streams asked of a text that holds 6 were scored as 6 without a word."""
    from attnlab.errors import LengthWarning
    from attnlab.eval.longctx import run_stream_loss

    text = np.random.default_rng(2).integers(0, 50, 400)  # 399 // 48 = 8 streams of 48 fit; 6 of 64
    model = eval_model(tiny(), tmp_path)  # max_seq_len 64
    with pytest.warns(LengthWarning, match=r"holds 6 stream\(s\) of 64 tokens \(400 tokens\), not the 8 asked"):
        (row,) = run_stream_loss(model, length=64, streams=8, bucket=16, text=text)
    assert row["streams"] == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all 8 fit: no warning
        assert run_stream_loss(model, length=48, streams=8, bucket=12, text=text)[0]["streams"] == 8


def test_the_report_draws_the_needle_grid_of_each_model_from_its_records(tmp_path):
    from attnlab.eval.plots import needle_grids
    from attnlab.eval.records import append_records
    from attnlab.eval.report import build_report

    wide = run_needle(eval_model(InductionOracle(), tmp_path), lengths=[400, 600], depths=[0.1, 0.9], trials=1,
                      intro="", gain=False)  # fmt: skip
    narrow = run_needle(eval_model(InductionOracle(window=150), tmp_path), lengths=[400, 600], depths=[0.1, 0.9],
                        trials=1, intro="", gain=False)  # fmt: skip
    for row in narrow:
        row["model"] = "windowed"
    lengths, depths, grids = needle_grids(wide + narrow)
    assert lengths == [400, 600] and depths == [0.1, 0.9]
    assert np.array_equal(grids["stub"], [[1.0, np.nan], [1.0, np.nan]], equal_nan=True)  # 600 > max_seq_len 512
    assert np.array_equal(grids["windowed"], [[0.0, np.nan], [1.0, np.nan]], equal_nan=True)
    (tmp_path / "out").mkdir()
    append_records(tmp_path / "out" / "records.jsonl", wide + narrow)
    build_report(tmp_path / "out")
    assert (tmp_path / "out" / "needle.png").exists()
    assert "## Passkey retrieval by length and depth" in (tmp_path / "out" / "report.md").read_text()


def test_the_report_shows_each_extrapolation_windows_length_and_draws_loss_against_it(tmp_path):
    from attnlab.eval.records import append_records
    from attnlab.eval.report import build_report

    model = eval_model(tiny(), tmp_path, config={"train": {"seq_len": 16}})
    rows = run_extrapolation(model, factors=(1, 2), max_tokens=64, text=np.random.default_rng(1).integers(0, 50, 300))
    for row in rows:
        row["benchmark"] = "rope_extrapolation"  # (the harness's name for it)
    (tmp_path / "out").mkdir()
    append_records(tmp_path / "out" / "records.jsonl", rows)
    build_report(tmp_path / "out")
    table = (tmp_path / "out" / "tables" / "rope_extrapolation.csv").read_text().splitlines()
    assert [line.split(",")[:3] for line in table] == [["model", "factor", "tokens"], ["stub", "1", "16"],
                                                       ["stub", "2", "32"]]  # fmt: skip
    assert (tmp_path / "out" / "rope_extrapolation.png").exists()
