"""The verification worker against a real nats-server and real sandboxes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from arena_core import subjects
from arena_core.schemas import DeadLetter, VerificationResult, VerifyJob
from arena.tasks import load_task
from arena_sandbox_providers import local
from arena_verification.worker import VerificationWorker

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no sandbox: {local.available()}")

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


def scripted_diff(label: str) -> str:
    script = json.loads((QUICKSTART / "llm_script.json").read_text())
    content = next(r["content"] for r in script["responses"] if r["label"] == label)
    return content.split("```diff\n", 1)[1].split("```", 1)[0]


async def fetch(sub, want: int, timeout: float = 30.0) -> list:
    got = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(got) < want and loop.time() < deadline:
        try:
            msgs = await sub.fetch(batch=want - len(got), timeout=0.5)
        except Exception:  # noqa: BLE001 - fetch timeout: nothing yet
            continue
        for m in msgs:
            await m.ack()
            got.append(m)
    return got


async def test_worker_verifies_publishes_once_and_dead_letters_invalid_tasks(bus, tmp_path):
    task = load_task(QUICKSTART)
    worker = VerificationWorker(bus, scratch_dir=tmp_path / "scratch")
    stop = asyncio.Event()
    running = asyncio.create_task(worker.consumer(concurrency=2).run(stop))
    results = await bus.js.pull_subscribe("arena.verify.done.*", durable="test-results", stream="ARENA_RESULTS")
    dead = await bus.js.pull_subscribe("arena.dead.*", durable="test-dead", stream="ARENA_DEAD")
    try:
        for rid, label in (("good", "correct"), ("bad", "wrong")):
            job = VerifyJob(rollout_id=rid, task=task, diff=scripted_diff(label))
            await bus.publish(subjects.VERIFY_RUN, job, msg_id=subjects.msg_id(rid, "verify-job"))
        broken = msgspec.structs.replace(task, repo=str(tmp_path / "no-such-repo"))
        await bus.publish(subjects.VERIFY_RUN, VerifyJob(rollout_id="broken", task=broken, diff=""),
                          msg_id=subjects.msg_id("broken", "verify-job"))

        msgs = await fetch(results, 3)
        by_id = {m.subject: msgspec.json.decode(m.data, type=VerificationResult) for m in msgs}
        assert set(by_id) == {subjects.verify_done(r) for r in ("good", "bad", "broken")}
        good, bad = by_id[subjects.verify_done("good")], by_id[subjects.verify_done("bad")]
        assert (good.rollout_id, good.reward, good.passed) == ("good", 1.0, True)
        assert (bad.rollout_id, bad.reward, bad.passed) == ("bad", 0.0, False)
        # Arena could not verify the broken task: a result with no reward (never a 0), saying why
        broken_result = by_id[subjects.verify_done("broken")]
        assert (broken_result.reward, broken_result.passed) == (None, False)
        assert broken_result.flags == ["infrastructure_error"] and "task repository" in broken_result.error
        assert {m.headers["Nats-Msg-Id"] for m in msgs} == {f"{r}:verify-done:0" for r in ("good", "bad", "broken")}

        letters = [msgspec.json.decode(m.data, type=DeadLetter) for m in await fetch(dead, 1)]
        assert [(d.subject, d.num_delivered) for d in letters] == [(subjects.VERIFY_RUN, 1)]
        assert letters[0].error.startswith("invalid task quickstart-textstats: task repository")

        # A redelivered job (here: published again) is verified again, and the result's
        # Nats-Msg-Id makes JetStream drop the second copy.
        job = VerifyJob(rollout_id="good", task=task, diff=scripted_diff("correct"))
        await bus.publish(subjects.VERIFY_RUN, job, msg_id=subjects.msg_id("good", "verify-job", 1))
        for _ in range(100):
            info = await bus.js.consumer_info("ARENA_VERIFY_JOBS", subjects.CONSUMER_VERIFIER)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.1)
        stream = await bus.js.stream_info("ARENA_RESULTS", subjects_filter="arena.verify.done.*")
        assert stream.state.messages == 3
    finally:
        stop.set()
        await running
        await worker.close()
    assert list((tmp_path / "scratch").iterdir()) == []


async def test_a_job_over_its_budget_is_retried_then_dead_lettered(bus, tmp_path):
    worker = VerificationWorker(bus, scratch_dir=tmp_path / "scratch", job_timeout_s=0.3)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.consumer(concurrency=1).run(stop))
    dead = await bus.js.pull_subscribe("arena.dead.*", durable="test-dead-budget", stream="ARENA_DEAD")
    try:
        task = load_task(QUICKSTART)
        # over budget by construction: the quickstart's own tests can now finish within 0.3 s
        task = msgspec.structs.replace(task, verifier=msgspec.structs.replace(task.verifier, command="sleep 60"))
        job = VerifyJob(rollout_id="slow", task=task, diff=scripted_diff("correct"))
        await bus.publish(subjects.VERIFY_RUN, job, msg_id=subjects.msg_id("slow", "verify-job"))
        [letter] = [msgspec.json.decode(m.data, type=DeadLetter) for m in await fetch(dead, 1, timeout=60)]
        assert letter.num_delivered == 3
        assert letter.error == "VerificationError: verification took longer than its 0.3s budget"
    finally:
        stop.set()
        await running
        await worker.close()
    assert list((tmp_path / "scratch").iterdir()) == []  # cancelled runs clean up too


async def test_answer_verifiers_read_the_agents_result_from_the_sandbox_result(bus, tmp_path):
    """Jobs from the sandbox plane carry no result.json: the worker reads it from SandboxDone."""
    from arena_core.schemas import ExactVerifier, SandboxDone, SandboxOutcome

    worker = VerificationWorker(bus, scratch_dir=tmp_path / "scratch")
    stop = asyncio.Event()
    running = asyncio.create_task(worker.consumer(concurrency=1).run(stop))
    results = await bus.js.pull_subscribe("arena.verify.done.*", durable="test-answers", stream="ARENA_RESULTS")
    try:
        await bus.publish(subjects.sandbox_done("ans"),
                          SandboxDone(rollout_id="ans", sandbox_id="s", provider="local", outcome=SandboxOutcome.COMPLETED,
                                      reason="done", started_at=1.0, finished_at=2.0, result={"answer": " 2.50 "}),
                          msg_id=subjects.msg_id("ans", "sandbox-done"))
        task = msgspec.structs.replace(load_task(QUICKSTART), verifier=ExactVerifier(answers=["5/2"]))
        for rid in ("ans", "none"):
            await bus.publish(subjects.VERIFY_RUN, VerifyJob(rollout_id=rid, task=task, diff=""),
                              msg_id=subjects.msg_id(rid, "verify-job"))
        got = {r.rollout_id: r for r in (msgspec.json.decode(m.data, type=VerificationResult)
                                         for m in await fetch(results, 2))}
        assert (got["ans"].verifier, got["ans"].reward) == ("exact", 1.0)
        assert (got["none"].reward, got["none"].flags) == (0.0, ["no_answer"])
    finally:
        stop.set()
        await running
        await worker.close()
