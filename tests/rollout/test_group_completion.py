"""Group completion policies (first k of n, a deadline) and a rollout's hard lifetime: the pure
decisions and the sweeps, without a bus. Through the real stack: tests/e2e/test_group_completion.py."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from arena_core.errors import InvalidRequest
from arena_core.schemas import (
    AgentSpec,
    Budget,
    GroupCompletion,
    RolloutRecord,
    RolloutState,
    SamplingParams,
    SubmitGroupRequest,
    Task,
    TestsVerifier,
)
from arena_rollout import groups, state
from arena_rollout.groups import GroupPolicies, counts_toward_k, decide, decisions
from arena_rollout.reaper import LIVE, Reaper, overdue
from arena_rollout.service import validate_submission

S = RolloutState
TASK = Task(id="t", repo="/r", instructions="i", agent=AgentSpec(command=["a"]),
            verifier=TestsVerifier(fail_to_pass=["x"]), budget=Budget(wall_clock_s=60.0))


def member(i: int, st: RolloutState = S.RUNNING, *, k: int | None = None, deadline: float | None = None,
           reward: float | None = None, infrastructure: bool = False, size: int = 4, gid: str = "g-1",
           lifetime_s: float = 0.0, created_at: float = 0.0) -> RolloutRecord:
    return RolloutRecord(rollout_id=f"r-{gid}-{i}", task=TASK, sampling=SamplingParams(), model="m",
                         provider="local", api_key="k", state=st, created_at=created_at, updated_at=created_at,
                         group_id=gid, group_index=i, group_size=size, reward=reward, infrastructure=infrastructure,
                         completion=GroupCompletion(first_k=k, deadline_s=deadline), group_submitted_at=100.0,
                         lifetime_s=lifetime_s)


# ---------------------------------------------------------------------------- what counts toward k


def test_a_verified_reward_counts_toward_k_even_a_zero_and_nothing_else_does():
    assert counts_toward_k(member(0, S.COMPLETED, reward=1.0))
    assert counts_toward_k(member(0, S.COMPLETED, reward=0.0))  # a verified 0 is a real outcome
    assert counts_toward_k(member(0, S.TIMED_OUT, reward=0.0))  # verified, then ended otherwise
    assert not counts_toward_k(member(0, S.FAILED))  # never verified
    assert not counts_toward_k(member(0, S.FAILED, infrastructure=True))  # load, not the policy
    assert not counts_toward_k(member(0, S.VERIFYING))  # not ended
    cancelled = msgspec.structs.replace(member(0, S.CANCELLED), group_cancelled=True)
    assert not counts_toward_k(cancelled)


# ---------------------------------------------------------------------------- decide (pure)


def test_first_k_cancels_every_live_member_once_k_scored():
    live = [member(2, k=2), member(3, S.VERIFYING, k=2), member(1, S.PENDING, k=2)]
    assert decide("g-1", live, scored=1, now=1e9) is None
    cancel = decide("g-1", live, scored=2, now=101.0)
    assert cancel is not None and cancel.rollout_ids == ["r-g-1-1", "r-g-1-2", "r-g-1-3"]
    assert "first 2 of 4" in cancel.reason and "first_k=2" in cancel.reason


def test_a_deadline_cancels_the_unfinished_members_from_submission_on():
    live = [member(0, deadline=30.0), member(3, S.PROVISIONING, deadline=30.0)]
    assert decide("g-1", live, scored=2, now=129.9) is None
    cancel = decide("g-1", live, scored=2, now=130.0)
    assert cancel is not None and cancel.rollout_ids == ["r-g-1-0", "r-g-1-3"]
    assert cancel.reason == ("group completion: deadline of 30 s after submission passed with 2 of 4 "
                             "members ended (deadline_s=30)")


def test_first_k_and_a_deadline_together_whichever_comes_first():
    live = [member(0, k=3, deadline=10.0)]
    assert "first 3" in decide("g-1", live, scored=3, now=101.0).reason
    assert "deadline" in decide("g-1", live, scored=1, now=111.0).reason
    assert decide("g-1", live, scored=2, now=105.0) is None


def test_the_default_policy_and_ungrouped_rollouts_are_never_decided_on():
    plain = [member(0), member(1)]  # no policy: wait for all
    assert decisions(plain, {"g-1": {0, 1, 2}}, now=1e12) == []
    single = msgspec.structs.replace(member(0, k=1), group_id=None)
    assert decisions([single], {}, now=1e12) == []


def test_decisions_take_each_policed_group_on_its_own_count():
    live = [member(1, k=1, gid="g-a"), member(1, k=2, gid="g-b"), member(2, k=2, gid="g-b")]
    found = decisions(live, {"g-a": {0}, "g-b": {0}}, now=0.0)
    assert [(c.group_id, c.rollout_ids) for c in found] == [("g-a", ["r-g-a-1"])]


# ---------------------------------------------------------------------------- validation (422)


@pytest.mark.parametrize("completion, message", [
    (GroupCompletion(first_k=5), "completion.first_k must be between 1 and n (4), got 5"),
    (GroupCompletion(first_k=0), "completion.first_k must be between 1 and n (4), got 0"),
])
def test_first_k_outside_one_to_n_is_refused_with_its_reason(completion, message):
    assert groups.completion_problems(completion, 4) == [message]
    req = SubmitGroupRequest(task=TASK, n=4, completion=completion)
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_submission(req, check_paths=False)


def test_the_request_decoder_bounds_the_policy():
    body = msgspec.json.encode({"task": msgspec.to_builtins(TASK), "n": 2, "completion": {"deadline_s": -1}})
    with pytest.raises(msgspec.ValidationError, match="deadline_s"):
        msgspec.json.decode(body, type=SubmitGroupRequest)
    body = msgspec.json.encode({"task": msgspec.to_builtins(TASK), "n": 2, "completion": {"first": 1}})
    with pytest.raises(msgspec.ValidationError, match="unknown field `first`"):
        msgspec.json.decode(body, type=SubmitGroupRequest)


def test_a_wall_clock_longer_than_the_lifetime_is_refused():
    req = SubmitGroupRequest(task=TASK, n=2)
    validate_submission(req, check_paths=False, max_lifetime_s=60.0)  # equal: fine
    with pytest.raises(InvalidRequest, match=r"longer than the rollout's hard lifetime \(30 s, from "
                                             "ARENA_ROLLOUT_MAX_LIFETIME_S"):
        validate_submission(req, check_paths=False, max_lifetime_s=30.0)
    own = msgspec.structs.replace(TASK, budget=Budget(wall_clock_s=60.0, max_lifetime_s=10.0))
    with pytest.raises(InvalidRequest, match=r"\(10 s, from task.budget.max_lifetime_s\)"):
        validate_submission(SubmitGroupRequest(task=own, n=2), check_paths=False, max_lifetime_s=0.0)
    validate_submission(req, check_paths=False, max_lifetime_s=0.0)  # 0: no lifetime


# ---------------------------------------------------------------------------- the sweep


class FakeLifecycle:
    """Records as a store would hold them; ``transition`` by the state machine's rules."""

    def __init__(self, records: list[RolloutRecord]):
        self.records = {r.rollout_id: r for r in records}
        self.watching = True
        self.calls: list[tuple[str, RolloutState, str]] = []

    def live(self) -> list[RolloutRecord]:
        return [r for r in self.records.values() if not r.state.is_final]

    async def transition(self, rollout_id, target, *, reason, only_from=None, group_cancelled=False,
                         infrastructure=False, reward=None):
        record = self.records[rollout_id]
        if record.state.is_final or (only_from is not None and record.state not in only_from):
            return None
        self.calls.append((rollout_id, target, reason))
        after = state.transition(record, target, reason=reason, at=0.0, reward=reward,
                                 infrastructure=infrastructure, group_cancelled=group_cancelled)
        self.records[rollout_id] = after
        return after


