"""``python -m arena_verification`` as processes: two workers share the queue, a job that
keeps failing is dead-lettered with its error, each exits 0 on SIGTERM; and
``arena verify`` replays a stored rollout (trajectory service process) with a new verifier."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from arena_core import apikeys, sources, subjects
from arena_stack.natsserver import free_port
from arena_core.schemas import (
    BundleSource,
    DeadLetter,
    ExactVerifier,
    LlmJudgeVerifier,
    RolloutRecord,
    RolloutState,
    RolloutStateChanged,
    SamplingParams,
    SandboxDone,
    SandboxOutcome,
    VerificationResult,
    VerifyJob,
)
from arena.tasks import load_task
from arena_sandbox_providers import local

from tests.trajectory.test_service import start as start_trajectory
from tests.trajectory.test_service import wait_for
from .test_worker import fetch, scripted_diff

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no sandbox: {local.available()}")

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


def start_verifier(nats_url: str, data_dir: Path, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "ARENA_NATS_URL": nats_url, "ARENA_DATA_DIR": str(data_dir), "ARENA_VERIFY_CONCURRENCY": "1"}
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "arena_verification"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)


async def stop_all(procs: list[subprocess.Popen]) -> list[int]:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    codes = []
    for proc in procs:
        try:
            codes.append(await asyncio.to_thread(proc.wait, 20))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(await asyncio.to_thread(proc.wait))
    return codes


def log_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


async def test_two_workers_dead_letters_and_replay(bus, nats_server, tmp_path):
    # the workers have their own data directories and accept no host paths: the task's
    # repository travels as a bundle in the object store
    quickstart = load_task(QUICKSTART)
    digest = await sources.push_bundle(bus, sources.pack_dir(Path(quickstart.repo)))
    task = msgspec.structs.replace(quickstart, repo="", source=BundleSource(digest=digest))
    logs = [tmp_path / "verify-a.log", tmp_path / "verify-b.log"]
    traj_port = free_port()
    traj_url = f"http://127.0.0.1:{traj_port}"
    procs = [start_verifier(nats_server.url, tmp_path / f"data-{i}", logs[i]) for i in range(2)]
    procs.append(start_trajectory(nats_server.url, tmp_path / "traj", traj_port, tmp_path / "trajectory.log"))
    key, _ = await apikeys.issue(bus, "test", ["read"])  # the trajectory API asks for one by default
    try:
        results = await bus.js.pull_subscribe("arena.verify.done.*", durable="t-results", stream="ARENA_RESULTS")
        dead = await bus.js.pull_subscribe("arena.dead.*", durable="t-dead", stream="ARENA_DEAD")
        labels = {"g1": "correct", "w1": "wrong"}
        for rid, label in labels.items():
            await bus.publish(subjects.VERIFY_RUN, VerifyJob(rollout_id=rid, task=task, diff=scripted_diff(label)),
                              msg_id=subjects.msg_id(rid, "verify-job"))
        exact = msgspec.structs.replace(task, verifier=ExactVerifier(answers=["2.5"]))
        for rid, answer in (("e1", "2.50"), ("e2", "3")):
            await bus.publish(subjects.VERIFY_RUN, VerifyJob(rollout_id=rid, task=exact, diff="",
                                                             result={"answer": answer}),
                              msg_id=subjects.msg_id(rid, "verify-job"))
        judge = LlmJudgeVerifier(rubric="x", base_url=f"http://127.0.0.1:{free_port()}/v1", timeout_s=2)
        await bus.publish(subjects.VERIFY_RUN,
                          VerifyJob(rollout_id="judge", task=msgspec.structs.replace(task, verifier=judge), diff="",
                                    result={"answer": "a"}),
                          msg_id=subjects.msg_id("judge", "verify-job"))

        got = {r.rollout_id: r for r in (msgspec.json.decode(m.data, type=VerificationResult)
                                         for m in await fetch(results, 5, timeout=120))}
        # the judge was unreachable on every attempt: Arena could not verify, so no reward (not 0)
        assert {rid: r.reward for rid, r in got.items()} == {"g1": 1.0, "w1": 0.0, "e1": 1.0, "e2": 0.0,
                                                             "judge": None}
        assert "unreachable" in got["judge"].error and got["judge"].flags == ["infrastructure_error"]
        [letter] = [msgspec.json.decode(m.data, type=DeadLetter) for m in await fetch(dead, 1, timeout=60)]
        assert letter.num_delivered == 3 and "unreachable" in letter.error
        assert msgspec.json.decode(letter.data, type=VerifyJob).rollout_id == "judge"
        # Both processes took jobs from the one work queue.
        per_process = [sum(line["msg"].startswith("verified:") for line in log_lines(p)) for p in logs]
        assert sum(per_process) == 4 and min(per_process) >= 1, per_process

        # A completed, stored rollout ...
        now = time.time()
        record = RolloutRecord(rollout_id="g1", task=task, sampling=SamplingParams(), model="m", provider="local",
                               api_key="k", state=RolloutState.COMPLETED, created_at=now, updated_at=now, reward=1.0)
        await (await bus.kv(subjects.KV_ROLLOUTS)).put("g1", msgspec.json.encode(record))
        await bus.publish(subjects.sandbox_done("g1"),
                          SandboxDone(rollout_id="g1", sandbox_id="s", provider="local", diff=scripted_diff("correct"),
                                      outcome=SandboxOutcome.COMPLETED, reason="done", started_at=now,
                                      finished_at=now, result={"answer": "2.5"}),
                          msg_id=subjects.msg_id("g1", "sandbox-done"))
        await bus.publish(subjects.rollout_state("g1"),
                          RolloutStateChanged(rollout_id="g1", task_id=task.id, from_state=RolloutState.VERIFYING,
                                              to_state=RolloutState.COMPLETED, at=now, steps=0),
                          msg_id=subjects.msg_id("g1", "state", "completed"))
        r = await wait_for(f"{traj_url}/v1/trajectories/g1", procs[2], timeout=60, key=key)
        assert r.json()["verification"]["verifier"] == "tests"

        # ... re-verified by `arena verify` with an exact-answer verifier, through the workers.
        cli = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "arena.cli", "--trajectory-url", traj_url, "verify", "g1",
             "--verifier", '{"type": "exact", "answers": ["5/2"]}', "--nats-url", nats_server.url, "--timeout", "60"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "ARENA_API_KEY": key})
        assert cli.returncode == 0, cli.stderr
        replayed = msgspec.json.decode(cli.stdout, type=VerificationResult)
        assert replayed.verifier.startswith("replay-exact-") and (replayed.reward, replayed.passed) == (1.0, True)
        # Stored beside the original: both results are on the results stream for g1.
        both = [msgspec.json.decode(m.data, type=VerificationResult) for m in await fetch(results, 1, timeout=30)]
        assert [b.verifier for b in both] == [replayed.verifier]
        bad = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "arena.cli", "verify", "g1", "--verifier", "{nope"],
            capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "invalid_request: --verifier is not valid JSON" in bad.stderr
    finally:
        codes = await stop_all(procs)
    assert codes[:2] == [0, 0], [p.read_text()[-2000:] for p in logs]
    for path in logs:
        assert log_lines(path)[-1]["msg"] == "verification service stopped"
