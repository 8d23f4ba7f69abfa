"""`attnlab report --paired A:B`: which records of two models were scored on the same windows of the same tokens
(so that their difference can be resampled window by window, eval.perplexity.paired_difference), and, for a pair
that has none, one line saying why: no setting in common, other tokens at the same setting (another tokenizer or
other data), records without per-window losses, or windows that differ (the text changed). Passkey cells pair too:
the trials both models were asked with the same key at the same token (needle_pairs), compared as a head-to-head."""

from __future__ import annotations

from attnlab.config import names_model
from attnlab.eval.perplexity import paired_difference
from attnlab.eval.stats import paired_comparison


def paired_rows(
    records: list[dict], pairs: list[tuple[str, str]], elsewhere: frozenset = frozenset()
) -> tuple[list[tuple], list[str]]:
    """([(a, b, benchmark, a's record, paired_difference of a's and b's)] for every perplexity or extrapolation
    setting both were scored at on the same windows of the same tokens, per (a, b) in pairs; one line per pair that
    gave none, saying why). records: those measured (status ok), one per model and setting. elsewhere: pairs another
    benchmark paired (needle_pairs), which get no line unless both models have a record of these benchmarks."""
    rows, unpaired = [], []
    for a, b in pairs:
        if (a, b) in elsewhere and not all(any(r["benchmark"] in PAIRED and r["model"] == m for r in records)
                                           for m in (a, b)):  # fmt: skip
            continue
        found, reasons = [], []  # reasons: (rank, line); the most telling one is said
        for benchmark in PAIRED:
            scored = {m: [r for r in records if r["benchmark"] == benchmark and r["model"] == m] for m in (a, b)}
            for record_a in scored[a]:
                for record_b in (r for r in scored[b] if _windows(r) == _windows(record_a)):
                    reason = _unpaired(record_a, record_b)
                    if reason:
                        reasons.append(reason)
                    else:
                        found.append((a, b, benchmark, record_a, paired_difference(record_a, record_b)))
        rows += found
        if not found:
            line = max(reasons)[1] if reasons else _no_common_setting(records, a, b)
            unpaired.append(f"--paired {a}:{b}: {line}")
    return rows, unpaired


def _shown(value) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


PAIRED = ("perplexity", "rope_extrapolation")  # the benchmarks whose records keep each window's loss
# Where two records' windows lie: the text, the split, the window, the stride and the token budget; and what they
# hold: the tokens (another tokenizer, or the same text prepared otherwise, puts other text in window k at the same
# offsets), known by the sha256 of the ids the windows read, and in older records by the tokenizer and the number of
# tokens the text is.
WINDOWS = ("dataset", "text", "split", "seq_len", "stride", "max_tokens", "tokens")
TOKENS = ("tokenizer", "tokens_in_split", "text_tokens", "tokens_sha256")
COUNTS = ("tokens_in_split", "text_tokens")


def other_tokens(a: dict, b: dict) -> bool:
    """Whether records a and b, scored at the same setting, read other tokens: the sha256 of the ids their windows
    read, when both have it; else (older records) the text's number of tokens, or the tokenizer's name. A model
    reference's name is not compared: one vocabulary has as many names as files (a GGUF and its conversion), and
    the digest or the count tells."""
    if a.get("tokens_sha256") and b.get("tokens_sha256"):
        return a["tokens_sha256"] != b["tokens_sha256"]
    if any(a[k] != b[k] for k in COUNTS if a.get(k) is not None and b.get(k) is not None):
        return True
    names = a.get("tokenizer"), b.get("tokenizer")
    return all(isinstance(n, str) and not names_model(n) for n in names) and names[0] != names[1]


def _windows(record: dict) -> list:
    return [record.get(k) for k in WINDOWS]


def _described(record: dict, keys: tuple[str, ...]) -> str:
    return ", ".join(f"{k} {_shown(record[k])}" for k in keys if record.get(k) is not None) or "none recorded"


