"""Statistics for comparing checkpoints case by case: exact McNemar, percentile bootstrap, Wilson interval.

Two checkpoints run on the same cases give PAIRED outcomes. Only the discordant cases (one right, the
other wrong) carry evidence about which is better, so the head-to-head test is McNemar's exact test: under
"no difference" each discordant case is a fair coin flip. A 7-6 split of discordant cases is p = 1.0:
no evidence of anything, however it is phrased.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from statistics import NormalDist

import torch

from attnlab.errors import InputError


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs (b: only A right, c: only B right).

    The exact binomial test of b successes in n = b + c trials with p = 1/2:
    p = min(1, 2 * P(X <= min(b, c))), X ~ Binomial(n, 1/2). No discordant pairs: p = 1.
    """
    for name, value in (("b", b), ("c", c)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{name}={value!r} must be a count (an integer >= 0)")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))  # 2^n * P(X <= min(b, c)), exact integers
    return min(1.0, 2 * tail / 2**n)  # int / int is correctly rounded, even for large n


def bootstrap_ci(
    *samples: Sequence[float],
    stat: Callable[..., torch.Tensor] | None = None,
    n: int = 10000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat` over cases, resampled with replacement.

    samples: one or more equal-length sequences indexed by case; paired samples are resampled with the SAME
    case indices (so a per-case pairing survives). stat(*resampled) gets one (n_boot, n_cases) float64
    tensor per sample and returns (n_boot,) statistics; the default is the mean of one sample, or
    mean(a) - mean(b) for two. Reproducible for a given seed. Returns (low, high).
    """
    if not samples:
        raise InputError("bootstrap_ci needs at least one sample")
    data = [torch.as_tensor([float(x) for x in s], dtype=torch.float64) for s in samples]
    n_cases = len(data[0])
    if n_cases == 0 or any(len(d) != n_cases for d in data):
        raise InputError(f"samples must be non-empty and of equal length, got lengths {[len(d) for d in data]}")
    if not 0 < level < 1:
        raise InputError(f"level={level} must be between 0 and 1 (e.g. 0.95)")
    if n < 1:
        raise InputError(f"n={n} resamples must be >= 1")
    if stat is None:
        if len(data) > 2:
            raise InputError("give stat=... for more than two samples")
        stat = (lambda a: a.mean(dim=1)) if len(data) == 1 else (lambda a, b: a.mean(dim=1) - b.mean(dim=1))
    generator = torch.Generator().manual_seed(seed)
    chunk = max(1, 4_000_000 // n_cases)  # bounds memory at ~32 MB per sample for large suites
    values = []
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        index = torch.randint(n_cases, (rows, n_cases), generator=generator)  # (rows, n_cases)
        values.append(stat(*(d[index] for d in data)).to(torch.float64).reshape(rows))
    stats = torch.cat(values)  # (n,)
    tail = (1 - level) / 2
    low, high = torch.quantile(stats, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high


def wilson_interval(correct: int, total: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for an accuracy of correct/total (better than the normal one near 0 and 1).

    The bounds solve |p_hat - p| = z sqrt(p (1 - p) / total) for p. total = 0 gives (0, 1): no information.
    """
    if not 0 <= correct <= total:
        raise InputError(f"correct={correct} must be between 0 and total={total}")
    if total == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    p_hat = correct / total
    centre = (p_hat + z * z / (2 * total)) / (1 + z * z / total)
    half = z / (1 + z * z / total) * math.sqrt(p_hat * (1 - p_hat) / total + z * z / (4 * total * total))
    low = 0.0 if correct == 0 else max(0.0, centre - half)  # exactly 0 (1) at the edges, not 1e-17 off
    high = 1.0 if correct == total else min(1.0, centre + half)
    return low, high


def _paired_outcomes(rows_a: list[dict], rows_b: list[dict]) -> tuple[list[str], dict, dict]:
    """Case ids in A's order and {id: row} for each side; InputError unless both scored the same cases."""
    by_id = []
    for side, rows in (("A", rows_a), ("B", rows_b)):
        repeated = sorted(str(i) for i, count in Counter(r["id"] for r in rows).items() if count > 1)
        if repeated:
            raise InputError(f"run {side} has repeated case ids: {', '.join(repeated[:10])}")
        by_id.append({r["id"]: r for r in rows})
    a, b = by_id
    only_a, only_b = [i for i in a if i not in b], [i for i in b if i not in a]
    if only_a or only_b:
        raise InputError(
            f"the two runs scored different cases (only in A: {only_a[:10]}, only in B: {only_b[:10]}); "
            "compare runs of the same suite"
        )
    if not a:
        raise InputError("no cases to compare")
    return list(a), a, b


def _counts(pairs: list[tuple[bool, bool]]) -> dict[str, int]:
    return {
        "both_right": sum(x and y for x, y in pairs),
        "a_only": sum(x and not y for x, y in pairs),
        "b_only": sum(y and not x for x, y in pairs),
        "both_wrong": sum(not x and not y for x, y in pairs),
    }


def paired_comparison(
    rows_a: list[dict],
    rows_b: list[dict],
    names: tuple[str, str] = ("A", "B"),
    n_boot: int = 10000,
    seed: int = 0,
    level: float = 0.95,
    alpha: float = 0.05,
) -> dict:
    """Head-to-head of two runs of the same cases (rows with `id`, `correct` and optionally `category`).

    Returns the 2x2 counts (both_right, a_only, b_only, both_wrong), each accuracy, the difference A - B
    with a seeded percentile-bootstrap interval over cases, McNemar's exact p on the discordant cases,
    per-category counts, `winner` (a name, or None when p >= alpha) and a plain-language `verdict`.
    """
    ids, a, b = _paired_outcomes(rows_a, rows_b)
    right_a = [bool(a[i]["correct"]) for i in ids]
    right_b = [bool(b[i]["correct"]) for i in ids]
    counts = _counts(list(zip(right_a, right_b, strict=True)))
    n = len(ids)
    accuracy_a, accuracy_b = sum(right_a) / n, sum(right_b) / n
    low, high = bootstrap_ci(right_a, right_b, n=n_boot, seed=seed, level=level)
    p = mcnemar_exact(counts["a_only"], counts["b_only"])
    categories: dict[str, list[tuple[bool, bool]]] = {}
    for i, x, y in zip(ids, right_a, right_b, strict=True):
        categories.setdefault(str(a[i].get("category", "")), []).append((x, y))
    name_a, name_b = names
    winner = None if p >= alpha else (name_a if counts["a_only"] > counts["b_only"] else name_b)
    diff = accuracy_a - accuracy_b
    figures = (
        f"{name_a} {accuracy_a:.1%} vs {name_b} {accuracy_b:.1%} on {n} cases, difference {diff:+.1%} "
        f"({level:.0%} bootstrap CI {low:+.1%} to {high:+.1%}); {name_a} alone right on {counts['a_only']}, "
        f"{name_b} alone right on {counts['b_only']}, McNemar exact p = {p:.3g}"
    )
    if winner is None:
        verdict = f"no significant difference (p >= {alpha}), so no winner: {figures}"
    else:
        verdict = f"{winner} is better (p < {alpha}): {figures}"
    return {
        "names": list(names),
        "cases": n,
        **counts,
        "accuracy_a": accuracy_a,
        "accuracy_b": accuracy_b,
        "difference": diff,
        "ci_low": low,
        "ci_high": high,
        "level": level,
        "n_boot": n_boot,
        "seed": seed,
        "mcnemar_p": p,
        "alpha": alpha,
        "winner": winner,
        "verdict": verdict,
        "categories": {c: _counts(pairs) for c, pairs in categories.items()},
    }
