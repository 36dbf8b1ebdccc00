"""The wall-clock reaper's pure logic: which rollouts are overdue, and a sweep, without a bus."""

from __future__ import annotations

import msgspec
import pytest

from arena_core.schemas import AgentSpec, Budget, RolloutRecord, RolloutState, SamplingParams, Task, TestsVerifier
from arena_rollout.reaper import REAPED, Reaper, deadline, overdue

S = RolloutState


def rec(rid: str, state: RolloutState, created_at: float, wall_clock_s: float = 60.0,
        started_at: float | None = None) -> RolloutRecord:
    """A rollout; one in ``running`` started its agent at ``started_at`` (default: when created)."""
    from arena_core.schemas import StateTransition

    task = Task(id="t", repo="/r", instructions="i", agent=AgentSpec(command=["a"]),
                verifier=TestsVerifier(fail_to_pass=["x"]), budget=Budget(wall_clock_s=wall_clock_s))
    history = []
    if state == S.RUNNING:
        at = created_at if started_at is None else started_at
        history = [StateTransition(from_state=S.PROVISIONING, to_state=S.RUNNING, at=at, reason="agent started")]
    return RolloutRecord(rollout_id=rid, task=task, sampling=SamplingParams(), model="m", provider="local",
                         api_key="k", state=state, created_at=created_at, updated_at=created_at, history=history)


def test_the_queue_limit_and_the_wall_clock_since_the_agent_started_decide_what_is_overdue():
    records = [
        rec("provisioning-late", S.PROVISIONING, created_at=0.0),  # job never picked up
        rec("pending-late", S.PENDING, created_at=-10.0),
        rec("running-late", S.RUNNING, created_at=1.0),  # agent makes no LLM calls
        rec("in-grace", S.RUNNING, created_at=4.0),  # 63 s of 60 s: still within the 5 s grace
        rec("on-time", S.PROVISIONING, created_at=50.0),
        rec("queued-long-then-ran", S.RUNNING, created_at=-500.0, started_at=30.0),  # its clock began at 30
        rec("verifying", S.VERIFYING, created_at=0.0),  # the agent finished in time
        rec("done", S.COMPLETED, created_at=0.0),
        rec("short", S.RUNNING, created_at=60.0, wall_clock_s=1.0),
    ]
    found = overdue(records, now=67.0, grace_s=5.0, queue_timeout_s=60.0)
    assert [o.rollout_id for o in found] == ["pending-late", "provisioning-late", "running-late", "short"]
    assert found[1].state == S.PROVISIONING
    # its agent never ran: an infrastructure outcome (no reward), not the policy's timeout
    assert found[1].reason == ("infrastructure: the agent never ran: 67.0 s in the queue (limit 60 s) "
                               "while provisioning")
    assert found[1].infrastructure and not found[3].infrastructure
    assert found[3].reason == "wall-clock budget exhausted: 7.0 s of 1 s used since the agent started"
    assert deadline(records[0], 5.0, 60.0) == 65.0
    assert deadline(records[5], 5.0, 60.0) == 95.0  # time in the queue is not the agent's
    # the deadline itself is still on time: strictly after it is overdue
    assert "provisioning-late" not in [o.rollout_id for o in overdue(records, now=65.0, grace_s=5.0,
                                                                      queue_timeout_s=60.0)]
    # a long queue limit: waiting is not a verdict
    assert [o.rollout_id for o in overdue(records, now=67.0, grace_s=5.0, queue_timeout_s=900.0)] == [
        "running-late", "short"]


def test_time_its_llm_calls_waited_for_a_backend_slot_is_not_the_agents():
    records = [rec("queued-calls", S.RUNNING, created_at=0.0), rec("no-waits", S.RUNNING, created_at=0.0)]
    waited = {"queued-calls": 30.0}.get
    found = overdue(records, now=70.0, grace_s=5.0, off_clock=lambda rid: waited(rid, 0.0))
    assert [o.rollout_id for o in found] == ["no-waits"]  # 70 s of 60: the other waited 30 s of them
    assert deadline(records[0], 5.0, off_clock_s=30.0) == 95.0
    late = overdue(records, now=96.0, grace_s=5.0, off_clock=lambda rid: waited(rid, 0.0))
    assert late[0].reason == ("wall-clock budget exhausted: 66.0 s of 60 s used since the agent started "
                              "(besides 30.0 s its LLM calls waited for a backend slot)")


class FakeCache:
    def __init__(self, records: list[RolloutRecord], watching: bool = True):
        self.records, self.watching = records, watching

    def live(self) -> list[RolloutRecord]:
        return self.records if self.watching else []


class Lifecycle:
    """Stands in for the rollout service: answers like it (None = nothing changed)."""

    def __init__(self, already_final: set[str] = frozenset()):
        self.calls: list[tuple[str, RolloutState, str, frozenset]] = []
        self.already_final = already_final

    async def transition(self, rollout_id, target, *, reason, only_from=None, infrastructure=False):
        self.calls.append((rollout_id, target, reason, only_from))
        self.infrastructure = getattr(self, "infrastructure", []) + [infrastructure]
        return None if rollout_id in self.already_final else object()


