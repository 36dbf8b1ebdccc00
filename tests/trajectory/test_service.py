"""``python -m arena_trajectory`` as a real process: consumes, serves HTTP, stops cleanly
on SIGINT and SIGTERM, and keeps its data across a restart."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from arena_core import apikeys, subjects
from arena_stack.natsserver import free_port
from arena_core.schemas import (
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxOutcome,
    Step,
    VerificationResult,
)


def start(nats_url: str, data_dir, port: int, log_path) -> subprocess.Popen:
    env = dict(os.environ, ARENA_NATS_URL=nats_url, ARENA_DATA_DIR=str(data_dir), ARENA_HOST="127.0.0.1",
               ARENA_TRAJECTORY_PORT=str(port))
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "arena_trajectory"], env=env, stdout=log, stderr=log)


async def wait_for(url: str, proc: subprocess.Popen, status: int = 200, timeout: float = 30.0,
                   key: str | None = None) -> httpx.Response:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2, headers=apikeys.auth_headers(key or "")) as client:
        while True:
            assert proc.poll() is None, f"service exited with {proc.returncode}"
            try:
                r = await client.get(url)
                if r.status_code == status:
                    return r
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{url} did not answer {status} in {timeout}s"
            await asyncio.sleep(0.1)


def stop(proc: subprocess.Popen, sig: signal.Signals) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


async def test_service_process(nats_server, bus, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "trajectory.log"
    key, _ = await apikeys.issue(bus, "test", ["read"])  # keys are on by default
    proc = start(nats_server.url, tmp_path / "data", port, log_path)
    try:
        await wait_for(f"{base}/healthz", proc)
        await bus.publish(subjects.step("r1"), Step(rollout_id="r1", step_index=0, model="m", backend="b"),
                          msg_id=subjects.msg_id("r1", "step", 0))
        await bus.publish(subjects.sandbox_done("r1"),
                          SandboxDone(rollout_id="r1", sandbox_id="s", provider="local",
                                      outcome=SandboxOutcome.COMPLETED, reason="", started_at=1.0, finished_at=2.0),
                          msg_id=subjects.msg_id("r1", "sandbox-done"))
        await bus.publish(subjects.verify_done("r1"),
                          VerificationResult(rollout_id="r1", verifier="tests", reward=1.0, passed=True,
                                             started_at=3.0, finished_at=4.0),
                          msg_id=subjects.msg_id("r1", "verify-done"))
        await bus.publish(subjects.rollout_state("r1"),
                          RolloutStateChanged(rollout_id="r1", task_id="t", from_state=RolloutState.VERIFYING,
                                              to_state=RolloutState.COMPLETED, at=5.0, steps=1),
                          msg_id=subjects.msg_id("r1", "state", "completed"))
        r = await wait_for(f"{base}/v1/trajectories/r1", proc, key=key)
        assert r.json()["reward"] == 1.0 and len(r.json()["steps"]) == 1
        assert stop(proc, signal.SIGINT) == 0  # Ctrl-C

        proc = start(nats_server.url, tmp_path / "data", port, log_path)
        r = await wait_for(f"{base}/v1/trajectories/r1", proc, key=key)  # embedded ClickHouse kept it
        assert r.json()["rollout_id"] == "r1"
        assert stop(proc, signal.SIGTERM) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    assert all(line["service"] == "trajectory" for line in lines)
    assert not [line for line in lines if line["level"] == "error"]
    assert sum(line["msg"] == "stopped" for line in lines) == 2
