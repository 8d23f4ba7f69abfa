"""Long-context benchmarks over an EvalModel: passkey retrieval, a chunked-prefill context sweep and RoPE
extrapolation. Each returns records (`make_record`); a length the model cannot run is a record with a
`status` (too_long, too_short, oom, over_budget, not_enough_text), never a crash.

needle        A passkey sentence inserted at a depth of filler text (Mohtashami & Jaggi 2023, "Landmark
              Attention", section 4.2), then "What is the pass key? The pass key is". Strict accuracy: the
              greedy continuation starts with the key's digits. Likelihood gain: log p(key | with needle) -
              log p(key | the same text without it), informative even when strict accuracy is 0 (seed
              dba-scaling-low-rank-routing.md, appendix C).
context_sweep Chunked prefill to each length, then a few greedy decode steps at that context: prefill time,
              last-chunk latency, decode ms/token and the teacher-forced loss of the last chunk (seed
              dba-structural-regularization.md, appendix D).
extrapolation Loss on held-out text at 1x, 2x, 4x the training context, in non-overlapping windows, with
              the loss of each training-context-wide segment of positions, so a RoPE failure beyond the
              trained positions shows up as a jump in the later segments.
stream_loss   Loss by position over long streams read whole (a memory model reads them through its memory,
              block by block): StreamingLLM's perplexity-by-position comparison of full cache, window, sinks
              and bounded memories (Xiao et al. 2024, figure 3), in buckets with intervals over streams.

Held-out text for every benchmark comes from `heldout_tokens`: the model's own dataset's test (else val)
split, a text file, or given token ids.
"""

from __future__ import annotations

import random
import re
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from attnlab.accounting import kv_report
from attnlab.config import DataConfig
from attnlab.data import prepare
from attnlab.errors import DataError, InputError, LengthWarning
from attnlab.eval.perplexity import dataset_split, press_problem, summarize_losses, token_digest
from attnlab.eval.records import make_record
from attnlab.eval.scoring import continuation_logprobs
from attnlab.eval.speed import dtype_name, run_guarded, synchronize, timed
from attnlab.generate import decode_step, generate, refuse_nan_logits

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


# ----------------------------------------------------------------------------- held-out text


def heldout_tokens(model, text=None, split: str | None = None, data_dir=None, cache_dir=None,
                   dataset: str | None = None) -> tuple[np.ndarray, str]:  # fmt: skip
    """(n,) token ids of held-out text and a label of where they came from.

    text: None = the model's own dataset (`prepare(DataConfig(**model.config["data"]))`), split `split`
    (default: test if the dataset has one, else val; never train unless named), or `dataset` (a named dataset
    or file, e.g. wikitext2-raw, tokenized with the model's tokenizer: a pretrained model); a str / Path = a
    text file encoded with the model's tokenizer; anything else = token ids (array, list or tensor), as given.
    """
    if isinstance(text, str | Path):
        path = Path(text)
        if not path.is_file():
            raise DataError(f"{path}: no such text file")
        if model.tokenizer is None:
            raise DataError(f"{model.path}: no tokenizer saved with this checkpoint: cannot encode {path}")
        return np.asarray(model.tokenizer.encode(path.read_text()), dtype=np.int64), f"file:{path}"
    if text is not None:
        return np.asarray(text, dtype=np.int64).reshape(-1), "given"
    if dataset is not None:
        return dataset_split(model, dataset, split or "test", data_dir), f"{dataset}:{split or 'test'}"
    data = model.config.get("data")
    if not data:
        raise DataError(
            f"{model.path}: no data config saved with this model: name a dataset (e.g. dataset=wikitext2-raw), a "
            "text file or token ids"
        )
    prepared = prepare(DataConfig(**data), data_dir=data_dir, cache_dir=cache_dir, tokenizer=model.tokenizer)
    split = split or ("test" if prepared.meta["splits"].get("test", {}).get("tokens") else "val")
    tokens = prepared.split(split)
    if len(tokens) < 2:
        raise DataError(f"{prepared.path}: split {split!r} has {len(tokens)} tokens")
    return tokens, f"{data['source']}:{split}"


def _window(tokens: np.ndarray, start: int, length: int) -> np.ndarray:
    """tokens[start : start + length], wrapping around the end (for filler only: never for scored text)."""
    return np.take(tokens, np.arange(start, start + length) % len(tokens)).astype(np.int64)


