"""stats: exact McNemar against textbook values and an independent binomial test, the seeded bootstrap
(reproducible, pairs kept, ~95% coverage), Wilson intervals and the paired head-to-head verdict."""

import math
import random
from fractions import Fraction

import pytest
import torch

from attnlab.errors import InputError
from attnlab.eval.stats import bootstrap_ci, mcnemar_exact, paired_comparison, wilson_interval


def binomial_two_sided(k: int, n: int) -> float:
    """Independent reference: the two-sided exact binomial test (p = 1/2) as scipy.stats.binomtest computes
    it, summing the probability of every outcome no more likely than the observed one, in exact fractions."""
    if n == 0:
        return 1.0
    pmf = [Fraction(math.comb(n, i), 2**n) for i in range(n + 1)]
    return float(min(Fraction(1), sum(p for p in pmf if p <= pmf[k])))


def test_mcnemar_textbook_values():
    assert mcnemar_exact(1, 6) == 0.125  # 2 * (1 + 7) / 2^7, exactly
    assert mcnemar_exact(6, 1) == 0.125
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(0, 5) == 0.0625  # 2 / 32
    assert mcnemar_exact(2, 10) == 2 * (1 + 12 + 66) / 4096
    assert mcnemar_exact(7, 6) == 1.0  # the seed's "7-6 head-to-head wins": no evidence at all


@pytest.mark.parametrize("b", [0, 1, 2, 5, 9, 17, 30])
@pytest.mark.parametrize("c", [0, 1, 3, 8, 13, 40])
def test_mcnemar_matches_an_independent_binomial_test(b, c):
    assert mcnemar_exact(b, c) == pytest.approx(binomial_two_sided(b, b + c), rel=1e-12)


def test_mcnemar_large_counts_stay_finite_and_ordered():
    assert 0 < mcnemar_exact(400, 500) < mcnemar_exact(440, 460) < 1
    assert mcnemar_exact(0, 1000) == 2.0**-999  # exact integer arithmetic, rounded once
    assert mcnemar_exact(0, 3000) == 0.0  # below the smallest float: 0, not an OverflowError


@pytest.mark.parametrize("bad", [(-1, 3), (1.5, 2), (True, 2), (2, "3")])
def test_mcnemar_rejects_non_counts(bad):
    with pytest.raises(InputError, match="count"):
        mcnemar_exact(*bad)


def test_bootstrap_is_reproducible_with_a_seed():
    rng = random.Random(1)
    values = [rng.random() for _ in range(50)]
    assert bootstrap_ci(values, n=2000, seed=3) == bootstrap_ci(values, n=2000, seed=3)
    assert bootstrap_ci(values, n=2000, seed=3) != bootstrap_ci(values, n=2000, seed=4)


def test_bootstrap_covers_the_true_difference_of_a_constructed_case():
    # A is right on 70% of 200 cases, B on 50%, drawn with a fixed seed: the true difference is +0.20.
    rng = random.Random(0)
    a = [rng.random() < 0.7 for _ in range(200)]
    b = [rng.random() < 0.5 for _ in range(200)]
    low, high = bootstrap_ci(a, b, n=10000, seed=0)
    assert low < 0.20 < high
    assert low < sum(a) / 200 - sum(b) / 200 < high
    assert 0.10 < high - low < 0.25  # ~ 4 standard errors of a difference of two proportions over 200 cases


def test_bootstrap_coverage_is_near_the_nominal_level():
    """Over 300 simulated suites the 90% interval of the mean should hold the true mean ~90% of the time."""
    rng = random.Random(7)
    hits = 0
    for trial in range(300):
        values = [float(rng.random() < 0.3) for _ in range(150)]
        low, high = bootstrap_ci(values, n=1000, seed=trial, level=0.90)
        hits += low <= 0.3 <= high
    assert 0.84 <= hits / 300 <= 0.96  # binomial sd over 300 trials ~ 0.017


def test_bootstrap_resamples_pairs_together():
    """Identical paired samples have a difference of exactly 0 in every resample; unpaired they would not."""
    a = [float(i % 3 == 0) for i in range(60)]
    assert bootstrap_ci(a, a, n=500, seed=0) == (0.0, 0.0)
    shifted = [x + 0.5 for x in a]
    assert bootstrap_ci(shifted, a, n=500, seed=0) == pytest.approx((0.5, 0.5))


