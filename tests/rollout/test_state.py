"""The rollout state machine, without a bus."""

from __future__ import annotations

import msgspec
import pytest

from arena_core.errors import Conflict
from arena_core.schemas import FINAL_STATES, AgentSpec, RolloutRecord, RolloutState, SamplingParams, Task, TestsVerifier
from arena_rollout.state import ALLOWED, can_transition, transition

S = RolloutState


def record(state: RolloutState = S.PENDING) -> RolloutRecord:
    task = Task(id="t", repo="/r", instructions="i", agent=AgentSpec(command=["a"]),
                verifier=TestsVerifier(fail_to_pass=["x"]))
    return RolloutRecord(rollout_id="r1", task=task, sampling=SamplingParams(), model="m", provider="local",
                         api_key="k", state=state, created_at=0.0, updated_at=0.0)


def test_happy_path_records_every_transition():
    r = record()
    for target in (S.PROVISIONING, S.RUNNING, S.VERIFYING):
        r = transition(r, target, reason=f"to {target.value}", at=1.0)
    r = transition(r, S.COMPLETED, reason="done", at=2.0, reward=1.0)
    assert r.state == S.COMPLETED and r.reward == 1.0 and r.updated_at == 2.0
    assert [(t.from_state, t.to_state) for t in r.history] == [
        (S.PENDING, S.PROVISIONING), (S.PROVISIONING, S.RUNNING), (S.RUNNING, S.VERIFYING), (S.VERIFYING, S.COMPLETED)]


@pytest.mark.parametrize("final", sorted(FINAL_STATES, key=lambda s: s.value))
def test_a_final_state_is_never_left(final):
    assert ALLOWED[final] == frozenset()
    for target in S:
        with pytest.raises(Conflict):
            transition(record(final), target, reason="", at=0.0)


@pytest.mark.parametrize("start", [S.PENDING, S.PROVISIONING, S.RUNNING, S.VERIFYING])
def test_every_live_state_can_abort(start):
    for target in (S.FAILED, S.TIMED_OUT, S.CANCELLED, S.BUDGET_EXHAUSTED):
        assert can_transition(start, target)


def test_no_skipping_ahead():
    assert not can_transition(S.PENDING, S.RUNNING)
    assert not can_transition(S.RUNNING, S.COMPLETED)
    with pytest.raises(Conflict, match="cannot go from pending to completed"):
        transition(record(), S.COMPLETED, reason="", at=0.0)


def test_record_cache_keeps_the_newest_live_record_and_forgets_ended_rollouts():
    from arena_core.schemas import AgentSpec, RolloutRecord, SamplingParams, Task, TestsVerifier
    from arena_rollout.store import RecordCache

    task = Task(id="t", repo="/r", instructions="i", agent=AgentSpec(command=["a"]),
                verifier=TestsVerifier(fail_to_pass=["x"]))
    rec = RolloutRecord(rollout_id="r1", task=task, sampling=SamplingParams(), model="m", provider="local",
                        api_key="k", state=RolloutState.RUNNING, created_at=0.0, updated_at=0.0)
    cache = RecordCache()
    cache.put(rec, 5)
    assert cache.get("r1") is None  # not answering until its watch has caught up
    cache.watching = True
    cache.put(msgspec.structs.replace(rec, steps=1), 4)  # an older revision arriving late
    assert cache.get("r1").steps == 0
    cache.put(msgspec.structs.replace(rec, state=RolloutState.COMPLETED), 6)
    cache.put(msgspec.structs.replace(rec, steps=2), 7)  # nothing brings an ended rollout back
    assert cache.get("r1") is None
