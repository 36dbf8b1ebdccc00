"""The reaper against a real nats-server: a rollout whose agent makes no LLM calls ends
``timed_out`` when its wall-clock budget since the agent started has passed, one whose
sandbox job no worker ever picks up ends at its queue limit with no reward, and one whose verify job no worker picks up ends ``failed`` at its
verification deadline, each with the reason and its final state event."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from arena_core import subjects
from arena_core.errors import Unauthorized
from arena_core.schemas import (AgentSpec, Budget, ExactVerifier, RolloutState, RolloutStateChanged, SandboxJob,
                           SubmitRolloutRequest, Task, TestsVerifier, VerificationResult)
from arena_core.settings import Settings
from arena_rollout.reaper import REAPED, Reaper
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore

from tests.rollout.test_service import fetch_all

S = RolloutState


@pytest.fixture
async def service(bus, tmp_path):
    kv = await bus.kv(subjects.KV_ROLLOUTS)
    store = RolloutStore(kv)
    stop = asyncio.Event()
    watch = asyncio.create_task(store.cache.watch(kv, stop))  # as in production: the reaper reads the cache
    http = httpx.AsyncClient()
    svc = RolloutService(bus=bus, store=store, settings=Settings(allow_host_paths=True, nats_url="nats://127.0.0.1:1"), http=http)
    for _ in range(200):
        if store.cache.watching:
            break
        await asyncio.sleep(0.01)
    assert store.cache.watching
    try:
        yield svc
    finally:
        stop.set()
        await watch
        await svc.upstream.aclose()
        await http.aclose()


async def submit(svc: RolloutService, tmp_path, wall_clock_s: float) -> tuple[str, str]:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    task = Task(id="t", repo=str(repo), instructions="i", agent=AgentSpec(command=["true"]),
                verifier=TestsVerifier(fail_to_pass=["t::x"]), budget=Budget(wall_clock_s=wall_clock_s))
    record = await svc.submit(SubmitRolloutRequest(task=task))
    return record.rollout_id, record.api_key


async def reap_until(svc, done, *, tries: int, **options) -> None:
    """Two rollout-service replicas reaping at once (one wins each rollout) until ``done()``,
    then a few more sweeps, in which nothing else may move and nothing may move twice."""
    stop = asyncio.Event()
    reapers = [asyncio.create_task(Reaper(lifecycle=svc, records=svc.store.cache, interval_s=0.1, grace_s=0.2,
                                          **options).run(stop)) for _ in range(2)]
    try:
        for _ in range(tries):
            if await done():
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.gather(*reapers)


async def test_over_time_rollouts_end_timed_out_without_llm_calls_or_a_sandbox_worker(service, bus, tmp_path):
    svc = service
    stuck, _ = await submit(svc, tmp_path, 1.0)  # provisioning: no sandbox worker will ever pick its job up
    idle, idle_key = await submit(svc, tmp_path, 1.0)  # running, but the agent never calls the LLM
    await svc.transition(idle, S.RUNNING, reason="sandbox s1 started")
    judged, _ = await submit(svc, tmp_path, 1.0)  # the agent finished in time: verifying is not reaped
    await svc.transition(judged, S.RUNNING, reason="sandbox s2 started")
    await svc.transition(judged, S.VERIFYING, reason="agent finished")
    roomy, _ = await submit(svc, tmp_path, 600.0)  # running with time to spare
    await svc.transition(roomy, S.RUNNING, reason="sandbox s3 started")
    await svc.authorize(idle, f"Bearer {idle_key}", None)  # the key works while the rollout runs

    async def reaped() -> bool:
        return [(await svc.store.get(rid))[0].state for rid in (stuck, idle)] == [S.TIMED_OUT, S.TIMED_OUT]

    await reap_until(svc, reaped, tries=150, queue_timeout_s=1.0)

    for rid, was in ((stuck, "provisioning"), (idle, "running")):
        record, _ = await svc.store.get(rid)
        assert record.state == S.TIMED_OUT, (rid, record.state)
        # a rollout whose agent never ran is an infrastructure outcome: no reward, not a 0
        never_ran = "infrastructure: the agent never ran: " if was == "provisioning" else ""
        assert record.infrastructure == bool(never_ran) and record.reward is None
        if never_ran:
            assert record.reason.startswith(never_ran) and record.reason.endswith(
                "s in the queue (limit 1 s) while provisioning")
        else:
            assert record.reason.startswith("wall-clock budget exhausted: ") and record.reason.endswith(
                "s of 1 s used since the agent started")
        assert [h.to_state for h in record.history][-2:] == [S(was), S.TIMED_OUT]
        events = await fetch_all(bus, "ARENA_ROLLOUTS", subjects.rollout_state(rid), RolloutStateChanged)
        finals = [e for e in events if e.to_state.is_final]
        assert len(finals) == 1 and finals[0].to_state == S.TIMED_OUT and finals[0].steps == 0
        assert finals[0].reason == record.reason and finals[0].history == record.history
    assert (await svc.store.get(judged))[0].state == S.VERIFYING
    # a reaper that decided on a stale record (still running) cannot end a rollout that has reached verifying
    assert await svc.transition(judged, S.TIMED_OUT, reason="stale", only_from=REAPED) is None
    assert (await svc.store.get(judged))[0].state == S.VERIFYING
    assert (await svc.store.get(roomy))[0].state == S.RUNNING
    with pytest.raises(Unauthorized, match="timed_out"):  # the proxy key ended with the rollout
        await svc.authorize(idle, f"Bearer {idle_key}", None)
    # the job was never picked up; a worker that takes it later sees a final rollout and skips it
    jobs = await fetch_all(bus, "ARENA_SANDBOX_JOBS", subjects.sandbox_run("local"), SandboxJob)
    assert stuck in {j.rollout_id for j in jobs}


async def test_a_rollout_stuck_verifying_fails_at_its_verification_deadline(service, bus, tmp_path):
    """No verification worker ever picks the verify job up: the rollout (and its group) does
    not wait forever, it ends ``failed`` with the reason once its verification deadline passed."""
    svc = service
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)

    async def verifying(verifier) -> str:
        task = Task(id="t", repo=str(repo), instructions="i", agent=AgentSpec(command=["true"]), verifier=verifier)
        rid = (await svc.submit(SubmitRolloutRequest(task=task))).rollout_id
        await svc.transition(rid, S.RUNNING, reason="sandbox s1 started")
        await svc.transition(rid, S.VERIFYING, reason="agent finished: done")
        return rid

    stuck = await verifying(ExactVerifier(answers=["4"]))  # no timeout of its own: the deadline decides
    suite = await verifying(TestsVerifier(fail_to_pass=["t::x"], timeout_s=300.0))  # its own 300 s (+ set-up)
    answered = await verifying(ExactVerifier(answers=["4"]))
    now = time.time()
    await svc.on_verify_done(VerificationResult(rollout_id=answered, verifier="exact", reward=1.0, passed=True,
                                                started_at=now, finished_at=now), None)

    async def failed() -> bool:
        return (await svc.store.get(stuck))[0].state == S.FAILED

    await reap_until(svc, failed, tries=100, verify_deadline_s=1.0)

    record, _ = await svc.store.get(stuck)
    assert record.state == S.FAILED, record.state
    assert record.reason.startswith("verification deadline passed: no verification result after ")
    assert record.reason.endswith("in verifying (deadline 1 s): the verify job was never picked up or every "
                                  "verification worker is down")
    entered = next(h.at for h in record.history if h.to_state == S.VERIFYING)
    assert record.history[-1].at - entered >= 1.0
    assert [h.to_state for h in record.history][-2:] == [S.VERIFYING, S.FAILED]
    events = await fetch_all(bus, "ARENA_ROLLOUTS", subjects.rollout_state(stuck), RolloutStateChanged)
    finals = [e for e in events if e.to_state.is_final]
    assert len(finals) == 1 and finals[0].to_state == S.FAILED and finals[0].reason == record.reason
    assert (await svc.store.get(suite))[0].state == S.VERIFYING  # within its verifier's own budget
    assert (await svc.store.get(answered))[0].state == S.COMPLETED
    # a verification result arriving after the deadline changes nothing: a final state is never left
    await svc.on_verify_done(VerificationResult(rollout_id=stuck, verifier="exact", reward=1.0, passed=True,
                                                started_at=now, finished_at=time.time()), None)
    assert (await svc.store.get(stuck))[0].state == S.FAILED
