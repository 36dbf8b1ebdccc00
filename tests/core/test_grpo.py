"""GRPO group advantages."""

from __future__ import annotations

import math

import pytest

from arena_core.grpo import group_advantages


def test_binary_rewards_are_plus_and_minus_one():
    adv = group_advantages([1.0, 0.0])
    assert adv == pytest.approx([1.0, -1.0], abs=1e-5)


def test_matches_the_formula_with_population_std():
    rewards = [0.0, 0.5, 1.0, 1.0]
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4)
    expected = [(r - mean) / (std + 1e-6) for r in rewards]
    assert group_advantages(rewards) == pytest.approx(expected, rel=1e-12)
    assert sum(group_advantages(rewards)) == pytest.approx(0.0, abs=1e-9)


def test_all_equal_rewards_give_exact_zeros():
    assert group_advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0]) == [0.0]
    assert group_advantages([]) == []


def test_without_std_normalization_only_centers():
    assert group_advantages([3.0, 1.0], normalize_std=False) == [1.0, -1.0]


def test_eps_is_added_to_std():
    assert group_advantages([1.0, 0.0], eps=1.0) == pytest.approx([0.5 / 1.5, -0.5 / 1.5])


def test_non_finite_rewards_are_rejected():
    with pytest.raises(ValueError):
        group_advantages([1.0, float("nan")])
    with pytest.raises(ValueError):
        group_advantages([1.0, float("inf")])
