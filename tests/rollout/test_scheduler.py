"""The scheduler's choice (arena_rollout/scheduler.py), a project's own queue limit in admission,
and admission's hold measured from when a rollout took its slot (``provisioning``), not from
its agent's start. The choice through the real stack: tests/e2e/test_projects_fair_share.py."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from arena_core import subjects
from arena_core.errors import Overloaded
from arena_core.quotas import ProjectQuota, defaults
from arena_core.schemas import (
    AgentSpec,
    Budget,
    RolloutRecord,
    RolloutState,
    SamplingParams,
    SandboxDone,
    SandboxOutcome,
    SandboxStarted,
    StateTransition,
    Task,
    TestsVerifier,
)
from arena_rollout.admission import Admission
from arena_rollout.scheduler import Usage, plan
from tests.rollout.test_service import rollout, task_json  # noqa: F401 - the fixture

S = RolloutState
TASK = Task(id="t", instructions="", agent=AgentSpec(command=["true"]),
            verifier=TestsVerifier(fail_to_pass=["a"]), budget=Budget(wall_clock_s=60))


def record(rid: str, project: str, state: S = S.PENDING, *, at: float = 0.0, took: float | None = None,
           provider: str = "local") -> RolloutRecord:
    history = [StateTransition(from_state=None, to_state=S.PENDING, at=at, reason="submitted")]
    if took is not None:
        history.append(StateTransition(from_state=S.PENDING, to_state=S.PROVISIONING, at=took, reason="slot"))
    return RolloutRecord(rollout_id=rid, task=TASK, sampling=SamplingParams(), model="default", provider=provider,
                         api_key="k", state=state, created_at=at, updated_at=at, history=history, project=project)


def choose(live, quotas: dict[str, ProjectQuota], slots, usage=None, now=100.0):
    return [r.rollout_id for r in plan(live, quotas=lambda p: quotas.get(p) or defaults(p), slots=slots,
                                       provider_slots=lambda _: None, usage=usage or Usage(), mean_hold_s=10.0,
                                       now=now)]


def test_a_higher_class_goes_first_whatever_its_arrival():
    live = [record(f"n{i}", "normal", at=i) for i in range(3)] + [record("h0", "urgent", at=50)]
    assert choose(live, {"urgent": ProjectQuota(project="urgent", priority="high")}, slots=2)[0] == "h0"
    low = [record("l0", "later", at=0), record("n0", "normal", at=10)]
    assert choose(low, {"later": ProjectQuota(project="later", priority="low")}, slots=1) == ["n0"]


def test_free_slots_are_shared_by_weight_among_projects_with_backlog():
    live = [record(f"a{i}", "a", at=i) for i in range(20)] + [record(f"b{i}", "b", at=i) for i in range(20)]
    got = choose(live, {"a": ProjectQuota(project="a", weight=3)}, slots=8)
    assert sum(r.startswith("a") for r in got) == 6 and sum(r.startswith("b") for r in got) == 2
    # within a project, the oldest first
    assert [r for r in got if r.startswith("b")] == ["b0", "b1"]


def test_the_sandbox_seconds_a_project_is_using_count_against_it():
    # a holds 3 sandboxes for 50 s already; b none: b takes the free slots until it catches up
    live = [record(f"a-run{i}", "a", S.RUNNING, at=0, took=50) for i in range(3)]
    live += [record(f"a{i}", "a", at=1) for i in range(5)] + [record(f"b{i}", "b", at=2) for i in range(5)]
    assert choose(live, {}, slots=6) == ["b0", "b1", "b2"]
    # and what it used before, decayed, too
    usage = Usage()
    usage.add("b", 1000.0, now=100.0)
    assert choose(live, {}, slots=5, usage=usage) == ["a0", "a1"]


def test_a_project_at_its_max_waits_and_the_slots_bound_everyone():
    live = [record("a-run", "a", S.PROVISIONING, at=0, took=99)] + [record(f"a{i}", "a", at=i) for i in range(5)]
    live += [record("b0", "b", at=9)]
    assert choose(live, {"a": ProjectQuota(project="a", max_sandboxes=2)}, slots=10) == ["b0", "a0"]
    assert choose(live, {}, slots=1) == []  # the one slot is held
    assert len(choose(live, {}, slots=None)) == 6  # unknown slots: everything waiting starts


def test_a_projects_own_queue_limit_is_a_429_naming_it():
    a = Admission(queue_timeout_s=600, max_queued=1000)
    held = a.reserve(queued=0, adding=3, project="p", project_queued=0, project_max_queued=4, slots=4)
    with pytest.raises(Overloaded) as refused:  # its 3 reserved + 2 > 4
        a.reserve(queued=3, adding=2, project="p", project_queued=0, project_max_queued=4, slots=4)
    assert "project 'p'" in str(refused.value) and "at most 4" in str(refused.value)
    assert refused.value.retry_after >= 1
    a.reserve(queued=3, adding=2, project="q", project_queued=0, project_max_queued=4, slots=4)  # another project
    held.close()
    assert a.reserved_by["p"] == 0
    a.reserve(queued=3, adding=2, project="p", project_queued=2, project_max_queued=4, slots=4)


async def test_admission_measures_a_slots_hold_from_provisioning(rollout, bus, tmp_path):  # noqa: F811
    api, service = rollout
    rid = (await api.post("/v1/rollouts", json={"task": task_json(tmp_path)})).json()["rollout_id"]
    await asyncio.sleep(0.05)  # the sandbox's start takes a moment after the worker took the job
    await bus.publish(subjects.sandbox_started(rid), SandboxStarted(rollout_id=rid, sandbox_id="s", provider="local",
                                                                    at=0.0), msg_id=subjects.msg_id(rid, "started"))
    for _ in range(200):
        if (await service.store.get(rid))[0].state == S.RUNNING:
            break
        await asyncio.sleep(0.02)
    await bus.publish(subjects.sandbox_done(rid), SandboxDone(
        rollout_id=rid, sandbox_id="s", provider="local", outcome=SandboxOutcome.FAILED, reason="exit 1",
        started_at=1.0, finished_at=2.0), msg_id=subjects.msg_id(rid, "sandbox-done"))
    view = (await api.get(f"/v1/rollouts/{rid}/wait", params={"timeout": 10})).json()
    assert view["state"] == "failed"
    at = {h["to_state"]: h["at"] for h in view["history"]}
    _, held = service.admission._holds[-1]
    assert held == pytest.approx(at["failed"] - at["provisioning"], abs=1e-6)
    assert held > at["failed"] - at["running"]


def test_a_projects_settings_are_checked():
    from arena_core.quotas import check

    for bad in (dict(weight=0), dict(max_sandboxes=-1), dict(priority="urgent")):
        with pytest.raises(ValueError):
            check(msgspec.structs.replace(ProjectQuota(project="p"), **bad))
    with pytest.raises(ValueError, match="project name"):
        check(ProjectQuota(project="no spaces"))
