"""Figures of a memory or kv_quant record that are each possible alone but not in the record they are in (probe AD7):
a table would show them side by side, contradicting each other. A record like that was changed by hand."""

from __future__ import annotations

import json
import math

AGREE = 1e-6  # relative: what float arithmetic (and a figure written with fewer digits) may leave between them
KL_SLACK = 1e-6  # a KL divergence is >= 0; float sums over near-identical distributions may leave it a hair below


def written_slack(value: float) -> float:
    """How far the figure a record holds may be from the one it stands for: half a unit of its last digit (66.7, as
    a test or a hand-made record writes it, stands for 66.65 to 66.75; a figure attnlab wrote has all 17), and at
    least AGREE of it."""
    mantissa, _, exponent = repr(float(value)).partition("e")
    digits = len(mantissa.partition(".")[2])
    return max(0.5 * 10.0 ** (int(exponent or 0) - digits), AGREE * abs(value))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(*values) -> bool:  # (NaN: a figure shown as such, whatever stands beside it)
    return all(_number(v) and math.isfinite(v) for v in values)


def _shown(value) -> str:
    return json.dumps(value)[:40]


def figures_problem(record: dict) -> str | None:
    """Why a memory record's length (a cache of 0 tokens is not measured) or its stored `kv_matches_analytic` (beside
    its two byte counts), or a kv_quant record's bytes (a policy stores every token in some bytes) or KL (a
    divergence, >= 0) cannot be, or None (missing fields and fields of the wrong kind are said elsewhere)."""
    if record.get("benchmark") == "memory":
        if record.get("length") == 0:
            return "field 'length' is 0, which is impossible (a cache of 0 tokens is not measured)"
        measured, analytic, equal = (record.get(f) for f in ("kv_bytes", "kv_bytes_analytic", "kv_matches_analytic"))
        if _finite(measured, analytic) and isinstance(equal, bool) and equal != (measured == analytic):
            return (f"field 'kv_matches_analytic' is {_shown(equal)}, which is impossible beside 'kv_bytes' "
                    f"{_shown(measured)} and 'kv_bytes_analytic' {_shown(analytic)} (it says whether they are "
                    "equal)")  # fmt: skip
    if record.get("benchmark") == "kv_quant":
        for field in ("bytes_per_token", "vs_full"):
            if record.get(field) == 0:
                return f"field '{field}' is 0, which is impossible (a policy stores every token in some bytes)"
        kl = record.get("kl")
        if _number(kl) and kl < -KL_SLACK:
            return f"field 'kl' is {_shown(kl)}, which is impossible (a KL divergence is >= 0)"
        return _kv_quant_problem(record)
    return _memory_problem(record) if record.get("benchmark") == "memory" else _windows_problem(record)


def _kv_quant_problem(record: dict) -> str | None:
    """A kv_quant record's KL and dNLL, of the same logits, one NaN beside the other finite. (Its bytes at seq_len are
    not checked against its bytes per token: they count the tokens its cache holds, which a memory bounds and the
    record does not say.)"""
    dnll, kl = record.get("dnll"), record.get("kl")
    if _number(dnll) and _number(kl) and math.isnan(dnll) != math.isnan(kl):
        return (f"field 'kl' is {_shown(kl)}, which is impossible beside 'dnll' {_shown(dnll)} (both come from the "
                "same logits: NaN with NaN)")  # fmt: skip
    return None


def _memory_problem(record: dict) -> str | None:
    """A memory record holding more tokens than it was filled with, or, for a cache of every token in one format
    (no capacity, no KV policy), whose bytes are not its tokens' bytes per token times the tokens it holds."""
    held, length = record.get("held_tokens"), record.get("length")
    if isinstance(held, int) and isinstance(length, int) and held > length:
        return (f"field 'held_tokens' is {_shown(held)}, which is impossible beside 'length' {_shown(length)} (a "
                "cache holds at most the tokens it was filled with)")  # fmt: skip
    analytic, per_token, batch = (record.get(f) for f in ("kv_bytes_analytic", "kv_bytes_per_token", "batch_size"))
    plain = record.get("capacity") is None and record.get("kv_policy") is None and isinstance(held, int)
    if plain and _finite(analytic, per_token) and abs(analytic - (batch or 1) * per_token * held) > 1e-6 * analytic:
        return (f"field 'kv_bytes_analytic' is {_shown(analytic)}, which is impossible beside 'kv_bytes_per_token' "
                f"{_shown(per_token)} x 'held_tokens' {held} (x 'batch_size' {batch or 1})")  # fmt: skip
    return None


def _windows_problem(record: dict) -> str | None:
    """A record scored over windows (window_loss: each window's summed loss; window_tokens: its tokens) whose count,
    tokens or loss (the windows' total loss over their tokens) are not theirs, or whose ci_level is no level."""
    for point_field, interval_field in (("loss", "loss_ci"), ("ppl", "ppl_ci")):
        point, interval = record.get(point_field), record.get(interval_field)
        if _number(point) and not math.isfinite(point) and isinstance(interval, list) and _finite(*interval):
            return (f"field '{point_field}' is {_shown(point)}, which is impossible beside the finite interval "
                    f"'{interval_field}' {_shown(interval)} (a point lies within its own interval)")  # fmt: skip
    level = record.get("ci_level")
    if _number(level) and not 0 < level < 1:
        return f"field 'ci_level' is {_shown(level)}, which is impossible (a confidence level is between 0 and 1)"
    losses, counts = record.get("window_loss"), record.get("window_tokens")
    if not (isinstance(losses, list) and isinstance(counts, list) and len(losses) == len(counts) and counts):
        return None
    if isinstance(record.get("windows"), int) and record["windows"] != len(losses):
        return (f"field 'windows' is {_shown(record['windows'])}, which is impossible beside {len(losses)} "
                "'window_loss' entries (one per window)")  # fmt: skip
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts) or not _finite(*losses):
        return None
    total = sum(counts)
    if isinstance(record.get("tokens"), int) and record["tokens"] != total:
        return (f"field 'tokens' is {_shown(record['tokens'])}, which is impossible beside 'window_tokens' (which "
                f"add up to {total})")  # fmt: skip
    loss = record.get("loss")
    mean = sum(losses) / total if total else math.nan
    # (each figure as written: a window loss written 263.2 stands for 263.15 to 263.25)
    slack = written_slack(loss) + sum(written_slack(v) for v in losses) / total if _finite(loss) and total else 0.0
    if _finite(loss, mean) and abs(loss - mean) > slack + AGREE * abs(mean):
        return (f"field 'loss' is {_shown(loss)}, which is impossible beside 'window_loss' (the windows' total "
                f"loss over their tokens is {mean:.6g})")  # fmt: skip
    return None
