"""Bradley–Terry ratings on the Elo scale with bootstrap intervals (libs/arena_core/ratings.py)."""

from __future__ import annotations

import math

import pytest

from arena_core.ratings import Game, rate


def by_policy(ratings):
    return {r.policy: r for r in ratings}


def test_no_games_no_ratings():
    assert rate([]) == []
    assert rate([Game(a="x", b="y", score=1.0, count=0)]) == []


def test_symmetric_results_rate_equal_at_the_mean():
    games = [Game(a="a", b="b", score=1.0), Game(a="b", b="a", score=1.0),
             Game(a="a", b="b", score=0.5, count=3)]
    r = by_policy(rate(games))
    assert r["a"].rating == r["b"].rating == 1500.0
    assert (r["a"].wins, r["a"].losses, r["a"].draws, r["a"].games) == (1, 1, 3, 5)
    assert r["a"].ci_low <= 1500.0 <= r["a"].ci_high


def test_a_cycle_of_three_rates_all_equal():
    games = [Game(a="a", b="b", score=1.0, count=4), Game(a="b", b="c", score=1.0, count=4),
             Game(a="c", b="a", score=1.0, count=4)]
    assert {round(r.rating, 3) for r in rate(games)} == {1500.0}


def test_draws_count_half_a_win_each_way():
    draws = by_policy(rate([Game(a="a", b="b", score=0.5, count=10)]))
    assert draws["a"].rating == draws["b"].rating == 1500.0
    assert draws["a"].draws == draws["b"].draws == 10


def test_an_undefeated_policy_stays_finite_and_rates_higher():
    r = rate([Game(a="good", b="bad", score=1.0, count=3)])
    assert [x.policy for x in r] == ["good", "bad"]
    assert all(math.isfinite(x.rating) and math.isfinite(x.ci_low) and math.isfinite(x.ci_high) for x in r)
    assert r[0].rating > 1500.0 > r[1].rating
    assert r[0].rating - 1500.0 == pytest.approx(1500.0 - r[1].rating, abs=0.2)  # anchored: the mean is 1500


def test_odds_of_three_to_one_are_about_191_elo_points():
    r = by_policy(rate([Game(a="a", b="b", score=1.0, count=300), Game(a="a", b="b", score=0.0, count=100)]))
    assert r["a"].rating - r["b"].rating == pytest.approx(400 * math.log10(3), abs=3)  # the prior shrinks a little


def test_a_dominant_policy_over_many_games_has_an_interval_clear_of_the_other():
    games = [Game(a="strong", b="weak", score=1.0, count=160), Game(a="strong", b="weak", score=0.0, count=40)]
    r = by_policy(rate(games))
    assert r["strong"].ci_low > r["weak"].ci_high
    assert r["strong"].ci_low < r["strong"].rating < r["strong"].ci_high
    few = by_policy(rate([Game(a="strong", b="weak", score=1.0, count=4), Game(a="strong", b="weak", score=0.0)]))
    assert few["strong"].ci_high - few["strong"].ci_low > r["strong"].ci_high - r["strong"].ci_low


def test_the_same_games_and_seed_give_the_same_ratings():
    games = [Game(a="a", b="b", score=1.0, count=7), Game(a="b", b="c", score=0.5, count=3),
             Game(a="c", b="a", score=0.0, count=5), Game(a="b", b="a", score=1.0, count=2)]
    assert rate(games) == rate(list(games))


def test_unknown_or_self_games_are_refused():
    with pytest.raises(ValueError):
        rate([Game(a="a", b="a", score=1.0)])
    with pytest.raises(ValueError):
        rate([Game(a="a", b="b", score=0.7)])


def test_a_clean_sweep_of_a_few_games_is_not_certain():
    sweep = [Game(a="good", b="bad", score=1.0, count=3)]
    good = rate(sweep)[0]
    assert good.ci_low < good.rating <= good.ci_high  # replayed from the fit: some replays lose a game
    by_games = rate(sweep, bootstrap="games")[0]
    assert by_games.ci_low == by_games.rating == by_games.ci_high  # resampling 3 identical games
    many = rate([Game(a="good", b="bad", score=1.0, count=60)])[0]
    assert many.ci_high - many.ci_low < good.ci_high - good.ci_low
