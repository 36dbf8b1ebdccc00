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


def test_two_names_that_reach_one_backend_replica_listing_no_models_are_refused():
    """``--policy A --policy B`` against one backend that serves any name would compare its one
    model with itself: refused, naming the replica and how to register each policy."""
    from arena_core.schemas import BackendReplica

    one = [BackendReplica(replica_id="vllm-0", url="http://gpu:8000/v1")]
    [problem] = duel_problems(request(seed=0), serves=serves, replicas=one)
    assert "'pa' and 'pb' both resolve to backend replica(s) vllm-0" in problem
    assert "compare a model with itself" in problem and "arena backend register" in problem


def test_two_names_served_by_name_or_by_two_replicas_are_accepted():
    from arena_core.schemas import BackendReplica

    by_name = [BackendReplica(replica_id="vllm-0", url="http://gpu:8000/v1", models=["pa", "pb"])]
    assert duel_problems(request(seed=0), serves=serves, replicas=by_name) == []
    split = [BackendReplica(replica_id="a", url="http://gpu-a:8000/v1", models=["pa"]),
             BackendReplica(replica_id="b", url="http://gpu-b:8000/v1")]
    assert duel_problems(request(seed=0), serves=serves, replicas=split) == []
