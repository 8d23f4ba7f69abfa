"""Held-out perplexity: non-overlapping windows (or a given stride) over a split, on a fixed token budget,
scored over the true vocabulary, with a confidence interval.

With stride < seq_len, windows overlap and each scores only its last `stride` tokens (the first window
scores all of its tokens), so every token is scored exactly once with up to seq_len - stride tokens of
context (the "sliding window" evaluation of Hugging Face's perplexity guide). The interval is a percentile
bootstrap over windows (tokens inside a window are correlated; windows much less so).
"""

from __future__ import annotations

import hashlib
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from attnlab.config import PRESSES, DataConfig
from attnlab.data import prepare
from attnlab.data.sources import open_source
from attnlab.errors import DataError, InputError
from attnlab.eval.records import make_record
from attnlab.eval.stats import bootstrap_ci
from attnlab.generate import refuse_nan_logits


def press_problem(cfg, key: str, length: int) -> str | None:
    """Why windows of `length` tokens, each read in one pass, would not measure cfg's press (memory.kind snapkv,
    tova, knorm), or None: a press reads a sequence as one chunk unless memory.block is shorter, and drops tokens
    only after the chunk's attention, so every loss would be the dense model's, whatever the budget."""
    memory = cfg.memory
    if memory.kind not in PRESSES or memory.block_size < length:
        return None
    block = "memory.block unset" if memory.block is None else f"memory.block={memory.block}"
    return (f"{key}={length}: a model with memory.kind={memory.kind} reads {length} tokens as one chunk ({block}) "
            "and presses only after the chunk's attention, so every loss would be the dense model's: measure the "
            "press with context_sweep (its last chunk reads through the pressed earlier ones) or needle, or convert "
            f"with memory.block below {length} so that later blocks read through the press")  # fmt: skip


BAR_DELAY = 2.0  # seconds before a perplexity shows its bar of tokens scored (on a terminal; a short one shows none)


def score_bar(total: int, desc: str, unit: str) -> tqdm:
    """A scorer's bar on stderr, shown only on a terminal (disable=None) and after BAR_DELAY seconds, cleared at
    its end: the perplexity's tokens, the KV policies' windows."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "tok", dynamic_ncols=True, delay=BAR_DELAY,
                disable=None, leave=False, file=sys.stderr)  # fmt: skip


@torch.no_grad()
def window_losses(
    model, tokens: np.ndarray, seq_len: int, stride: int | None = None, max_tokens: int | None = None
) -> list[tuple[float, int]]:
    """[(summed loss in nats, tokens scored)] per window, in order, until max_tokens targets are scored.

    Window w reads tokens[b : b + L] (b = w * stride) and predicts tokens[b + 1 : b + L + 1]; it scores only
    the targets no earlier window scored, so each target counts once. On a terminal, a bar of the tokens scored
    shows on stderr after BAR_DELAY seconds (a whole split can take minutes).
    """
    stride = stride or seq_len
    if not 1 <= stride <= seq_len:
        raise InputError(f"stride={stride} must be between 1 and seq_len={seq_len}")
    if len(tokens) < 2:
        raise DataError("the split has fewer than 2 tokens")
    budget = min(max_tokens or len(tokens), len(tokens) - 1)
    device = next(model.parameters()).device
    results, scored_until, begin = [], 0, 0  # scored_until: index of the last target scored so far
    with score_bar(budget, "perplexity", "tok") as bar:
        while scored_until < budget:
            length = min(seq_len, len(tokens) - 1 - begin)  # inputs in this window
            new = begin + length - scored_until  # targets not scored by an earlier window: the window's last `new`
            take = min(new, budget - scored_until)  # the first `take` of them, within the budget
            window = torch.from_numpy(tokens[begin : begin + length + 1].astype(np.int64)).to(device)  # (L + 1,)
            logits, _ = model(window[None, :-1], use_cache=False)  # (1, L, V), true vocabulary only
            refuse_nan_logits(model, logits, f"on the held-out window of tokens {begin}..{begin + length}")
            losses = F.cross_entropy(logits[0].float(), window[1:], reduction="none")  # (L,)
            results.append((losses[length - new : length - new + take].sum().item(), take))
            scored_until += take
            begin += stride
            bar.update(take)
    return results


def token_digest(tokens) -> str:
    """16 hex digits of sha256 over token ids (as little-endian int64, whatever their stored type): what tells two
    records' windows apart when their settings agree (another tokenizer, or the text prepared otherwise). Read in
    chunks: a memory-mapped split is never copied whole."""
    digest, chunk = hashlib.sha256(), 1 << 20
    for start in range(0, len(tokens), chunk):
        digest.update(np.asarray(tokens[start : start + chunk], dtype="<i8").tobytes())
    return digest.hexdigest()[:16]


def exp_or_inf(loss: float) -> float:
    """exp(loss), infinite past the largest float (math.exp raises OverflowError there: a diverged model's loss of
    710 nats or more); NaN stays NaN."""
    return math.exp(loss) if not loss > 709.78 else math.inf


def summarize_losses(windows: list[tuple[float, int]], n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Mean loss per token, perplexity, and a percentile-bootstrap interval over windows."""
    sums = np.array([s for s, _ in windows], dtype=np.float64)
    counts = np.array([n for _, n in windows], dtype=np.float64)
    loss = sums.sum() / counts.sum()
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(windows), size=(n_boot, len(windows)))
    boot = sums[picks].sum(axis=1) / counts[picks].sum(axis=1)
    low, high = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return {
        "loss": float(loss), "ppl": exp_or_inf(loss), "tokens": int(counts.sum()), "windows": len(windows),
        "loss_ci": [float(low), float(high)], "ppl_ci": [exp_or_inf(low), exp_or_inf(high)], "ci_level": level,
        "window_loss": sums.tolist(), "window_tokens": counts.astype(int).tolist(),  # for paired comparisons
    }  # fmt: skip