async def test_a_sweep_times_out_overdue_rollouts_only_from_the_agent_states():
    records = [rec("late", S.PROVISIONING, 0.0), rec("raced", S.RUNNING, 0.0), rec("fresh", S.RUNNING, 100.0)]
    life = Lifecycle(already_final={"raced"})  # another replica (or the sandbox) ended it first
    reaper = Reaper(lifecycle=life, records=FakeCache(records), interval_s=0.1, grace_s=0.0, queue_timeout_s=60.0)
    assert await reaper.sweep(now=61.0) == ["late"]
    assert [(c[0], c[1], c[3]) for c in life.calls] == [("late", S.TIMED_OUT, REAPED), ("raced", S.TIMED_OUT, REAPED)]
    assert life.calls[0][2].startswith("infrastructure: the agent never ran: 61.0 s in the queue")
    assert life.infrastructure == [True, False]  # "late" never ran; "raced" was running
    # the cache answers nothing before its watch caught up: nothing is reaped from a partial view
    idle = Reaper(lifecycle=Lifecycle(), records=FakeCache(records, watching=False), grace_s=0.0)
    assert await idle.sweep(now=1000.0) == [] and idle.lifecycle.calls == []
    with pytest.raises(ValueError, match="interval_s"):
        Reaper(lifecycle=life, records=FakeCache([]), interval_s=0)
    assert S.VERIFYING not in REAPED


def verifying(rid: str, entered_at: float, verifier=None) -> RolloutRecord:
    """A rollout that entered ``verifying`` at ``entered_at`` (created at 0, wall clock 60 s)."""
    from arena_core.schemas import StateTransition

    r = rec(rid, S.VERIFYING, created_at=0.0)
    history = [StateTransition(from_state=S.RUNNING, to_state=S.VERIFYING, at=entered_at, reason="agent finished")]
    changes = {"history": history, "updated_at": entered_at + 1.0}  # a later update (a step counter, say)
    if verifier is not None:
        changes["task"] = msgspec.structs.replace(r.task, verifier=verifier)
    return msgspec.structs.replace(r, **changes)


def test_verifying_past_its_deadline_fails_from_when_it_entered_verifying():
    from arena_core.schemas import CompositeVerifier, ExactVerifier, LlmJudgeVerifier, WeightedVerifier
    from arena_rollout.reaper import VERIFY_SETUP_S, verifier_budget_s, verify_deadline_s, verifying_since

    exact = ExactVerifier(answers=["4"])
    records = [
        verifying("stuck", entered_at=10.0, verifier=exact),  # no verifier timeout: the setting decides
        verifying("fresh", entered_at=50.0, verifier=exact),
        verifying("slow-suite", entered_at=10.0),  # tests, 300 s timeout: its own budget is longer
        rec("running", S.RUNNING, created_at=0.0, wall_clock_s=10_000.0),
    ]
    found = overdue(records, now=111.0, grace_s=5.0, verify_deadline=100.0)
    assert [(o.rollout_id, o.state, o.target) for o in found] == [("stuck", S.VERIFYING, S.FAILED)]
    assert found[0].reason == ("verification deadline passed: no verification result after 101.0 s in verifying "
                               "(deadline 100 s): the verify job was never picked up or every verification "
                               "worker is down")
    assert verifying_since(records[0]) == 10.0  # the transition, not the record's last update
    assert overdue(records, now=110.0, grace_s=5.0, verify_deadline=100.0) == []  # at the deadline: on time
    assert overdue(records, now=10_000.0, grace_s=5.0, verify_deadline=0.0) == []  # 0: no deadline
    assert verify_deadline_s(records[2], 100.0) == 300.0 + VERIFY_SETUP_S
    suite_deadline = 10.0 + 300.0 + VERIFY_SETUP_S
    assert "slow-suite" not in [o.rollout_id for o in overdue(records, now=suite_deadline, grace_s=5.0,
                                                                verify_deadline=100.0)]
    late = overdue(records, now=suite_deadline + 0.5, grace_s=5.0, verify_deadline=100.0)
    assert [o.rollout_id for o in late] == ["stuck", "fresh", "slow-suite"]
    assert verify_deadline_s(records[2], 1800.0) == 1800.0  # the setting, when longer
    composite = CompositeVerifier(verifiers=[
        WeightedVerifier(name="tests", verifier=TestsVerifier(fail_to_pass=["x"], timeout_s=600.0)),
        WeightedVerifier(name="judge", verifier=LlmJudgeVerifier(rubric="r", timeout_s=120.0)),
        WeightedVerifier(name="exact", verifier=exact)])
    assert verifier_budget_s(composite) == 720.0 and verifier_budget_s(exact) == 0.0


async def test_a_sweep_fails_rollouts_stuck_verifying_only_from_verifying():
    from arena_core.schemas import ExactVerifier
    from arena_rollout.reaper import VERIFYING

    records = [verifying("stuck", 0.0, ExactVerifier(answers=["4"])), rec("late", S.PROVISIONING, 0.0)]
    life = Lifecycle()
    reaper = Reaper(lifecycle=life, records=FakeCache(records), grace_s=0.0, verify_deadline_s=30.0,
                    queue_timeout_s=60.0)
    assert await reaper.sweep(now=61.0) == ["stuck", "late"]
    assert [(c[0], c[1], c[3]) for c in life.calls] == [("stuck", S.FAILED, VERIFYING),
                                                        ("late", S.TIMED_OUT, REAPED)]
    assert life.calls[0][2].startswith("verification deadline passed: no verification result after 61.0 s")
    off = Reaper(lifecycle=Lifecycle(), records=FakeCache(records), grace_s=0.0, verify_deadline_s=0,
                 queue_timeout_s=60.0)
    assert await off.sweep(now=10_000.0) == ["late"]  # 0 disables the verification deadline
    with pytest.raises(ValueError, match="verify_deadline_s"):
        Reaper(lifecycle=life, records=FakeCache([]), verify_deadline_s=-1)
