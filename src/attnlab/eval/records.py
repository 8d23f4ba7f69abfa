"""Records: one JSON line per measured figure set, with what is needed to trust and reproduce it."""

from __future__ import annotations

import datetime
import errno
import json
import math
import os
import platform
import re
import sys
import unicodedata
import warnings
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch

import attnlab
from attnlab.data.files import (
    LINK_LOOP,
    OUTPUTS_IDLE,
    SEAL,
    appending_in,
    atomic_path,
    file_kind,
    json_objects,
    link_loop,
    read_json_lines,
    read_only_file_system,
    remove_stale_temporaries,
    sealed,
)
from attnlab.errors import AttnlabWarning, DataError, InputError
from attnlab.eval.record_sense import AGREE, figures_problem, written_slack
from attnlab.paths import is_run_folder, run_folder_problem


def make_record(benchmark: str, model=None, **figures) -> dict:
    """A row: benchmark name, model label/path/config hash, device, dtype, versions, time, then the figures."""
    row = {
        "benchmark": benchmark,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "attnlab": attnlab.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
    if model is not None:
        row.update(
            model=model.name, model_path=str(model.path), config_hash=model.cfg.config_hash(),
            kind=model.cfg.attention.kind, device=str(model.device),
            dtype=str(next(model.model.parameters()).dtype).replace("torch.", ""),
        )  # fmt: skip
    row.update(figures)
    return row


def records_target(path: str | Path) -> Path:
    """The file rows appended to `path` go to, refused (InputError, one line) unless it is a regular file or
    does not exist yet: a device (/dev/full), fifo or folder would be read without end or replaced by a file.
    A symlink is written through: the rows go to the file it points at and the link stays a link."""
    given = Path(path)
    if link_loop(given):  # (Path.resolve raises RuntimeError on one)
        raise InputError(f"{given}: {LINK_LOOP}: point the link at the records file itself, or give another path")
    target = given.resolve()
    if target.exists() and not target.is_file():
        what = "a folder" if target.is_dir() else "not a regular file (a device, fifo or socket)"
        via = f" (via the link {given})" if target != given.absolute() else ""
        raise InputError(f"{target}{via}: {what}: records are appended to a regular .jsonl file; give a file path")
    if target.is_file():  # rows are appended only to records: never to a user's YAML, notes or a binary file
        torn = torn_line(target)
        if torn:
            raise InputError(f"{given}: {torn}")
        problem = _not_records(target)
        if problem:
            raise InputError(f"{given}: exists and is not a file of attnlab records ({problem}); records are "
                             "appended only to a .jsonl file of records: give a new file or a records one")  # fmt: skip
    return target


def torn_line(path: Path) -> str | None:
    """What a records file whose last line was cut short (an append interrupted: killed, a full disk) is, in one
    phrase with the fix, or None. Refused, not dropped: the records are the user's results."""
    try:
        text = path.read_bytes().decode("utf-8-sig", errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    if not lines or text.endswith(("\n", "\r")) or not isinstance(json_objects(lines[:-1]), list):
        return None
    if isinstance(json_objects(lines[-1:]), list):
        return None
    return (f"line {len(lines)} was cut short (a write interrupted: it ends without its newline and is not a whole "
            "JSON object); remove that line: the next `attnlab bench` into this folder measures it again")  # fmt: skip


def _not_records(path: Path) -> str | None:
    """Why an existing file is not one records are appended to (one JSON object per line), or None."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    rows = json_objects(text.splitlines())
    return f"line {rows[0]} {rows[1]}" if isinstance(rows, tuple) else None


def records_in_run_problem(path: str | Path, flag: str = "--out", example: str = "results") -> str | None:
    """The line refusing records (a folder of them, or a records file: `path`) in a run's folder or inside one, as
    compare, convert and export refuse their outputs there; None elsewhere. `example`: a path to suggest instead."""
    what = "file" if example.endswith(".jsonl") else "folder"
    return run_folder_problem(path, f"records written there would be mixed with the run's own files (its metrics, "
                                    f"summary and checkpoints) and taken for some of them: give {flag} a {what} "
                                    f"outside the run, e.g. {flag} {example}", flag)  # fmt: skip


def records_folder(folder: str | Path, *names: str, flag: str = "--out", example: str = "results") -> list[Path]:
    """The records files `names` a command appends to in `folder` when it is done, checked before it starts, so that
    minutes of work are not lost to a path it cannot write: InputError (one line naming `flag`) when `folder` is a
    run's folder or inside one (records_in_run_problem, suggesting `example`), when it or one of its parents is not a
    folder, a records file is not a regular file (records_target), or the folder that would hold one may not be
    written (permissions, a read-only file system). Creates nothing."""
    problem = records_in_run_problem(folder, flag, example)
    if problem:
        raise InputError(problem)
    folder = Path(folder)
    existing = next(p for p in [folder, *folder.parents] if os.path.lexists(p))  # "." or "/" at the latest
    if not existing.is_dir():
        what = "a file" if existing == folder else f"cannot be made: {existing} is a file"
        raise InputError(f"{flag} {folder}: {what}, not a folder (the records go to {folder / names[0]}; give a "
                         "folder's path)")  # fmt: skip
    targets = [records_target(folder / name) for name in names]
    for target in targets:
        holder = next(p for p in [target.parent, *target.parent.parents] if p.exists())
        if not os.access(holder, os.W_OK | os.X_OK):  # the file is written beside itself, then renamed
            why = ("a read-only file system): give a folder on a writable one" if read_only_file_system(holder) else
                   "permission denied): make it writable, or give another folder")  # fmt: skip
            raise InputError(f"{flag} {folder}: {target.name} cannot be written in {holder} ({why}")
    return targets


def append_records(path: str | Path, rows: list[dict]) -> Path:
    """Appends rows to a JSONL file atomically (old content + new rows to a temporary file, flushed to the disk,
    then renamed over it); see records_target for the paths refused."""
    return append_records_together({path: rows})[0]


def append_records_together(rows_by_path: dict) -> list[Path]:
    """append_records for files of one folder that go together (a summary and its item rows): every new file is
    written in full before any is renamed over its old one, so a write that fails (a full disk) leaves every file
    as it was, not item rows without their summary (which a rerun would append again)."""
    paths = [records_target(p) for p in rows_by_path]
    folder = paths[0].parent
    folder.mkdir(parents=True, exist_ok=True)
    with appending_in(folder), ExitStack() as stack:  # another process appending there waits: its rows are kept too
        for path, rows in zip(paths, rows_by_path.values(), strict=True):
            # a killed append's temporary (a whole copy of the records): its writer is gone and it was not written
            # for OUTPUTS_IDLE seconds (an append takes a moment: one of another machine, whose pid cannot be seen
            # from here, is still writing it)
            remove_stale_temporaries(folder, re.escape(path.name), idle_seconds=OUTPUTS_IDLE)
            old = path.read_text() if path.exists() else ""
            if old and not old.endswith("\n"):
                old += "\n"
            tmp = stack.enter_context(atomic_path(path, durable=True))  # renamed when every one is written
            tmp.write_text(old + "".join(json.dumps(sealed(r), sort_keys=True) + "\n" for r in rows), encoding="utf-8")
    return paths


def bench_records(folder: str | Path) -> Path:
    """folder/records.jsonl, the records file `attnlab bench --out folder` wrote, checked before it is read: DataError
    (one line naming it) when nothing is there, when its symbolic links point at each other (not "not found": ls
    shows it), or when it is not a regular file (file_kind, as compare checks a run's files): a device such as
    /dev/zero would be read without end, a fifo waited on without end."""
    path = Path(folder) / "records.jsonl"
    try:
        kind = file_kind(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DataError(f"{path}: {LINK_LOOP}: point the link at the records file itself, or give the folder "
                            "`attnlab bench --out` wrote") from None  # fmt: skip
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise  # (permissions: said by the command's line for the operating system's refusals)
        run = next((f for f in (Path(folder), *Path(folder).resolve().parents) if is_run_folder(f)), None)
        if run is not None:  # (bench refuses to write into a run: advice naming it as --out would not work)
            raise DataError(f"{folder}: {'is' if run == Path(folder) else f'is inside {run},'} a run's folder, not a "
                            f"bench folder: report reads what `attnlab bench {run} --out DIR` writes in DIR (give a "
                            "folder outside the run); to compare runs, use attnlab compare") from None  # fmt: skip
        raise DataError(f"{path} not found: run `attnlab bench ... --out {folder}` first") from None
    if kind is not None:
        raise DataError(f"{path}: {kind}, not a records file (give the folder `attnlab bench --out` wrote: its "
                        "records.jsonl is a regular file)")  # fmt: skip
    return path


def read_records(path: str | Path, benchmark: str | None = None) -> list[dict]:
    """The records of a JSONL file (a UTF-8 byte-order mark at its start is read past), those of `benchmark` if
    given; DataError naming the file and the first line that is not a JSON object (a damaged file)."""
    try:
        rows = read_json_lines(path, fix="records are appended one JSON object per line")
    except DataError:
        torn = torn_line(Path(path))
        if torn:
            raise DataError(f"{path}: {torn}") from None
        raise
    return [r for r in rows if benchmark is None or r.get("benchmark") == benchmark]


# ----------------------------------------------------------------------------- what one record measured

# The fields that say what a record measured (its setting), by benchmark, beside its benchmark, model, model path
# and the harness's parameters: two records that agree on all of them are two measurements of the same thing (a
# checkpoint benchmarked again, two records files joined), of which a report shows the latest. A benchmark not named
# here has no such key: each of its records stands alone.
SETTING: dict[str, tuple[str, ...]] = {
    "perplexity": ("dataset", "text", "split", "seq_len", "stride", "max_tokens"),
    "memory": ("length", "batch_size", "cache_dtype", "kv_policy"),
    "latency": ("prompt_length", "batch_size", "new_tokens", "kv_policy"),
    "multiple_choice": ("task", "limit"),
    "needle": ("scope", "length", "depth", "filler", "seed"),
    "rope_extrapolation": ("factor", "seq_len", "max_tokens", "text"),
    "context_sweep": ("length", "chunk_size", "text"),
    "stream_loss": ("length", "bucket", "text"),
    "effective_rank": ("split", "seq_len", "offset", "center"),
    "attention_maps": ("prompt", "unit"),
    "probes": ("record", "suite_fingerprint", "id"),
    "kv_quant": ("policy", "dataset", "split", "seq_len", "tokens", "chunk", "dtype"),
    "presses": ("context", "window", "continuation", "press", "budget", "impl"),  # bench/presses.py's rows
}
# when and with what (and the record's seal): not what was measured
VOLATILE = ("time", "attnlab", "torch", "python", "threads", "weights", SEAL)


def setting_key(record: dict) -> str | None:
    """What a record measured, as a string (see SETTING); None for a benchmark without a setting key."""
    fields = SETTING.get(record.get("benchmark"))
    if fields is None:
        return None
    key = [record.get(k) for k in ("benchmark", "model", "model_path", "params", *fields)]
    return json.dumps(key, sort_keys=True, default=str)


def latest_records(records: list[dict]) -> tuple[list[dict], list[tuple[int, int, bool]]]:
    """(the records, each kept only where no later record measured the same thing, in file order; the superseded
    ones as (its 1-based number, the number of the latest record of its setting, whether their figures differ))."""
    latest: dict[str, int] = {}
    for number, record in enumerate(records, 1):
        key = setting_key(record)
        if key is not None:
            latest[key] = number
    kept, superseded = [], []
    for number, record in enumerate(records, 1):
        key = setting_key(record)
        if key is None or latest[key] == number:
            kept.append(record)
            continue
        newer = records[latest[key] - 1]
        differ = _figures(record) != _figures(newer)
        superseded.append((number, latest[key], differ))
    return kept, superseded


def _figures(record: dict) -> str:
    return json.dumps({k: v for k, v in record.items() if k not in VOLATILE}, sort_keys=True, default=str)


def latest_and_distinct(records: list[dict], records_path: Path) -> tuple[list[dict], list[str]]:
    """(the records a report shows, notes saying what it did): of records that measured the same thing (a checkpoint
    benchmarked again after its weights changed, records files joined, two benches at once) only the latest; and
    a label two checkpoints share (records of older benches) replaced by their folders' last parts. Each is said
    in a note and, when figures disagree or labels change, in a warning line."""
    records, superseded = latest_records(records)
    notes = []
    if superseded:
        old, new = [str(o) for o, _, _ in superseded], sorted({n for _, n, _ in superseded})
        differ = sum(d for _, _, d in superseded)
        one = len(old) == 1
        what = "with other figures" if one else f"{differ} with other figures"
        what = what if differ else "with the same figures"
        why = " (measured again, e.g. after the checkpoint was retrained, or records files joined)" if differ else ""
        notes.append(f"record{'s' * (not one)} {', '.join(old)} measured the same checkpoint and settings as "
                     f"{'a later record' if len(new) == 1 else 'later records'} ({', '.join(map(str, new))}), "
                     f"{what}{why}: only the latest {'is' if one else 'are'} shown.")  # fmt: skip
        if differ:
            warnings.warn(f"{records_path}: {notes[-1]}", AttnlabWarning, stacklevel=3)
    paths: dict[str, set[str]] = defaultdict(set)
    for r in records:
        if isinstance(r.get("model_path"), str):
            paths[r["model"]].add(os.path.normpath(r["model_path"]))
    shared = {label: sorted(p) for label, p in paths.items() if len(p) > 1}
    if not shared:
        return records, notes
    labels = distinct_labels({p: label for label, group in shared.items() for p in group})
    records = [{**r, "model": labels[os.path.normpath(r["model_path"])]} if r["model"] in shared and
               isinstance(r.get("model_path"), str) else r for r in records]  # fmt: skip
    for label, group in shared.items():
        notes.append(f"{len(group)} checkpoints share the label {label}: shown as "
                     f"{', '.join(labels[p] for p in group)} (the last parts of their folders).")  # fmt: skip
        warnings.warn(f"{records_path}: {notes[-1]}", AttnlabWarning, stacklevel=3)
    return records, notes


def distinct_labels(labels: dict[str, str]) -> dict[str, str]:
    """{path: label} with every label that two paths share replaced by the paths' last folders, as many as tell
    them apart (runs/tiny/base/seed0 and runs2/tiny/base/seed0, both base/seed0, keep their four last parts)."""
    by_label: dict[str, list[str]] = defaultdict(list)
    for path, label in labels.items():
        by_label[label].append(path)
    out = dict(labels)
    for group in (paths for paths in by_label.values() if len(paths) > 1):
        parts = {p: Path(p).parts for p in group}
        for keep in range(1, max(len(x) for x in parts.values()) + 1):
            tails = {p: "/".join(parts[p][-keep:]).replace("//", "/") for p in group}
            if len(set(tails.values())) == len(group):
                break
        out.update(tails)
    return out


# ----------------------------------------------------------------------------- the fields a report reads

# The fields the tables and plots read, by benchmark: field -> (kind, when it must be present). "always": in every
# record of the benchmark; "ok": in those whose status is ok; None: optional (checked when present and not null).
# A record whose fields do not fit is refused with its number rather than drawn wrong or crashing the report.
NUM, INT, STR, PAIR, NUMS, PAIRS, DICT = "a number", "an integer", "a string", "a pair of numbers", \
    "a list of numbers", "a list of number pairs", "an object"  # fmt: skip
FIELDS: dict[str, dict[str, tuple[str, str | None]]] = {
    "perplexity": {"kind": (STR, "always"), "split": (STR, "always"), "tokens": (INT, "always"),
                   "loss": (NUM, "always"), "loss_ci": (PAIR, "always"), "ppl": (NUM, "always"),
                   "ppl_ci": (PAIR, "always"), "window_loss": (NUMS, None), "window_tokens": (NUMS, None)},
    "memory": {"kind": (STR, "always"), "length": (INT, "always"), "kv_bytes": (NUM, "ok"),
               "batch_size": (INT, None), "kv_bytes_analytic": (NUM, None), "peak_rss_bytes": (NUM, None)},
    "latency": {"kind": (STR, "ok"), "prompt_length": (INT, "ok"), "batch_size": (INT, "ok"),
                "decode_tokens_per_s_median": (NUM, "ok"), "decode_tokens_per_s_min": (NUM, "ok"),
                "decode_tokens_per_s_max": (NUM, "ok"), "ttft_ms_median": (NUM, "ok")},
    "multiple_choice": {"task": (STR, "always"), "n": (INT, "always"), "acc": (NUM, "always"),
                        "acc_stderr": (NUM, None), "acc_norm": (NUM, None), "acc_norm_stderr": (NUM, None)},
    "needle": {"length": (INT, None), "depth": (NUM, None), "accuracy": (NUM, None), "gain_mean": (NUM, None),
               "gain_sem": (NUM, None)},
    "rope_extrapolation": {"factor": (NUM, None), "length": (INT, None), "loss": (NUM, None), "ppl": (NUM, None),
                           "window_loss": (NUMS, None), "window_tokens": (NUMS, None)},
    "context_sweep": {"length": (INT, None), "prefill_ms": (NUM, None), "last_chunk_ms": (NUM, None),
                      "decode_ms_per_token": (NUM, None), "last_chunk_loss": (NUM, None)},
    "stream_loss": {"memory_slots": (INT, None), "length": (INT, None), "streams": (INT, None), "ppl": (NUM, None),
                    "bucket": (NUM, None), "positions": (NUMS, None), "bucket_loss": (NUMS, None),
                    "bucket_ci": (PAIRS, None)},
    "effective_rank": {"layers": (list, "always")},
    "attention_maps": {"regions": (list, None)},
    "kv_quant": {"policy": (STR, "always"), "bytes_per_token": (NUM, "always"), "vs_full": (NUM, "always"),
                 "dnll": (NUM, "always"), "dnll_ci": (PAIR, None), "ppl_ratio": (NUM, "always"), "kl": (NUM, "always"),
                 "top1": (NUM, "always"), "greedy": (NUM, None), "tokens": (INT, None), "seq_len": (INT, None)},
}  # fmt: skip


# The range a figure can have at all (a field not named here is checked for its kind only): a loss is a mean
# negative log-probability, a perplexity its exponential, bytes, tokens, times and speeds are never negative,
# fractions are fractions. A record outside it was changed by hand, and would draw a plot wrong or not at all.
AT_LEAST_0 = ("loss", "kv_bytes", "kv_bytes_analytic", "peak_rss_bytes", "bytes_per_token", "vs_full", "tokens",
              "length", "decode_tokens_per_s_median", "decode_tokens_per_s_min", "decode_tokens_per_s_max",
              "ttft_ms_median", "prefill_ms", "last_chunk_ms", "decode_ms_per_token", "last_chunk_loss",
              "ppl_ratio", "window_loss", "bucket_loss")  # fmt: skip
AT_LEAST_1 = ("ppl",)
FRACTIONS = ("acc", "acc_norm", "accuracy", "top1", "greedy")
# Lengths and counts a benchmark ran with, in any record that holds them: whole numbers of at least 1 (a window of
# 0 tokens measures nothing). Figures that are never infinite whatever the model does (bytes, times, speeds,
# fractions; a loss and a perplexity may be a diverged model's infinity), nor NaN but a diverged model's fractions.
COUNTS = ("seq_len", "stride", "max_tokens", "windows", "threads", "batch_size", "prompt_length", "memory_slots",
          "streams", "n")  # fmt: skip
FINITE = ("kv_bytes", "kv_bytes_analytic", "peak_rss_bytes", "bytes_per_token", "vs_full", "decode_tokens_per_s_median",
          "decode_tokens_per_s_min", "decode_tokens_per_s_max", "ttft_ms_median", "prefill_ms", "last_chunk_ms",
          "decode_ms_per_token", "depth", "factor", "bucket", *FRACTIONS)  # fmt: skip
LABELS = ("model", "kind", "split", "task", "policy")  # shown in tables and legends: one line, and not empty

# Figures a record holds twice, so that one must agree with the other: a perplexity is the exponential of its loss
# (a perplexity ratio of its loss difference), and a bootstrap interval holds its own point (summarize_losses: the
# mean of the resampled windows' losses spreads around the mean of the windows). A record where they disagree was
# changed by hand: which of the two figures a table shows would be a guess.
EXPONENTIALS = {"perplexity": [("loss", "ppl")], "rope_extrapolation": [("loss", "ppl")],
                "stream_loss": [("loss", "ppl")], "kv_quant": [("dnll", "ppl_ratio")],
                "context_sweep": [("last_chunk_loss", "last_chunk_ppl")]}  # fmt: skip
INTERVALS = {"perplexity": [("loss", "loss_ci"), ("ppl", "ppl_ci")],
             "rope_extrapolation": [("loss", "loss_ci"), ("ppl", "ppl_ci")],
             "stream_loss": [("loss", "loss_ci"), ("ppl", "ppl_ci")]}  # fmt: skip


def pair_labels(text: str, models: list[str], records_path: Path) -> tuple[str, str]:
    """--paired A:B -> (A, B), two labels of `models`: split at the colon that leaves two of them, so that a label
    holding ':' (from a folder named x:y) can be given as it is. InputError when no colon does (naming the label
    not found), when two do (ambiguous), and when A is B (a model compared with itself differs by 0, always)."""
    colons = [i for i, c in enumerate(text) if c == ":"]
    readings = [(text[:i], text[i + 1 :]) for i in colons if text[:i] in models and text[i + 1 :] in models]
    if len(readings) > 1:
        both = " or ".join(f"{a!r} minus {b!r}" for a, b in readings)
        raise InputError(f"--paired {text}: reads as {both} (labels that hold ':'): rename one of the folders so "
                         "that the labels tell the pair apart")  # fmt: skip
    if not readings:
        halves = [(text[:i], text[i + 1 :]) for i in colons]
        a, b = next((pair for pair in halves if pair[0] in models or pair[1] in models), halves[0])
        missing = a if a not in models else b
        colon = len(colons) > 1 or any(":" in m for m in models)
        colon = " (a label that holds ':' is given as it is: A:B is split at the colon that leaves two of them)" * colon
        raise InputError(f"--paired {text}: {records_path} has no records of {missing!r} (its models: "
                         f"{', '.join(models)}){colon}")  # fmt: skip
    a, b = readings[0]
    if a == b:
        raise InputError(f"--paired {text} compares {a} with itself (its difference is 0 by construction): give two "
                         "different model labels")  # fmt: skip
    return a, b


def range_problem(field: str, value, kind: str | None = None) -> str | None:
    """Why a figure that fits its kind is still impossible (below 0, a perplexity below 1, a fraction above 1), or
    None. kind: the figure it is, when its field is named otherwise (a run summary's val_loss is a "loss")."""
    values = value if isinstance(value, list) else [value]
    kind = kind or field
    low, high = (0, None) if kind in AT_LEAST_0 else (1, None) if kind in AT_LEAST_1 else (0, 1) if kind in \
        FRACTIONS else (None, None)  # fmt: skip
    for v in values:
        if not _number(v) or math.isnan(v):  # (NaN: a diverged model's figure, shown as such)
            continue
        if (low is not None and v < low) or (high is not None and v > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            return f"field '{field}' is {_shown(value)}, which is impossible (it is {bound})"
    return None


def _finite(*values) -> bool:
    return all(_number(v) and math.isfinite(v) for v in values)


def exponential_problem(record: dict, log_field: str, exp_field: str) -> str | None:
    """Why record[exp_field] is not the exponential of record[log_field] (a perplexity of its loss), or None (also
    when either is missing or not a number, which the fields' kinds say). NaN with NaN and infinite with infinite
    are a diverged model's figures, shown as such; one NaN or infinity beside a finite figure was written by hand."""
    loss, ppl = record.get(log_field), record.get(exp_field)
    if not (_number(loss) and _number(ppl)):
        return None
    if not _finite(loss, ppl):  # a diverged model's: NaN with NaN, inf with inf (or a finite loss past exp's range)
        both_nan = math.isnan(loss) and math.isnan(ppl)
        if both_nan or (ppl == math.inf and loss > math.log(sys.float_info.max)):
            return None
        return (f"field '{exp_field}' is {_shown(ppl)}, which is impossible beside '{log_field}' "
                f"{_shown(loss)} (it is exp({log_field}): NaN with NaN, infinite with infinite)")  # fmt: skip
    # in logarithms (exp(loss) can overflow): ppl +- its slack, against loss +- its slack
    low, high = ppl - written_slack(ppl), ppl + written_slack(ppl)
    low = math.log(low) if low > 0 else -math.inf
    high = math.log(high) if high > 0 else -math.inf
    if high + AGREE < loss - written_slack(loss) or low - AGREE > loss + written_slack(loss):
        shown = f"{math.exp(loss):.6g}" if loss < 709 else f"e^{loss:.6g}"
        return (f"field '{exp_field}' is {_shown(ppl)}, which is impossible (it is exp({log_field}) = {shown}, "
                f"'{log_field}' being {_shown(loss)})")  # fmt: skip
    return None


def _contradiction(record: dict) -> str | None:
    """Why two figures of a record contradict each other (EXPONENTIALS, INTERVALS), or None. NaN and infinities
    (a diverged model's figures, shown as such) are left alone."""
    benchmark = record["benchmark"]
    for log_field, exp_field in EXPONENTIALS.get(benchmark, []):
        problem = exponential_problem(record, log_field, exp_field)
        if problem:
            return problem
    for point_field, interval_field in INTERVALS.get(benchmark, []):
        point, interval = record.get(point_field), record.get(interval_field)
        bounds = interval if isinstance(interval, list) and all(_number(v) for v in interval) else []
        if bounds and not _finite(*bounds) and (_finite(point) or any(_finite(v) for v in bounds)):
            return (f"field '{interval_field}' is {_shown(interval)}, which is impossible beside '{point_field}' "
                    f"{_shown(point)} (an interval around a finite figure has finite bounds)")  # fmt: skip
        if not (isinstance(interval, list) and len(interval) == 2 and _finite(point, *interval)):
            continue
        low, high = interval
        slack = written_slack  # (each figure stands for what it rounds)
        if point + slack(point) < low - slack(low) or point - slack(point) > high + slack(high):
            return (f"field '{point_field}' is {_shown(point)}, which is impossible (it lies outside its own "
                    f"interval, '{interval_field}' {_shown(interval)})")  # fmt: skip
    return None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fits(value, kind) -> bool:
    if kind is list:
        return isinstance(value, list)
    if kind == NUM:
        return _number(value)
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == STR:
        return isinstance(value, str)
    if kind == DICT:
        return isinstance(value, dict)
    if kind == PAIR:
        return isinstance(value, list) and len(value) == 2 and all(_number(v) for v in value)
    if kind == NUMS:
        return isinstance(value, list) and all(_number(v) for v in value)
    return isinstance(value, list) and all(_fits(v, PAIR) for v in value)  # PAIRS


def _probes_problem(record: dict) -> str | None:
    if record.get("record") != "summary":
        return None
    counts = (INT, "always")
    tally = {"correct": counts, "total": counts, "accuracy": (NUM, "always")}
    categories = record.get("categories")
    if not isinstance(categories, dict) or not all(isinstance(c, dict) for c in categories.values()):
        return "field 'categories' is missing or not an object of per-category counts"
    for where, counts_of in [("overall", record.get("overall")), *((f"categories.{c}", v) for c, v in
                                                                    categories.items())]:  # fmt: skip
        if not isinstance(counts_of, dict):
            return f"field '{where}' is missing or not an object"
        for key, (kind, _) in tally.items():
            if not _fits(counts_of.get(key), kind):
                return f"field '{where}.{key}' is {_shown(counts_of.get(key))}, not {kind}"
    return None


def _shown(value) -> str:
    return "missing" if value is None else f"{json.dumps(value)[:40]}"


def label_problem(field: str, value) -> str | None:
    """Why a label a table or a plot shows (a model's, a split's) cannot be shown, or None: empty (a row and a
    legend entry without a name), or holding a line break or another control character (it would break a markdown
    table's row in two)."""
    if not isinstance(value, str):
        return None
    if not value.strip():
        return f"field '{field}' is {_shown(value)}, which is impossible (an empty label)"
    if any(unicodedata.category(c) == "Cc" for c in value):
        return f"field '{field}' is {_shown(value)}, which is impossible (a label holding a control character)"
    return None


def _count_or_finite_problem(record: dict) -> str | None:
    """Why a length or count (COUNTS) is not a whole number >= 1, or a figure that is always finite (FINITE) is NaN
    or infinite, or None (missing and null are left to FIELDS)."""
    for field in COUNTS:
        value = record.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            return f"field '{field}' is {_shown(value)}, which is impossible (a length or count: a whole number >= 1)"
    for field in FINITE:
        values = record.get(field) if isinstance(record.get(field), list) else [record.get(field)]
        if any(_number(v) and not math.isfinite(v) and not (math.isnan(v) and field in FRACTIONS) for v in values):
            return f"field '{field}' is {_shown(record.get(field))}, which is impossible (it is a finite number)"
    return None


def record_problem(record: dict) -> str | None:
    """What is wrong with a record's fields that the report reads (see FIELDS), or None."""
    for field in LABELS:
        problem = label_problem(field, record.get(field))
        if problem:
            return problem
    problem = _count_or_finite_problem(record)
    if problem:
        return problem
    if record["benchmark"] == "probes":
        return _probes_problem(record)
    ok = record.get("status", "ok") == "ok"
    for field, (kind, required) in FIELDS.get(record["benchmark"], {}).items():
        value = record.get(field)
        if value is None and (required is None or (required == "ok" and not ok)):
            continue
        if not _fits(value, kind):
            what = "a list" if kind is list else kind
            return f"field '{field}' is {_shown(value)}, not {what}"
        problem = range_problem(field, value)
        if problem:
            return problem
    problem = _contradiction(record) or figures_problem(record)
    if problem:
        return problem
    if record["benchmark"] == "effective_rank" and not record["layers"]:
        return "field 'layers' is empty: an effective_rank record holds one entry per layer"
    losses, counts = record.get("window_loss"), record.get("window_tokens")
    if isinstance(losses, list) and isinstance(counts, list) and (len(losses) != len(counts) or not losses):
        return (f"field 'window_loss' has {len(losses)} entries and 'window_tokens' {len(counts)}: one of each per "
                "window, at least one")  # fmt: skip
    if isinstance(losses, list) and _finite(record.get("loss")):  # (the loss is the windows' mean: NaN with NaN)
        window = next((i for i, v in enumerate(losses) if _number(v) and not math.isfinite(v)), None)
        if window is not None:
            return (f"field 'window_loss' holds {_shown(losses[window])} at window {window}, which is impossible "
                    f"beside 'loss' {_shown(record['loss'])} (the loss is the windows' mean: a finite loss has "
                    "finite windows)")  # fmt: skip
    if record["benchmark"] == "stream_loss" and record.get("bucket_loss") and ok:
        lengths = {f: len(record.get(f) or []) for f in ("positions", "bucket_loss", "bucket_ci")}
        if len(set(lengths.values())) > 1 or not _number(record.get("bucket")):
            return ("fields 'positions', 'bucket_loss' and 'bucket_ci' must have one entry per bucket and 'bucket' "
                    f"must be a number (lengths {lengths['positions']}, {lengths['bucket_loss']}, "
                    f"{lengths['bucket_ci']})")  # fmt: skip
    return None
