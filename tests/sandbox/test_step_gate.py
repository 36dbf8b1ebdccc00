"""A multi-step task's step gate over a real NATS server, with real bubblewrap sandboxes: a verification
plane that is down, or takes the request and never answers, ends the rollout as an infrastructure
outcome (no reward, never a 0) after the first turn; a real verification worker's gate ends the turns
at the first step under its minimum, and lets them all run when every step reaches it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from arena_core import subjects
from arena_core.sources import SourceCache
from arena_core.schemas import (
    AgentSpec,
    Budget,
    RewardFileStep,
    RewardFileVerifier,
    SandboxJob,
    SandboxOutcome,
    Task,
    TaskStep,
)
from arena_core.step_gate import StepVerdict, request_decoder
from arena_sandbox import runner
from arena_sandbox.gate import NatsStepGate
from arena_sandbox_providers import local
from arena_sandbox_providers.testing import make_provider
from arena_verification.gate import StepGates
from arena_verification.sandboxes import LocalSandboxes
from arena_verification.worker import VerificationWorker

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no bubblewrap: {local.available()}")

#: Each turn appends its step to turns.log and writes <step>.txt: "ok", or what WRONG_<step> says.
AGENT = ('echo "$ARENA_STEP" >> turns.log; eval "v=\\${WRONG_$ARENA_STEP:-ok}"; echo "$v" > "$ARENA_STEP.txt"; '
         "touch /sandbox/.arena/done")
#: Step <name>'s test: reward 1 when <name>.txt says ok, else 0.
TEST = '#!/bin/sh\nif [ "$(cat {name}.txt)" = ok ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
NAMES = ["a", "b", "c"]


def steps_job(tmp_path: Path, wrong: dict[str, str] | None = None) -> SandboxJob:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "README").write_text("base\n")
    env = "".join(f"WRONG_{k}={v} " for k, v in (wrong or {}).items())
    task = Task(
        id="gated", repo=str(repo), instructions="three steps", budget=Budget(wall_clock_s=120.0),
        agent=AgentSpec(command=["sh", "-c", f"export {env}; {AGENT}" if env else AGENT]),
        steps=[TaskStep(name=n, instructions=f"do {n}") for n in NAMES],
        verifier=RewardFileVerifier(timeout_s=60.0, steps=[
            RewardFileStep(name=n, files={"test.sh": TEST.format(name=n).encode()}, min_reward=1.0) for n in NAMES]),
    )
    return SandboxJob(rollout_id="gate-r1", task=task, proxy_url="http://127.0.0.1:9/proxy/r/v1", api_key="ak-test")


async def run(tmp_path: Path, job: SandboxJob, gate) -> runner.JobRun:
    return await runner.run_job(provider=make_provider("local", tmp_path / "data"), job=job,
                                data_dir=tmp_path / "data", gate=gate)


async def test_a_verification_service_that_is_down_is_an_infrastructure_outcome(bus, tmp_path):
    done = (await run(tmp_path, steps_job(tmp_path), NatsStepGate(bus, steps_job(tmp_path)))).done
    assert done.outcome is SandboxOutcome.ERROR, done.reason  # the rollout: failed, infrastructure, no reward
    assert "no verification worker is listening" in done.reason
    assert [t.name for t in done.step_turns] == ["a"]  # no turn after the gate that could not decide
    assert "turns.log" in done.diff and "+a\n" in done.diff and "+b\n" not in done.diff


async def test_a_verification_service_that_never_answers_is_an_infrastructure_outcome(bus, tmp_path):
    asked: list = []

    async def silent(msg) -> None:  # takes the request, never answers
        asked.append(request_decoder.decode(msg.data))

    sub = await bus.nc.subscribe(subjects.VERIFY_STEP_ALL, cb=silent)
    try:
        job = steps_job(tmp_path)
        done = (await run(tmp_path, job, NatsStepGate(bus, job, accept_timeout_s=1.0))).done
    finally:
        await sub.unsubscribe()
    assert done.outcome is SandboxOutcome.ERROR, done.reason
    assert "gave no answer within 1s" in done.reason
    assert [(r.step, r.index) for r in asked] == [("a", 0)] and "a.txt" in asked[0].diff
    assert asked[0].task.verifier is not None  # the job's own task, as the sandbox plane has it


async def test_a_failing_grade_mid_rollout_is_an_infrastructure_outcome(bus, tmp_path):
    async def failing(msg) -> None:
        rid = request_decoder.decode(msg.data).rollout_id
        await bus.nc.publish(msg.reply, msgspec.json.encode(StepVerdict(
            rollout_id=rid, step="a", decision="error", reason="cannot create a verification sandbox")))

    sub = await bus.nc.subscribe(subjects.VERIFY_STEP_ALL, cb=failing)
    try:
        job = steps_job(tmp_path)
        done = (await run(tmp_path, job, NatsStepGate(bus, job))).done
    finally:
        await sub.unsubscribe()
    assert done.outcome is SandboxOutcome.ERROR
    assert "step a's gate could not decide: cannot create a verification sandbox" in done.reason


@pytest.fixture
async def gates(bus, tmp_path):
    """A verification worker's step gates on ``bus``, grading in local sandboxes."""
    worker = VerificationWorker(bus, scratch_dir=tmp_path / "verify", sandboxes=LocalSandboxes(tmp_path / "boxes"),
                                sources=SourceCache(tmp_path / "verify-sources", allow_paths=True))
    stop = asyncio.Event()
    gates = StepGates(worker)
    serving = asyncio.create_task(gates.run(stop))
    await asyncio.wait_for(gates.ready.wait(), timeout=30)
    try:
        yield worker
    finally:
        stop.set()
        await serving
        await worker.close()


async def test_the_gate_ends_the_turns_at_the_first_step_under_its_minimum(bus, gates, tmp_path):
    job = steps_job(tmp_path, wrong={"a": "nope"})
    done = (await run(tmp_path, job, NatsStepGate(bus, job))).done
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason  # graded as it stands: the policy's reward
    assert [t.name for t in done.step_turns] == ["a"]
    assert "the rollout ended at step 1 of 3 (a): under its minimum: reward=0 below min_reward 1" in done.reason
    assert "+b\n" not in done.diff
    kv = await bus.kv(subjects.KV_STEP_GRADES)
    assert msgspec.json.decode((await kv.get("gate-r1.0")).value)["below"] == "reward=0 below min_reward 1"


async def test_every_step_at_its_minimum_gets_its_turn(bus, gates, tmp_path):
    job = steps_job(tmp_path)
    done = (await run(tmp_path, job, NatsStepGate(bus, job))).done
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason
    assert [t.name for t in done.step_turns] == NAMES
    assert "+a\n+b\n+c\n" in done.diff