# ----------------------------------------------------------------------------- needle / passkey


@dataclass(frozen=True)
class PasskeyPrompt:
    """One trial's token ids: `before + needle + after` is the prompt (with the needle), `before + after` the
    same text without it, `answer` the key's ids as they follow "The pass key is"."""

    before: list[int]
    needle: list[int]
    after: list[int]
    answer: list[int]

    @property
    def with_needle(self) -> list[int]:
        return self.before + self.needle + self.after

    @property
    def without_needle(self) -> list[int]:
        return self.before + self.after


def passkey_prompt(
    tokenizer,
    filler: np.ndarray,
    length: int,
    depth: float,
    key: str,
    offset: int = 0,
    intro: str = INTRO,
    needle: str = NEEDLE,
    question: str = QUESTION,
) -> PasskeyPrompt | None:
    """Lays out intro, filler[:a], needle, filler[a:F], question so prompt + answer is `length` tokens, with
    a = round(depth * F) (depth 0 = the needle first, 1 = last before the question). None when `length`
    cannot hold the fixed parts. filler: ids, read from `offset` on and repeated when too short."""
    intro_ids = tokenizer.encode(intro) if intro else []
    needle_ids = tokenizer.encode(" " + needle.format(key=key))
    question_ids = tokenizer.encode("\n" + question)
    answer = tokenizer.encode(" " + key)
    n_filler = length - len(intro_ids) - len(needle_ids) - len(question_ids) - len(answer)
    if n_filler < 0:
        return None
    at = round(depth * n_filler)
    filler_ids = _window(filler, offset, n_filler).tolist()
    return PasskeyPrompt(intro_ids + filler_ids[:at], needle_ids, filler_ids[at:] + question_ids, answer)


def _starts_with_key(output: str, key: str) -> bool:
    """The continuation's first number is the key (leading whitespace allowed; "714320" is not "71432")."""
    match = re.match(r"\s*(\d+)", output)
    return match is not None and match.group(1) == key


def needle_trial(module, tokenizer, prompt: PasskeyPrompt, key: str, gain: bool = True) -> dict:
    """Greedy retrieval and (gain=True) the needle's likelihood gain (nats) for one prompt: the gain reads the
    prompt twice more, with and without the needle, so it triples the trial's cost."""
    budget = len(prompt.answer) + 2
    if module.cfg.memory.kind == "none":  # what the context leaves (the answer itself always fits: it is scored)
        budget = min(budget, module.cfg.max_seq_len - len(prompt.with_needle))
    ids = generate(
        module,
        prompt.with_needle,
        max_new_tokens=budget,
        temperature=0.0,
        stop_tokens=[tokenizer.eot_id],
        compile=False,  # a few tokens per prompt: compiling the decode step would cost more than it saves
    ).tolist()
    output = tokenizer.decode([i for i in ids if i != tokenizer.eot_id])
    correct = _starts_with_key(output, key)
    retrieval = {"key": key, "needle_at": len(prompt.before), "output": output, "correct": correct}
    if not gain:
        return retrieval
    with_needle = continuation_logprobs(module, prompt.with_needle, prompt.answer).sum().item()
    without = continuation_logprobs(module, prompt.without_needle, prompt.answer).sum().item()
    return {**retrieval, "logp_with": with_needle, "logp_without": without, "gain": with_needle - without}


def _needle_summary(trials: list[dict]) -> dict:
    retrieval = {"trials": len(trials), "correct": sum(t["correct"] for t in trials),
                 "accuracy": float(np.mean([t["correct"] for t in trials]))}  # fmt: skip
    if "gain" not in trials[0]:  # gain=False: retrieval only
        return retrieval
    gains = np.array([t["gain"] for t in trials], dtype=np.float64)
    sem = float(gains.std(ddof=1) / np.sqrt(len(gains))) if len(gains) > 1 else None  # standard error of the mean
    return {
        **retrieval,
        "gain_mean": float(gains.mean()), "gain_sem": sem,
        "gain_min": float(gains.min()), "gain_max": float(gains.max()),
        "logp_with_mean": float(np.mean([t["logp_with"] for t in trials])),
        "logp_without_mean": float(np.mean([t["logp_without"] for t in trials])),
    }  # fmt: skip