def test_bootstrap_custom_statistic_and_errors():
    values = list(range(101))
    low, high = bootstrap_ci(values, stat=lambda x: x.median(dim=1).values, n=2000, seed=0)
    assert low < 50 < high
    with pytest.raises(InputError, match="equal length"):
        bootstrap_ci([1, 2, 3], [1, 2])
    with pytest.raises(InputError, match="level"):
        bootstrap_ci([1, 2, 3], level=95)
    with pytest.raises(InputError, match="stat"):
        bootstrap_ci([1], [2], [3])


def test_bootstrap_large_suites_are_chunked_without_changing_the_statistic():
    values = torch.rand(50000, generator=torch.Generator().manual_seed(0)).tolist()
    low, high = bootstrap_ci(values, n=300, seed=1)
    mean = sum(values) / len(values)
    assert low < mean < high and high - low < 0.01


@pytest.mark.parametrize("correct,total", [(0, 10), (8, 10), (5, 10), (30, 117), (117, 117)])
def test_wilson_bounds_solve_the_score_equation(correct, total):
    z = 1.959963984540054
    low, high = wilson_interval(correct, total)
    p_hat = correct / total
    assert low <= p_hat <= high
    for bound in (low, high):
        if 0 < bound < 1:  # |p_hat - p| = z sqrt(p (1 - p) / n) at each interior bound
            assert abs(p_hat - bound) == pytest.approx(z * math.sqrt(bound * (1 - bound) / total), rel=1e-9)
    if correct == 0:
        assert (low, high) == (0.0, pytest.approx(z * z / (total + z * z)))


def test_wilson_edge_cases():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(InputError, match="between 0 and total"):
        wilson_interval(5, 3)


def rows(outcomes: list[bool], categories: list[str] | None = None) -> list[dict]:
    categories = categories or ["all"] * len(outcomes)
    return [
        {"id": f"case-{i:03d}", "category": c, "correct": ok}
        for i, (ok, c) in enumerate(zip(outcomes, categories, strict=True))
    ]


def paired_rows(both_right: int, a_only: int, b_only: int, both_wrong: int) -> tuple[list[dict], list[dict]]:
    a = [True] * both_right + [True] * a_only + [False] * b_only + [False] * both_wrong
    b = [True] * both_right + [False] * a_only + [True] * b_only + [False] * both_wrong
    return rows(a), rows(b)


def test_a_seven_six_split_is_not_a_win():
    """The seed's 117-case comparison read a 7-6 split of discordant cases as wins; it is p = 1.0."""
    a, b = paired_rows(25, 7, 6, 79)
    result = paired_comparison(a, b, names=("decoupled", "baseline"), n_boot=2000)
    assert (result["both_right"], result["a_only"], result["b_only"], result["both_wrong"]) == (25, 7, 6, 79)
    assert result["cases"] == 117
    assert result["accuracy_a"] == pytest.approx(32 / 117) and result["accuracy_b"] == pytest.approx(31 / 117)
    assert result["mcnemar_p"] == 1.0
    assert result["winner"] is None
    assert result["verdict"].startswith("no significant difference")
    assert "decoupled alone right on 7" in result["verdict"] and "baseline alone right on 6" in result["verdict"]
    assert result["ci_low"] < 0 < result["ci_high"]


def test_a_clear_split_names_the_winner():
    a, b = paired_rows(40, 0, 15, 45)
    result = paired_comparison(a, b, names=("small", "large"), n_boot=2000)
    assert result["mcnemar_p"] == 2 / 2**15
    assert result["winner"] == "large"
    assert result["verdict"].startswith("large is better")
    assert result["difference"] == pytest.approx(-0.15)
    assert result["ci_low"] <= -0.15 <= result["ci_high"] < 0


def test_comparison_pairs_by_id_and_counts_per_category():
    a = rows([True, True, False, False], ["x", "x", "y", "y"])
    b = list(reversed(rows([False, True, True, False], ["x", "x", "y", "y"])))  # order does not matter
    result = paired_comparison(a, b, n_boot=200)
    assert result["categories"] == {
        "x": {"both_right": 1, "a_only": 1, "b_only": 0, "both_wrong": 0},
        "y": {"both_right": 0, "a_only": 0, "b_only": 1, "both_wrong": 1},
    }
    assert result["seed"] == 0 and result["n_boot"] == 200


def test_comparison_of_different_cases_is_refused():
    a = rows([True, False, True])
    b = rows([True, False])
    with pytest.raises(InputError, match="different cases"):
        paired_comparison(a, b)
    with pytest.raises(InputError, match="repeated case ids"):
        paired_comparison(a + a[:1], a)