async def test_first_k_sweep_cancels_the_rest_marked_and_forgets_the_group():
    done = [member(0, S.COMPLETED, k=2, reward=1.0), member(1, S.COMPLETED, k=2, reward=0.0)]
    live = [member(2, k=2), member(3, S.VERIFYING, k=2)]
    lifecycle = FakeLifecycle(done + live)
    policies = GroupPolicies(lifecycle=lifecycle, records=lifecycle)
    policies.ended(done[0])
    assert await policies.sweep(now=0.0) == []  # one of two
    policies.ended(done[1])
    assert policies._wake.is_set()  # noqa: SLF001 - a first_k member woke the loop
    assert sorted(await policies.sweep(now=0.0)) == ["r-g-1-2", "r-g-1-3"]
    for rid in ("r-g-1-2", "r-g-1-3"):
        after = lifecycle.records[rid]
        assert after.state == S.CANCELLED and after.group_cancelled and after.reward is None
        assert "first 2 of 4" in after.reason
    assert policies.scored == {}  # no live member left: nothing more to decide, the count forgotten


async def test_an_infrastructure_failure_does_not_count_toward_k():
    failed = member(0, S.FAILED, k=1, infrastructure=True)
    lifecycle = FakeLifecycle([failed, member(1, k=1)])
    policies = GroupPolicies(lifecycle=lifecycle, records=lifecycle)
    policies.ended(failed)
    assert await policies.sweep(now=0.0) == [] and lifecycle.calls == []


