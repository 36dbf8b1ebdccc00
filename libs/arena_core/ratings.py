"""Ratings of policies from their duels: Bradley–Terry by maximum likelihood, on the Elo scale,
with bootstrap confidence intervals. Pure: games in, ratings out (the leaderboard
of duels, and the evaluation reports). docs/trajectory.md (Duels).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

#: Elo's scale: a 400-point gap is 10:1 odds.
SCALE = 400.0 / math.log(10.0)
MEAN = 1500.0


class Game(msgspec.Struct, frozen=True, kw_only=True):
    """``count`` games of ``a`` against ``b``, each scoring ``score`` for ``a``: 1 a win, 0.5 a
    draw, 0 a loss."""

    a: str
    b: str
    score: float
    count: int = 1


class Rating(msgspec.Struct, frozen=True, kw_only=True):
    """A policy's Bradley–Terry strength on the Elo scale (the rated policies average 1500),
    with its 95% bootstrap interval, and its record."""

    policy: str
    rating: float
    ci_low: float
    ci_high: float
    games: int
    wins: int
    losses: int
    draws: int


def rate(games: Sequence[Game], *, prior: float = 2.0, resamples: int = 200, seed: int = 0,
         bootstrap: Literal["model", "games"] = "model") -> list[Rating]:
    """Ratings of every policy in ``games``, best first.

    ``prior``: virtual drawn games of each policy against a reference of average strength, so
    an undefeated (or winless) policy stays finite and few games say little. ``resamples``:
    bootstrap resamples of the games, drawn from a generator seeded with ``seed`` (the same
    games give the same intervals). ``bootstrap``: ``model`` replays every game played (the
    same pairs, as often) with its outcome drawn from the fit (and each pair's draw rate);
    ``games`` draws the games themselves with replacement, which gives a zero-width interval
    whenever every game of a pair went the same way (3 wins of 3 look certain).
    """
    if bootstrap not in ("model", "games"):
        raise ValueError(f"bootstrap must be 'model' or 'games', got {bootstrap!r}")
    if prior <= 0:
        raise ValueError("prior must be > 0: without it an undefeated policy's strength is infinite")
    for g in games:
        if g.a == g.b or g.score not in (0.0, 0.5, 1.0) or g.count < 0:
            raise ValueError(f"not a game: {g!r} (two distinct policies, score 0, 0.5 or 1, count >= 0)")
    cells = [g for g in games if g.count > 0]
    if not cells:
        return []
    names = sorted({g.a for g in cells} | {g.b for g in cells})
    index = {name: i for i, name in enumerate(names)}
    a = np.array([index[g.a] for g in cells])
    b = np.array([index[g.b] for g in cells])
    score = np.array([g.score for g in cells])
    counts = np.array([g.count for g in cells], dtype=float)
    n = len(names)

    theta = _fit(a, b, score, counts, n, prior, None)
    point = _elo(theta)
    total = int(counts.sum())
    rng = np.random.default_rng(seed)
    lo, hi = np.minimum(a, b), np.maximum(a, b)  # each pair once, as (lo, hi)
    pairs, which = np.unique(lo * n + hi, return_inverse=True)
    pi, pj = pairs // n, pairs % n
    played = np.bincount(which, counts)
    drawn_share = np.bincount(which, counts * (score == 0.5)) / played
    samples = np.empty((resamples, n))
    for r in range(resamples):
        if bootstrap == "games":
            again = a, b, score, rng.multinomial(total, counts / total).astype(float)
        else:
            draws = rng.binomial(played.astype(np.int64), drawn_share)
            wins = rng.binomial(played.astype(np.int64) - draws, _sigmoid(theta[pi] - theta[pj]))
            again = (np.concatenate([pi, pi, pi]), np.concatenate([pj, pj, pj]),
                     np.repeat([1.0, 0.0, 0.5], len(pairs)),
                     np.concatenate([wins, played - draws - wins, draws]).astype(float))
        samples[r] = _elo(_fit(*again, n, prior, theta))
    low, high = (np.percentile(samples, [2.5, 97.5], axis=0) if resamples else (point, point))

    record = np.zeros((n, 3), dtype=np.int64)  # wins, losses, draws
    for g in cells:
        i, j = index[g.a], index[g.b]
        if g.score == 1.0:
            record[i, 0] += g.count
            record[j, 1] += g.count
        elif g.score == 0.0:
            record[i, 1] += g.count
            record[j, 0] += g.count
        else:
            record[i, 2] += g.count
            record[j, 2] += g.count
    out = [Rating(policy=name, rating=round(float(point[i]), 1),
                  ci_low=round(float(min(low[i], point[i])), 1), ci_high=round(float(max(high[i], point[i])), 1),
                  games=int(record[i].sum()), wins=int(record[i, 0]), losses=int(record[i, 1]),
                  draws=int(record[i, 2]))
           for i, name in enumerate(names)]
    return sorted(out, key=lambda r: (-r.rating, r.policy))


def _fit(a: np.ndarray, b: np.ndarray, score: np.ndarray, counts: np.ndarray, n: int, prior: float,
         start: np.ndarray | None, *, tol: float = 1e-9, max_iter: int = 100) -> np.ndarray:
    """Bradley–Terry log-strengths by maximum likelihood: Newton's method with step halving
    (the log-likelihood is strictly concave with the prior, so it converges in a few steps, where
    Hunter's MM algorithm takes thousands on lopsided records). A draw is half a win each way;
    each policy also drew ``prior`` games against a reference of log-strength 0."""
    scored = np.bincount(a, score * counts, n) + np.bincount(b, (1.0 - score) * counts, n) + prior / 2
    theta = np.zeros(n) if start is None else start.copy()
    value = _likelihood(theta, a, b, score, counts, prior)
    for _ in range(max_iter):
        p = _sigmoid(theta[a] - theta[b])
        expected = np.bincount(a, p * counts, n) + np.bincount(b, (1.0 - p) * counts, n) + prior * _sigmoid(theta)
        gradient = scored - expected
        w = counts * p * (1.0 - p)
        hessian = np.zeros((n, n))
        np.add.at(hessian, (a, b), w)
        hessian = hessian + hessian.T
        hessian = np.diag(hessian.sum(axis=1) + prior * _sigmoid(theta) * _sigmoid(-theta)) - hessian
        step = np.linalg.solve(hessian, gradient)  # the negative Hessian is positive definite
        t = 1.0
        while True:
            candidate = theta + t * step
            new_value = _likelihood(candidate, a, b, score, counts, prior)
            if new_value >= value - 1e-12 or t < 1e-6:
                break
            t /= 2
        theta, value = candidate, new_value
        if np.max(np.abs(t * step)) < tol:
            break
    return theta


def _likelihood(theta, a, b, score, counts, prior) -> float:
    d = theta[a] - theta[b]
    games = counts * (score * _log_sigmoid(d) + (1.0 - score) * _log_sigmoid(-d))
    return float(games.sum() + prior / 2 * (_log_sigmoid(theta) + _log_sigmoid(-theta)).sum())


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def _elo(theta: np.ndarray) -> np.ndarray:
    """Log-strengths on the Elo scale, shifted so they average ``MEAN``."""
    elo = SCALE * theta
    return elo - elo.mean() + MEAN