def passkeys(rng: random.Random, key_digits: int, trials: int) -> list[str]:
    """The trials' passkeys, drawn first from the needle benchmark's seeded rng (its filler offsets follow)."""
    return [str(rng.randrange(10 ** (key_digits - 1), 10**key_digits)) for _ in range(trials)]


def fixed_tokens(tokenizer, key: str, intro: str = INTRO, needle: str = NEEDLE, question: str = QUESTION) -> int:
    """The tokens a passkey prompt's fixed parts take (intro, needle, question, answer): the least length that can
    hold it, with no filler at all."""
    fixed = [intro and tokenizer.encode(intro), tokenizer.encode(" " + needle.format(key=key)),
             tokenizer.encode("\n" + question), tokenizer.encode(" " + key)]  # fmt: skip
    return sum(len(part or []) for part in fixed)


def run_needle(
    model,
    lengths=None,
    depths=DEPTHS,
    trials: int = 5,
    seed: int = 0,
    key_digits: int = 5,
    filler: str = "sentences",
    text=None,
    split: str | None = None,
    data_dir=None,
    dataset: str | None = None,
    intro: str = INTRO,
    needle: str = NEEDLE,
    question: str = QUESTION,
    gain: bool = True,
) -> list[dict]:
    """`needle` records: one per (length, depth) cell (scope "cell", with every trial), then one overall.

    lengths: total tokens of prompt + key (default max_seq_len / 4, / 2 and max_seq_len); trial t uses the
    same seeded key (and filler offset) in every cell, so cells compare paired trials. filler: "sentences"
    (FILLER repeated) or "heldout" (text from `heldout_tokens(model, text, split, data_dir)`). gain=False
    measures retrieval only (a third of the forward passes): records then carry no gain fields.
    """
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InputError(f"{model.path}: the needle benchmark needs the model's tokenizer (none was found)")
    max_len = model.cfg.max_seq_len
    lengths = sorted(set(lengths or (max_len // 4, max_len // 2, max_len)))
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise InputError(f"depths={list(depths)} must lie in [0, 1]")
    if filler == "sentences":
        filler_ids, origin = np.asarray(tokenizer.encode(" " + FILLER), dtype=np.int64), "sentences"
    elif filler == "heldout":
        filler_ids, origin = heldout_tokens(model, text, split, data_dir, dataset=dataset)
    else:
        raise InputError(f"filler={filler!r} is not known (use 'sentences' or 'heldout')")
    rng = random.Random(seed)
    keys = passkeys(rng, key_digits, trials)
    offsets = [rng.randrange(len(filler_ids)) if filler == "heldout" else 0 for _ in range(trials)]
    if tokenizer.decode(tokenizer.encode(" " + keys[0])).strip() != keys[0]:
        raise InputError(f"tokenizer {tokenizer.name!r} cannot spell a passkey ({keys[0]!r} does not round-trip)")
    common = {"filler": origin, "seed": seed, "key_digits": key_digits, "max_seq_len": max_len, "gain": gain}
    rows, done = [], []
    for length in lengths:
        for depth in depths:
            cell = {"scope": "cell", "length": length, "depth": depth, **common}
            if length > max_len:
                rows.append(make_record("needle", model, status="too_long", **cell))
                continue
            results = []
            for key, offset in zip(keys, offsets, strict=True):
                prompt = passkey_prompt(tokenizer, filler_ids, length, depth, key, offset, intro, needle, question)
                if prompt is None:
                    break
                results.append(needle_trial(model.model, tokenizer, prompt, key, gain))
            if not results:  # the tokens its fixed parts take (intro, needle, question, answer): the least length
                needs = fixed_tokens(tokenizer, keys[0], intro, needle, question)
                rows.append(make_record("needle", model, status="too_short", needs=needs, **cell))
                continue
            done += results
            summary = _needle_summary(results)
            rows.append(make_record("needle", model, status="ok", **cell, **summary, results=results))
    if done:
        overall = {"scope": "overall", "lengths": lengths, "depths": list(depths), **common}
        rows.append(make_record("needle", model, status="ok", **overall, **_needle_summary(done)))
    return rows


# ----------------------------------------------------------------------------- context sweep


@torch.no_grad()
def sweep_one(module, tokens: torch.Tensor, chunk_size: int, decode_tokens: int) -> dict:
    """tokens (1, L + 1): prefill tokens[:, :L] in chunks, score the last chunk against the next tokens, then
    `decode_tokens` greedy steps. Times in milliseconds (device synchronised around each timed call)."""
    device, length = tokens.device, tokens.shape[1] - 1
    inputs = tokens[:, :length]  # (1, L)
    cache = module.new_cache(1, length + decode_tokens)
    chunk_ms, logits, start = [], None, 0
    for start in range(0, length, chunk_size):
        (logits, _), seconds = timed(lambda s=start: module(inputs[:, s : s + chunk_size], cache=cache), device)
        chunk_ms.append(seconds * 1e3)
    refuse_nan_logits(module, logits, f"at the last chunk of {length} held-out tokens")
    # The last chunk's logits (1, C, V) predict tokens start + 1 .. L: teacher-forced, full context before.
    last_loss = F.cross_entropy(logits[0].float(), tokens[0, start + 1 :]).item()
    token = logits[:, -1:].argmax(dim=-1)  # (1, 1)
    step_ms = []
    for _ in range(decode_tokens):
        next_logits, seconds = timed(lambda t=token: decode_step(module, t, cache), device)
        step_ms.append(seconds * 1e3)
        token = next_logits.argmax(dim=-1, keepdim=True)  # (1, 1)
    synchronize(device)
    return {
        "prefill_ms": sum(chunk_ms), "prefill_tokens_per_s": length / (sum(chunk_ms) / 1e3),
        "chunks": len(chunk_ms), "last_chunk_tokens": length - start, "last_chunk_ms": chunk_ms[-1],
        "last_chunk_loss": last_loss, "last_chunk_ppl": float(np.exp(last_loss)), "decode_steps": decode_tokens,
        "decode_ms_per_token": float(np.median(step_ms)) if step_ms else None, "decode_ms": step_ms,
        "kv_bytes": cache.nbytes(),
    }  # fmt: skip


def context_sweep(
    model,
    lengths=(512, 1024, 2048, 4096),
    chunk_size: int = 512,
    decode_tokens: int = 8,
    text=None,
    split: str | None = None,
    data_dir=None,
    dataset: str | None = None,
    offset: int = 0,
    max_kv_bytes: int | None = None,
    warmup: bool = True,
) -> list[dict]:
    """`context_sweep` records, one per length: chunked prefill of held-out text tokens[offset : offset + L],
    its last chunk's loss, and up to `decode_tokens` greedy decode steps at that context (fewer when
    L + decode_tokens passes max_seq_len). Statuses: ok, too_long (L > max_seq_len), not_enough_text,
    over_budget (the analytic KV cache exceeds max_kv_bytes: not tried) and oom (out of memory, caught).
    `warmup` runs one short untimed prefill and decode first."""
    if chunk_size < 1 or decode_tokens < 0:
        raise InputError(f"chunk_size={chunk_size} must be >= 1 and decode_tokens={decode_tokens} >= 0")
    tokens, origin = heldout_tokens(model, text, split, data_dir, dataset=dataset)
    max_len, device = model.cfg.max_seq_len, model.device
    warmup_length = min(chunk_size, max_len - 2, len(tokens) - 1)
    if warmup and warmup_length >= 1:  # one untimed short run, so the first length pays no one-time costs
        ids = torch.from_numpy(np.asarray(tokens[: warmup_length + 1], dtype=np.int64)).to(device)[None]
        run_guarded(lambda: sweep_one(model.model, ids, chunk_size, 2))
    rows, cut = [], []
    for length in sorted(lengths):
        steps = max(0, min(decode_tokens, max_len - length))
        common = {"length": length, "chunk_size": chunk_size, "text": origin, "offset": offset, "max_seq_len": max_len}
        record = partial(make_record, "context_sweep", model, **common)  # record(status=..., **figures)

        if length > max_len:
            rows.append(record(status="too_long"))
            continue
        if len(tokens) < offset + length + 1:
            rows.append(record(status="not_enough_text", text_tokens=len(tokens)))
            continue
        if max_kv_bytes is not None:
            dtype = dtype_name(next(model.model.parameters()).dtype)
            analytic = kv_report(model.cfg, dtype, length + steps)["kv_bytes"]
            if analytic > max_kv_bytes:
                rows.append(record(status="over_budget", kv_bytes_analytic=analytic, max_kv_bytes=max_kv_bytes))
                continue
        ids = torch.from_numpy(np.asarray(tokens[offset : offset + length + 1], dtype=np.int64)).to(device)[None]
        figures, error = run_guarded(lambda ids=ids, steps=steps: sweep_one(model.model, ids, chunk_size, steps))
        rows.append(record(status="oom", error=error) if error is not None else record(status="ok", **figures))
        if steps < decode_tokens:
            cut.append(f"{steps} at length {length}")
    if cut:  # as generate says a max_new_tokens cut to the room left (latency refuses one prompt that has none)
        warnings.warn(f"context_sweep: decode_tokens={decode_tokens} passes max_seq_len={max_len} after the context, "
                      f"so fewer decode steps were measured ({', '.join(cut)}; each record's decode_steps): give "
                      "decode_tokens that fit, or shorter lengths", LengthWarning, stacklevel=2)  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- RoPE extrapolation


@torch.no_grad()
def position_losses(module, tokens: np.ndarray, seq_len: int, windows: int) -> torch.Tensor:
    """(windows, seq_len) fp32 loss of each target in `windows` non-overlapping windows of seq_len inputs:
    window w reads tokens[w L : (w + 1) L] and predicts tokens[w L + 1 : (w + 1) L + 1]."""
    device = next(module.parameters()).device
    rows = []
    for w in range(windows):
        window = torch.from_numpy(np.asarray(tokens[w * seq_len : (w + 1) * seq_len + 1], dtype=np.int64)).to(device)
        logits, _ = module(window[None, :-1], use_cache=False)  # (1, L, V)
        refuse_nan_logits(module, logits, f"on the held-out window of tokens {w * seq_len}..{(w + 1) * seq_len}")
        rows.append(F.cross_entropy(logits[0].float(), window[1:], reduction="none"))  # (L,)
    return torch.stack(rows)  # (W, L)


def run_extrapolation(
    model,
    factors=(1, 2, 4),
    train_seq_len: int | None = None,
    max_tokens: int = 65536,
    text=None,
    split: str | None = None,
    data_dir=None,
    dataset: str | None = None,
) -> list[dict]:
    """`extrapolation` records, one per factor: loss at seq_len = factor * train_seq_len (default the run's
    train.seq_len, else max_seq_len) over floor(max_tokens / seq_len) non-overlapping windows (at least one)
    of the same held-out text, with a bootstrap interval over windows and `segment_loss`: the mean loss at
    input positions [k T, (k + 1) T) for each training-context-wide segment k. Lengths beyond max_seq_len
    are too_long; text shorter than one window is not_enough_text."""
    train_seq_len = train_seq_len or model.config.get("train", {}).get("seq_len") or model.cfg.max_seq_len
    tokens, origin = heldout_tokens(model, text, split, data_dir, dataset=dataset)
    rows = []
    for factor in factors:
        seq_len = int(round(factor * train_seq_len))
        common = {"factor": factor, "seq_len": seq_len, "train_seq_len": train_seq_len, "text": origin,
                  "max_tokens": max_tokens, "max_seq_len": model.cfg.max_seq_len,
                  "tokenizer": tokenizer_name(model, text, dataset)}  # fmt: skip
        record = partial(make_record, "extrapolation", model, **common)  # record(status=..., **figures)

        if seq_len > model.cfg.max_seq_len:
            rows.append(record(status="too_long"))
            continue
        windows = min(max(1, max_tokens // seq_len), (len(tokens) - 1) // seq_len)
        if windows < 1:
            rows.append(record(status="not_enough_text", text_tokens=len(tokens)))
            continue
        losses, error = run_guarded(lambda n=windows, s=seq_len: position_losses(model.model, tokens, s, n))
        if error is not None:
            rows.append(record(status="oom", error=error))
            continue
        # Mean loss over input positions [k T, (k + 1) T): past k = 0 the positions were never trained on.
        segments = [losses[:, k : k + train_seq_len].mean().item() for k in range(0, seq_len, train_seq_len)]
        summary = summarize_losses([(row.sum().item(), seq_len) for row in losses])  # bootstrap over windows
        read = token_digest(tokens[: windows * seq_len + 1])  # the ids the windows read
        rows.append(record(status="ok", **summary, segment_loss=segments, text_tokens=len(tokens), tokens_sha256=read))
    return rows


def tokenizer_name(model, text=None, dataset: str | None = None) -> str | None:
    """The tokenizer that made heldout_tokens' ids (what, with their number, tells two records' windows apart): the
    run's data tokenizer for its own split, the model's for a dataset or a text file; None for ids given as such."""
    if text is None and dataset is None:
        return model.config.get("data", {}).get("tokenizer")
    if text is not None and not isinstance(text, str | Path):
        return None
    return getattr(model.tokenizer, "name", None)


# ----------------------------------------------------------------------------- loss by position over streams


def bucket_means(losses: torch.Tensor, bucket: int, n_boot: int = 2000, seed: int = 0, level: float = 0.95):
    """losses (streams, length) -> (start of each bucket, mean loss per bucket, [low, high] per bucket): each
    bucket's mean over its positions and the streams, with a percentile-bootstrap interval over streams."""
    streams, length = losses.shape
    starts = list(range(0, length, bucket))
    per_stream = np.stack([losses[:, s : s + bucket].double().mean(dim=1).numpy() for s in starts], axis=1)  # (W, B)
    picks = np.random.default_rng(seed).integers(0, streams, size=(n_boot, streams))
    boot = per_stream[picks].mean(axis=1)  # (n_boot, B)
    low, high = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return starts, per_stream.mean(axis=0).tolist(), [[float(a), float(b)] for a, b in zip(low, high, strict=True)]


DEFAULT_BUCKET = 256  # stream_loss's positions per bucket when none is given (a shorter stream: one bucket)


def run_stream_loss(
    model,
    length: int = 8192,
    streams: int = 8,
    bucket: int | None = None,
    text=None,
    split: str | None = None,
    data_dir=None,
    dataset: str | None = None,
) -> list[dict]:
    """One `stream_loss` record: the loss at every position of `streams` non-overlapping streams of `length`
    held-out tokens, each read whole in one forward pass (a model with a memory reads it through the memory, block
    by block, so its later positions see only what the memory kept), as the mean over each `bucket` positions (default
    DEFAULT_BUCKET, or the whole stream when shorter) with
    a bootstrap interval over streams, and the streams' perplexity (bootstrap over streams). A length beyond
    max_seq_len without a memory is too_long; text shorter than one stream is not_enough_text."""
    bucket = min(DEFAULT_BUCKET, length) if bucket is None else bucket  # (the default: at most the whole stream)
    if length < 2 or streams < 1 or bucket < 1:
        raise InputError(f"length={length} must be >= 2, streams={streams} and bucket={bucket} >= 1")
    if bucket > length:
        raise InputError(f"bucket={bucket} is longer than a stream (length={length}): give a bucket of at most "
                         f"{length} positions")  # fmt: skip
    problem = press_problem(model.cfg, "length", length)
    if problem:
        raise InputError(problem)
    tokens, origin = heldout_tokens(model, text, split, data_dir, dataset=dataset)
    memory = model.cfg.memory
    common = {"length": length, "bucket": bucket, "text": origin, "max_seq_len": model.cfg.max_seq_len,
              "memory": memory.kind, "memory_slots": memory.read_slots}  # fmt: skip
    record = partial(make_record, "stream_loss", model, **common)
    if length > model.cfg.max_seq_len and memory.kind == "none":
        return [record(status="too_long")]
    windows = min(streams, (len(tokens) - 1) // length)
    if windows < 1:
        return [record(status="not_enough_text", text_tokens=len(tokens))]
    if windows < streams:  # probe M m8: the record's interval is over fewer streams than asked
        warnings.warn(f"stream_loss: {origin} holds {windows} stream(s) of {length:,} tokens ({len(tokens):,} "
                      f"tokens), not the {streams} asked: scoring {windows} (a smaller length fits more)",
                      LengthWarning, stacklevel=2)  # fmt: skip
    losses, error = run_guarded(lambda: position_losses(model.model, tokens, length, windows))
    if error is not None:
        return [record(status="oom", error=error)]
    starts, means, intervals = bucket_means(losses, bucket)
    summary = summarize_losses([(row.sum().item(), length) for row in losses])
    return [record(status="ok", streams=windows, **summary, positions=starts, bucket_loss=means,
                   bucket_ci=intervals)]  # fmt: skip