def _unpaired(a: dict, b: dict) -> tuple[int, str] | None:
    """Why records a and b, scored at the same setting, cannot be compared window by window, as (rank: the higher
    the more telling, one line), or None when they can."""
    of_a, of_b = f"{a['model']}'s {a['benchmark']} record", f"{b['model']}'s"
    if other_tokens(a, b):
        return 3, (f"{of_a} ({_described(a, TOKENS)}) and {of_b} ({_described(b, TOKENS)}) read other tokens at "
                   "the same setting: their windows hold other text, so they cannot be compared window by "
                   "window (pair models with the same tokenizer and data; the perplexity table compares them "
                   "apart)")  # fmt: skip
    missing = [r for r in (a, b) if not isinstance(r.get("window_loss"), list)
               or not isinstance(r.get("window_tokens"), list)]  # fmt: skip
    if missing:
        who = " and ".join(f"{r['model']}'s" for r in missing)
        many = len(missing) > 1
        return 1, (f"{who} {a['benchmark']} record{'s' * many} at {_described(a, WINDOWS)} "
                   f"{'hold' if many else 'holds'} no per-window losses (recorded by an older attnlab): run the "
                   "benchmark again to compare window by window")  # fmt: skip
    if a["window_tokens"] != b["window_tokens"]:
        return 2, (f"{of_a} and {of_b} were scored on other windows ({len(a['window_tokens'])} and "
                   f"{len(b['window_tokens'])} windows at {_described(a, WINDOWS)}): the text changed between "
                   "them; score both again on the same text")  # fmt: skip
    return None


def _no_common_setting(records: list[dict], a: str, b: str) -> str:
    """Why a and b share no setting to pair: what each was scored at."""
    scored = {m: [r for r in records if r["benchmark"] in PAIRED and r["model"] == m] for m in (a, b)}
    asked = [m for m in (a, b) if any(r["benchmark"] == "needle" and r["model"] == m for r in records)]
    if len(asked) == 2 and not scored[a] and not scored[b]:
        return (f"{a} and {b} were never given the same passkey trial (the same key at the same token of the same "
                "filler, length and depth): run the needle benchmark on both with the same parameters and "
                "tokenizer")  # fmt: skip
    if not scored[a] or not scored[b]:
        who = f"neither {a} nor {b} has" if not scored[a] and not scored[b] else f"{a if not scored[a] else b} has no"
        return (f"{who} {', '.join(PAIRED)} or needle record to pair (run `attnlab bench --benchmarks perplexity` "
                "or needle on both)")  # fmt: skip
    shown = "; ".join(f"{m}: " + " | ".join(f"{r['benchmark']} at {_described(r, WINDOWS)}" for r in scored[m][:3])
                      + (" | ..." if len(scored[m]) > 3 else "") for m in (a, b))  # fmt: skip
    return (f"{a} and {b} were never scored at the same setting ({shown}): score both with the same dataset, "
            "split, seq_len, stride and max_tokens")  # fmt: skip


def needle_pairs(records: list[dict], pairs: list[tuple[str, str]]) -> list[tuple[str, str, dict]]:
    """[(a, b, stats.paired_comparison of their trials)] for each (a, b) in pairs whose models were both asked for
    the same keys at the same places: each trial of a needle cell is a case, known by its cell (length, depth,
    filler), its place in the cell, its key and the token the key starts at, so that two models' cases of one name
    read the same text. McNemar's exact test counts only the trials one of the two got right."""
    found = []
    for a, b in pairs:
        trials = {m: _needle_trials(records, m) for m in (a, b)}
        common = [t for t in trials[a] if t in trials[b]]
        if common:
            rows = [[{"id": t, "correct": trials[m][t]} for t in common] for m in (a, b)]
            found.append((a, b, paired_comparison(*rows, names=(a, b))))
    return found


def _needle_trials(records: list[dict], model: str) -> dict[str, bool]:
    """{case name: right} of a model's needle trials (needle_pairs)."""
    out = {}
    for r in records:
        if r["benchmark"] == "needle" and r.get("scope") == "cell" and r["model"] == model:
            for i, trial in enumerate(r.get("results") or []):
                name = f"{r['length']}@{r['depth']}#{i} {r.get('filler')}: {trial.get('key')}@{trial.get('needle_at')}"
                out[name] = bool(trial.get("correct"))
    return out
