"""Evaluation statistics, pure: unbiased pass@k and pass^k per task, means over tasks with 95%
bootstrap intervals, paired comparisons of two models over the same tasks (a sign-flip test), and
Bradley–Terry ratings from attempt-by-attempt duels. Formulas and references: docs/evaluation.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from statistics import NormalDist

import msgspec
import numpy as np

from arena_core.ratings import Game, Rating, rate

#: Bootstrap resamples of the tasks, and sign flips of the paired test when they are drawn.
RESAMPLES = 2000
FLIPS = 10000
#: Up to this many tasks with a non-zero difference the paired test enumerates every sign flip (exact).
EXACT_FLIPS_UP_TO = 16
LEVEL = 0.95


class Estimate(msgspec.Struct, frozen=True, kw_only=True):
    """A mean over tasks with its bootstrap interval. ``tasks``: how many tasks it averages (tasks
    with fewer valid attempts than the estimator needs are left out); ``value`` is None with none."""

    value: float | None
    ci_low: float | None
    ci_high: float | None
    tasks: int


class PairedComparison(msgspec.Struct, frozen=True, kw_only=True):
    """``a`` minus ``b`` on ``metric``, task by task over the tasks both have: the mean difference,
    its bootstrap interval, the two-sided p-value of a paired sign-flip test (``exact``: every
    flip enumerated), and on how many tasks ``a`` did better, worse, the same."""

    a: str
    b: str
    metric: str
    difference: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    exact: bool
    tasks: int
    better: int
    worse: int
    same: int


def _products(top: np.ndarray, n: np.ndarray, k: int) -> np.ndarray:
    """prod_{i<k} (top - i) / (n - i), elementwise; NaN where n < k. Each factor is in [0, 1]
    once a zero factor is reached, so the product never over- or underflows (no binomials)."""
    top = np.asarray(top, dtype=float)
    n = np.asarray(n, dtype=float)
    i = np.arange(k, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        factors = np.clip((top[..., None] - i), 0.0, None) / (n[..., None] - i)
        out = np.prod(factors, axis=-1)
    return np.where(n >= k, out, np.nan)


def pass_at_k(n, c, k: int) -> np.ndarray:
    """Chen et al. (2021): the unbiased estimate of P(at least one of k attempts succeeds) from
    ``c`` successes in ``n >= k`` attempts, 1 - C(n-c, k) / C(n, k); NaN where n < k."""
    if k < 1:
        raise ValueError(f"k must be >= 1, not {k}")
    n = np.asarray(n)
    return 1.0 - _products(n - np.asarray(c), n, k)


def pass_hat_k(n, c, k: int) -> np.ndarray:
    """pass^k (Yao et al. 2024, tau-bench): the unbiased estimate of P(all of k attempts succeed),
    C(c, k) / C(n, k); NaN where n < k."""
    if k < 1:
        raise ValueError(f"k must be >= 1, not {k}")
    return _products(np.asarray(c), np.asarray(n), k)


def bootstrap_interval(values, *, resamples: int = RESAMPLES, level: float = LEVEL,
                       seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """BCa bootstrap interval (Efron 1987) of the mean over the last axis (tasks), for every
    leading index at once: the tasks resampled with replacement ``resamples`` times (the same
    draws for every leading index), the percentiles moved for the bootstrap's median bias and for
    skew (acceleration from the jackknife). No NaN allowed: drop the tasks first."""
    values = np.asarray(values, dtype=float)
    if np.isnan(values).any():
        raise ValueError("bootstrap_interval: NaN among the values (leave those tasks out)")
    t = values.shape[-1]
    if t == 0:
        raise ValueError("bootstrap_interval: no tasks")
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(t, np.full(t, 1.0 / t), size=resamples) / t  # (resamples, tasks)
    means = np.sort(values @ weights.T, axis=-1)  # (..., resamples)
    point = values.mean(axis=-1, keepdims=True)
    # median bias: where the point estimate falls among the resampled means (ties count half)
    below = (np.sum(means < point - 1e-12, axis=-1) + 0.5 * np.sum(np.abs(means - point) <= 1e-12, axis=-1))
    share = np.clip(below / resamples, 0.5 / resamples, 1 - 0.5 / resamples)
    z0 = _ppf(share)
    # acceleration: the skew of the jackknife means (leave one task out)
    jack = (values.sum(axis=-1, keepdims=True) - values) / max(t - 1, 1)
    dev = jack.mean(axis=-1, keepdims=True) - jack
    spread = np.sum(dev ** 2, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        accel = np.where(spread > 0, np.sum(dev ** 3, axis=-1) / (6.0 * spread ** 1.5), 0.0)
    bounds = []
    for tail in ((1.0 - level) / 2, (1.0 + level) / 2):
        z = z0 + _ppf(np.asarray(tail))
        alpha = _cdf(z0 + z / (1.0 - accel * z))
        index = np.clip(np.floor(alpha * (resamples - 1) + 0.5).astype(int), 0, resamples - 1)
        bounds.append(np.take_along_axis(means, index[..., None], axis=-1)[..., 0])
    return bounds[0], bounds[1]


_NORMAL = NormalDist()
_ppf = np.vectorize(_NORMAL.inv_cdf, otypes=[float])
_cdf = np.vectorize(_NORMAL.cdf, otypes=[float])


def mean_with_interval(per_task, *, seed: int = 0, resamples: int = RESAMPLES) -> Estimate:
    """The mean of the per-task values (NaN tasks left out) with its 95% bootstrap interval."""
    values = np.asarray(per_task, dtype=float)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return Estimate(value=None, ci_low=None, ci_high=None, tasks=0)
    low, high = bootstrap_interval(values, seed=seed, resamples=resamples)
    return Estimate(value=float(values.mean()), ci_low=float(low), ci_high=float(high), tasks=int(values.size))


def sign_flip_p_value(differences, *, flips: int = FLIPS, seed: int = 0) -> tuple[float, bool]:
    """Two-sided p-value of the paired sign-flip (permutation) test of mean difference 0, and
    whether it is exact. Under the null each task's difference is as likely with either sign;
    the p-value is the share of sign assignments whose |mean| reaches the observed one. Exact
    (every assignment) up to ``EXACT_FLIPS_UP_TO`` non-zero differences, else ``flips`` random
    ones with the observed counted in ((1 + hits) / (1 + flips)), so never 0."""
    d = np.asarray(differences, dtype=float)
    d = d[d != 0.0]  # a zero difference is the same under either sign
    if d.size == 0:
        return 1.0, True
    observed = abs(d.sum())
    tolerance = 1e-9 * max(1.0, observed)
    if d.size <= EXACT_FLIPS_UP_TO:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))
        return float(np.mean(np.abs(signs @ d) >= observed - tolerance)), True
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([1.0, -1.0]), size=(flips, d.size))
    hits = int(np.count_nonzero(np.abs(signs @ d) >= observed - tolerance))
    return (1 + hits) / (1 + flips), False


def paired(a: str, b: str, metric: str, per_task_a: Mapping[str, float], per_task_b: Mapping[str, float], *,
           seed: int = 0) -> PairedComparison:
    """``a`` against ``b`` over the tasks both have a (non-NaN) value for."""
    common = sorted(t for t in per_task_a.keys() & per_task_b.keys()
                    if not (np.isnan(per_task_a[t]) or np.isnan(per_task_b[t])))
    d = np.array([per_task_a[t] - per_task_b[t] for t in common], dtype=float)
    if d.size == 0:
        return PairedComparison(a=a, b=b, metric=metric, difference=None, ci_low=None, ci_high=None,
                                p_value=None, exact=False, tasks=0, better=0, worse=0, same=0)
    low, high = bootstrap_interval(d, seed=seed)
    p, exact = sign_flip_p_value(d, seed=seed)
    return PairedComparison(a=a, b=b, metric=metric, difference=float(d.mean()), ci_low=float(low),
                            ci_high=float(high), p_value=p, exact=exact, tasks=int(d.size),
                            better=int((d > 0).sum()), worse=int((d < 0).sum()), same=int((d == 0).sum()))


def duel_games(rewards: Mapping[str, Mapping[str, Sequence[float | None]]]) -> list[Game]:
    """Every pair of models as duels: on each task, attempt i of one against attempt i of the other
    (both with a reward), the higher reward winning, equal rewards a draw. ``rewards``: model ->
    task -> the attempts' rewards in attempt order (None: no reward, not a game)."""
    counts: dict[tuple[str, str, float], int] = {}
    models = sorted(rewards)
    for x, y in itertools.combinations(models, 2):
        for task in rewards[x].keys() & rewards[y].keys():
            for rx, ry in zip(rewards[x][task], rewards[y][task]):
                if rx is None or ry is None:
                    continue
                score = 1.0 if rx > ry else 0.0 if rx < ry else 0.5
                counts[(x, y, score)] = counts.get((x, y, score), 0) + 1
    return [Game(a=x, b=y, score=s, count=c) for (x, y, s), c in sorted(counts.items())]


def ratings(rewards: Mapping[str, Mapping[str, Sequence[float | None]]], *, seed: int = 0) -> list[Rating]:
    """Bradley–Terry ratings (Elo scale, 95% intervals; ``arena_core.ratings``) from ``duel_games``."""
    return rate(duel_games(rewards), seed=seed)