async def test_the_sweep_waits_for_the_record_cache_and_the_loop_stops():
    lifecycle = FakeLifecycle([member(0, deadline=1.0)])
    lifecycle.watching = False
    policies = GroupPolicies(lifecycle=lifecycle, records=lifecycle, interval_s=0.01)
    assert await policies.sweep(now=1e9) == []
    lifecycle.watching = True
    stop = asyncio.Event()
    task = asyncio.create_task(policies.run(stop))
    for _ in range(200):
        if lifecycle.calls:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 2)
    assert lifecycle.calls and lifecycle.records["r-g-1-0"].state == S.CANCELLED  # time.time() is past 101


# ---------------------------------------------------------------------------- the hard lifetime


def test_the_hard_lifetime_ends_a_rollout_in_any_live_state_as_an_infrastructure_outcome():
    records = [member(i, st, lifetime_s=50.0, created_at=0.0, gid=f"g{i}")
               for i, st in enumerate([S.PENDING, S.PROVISIONING, S.RUNNING, S.VERIFYING])]
    records.append(member(9, S.RUNNING, lifetime_s=0.0, created_at=0.0, gid="none"))  # 0: no lifetime
    records.append(member(8, S.RUNNING, lifetime_s=100.0, created_at=0.0, gid="later"))
    found = overdue(records, now=51.0, grace_s=5.0, queue_timeout_s=1000.0)
    assert [o.rollout_id for o in found] == ["r-g0-0", "r-g1-1", "r-g2-2", "r-g3-3"]
    for o in found:
        assert o.target == S.TIMED_OUT and o.infrastructure and o.only_from == LIVE
    assert found[3].reason == ("infrastructure: hard lifetime exceeded: 51.0 s since submission (limit 50 s, "
                               "queue + run + verify) while verifying; its sandbox and verification are abandoned")


async def test_the_reaper_ends_a_verifying_rollout_past_its_lifetime():
    record = member(0, S.VERIFYING, lifetime_s=5.0, created_at=0.0)
    lifecycle = FakeLifecycle([record])
    reaper = Reaper(lifecycle=lifecycle, records=lifecycle, verify_deadline_s=0)
    assert await reaper.sweep(now=6.0) == ["r-g-1-0"]
    after = lifecycle.records["r-g-1-0"]
    assert after.state == S.TIMED_OUT and after.infrastructure and "hard lifetime" in after.reason


async def test_a_group_that_scores_while_the_sweep_cancels_keeps_its_count():
    """The sweep awaits each cancel; a group submitted meanwhile whose member already scored is
    not forgotten with the groups that have no live member left."""
    lifecycle = FakeLifecycle([member(0, S.COMPLETED, k=1, reward=1.0), member(1, k=1)])
    policies = GroupPolicies(lifecycle=lifecycle, records=lifecycle)
    policies.ended(lifecycle.records["r-g-1-0"])
    cancel = lifecycle.transition

    async def transition(rollout_id, target, **kw):
        new = [member(0, S.COMPLETED, k=2, reward=0.0, gid="g-2"), member(1, k=2, gid="g-2")]
        lifecycle.records.update({r.rollout_id: r for r in new})
        policies.ended(new[0])
        return await cancel(rollout_id, target, **kw)

    lifecycle.transition = transition
    assert await policies.sweep(now=0.0) == ["r-g-1-1"]
    assert policies.scored == {"g-2": {0}}
