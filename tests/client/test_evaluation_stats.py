"""Evaluation statistics (libs/arena/evaluation/stats.py): the estimators against hand-computed and
exact values, the paired test against full enumeration, and simulations showing the 95% intervals
cover the true value 95% ± 2 points of the time over 2,000 simulated evaluations."""

from __future__ import annotations

import math
from fractions import Fraction
from math import comb, lgamma

import numpy as np
import pytest

from arena.evaluation import stats


def test_pass_at_k_matches_the_binomial_formula_by_hand():
    # 1 - C(n-c, k) / C(n, k)
    assert stats.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert stats.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c / n
    assert stats.pass_at_k(5, 0, 3) == 0.0
    assert stats.pass_at_k(5, 5, 3) == 1.0
    assert stats.pass_at_k(5, 4, 2) == 1.0  # n - c < k: any k attempts hold a success
    assert math.isnan(stats.pass_at_k(2, 1, 3))  # fewer attempts than k: no estimate
    np.testing.assert_allclose(stats.pass_at_k([5, 5, 4], [2, 0, 1], 2), [0.7, 0.0, 0.5])


def test_pass_hat_k_is_all_k_succeed_by_hand():
    # C(c, k) / C(n, k)
    assert stats.pass_hat_k(5, 3, 2) == pytest.approx(3 / 10)
    assert stats.pass_hat_k(5, 5, 5) == 1.0
    assert stats.pass_hat_k(5, 1, 2) == 0.0
    assert stats.pass_hat_k(4, 2, 1) == pytest.approx(0.5)
    assert math.isnan(stats.pass_hat_k(3, 3, 4))
    with pytest.raises(ValueError):
        stats.pass_hat_k(3, 1, 0)


def test_estimators_are_exact_where_binomials_overflow_floats():
    n, c, k = 2000, 1500, 500
    want_hat = Fraction(comb(c, k), comb(n, k))  # ~1e-66: far from a float's limits, but C(2000,500) is not
    assert float(stats.pass_hat_k(n, c, k)) == pytest.approx(float(want_hat), rel=1e-9)
    want_at = 1 - Fraction(comb(n - 1990, 5), comb(n, 5))
    assert float(stats.pass_at_k(n, 1990, 5)) == pytest.approx(float(want_at), rel=1e-12)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_estimators_are_unbiased_over_the_binomial(k):
    n, p = 6, 0.3
    c = np.arange(n + 1)
    weights = np.array([comb(n, int(i)) * p ** i * (1 - p) ** (n - i) for i in c])
    assert weights @ stats.pass_at_k(n, c, k) == pytest.approx(1 - (1 - p) ** k, abs=1e-12)
    assert weights @ stats.pass_hat_k(n, c, k) == pytest.approx(p ** k, abs=1e-12)


def test_interval_of_equal_values_is_the_value_and_of_nothing_is_none():
    e = stats.mean_with_interval([0.5, 0.5, 0.5, float("nan")])
    assert (e.value, e.ci_low, e.ci_high, e.tasks) == (0.5, 0.5, 0.5, 3)
    assert stats.mean_with_interval([float("nan")]) == stats.Estimate(value=None, ci_low=None, ci_high=None,
                                                                      tasks=0)


def test_interval_holds_the_mean_and_narrows_with_more_tasks():
    rng = np.random.default_rng(3)
    few = stats.mean_with_interval(rng.binomial(1, 0.4, 20))
    many = stats.mean_with_interval(rng.binomial(1, 0.4, 400))
    assert few.ci_low <= few.value <= few.ci_high
    assert many.ci_low <= many.value <= many.ci_high
    assert many.ci_high - many.ci_low < (few.ci_high - few.ci_low) / 2


def test_sign_flip_p_value_by_full_enumeration():
    # 8 sign assignments of [1, 2, 3]: only +++ and --- reach |sum| 6
    assert stats.sign_flip_p_value([1, 2, 3]) == (0.25, True)
    assert stats.sign_flip_p_value([1, 1, 1, 1, 1]) == (2 / 32, True)
    # zeros are the same under either sign: left out
    assert stats.sign_flip_p_value([0, 0, 1, 1, 1, 1, 1]) == (2 / 32, True)
    assert stats.sign_flip_p_value([0, 0]) == (1.0, True)
    # [1, -1, 2]: sums over the 8 flips are 2,4,-2,0,0,2,-4,-2 -> |s| >= 2 in 6 of 8
    assert stats.sign_flip_p_value([1, -1, 2]) == (6 / 8, True)


def test_sign_flip_p_value_is_drawn_past_sixteen_tasks_and_never_zero():
    p, exact = stats.sign_flip_p_value(np.ones(40))
    assert not exact and p == pytest.approx(1 / (1 + stats.FLIPS))
    p, exact = stats.sign_flip_p_value(np.r_[np.ones(20), -np.ones(20)])
    assert not exact and p == 1.0