def paired_difference(a: dict, b: dict, n_boot: int = 10000, seed: int = 0, level: float = 0.95) -> dict:
    """Loss (and perplexity) of record a minus record b, scored on the same windows of the same tokens, with a
    paired percentile-bootstrap interval: windows are resampled with the same indices for both, so what the
    windows share (their text) cancels. Records from `summarize_losses` (window_loss, window_tokens)."""
    for name, record in (("a", a), ("b", b)):
        if not isinstance(record.get("window_loss"), list) or not isinstance(record.get("window_tokens"), list):
            raise InputError(f"record {name} ({record.get('model')}) holds no per-window losses: run its "
                             "benchmark again with this version to compare it window by window")  # fmt: skip
    for record in (a, b):
        if len(record["window_loss"]) != len(record["window_tokens"]) or not record["window_tokens"]:
            raise InputError(f"record of {record.get('model')} has {len(record['window_loss'])} window losses and "
                             f"{len(record['window_tokens'])} window token counts: one of each per window, at least "
                             "one (the record was changed: run its benchmark again)")  # fmt: skip
    if a["window_tokens"] != b["window_tokens"]:
        raise InputError(f"{a.get('model')} and {b.get('model')} were not scored on the same windows "
                         f"({len(a['window_tokens'])} and {len(b['window_tokens'])} windows): use the same "
                         "dataset, seq_len, stride and max_tokens")  # fmt: skip
    counts = torch.tensor(a["window_tokens"], dtype=torch.float64)
    sums_a, sums_b = (torch.tensor(r["window_loss"], dtype=torch.float64) for r in (a, b))

    def stat(exp: bool):  # resampled (n_boot, W) sums of a and b and their windows' counts -> (n_boot,)
        def difference(x, y, c):
            loss_x, loss_y = x.sum(dim=1) / c.sum(dim=1), y.sum(dim=1) / c.sum(dim=1)
            return loss_x.exp() - loss_y.exp() if exp else loss_x - loss_y

        return difference

    dloss = bootstrap_ci(sums_a, sums_b, counts, stat=stat(False), n=n_boot, seed=seed, level=level)
    dppl = bootstrap_ci(sums_a, sums_b, counts, stat=stat(True), n=n_boot, seed=seed, level=level)
    loss_a, loss_b = float(sums_a.sum() / counts.sum()), float(sums_b.sum() / counts.sum())
    return {"dloss": loss_a - loss_b, "dloss_ci": list(dloss), "dppl": exp_or_inf(loss_a) - exp_or_inf(loss_b),
            "dppl_ci": list(dppl), "ppl_a": exp_or_inf(loss_a), "ppl_b": exp_or_inf(loss_b), "windows": len(counts),
            "tokens": int(counts.sum()), "ci_level": level}  # fmt: skip


def prepared_heldout(eval_model, data_dir: str | None = None):
    """The prepared dataset the checkpoint was trained on (its saved data config): its held-out splits."""
    data = eval_model.config.get("data")
    if not data:  # InputError: the benchmark's harness names its own dataset parameter in the fix
        raise InputError(
            f"{eval_model.path}: no data config saved with this model (a converted or pretrained model keeps none): "
            "cannot find its held-out split (name a dataset: dataset=wikitext2-raw)"
        )
    return prepare(DataConfig(**data), data_dir=data_dir, tokenizer=eval_model.tokenizer)  # (a model's: needed)


def missing_split(eval_model, prepared, split: str, given: str) -> str | None:
    """Why the model's own prepared data has no split `split` (given as `given`: "split='test'", "--split test"),
    naming the model, its data and the splits it has, or None."""
    if split in prepared.splits:
        return None
    source = eval_model.config.get("data", {}).get("source")
    why = ": a source without split files of its own is divided into train and val unless data.test_fraction > 0"
    why = why if split == "test" else ""
    return (f"{given}: {eval_model.name}'s data ({source}, prepared in {prepared.path}) has no {split!r} split (it has "
            f"{', '.join(prepared.splits)}{why})")  # fmt: skip


def heldout_split(eval_model, split: str, data_dir: str | None = None) -> np.ndarray:
    """The token ids of `split` of the dataset the checkpoint was trained on (its saved data config)."""
    prepared = prepared_heldout(eval_model, data_dir)
    problem = missing_split(eval_model, prepared, split, f"split={split!r}")
    if problem:
        has = "val" if "val" in prepared.splits else prepared.splits[-1]
        raise InputError(f"{problem}: score one it has (e.g. split={has!r})")
    return prepared.split(split)


