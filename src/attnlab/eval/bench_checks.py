"""What `attnlab bench` refuses before it measures: parameters that cannot measure anything together, lengths past a
model's context that would only be recorded as not measured, caches far beyond this machine's memory.

A benchmark whose every cell would be recorded too_long (or too_short) measured nothing: it is refused, as a
perplexity window past the context is, naming the benchmark, the lengths and the limit. A benchmark some of whose
cells fall past the context measures the others, and says which it left (`context_notes`).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from attnlab.accounting import kv_report
from attnlab.cache.codecs import FLOAT_FORMATS, as_policy
from attnlab.config import source_problem
from attnlab.config_checks import unknown_key_problem
from attnlab.data.prepared import SPLIT_ALIASES
from attnlab.errors import ConfigError, InputError
from attnlab.eval.kvquant import OWN_SPLITS, split_problem
from attnlab.eval.multiple_choice import TASKS
from attnlab.paths import brief
from attnlab.train.budget import _size, machine_memory

MIN_PERPLEXITY_TOKENS = 2  # a bootstrap interval over windows needs two windows at least
FILLERS = ("sentences", "heldout")  # what the needle's haystack is made of (longctx.run_needle)
DEFAULT_SPLITS = {"perplexity": "test", "kv_quant": "test"}  # benchmarks scoring a `dataset`'s split, by default


def parameter_problems(name: str, params: dict, where: str = "benchmarks") -> list[str]:
    """Parameters of one benchmark that its code would refuse once the model is loaded: said before loading, each
    violated condition alone (params: the ones given; values of the wrong type are checked elsewhere)."""
    problems = []

    def whole(key):
        value = params.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    if name == "latency":
        new_tokens = whole("new_tokens")
        if new_tokens is not None and new_tokens < 2:
            problems.append(f"{where}.latency.new_tokens={new_tokens} must be >= 2 (the first token ends the prefill; "
                            "the decode speed is timed over the tokens after it)")  # fmt: skip
    dtype = params.get("cache_dtype") if name == "memory" else None
    if isinstance(dtype, str) and dtype not in FLOAT_FORMATS:  # (else named by the cache's accounting, unprefixed)
        problems.append(f"{where}.memory.cache_dtype={brief(dtype)} is not known (use one of "
                        f"{', '.join(FLOAT_FORMATS)}; for a quantized cache set memory.kv_policy, e.g. "
                        "k=q8_0,v=q8_0)")  # fmt: skip
    if name == "stream_loss":
        length, bucket = whole("length") if "length" in params else 8192, whole("bucket")
        if length is not None and bucket is not None and 2 <= length < bucket:
            problems.append(f"{where}.stream_loss.bucket={bucket} is longer than a stream (length={length}): give a "
                            f"bucket of at most {length} positions")  # fmt: skip
    if name == "perplexity":
        max_tokens = whole("max_tokens")
        if max_tokens is not None and max_tokens < 1:
            problems.append(
                f"{where}.perplexity.max_tokens={max_tokens} is not a number of tokens (give "
                f"{MIN_PERPLEXITY_TOKENS} or more, or leave max_tokens out for the whole split)"
            )
        elif max_tokens is not None and max_tokens < MIN_PERPLEXITY_TOKENS:
            problems.append(f"{where}.perplexity.max_tokens={max_tokens} is too few for an interval: the bootstrap "
                            f"over windows needs two windows, {MIN_PERPLEXITY_TOKENS} tokens at the least (give more, "
                            "or leave max_tokens out for the whole split)")  # fmt: skip
    if name == "needle" and isinstance(params.get("filler"), str) and params["filler"] not in FILLERS:
        problems.append(f"{where}.needle.filler={brief(params['filler'])} is not known (use 'sentences' or "
                        "'heldout')")  # fmt: skip
    tasks = params.get("tasks") if name == "multiple_choice" else None
    for task in tasks if isinstance(tasks, list) else []:  # (said before any model is loaded)
        if isinstance(task, str) and task not in TASKS:
            problems.append(f"{where}.multiple_choice.tasks: {unknown_key_problem(task, list(TASKS), '', 'task')}")
    unknown = source_problem(params["dataset"], f"{where}.{name}.dataset") if isinstance(params.get("dataset"),
                                                                                      str) else None  # fmt: skip
    if unknown:  # (said before its splits: the name is the mistake)
        problems.append(unknown)
    split = params.get("split", DEFAULT_SPLITS.get(name))
    if name in DEFAULT_SPLITS and isinstance(params.get("dataset"), str) and isinstance(split, str) and not unknown:
        problem = split_problem(params["dataset"], split)  # (said after loading the model, without the setting)
        if problem:
            default = "" if "split" in params else " (the default)"
            problems.append(f"{where}.{name}.split={split}{default}: {problem}: set {name}.split: val (or train)")
    return problems


def _join(values) -> str:
    return ", ".join(str(v) for v in values)


def context_cells(name: str, full: dict, cfg, train_seq_len: int | None = None) -> tuple[list, list, str] | None:
    """(every cell, the cells past the model's context, how the limit reads) for the benchmarks whose lengths are
    checked against max_seq_len, as their code marks cells too_long; None for the others (and for
    rope_extrapolation without train_seq_len)."""
    limit = cfg.max_seq_len
    memory = cfg.memory.kind != "none"
    if name == "latency":
        new = full["new_tokens"]
        cells = sorted(full["prompt_lengths"])
        return cells, [n for n in cells if n + new - 1 > limit], f"+ {new} new tokens"
    if name in ("memory", "context_sweep", "needle") and full.get("lengths") is not None:
        cells = sorted(full["lengths"])
        return cells, [n for n in cells if n > limit], ""
    if name == "stream_loss":
        cells = [full["length"]]
        return cells, [n for n in cells if n > limit and not memory], ""
    if name in ("perplexity", "kv_quant") and full.get("seq_len") is not None:  # (a window read in one pass)
        cells = [full["seq_len"]]
        return cells, [n for n in cells if n > limit and not memory], ""
    if name == "effective_rank" and full.get("seq_len") is not None:  # (rows of seq_len, memory or not)
        cells = [full["seq_len"]]
        return cells, [n for n in cells if n > limit], ""
    if name == "rope_extrapolation" and train_seq_len:
        cells = list(full["factors"])
        return cells, [f for f in cells if round(f * train_seq_len) > limit], f"x the training context {train_seq_len}"
    return None


GIVES_CELLS = {"latency": ("prompt_lengths", "new_tokens"), "rope_extrapolation": ("factors",),
               "stream_loss": ("length",), "perplexity": ("seq_len",), "kv_quant": ("seq_len",),
               "effective_rank": ("seq_len",)}  # what makes the cells  # fmt: skip


def context_problem(name: str, full: dict, cfg, label: str, train_seq_len: int | None = None,
                    given: dict | None = None) -> str | None:  # fmt: skip
    """Why benchmark `name` with parameters `full` cannot run on this model: every cell past its context (nothing
    would be measured), or a cell past it that the user asked for (`given`: the parameters given, not defaulted).
    None when it can (defaults past the context are recorded too_long and said: context_note)."""
    found = context_cells(name, full, cfg, train_seq_len)
    if found is None or not found[1]:
        return None
    cells, past, how = found
    asked = any(key in (given or {}) for key in GIVES_CELLS.get(name, ("lengths",)))
    if len(past) < len(cells) and not asked:
        return None
    what = "nothing would be measured" if len(past) == len(cells) else "it would not be measured"
    limit, one = cfg.max_seq_len, len(past) == 1
    exceed = "exceeds" if one else "exceed"
    # (a memory model reads past its context elsewhere: say why not here, and where)
    one_pass = ""
    if name in ("memory", "latency") and cfg.memory.kind != "none":
        one_pass = ("; this benchmark fills the cache in one pass of at most max_seq_len tokens, memory or not: "
                    "stream_loss reads a memory model past it")  # fmt: skip
    if name == "latency":  # a cell fits when prompt + new_tokens - 1 <= max_seq_len (speed.run_latency)
        longest, fewer = limit - full["new_tokens"] + 1, limit - max(past) + 1
        fixes = [f"prompt lengths <= {longest}"] if longest >= 1 else []
        if fewer >= 2:  # (new_tokens >= 2: the decode is timed after the first token)
            fixes.append(f"new_tokens <= {fewer} for prompt{'s up to' if len(past) > 1 else ''} {max(past)}")
        fix = " or ".join(fixes) or f"prompt lengths < {limit}, and new_tokens <= {limit + 1} - the prompt length"
        return (f"benchmarks.latency: prompt {_join(past)} + {full['new_tokens']} new tokens exceed {label}'s "
                f"max_seq_len {limit} ({what}): give {fix}{one_pass}")  # fmt: skip
    if name == "rope_extrapolation":
        return (f"benchmarks.rope_extrapolation.factors={_list(cells)}: {_join(past)} {how} {exceed} {label}'s "
                f"max_seq_len {limit} ({what}): give factors <= {limit / train_seq_len:g}")  # fmt: skip
    key = "length" if name == "stream_loss" else "seq_len" if name in GIVES_CELLS else "lengths"
    shown = cells[0] if key != "lengths" else _list(cells)
    return (
        f"benchmarks.{name}.{key}={shown}: {_join(past)} {exceed} {label}'s max_seq_len {limit} ({what}): give "
        f"{key} <= {limit}" + (" (a model with a memory reads past it)" if name == "stream_loss" else "") + one_pass
    )


def _list(values) -> str:
    return "[" + _join(values) + "]"


def context_note(name: str, full: dict, cfg, label: str, train_seq_len: int | None = None) -> str | None:
    """A line saying which cells of a benchmark fall past the model's context (recorded too_long, not measured)
    while others are measured, or None."""
    found = context_cells(name, full, cfg, train_seq_len)
    if found is None or not found[1]:
        return None
    _, past, how = found
    what = GIVES_CELLS.get(name, ("lengths",))[0]
    return (f"{label} {name}: {what} {_join(past)}{' ' + how if how else ''} exceed max_seq_len {cfg.max_seq_len}: "
            "recorded as too_long, not measured")  # fmt: skip


def policy_note(name: str, full: dict, label: str) -> str | None:
    """A line saying a memory or latency benchmark's KV policy quantizes nothing (its residual window holds every
    token of every length measured: the row is the full-precision cache's, labelled with the policy), or None."""
    policy = full.get("kv_policy") if name in ("memory", "latency") else None
    if not policy:
        return None
    lengths = full["lengths"] if name == "memory" else [n + full["new_tokens"] - 1 for n in full["prompt_lengths"]]
    resid = as_policy(policy).resid
    if not resid or resid < max(lengths):
        return None
    return (
        f"{label} {name}: kv_policy {policy}: resid={resid} >= {max(lengths):,} tokens keeps every token in the "
        f"full-precision residual window, so nothing is quantized (give resid below {min(lengths):,})"
    )


def cache_memory_problem(name: str, full: dict, cfg, label: str) -> str | None:
    """A KV cache the memory or latency benchmark would allocate, far beyond this machine's memory (RAM plus GPUs),
    refused before loading rather than failing in the allocator: the largest batch that fits, or None."""
    if name == "memory":
        batches, lengths, dtype = [full["batch_size"]], full["lengths"], full.get("cache_dtype") or "fp32"
        key = "batch_size"
    elif name == "latency":
        batches, dtype, key = full["batch_sizes"], "fp32", "batch_sizes"
        lengths = [n + full["new_tokens"] - 1 for n in full["prompt_lengths"]]
    else:
        return None
    lengths = [n for n in lengths if n <= cfg.max_seq_len] or None
    policy = full.get("kv_policy")
    try:  # (a policy this model's cache cannot take, named by its key and the model, before any model is loaded)
        per_sequence = kv_report(cfg, dtype, max(lengths or [1]), policy)["kv_bytes"]
    except (ConfigError, InputError) as e:
        return f"benchmarks.{name}.kv_policy={policy} on {label}: {e}"
    have = machine_memory()
    if lengths is None or have is None:
        return None
    batch = max(batches)
    if per_sequence * batch <= have:
        return None
    most = max(1, have // max(1, per_sequence))
    return (
        f"benchmarks.{name}.{key}={batch:,} needs {_size(per_sequence * batch)} of KV cache on {label} "
        f"({max(lengths):,} tokens); this machine has {_size(have)} (give at most {most:,})"
    )


# Tokens a tokenizer makes of a prompt, at most, beyond one per UTF-8 byte (a BOS, a prefix space, an EOS): a prompt
# this short is not tokenized before the benchmarks run (for a run, that loads its weights once more).
SPECIAL_TOKENS = 8


def prompt_problem(name: str, full: dict, cfg, label: str, tokenizer: Callable[[], Any]) -> str | None:
    """Why the attention_maps prompt cannot be read in one pass by this model, said before any benchmark runs (its
    own check, analysis.run_attention_maps, comes after every other benchmark of every checkpoint): more tokens than
    max_seq_len, or a model with a memory reading it in blocks of memory.block tokens. tokenizer() gives the model's
    tokenizer, asked for only when the prompt may be too long. None when it fits, or cannot be told here."""
    prompt = full.get("prompt") if name == "attention_maps" else None
    if not isinstance(prompt, str):
        return None
    memory = cfg.memory.kind != "none"
    limit = min(cfg.max_seq_len, cfg.memory.block_size) if memory else cfg.max_seq_len
    if prompt and len(prompt.encode("utf-8")) + SPECIAL_TOKENS <= limit:
        return None
    loaded = tokenizer()
    if loaded is None:  # (a model without a tokenizer: refused by the benchmark itself)
        return None
    n = len(loaded.encode(prompt))
    where = f"benchmarks.attention_maps.prompt={brief(prompt)} has {n} tokens on {label}"
    if not n or n > cfg.max_seq_len:
        return f"{where}: give one of 1..{cfg.max_seq_len} tokens (the model's max_seq_len)"
    if memory and n > cfg.memory.block_size:  # (the words of analysis.run_attention_maps)
        block = cfg.memory.block_size
        return (f"{where}: a model with memory.kind={cfg.memory.kind} reads a prompt in blocks of {block} tokens "
                "(memory.block), the later ones through its memory, which one pass's attention maps cannot show: give "
                f"a prompt of at most {block} tokens")  # fmt: skip
    return None


def needle_length_problem(name: str, full: dict, cfg, label: str, tokenizer: Callable[[], Any]) -> str | None:
    """Why the needle benchmark would measure nothing on this model, told before it loads: every length within
    its context too short for the prompt's fixed parts (intro, needle, question, answer), the others past it.
    tokenizer() gives the model's tokenizer. The words of unmeasured_problem, which says it after the run."""
    if name != "needle":
        return None
    from attnlab.eval.longctx import fixed_tokens, passkeys  # (the benchmark's own count)

    limit = cfg.max_seq_len
    lengths = sorted(set(full.get("lengths") or (limit // 4, limit // 2, limit)))
    fitting = [n for n in lengths if n <= limit]
    loaded = tokenizer() if fitting else None
    if loaded is None:  # (every length past the context: context_problem; no tokenizer: the benchmark says so)
        return None
    needs = fixed_tokens(loaded, passkeys(random.Random(full.get("seed", 0)), 5, 1)[0])
    if any(n >= needs for n in fitting):
        return None
    records = [{"status": "too_short", "length": n, "needs": needs, "max_seq_len": limit} for n in fitting]
    return unmeasured_problem(name, records, label)


def unmeasured_problem(name: str, records: list[dict], label: str) -> str | None:
    """A benchmark that ran and recorded no cell as measured, every one too short (needle: a length too short
    for its prompt): why, or None."""
    statuses = Counter(r.get("status", "ok") for r in records)
    if not records or statuses.get("ok") or set(statuses) != {"too_short"}:
        return None
    lengths = sorted({r["length"] for r in records if isinstance(r.get("length"), int)})
    needs = max((r["needs"] for r in records if isinstance(r.get("needs"), int)), default=None)
    least = f"lengths >= {needs}" if needs else "longer lengths"
    limit = next((r["max_seq_len"] for r in records if isinstance(r.get("max_seq_len"), int)), None)
    if needs and limit and needs > limit:
        least += f", more than its max_seq_len {limit}: this model cannot hold the needle's prompt"
    return (f"benchmarks.{name}: lengths {_join(lengths)} are too short on {label} to hold the prompt (the needle, "
            f"its question and the answer) with any filler (nothing would be measured): give {least}")  # fmt: skip


def own_split_problem(name: str, full: dict, data: dict | None, label: str) -> str | None:
    """Why a benchmark reading the checkpoint's own held-out data (no `dataset` parameter) would find no `split` in
    it, told from its saved data config (`data`, None for a model without one: said when it loads): a source
    without split files of its own is divided into train and val unless data.test_fraction > 0."""
    split = SPLIT_ALIASES.get(full.get("split"), full.get("split"))
    if split != "test" or full.get("dataset") is not None or not data:
        return None
    source, fraction = data.get("source"), data.get("test_fraction") or 0
    if source in OWN_SPLITS or fraction:
        return None
    return (f"benchmarks.{name}.split='test': {label}'s data ({source}) has no 'test' split (a source without split "
            "files of its own is divided into train and val unless data.test_fraction > 0): score one it has "
            f"(benchmarks.{name}.split='val'), or name a dataset (benchmarks.{name}.dataset=wikitext2-raw)"
            )  # fmt: skip


def status_notes(records: list[dict]) -> list[str]:
    """Report notes: per benchmark and model, the records that measured nothing (status other than ok) and why."""
    counts: Counter = Counter(
        (r["benchmark"], r["model"], r["status"]) for r in records if r.get("status", "ok") != "ok"
    )
    why = {"too_long": "past the model's context (max_seq_len)", "too_short": "too short to hold the prompt",
           "oom": "out of memory", "not_enough_text": "more tokens than the held-out text has",
           "over_budget": "over the KV byte budget"}  # fmt: skip
    return [
        f"{n} {benchmark} record{'s' * (n > 1)} of {model} measured nothing: {status}"
        f"{' (' + why[status] + ')' if status in why else ''}."
        for (benchmark, model, status), n in counts.items()
    ]


def needle_problems(params: dict, where: str) -> list[str]:
    """What the needle benchmark's parameters cannot mean together: a dataset the filler does not read (only
    filler=heldout reads `dataset`), lengths that cannot hold a prompt and its answer (< 2 tokens)."""
    problems = []
    filler = params.get("filler", "sentences")
    if params.get("dataset") is not None and filler != "heldout":
        problems.append(
            f"{where}.dataset={brief(params['dataset'])} is read only with filler=heldout (filler is {brief(filler)}):"
            " set filler: heldout, or leave the dataset out"
        )
    lengths = params.get("lengths")
    if isinstance(lengths, list):
        bad = next((x for x in lengths if isinstance(x, bool) or not isinstance(x, int) or x < 2), None)
        if bad is not None or any(isinstance(x, bool) for x in lengths):
            problems.append(f"{where}.lengths={brief(lengths)} holds {brief(bad)}, which must be a whole number >= 2")
    return problems