def test_paired_comparison_counts_tasks_both_have():
    a = {"t1": 1.0, "t2": 1.0, "t3": 0.0, "t4": 1.0, "t5": float("nan")}
    b = {"t1": 0.0, "t2": 1.0, "t3": 0.0, "t4": 0.0, "t6": 1.0}
    c = stats.paired("A", "B", "pass@1", a, b)
    assert (c.tasks, c.better, c.worse, c.same) == (4, 2, 0, 2)
    assert c.difference == pytest.approx(0.5)
    assert c.p_value == 0.5 and c.exact  # two non-zero differences of 1: 2 of 4 flips reach |sum| 2
    assert c.ci_low <= 0.5 <= c.ci_high
    assert stats.paired("A", "B", "pass@1", {"x": 1.0}, {"y": 1.0}).difference is None


def test_duel_games_pair_attempts_by_index_and_skip_missing_rewards():
    rewards = {"good": {"t1": [1.0, 1.0, None], "t2": [1.0, 0.0, 1.0]},
               "bad": {"t1": [0.0, 1.0, 1.0], "t2": [0.0, 0.0, 0.0]}}
    games = {(g.a, g.b, g.score): g.count for g in stats.duel_games(rewards)}
    # models sorted: "bad" is side a. t1: (0,1) loss, (1,1) draw, None skipped; t2: loss, draw, loss
    assert games == {("bad", "good", 0.0): 3, ("bad", "good", 0.5): 2}
    board = stats.ratings(rewards)
    assert [r.policy for r in board] == ["good", "bad"]
    assert board[0].ci_low <= board[0].rating <= board[0].ci_high
    assert (board[0].wins, board[0].draws, board[0].losses) == (3, 2, 0)


# ------------------------------------------------------------------ coverage simulations

SIMULATIONS, TASKS, ATTEMPTS = 2000, 50, 5
ALPHA, BETA = 0.6, 0.9  # each task's solve rate ~ Beta(0.6, 0.9): many hard tasks, some easy (skewed)


def beta_moment(j: int, m: int, a: float = ALPHA, b: float = BETA) -> float:
    """E[p^j (1 - p)^m] for p ~ Beta(a, b)."""
    return math.exp(lgamma(a + j) + lgamma(b + m) - lgamma(a + b + j + m) - lgamma(a) - lgamma(b) + lgamma(a + b))


def coverage(per_task: np.ndarray, truth: float) -> float:
    low, high = stats.bootstrap_interval(per_task, seed=11)
    return float(np.mean((low <= truth) & (truth <= high)))


@pytest.fixture(scope="module")
def simulated():
    """2,000 evaluations of 50 tasks drawn from the population, 5 attempts each: successes per task."""
    rng = np.random.default_rng(2026)
    p = rng.beta(ALPHA, BETA, size=(SIMULATIONS, TASKS))
    return p, rng.binomial(ATTEMPTS, p)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_pass_at_k_interval_covers_the_population_value_at_95_percent(simulated, k):
    _, c = simulated
    truth = 1 - beta_moment(0, k)  # E[1 - (1 - p)^k]
    assert abs(coverage(stats.pass_at_k(ATTEMPTS, c, k), truth) - 0.95) <= 0.02


@pytest.mark.parametrize("k", [1, 3, 5])
def test_pass_hat_k_interval_covers_the_population_value_at_95_percent(simulated, k):
    _, c = simulated
    truth = beta_moment(k, 0)  # E[p^k]
    assert abs(coverage(stats.pass_hat_k(ATTEMPTS, c, k), truth) - 0.95) <= 0.02


def test_mean_reward_interval_covers_at_95_percent_with_partial_rewards():
    rng = np.random.default_rng(7)
    # rewards in [0, 1] (a rubric's share of criteria): a task's mean reward m ~ Beta, 5 attempts Beta around m
    m = rng.beta(2.0, 3.0, size=(SIMULATIONS, TASKS))
    rewards = rng.beta(4 * m + 0.01, 4 * (1 - m) + 0.01, size=(ATTEMPTS, SIMULATIONS, TASKS))
    truth = (4 * 0.4 + 0.01) / 4.02  # E[reward] = E[(4m + 0.01) / 4.02], E[m] = 2 / 5
    assert abs(coverage(rewards.mean(axis=0), truth) - 0.95) <= 0.02


def test_paired_difference_interval_covers_and_the_test_holds_its_size():
    rng = np.random.default_rng(9)
    # two correlated models over the same tasks: B is A on the logit scale shifted by `gap`
    logit = rng.normal(-0.3, 1.5, size=(SIMULATIONS, TASKS))
    gap = 0.4
    pa, pb = 1 / (1 + np.exp(-logit - gap)), 1 / (1 + np.exp(-logit))
    d = rng.binomial(ATTEMPTS, pa) / ATTEMPTS - rng.binomial(ATTEMPTS, pb) / ATTEMPTS
    # the true difference in the population, by a large Monte Carlo over the same model
    big = rng.normal(-0.3, 1.5, size=2_000_000)
    truth = float(np.mean(1 / (1 + np.exp(-big - gap)) - 1 / (1 + np.exp(-big))))
    assert abs(coverage(d, truth) - 0.95) <= 0.02
    # under the null (the same model twice) the test rejects at 5% about 5% of the time
    null = rng.binomial(ATTEMPTS, pb) / ATTEMPTS - rng.binomial(ATTEMPTS, pb) / ATTEMPTS
    rejected = np.mean([stats.sign_flip_p_value(row, flips=999, seed=i)[0] <= 0.05
                        for i, row in enumerate(null[:1000])])
    assert abs(rejected - 0.05) <= 0.02
