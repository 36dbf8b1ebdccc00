"""What makes a duel request unrunnable (service.duel_problems, pure): its seeds must stay
Int64 (each is stored as a round's key), two distinct served policies."""

from __future__ import annotations

import pytest

from arena_core.schemas import AgentSpec, SamplingParams, SubmitDuelRequest, Task
from arena_rollout.service import duel_problems


def request(*, seed: int | None, n: int = 4, policies=("pa", "pb")) -> SubmitDuelRequest:
    task = Task(id="t1", instructions="fix it", agent=AgentSpec(command=["true"]))
    return SubmitDuelRequest(task=task, policies=list(policies), n=n, sampling=SamplingParams(seed=seed))


def serves(model: str) -> bool:
    return True


@pytest.mark.parametrize("seed", [None, 0, -5, 2**63 - 4, -(2**63)])
def test_seeds_within_int64_are_accepted(seed):
    assert duel_problems(request(seed=seed), serves=serves) == []


@pytest.mark.parametrize("seed", [2**63 - 3, 2**64 - 1, -(2**63) - 1])
def test_seeds_past_int64_are_refused(seed):
    problems = duel_problems(request(seed=seed), serves=serves)
    assert any("seed" in p for p in problems), problems


def test_the_same_policy_twice_or_an_unserved_one_is_refused():
    assert duel_problems(request(seed=0, policies=("pa", "pa")), serves=serves)
    assert duel_problems(request(seed=0), serves=lambda m: m == "pa")