def dataset_split(eval_model, dataset: str, split: str, data_dir: str | None = None) -> np.ndarray:
    """`split` of the named dataset (or local file) `dataset`, tokenized with the model's own tokenizer: its
    documents joined by a blank line and read as one stream (a pretrained model has no prepared data)."""
    if eval_model.tokenizer is None:
        raise DataError(f"{eval_model.path}: no tokenizer with this model: cannot tokenize {dataset}")
    return dataset_tokens(eval_model.tokenizer, dataset, split, data_dir)


def dataset_tokens(tokenizer, dataset: str, split: str, data_dir: str | None = None) -> np.ndarray:
    """`split` of `dataset` (a named dataset or local file) read as one stream by `tokenizer`."""
    source = open_source(dataset, data_dir, splits=(split,))
    texts, documents = [], 0
    for name, text in source.documents():
        documents += 1
        if name == split:
            texts.append(text)
    if not documents and source.files:  # an empty or blank file has no split to name
        raise DataError(f"{dataset} holds no text (it is empty, or blank lines only): give a file with text")
    if not texts:
        raise DataError(f"{dataset} has no {split!r} split here (check the split's name, or the data directory)")
    return stream_ids(tokenizer, "\n\n".join(texts))


STREAMS_KEPT = 4  # texts whose ids a tokenizer remembers (WikiText-2's test split: 2.4 MB of int64 ids)


def stream_ids(tokenizer, text: str) -> np.ndarray:
    """tokenizer.encode(text) as int64 ids, a new array each call; the ids of the last STREAMS_KEPT texts are
    remembered on the tokenizer by the text's sha256, so that benchmarks of one model on one dataset (perplexity,
    needle, kv_quant, ... in one bench) tokenize its split once (SmolLM2's tokenizer: seconds for WikiText-2's)."""
    key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    kept = tokenizer.__dict__.setdefault("_stream_ids", {})
    if key not in kept:
        while len(kept) >= STREAMS_KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = np.asarray(tokenizer.encode(text), dtype=np.int64)
    return kept[key].copy()


def eval_tokens(eval_model, split: str, data_dir: str | None = None, dataset: str | None = None):
    """(token ids, dataset name, tokenizer name) of held-out text: `split` of the model's own prepared dataset,
    or, with `dataset` (a named dataset or file, e.g. wikitext2-raw), of that text tokenized with the model's
    own tokenizer (what a pretrained model is scored on)."""
    if dataset is None:
        tokens = heldout_split(eval_model, split, data_dir)  # raises without a saved data config
        data = eval_model.config["data"]
        return tokens, data["source"], data["tokenizer"]
    return dataset_split(eval_model, dataset, split, data_dir), dataset, eval_model.tokenizer.name


def run_perplexity(eval_model, split: str = "test", seq_len: int | None = None, stride: int | None = None,
                   max_tokens: int | None = None, data_dir: str | None = None,
                   dataset: str | None = None) -> dict:  # fmt: skip
    """A `perplexity` record for a model on its own dataset's held-out split (never the training split unless
    asked for by name), or on `dataset` (a named dataset or file, e.g. wikitext2-raw) tokenized with its own
    tokenizer: what a pretrained model is scored on. seq_len defaults to the run's training context."""
    seq_len = seq_len or eval_model.config.get("train", {}).get("seq_len") or eval_model.cfg.max_seq_len
    problem = press_problem(eval_model.cfg, "seq_len", seq_len)
    if problem:
        raise InputError(problem)
    limit = eval_model.cfg.max_seq_len
    if seq_len > limit and eval_model.cfg.memory.kind == "none":  # (a memory reads past it) before the text is read
        raise InputError(f"seq_len={seq_len} exceeds {eval_model.name}'s max_seq_len {limit} (a window is read in one "
                         f"pass): give seq_len <= {limit}")  # fmt: skip
    tokens, dataset, tokenizer = eval_tokens(eval_model, split, data_dir, dataset)
    windows = window_losses(eval_model.model, tokens, seq_len, stride, max_tokens)
    if len(windows) < 2 and max_tokens is not None and max_tokens < len(tokens) - 1:  # a zero-width interval
        raise InputError(f"max_tokens={max_tokens} scores a single window of seq_len={seq_len} tokens: the bootstrap "
                         f"interval over windows needs two at least (give max_tokens > {seq_len}, or a shorter "
                         "seq_len)")  # fmt: skip
    summary = summarize_losses(windows)
    scored = tokens[: summary["tokens"] + 1]  # what the windows' scored losses depend on (inputs and targets)
    return make_record(
        "perplexity", eval_model, split=split, seq_len=seq_len, stride=stride or seq_len, max_tokens=max_tokens,
        dataset=dataset, tokenizer=tokenizer, tokens_in_split=len(tokens), tokens_sha256=token_digest(scored),
        **summary,
    )  # fmt: skip
