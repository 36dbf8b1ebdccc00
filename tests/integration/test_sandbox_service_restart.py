"""The sandbox service killed with SIGKILL mid-job and restarted: the sandbox it left
behind (a container, or a local sandbox directory + cgroup) is reaped at start-up."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from arena import subjects
from arena.schemas import AgentSpec, Budget, SandboxJob, Task, TestsVerifier
from arena_sandbox import local

OWNER = f"restart-{uuid.uuid4().hex[:8]}"  # engines are shared by concurrent test runs


def _start(name: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "arena_sandbox"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.2)
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize("name", ["local", "docker"])
async def test_sigkilled_service_leaves_nothing_after_restart(request, name, bus, nats_server, tmp_path):
    if name == "local" and local.available() is not None:
        pytest.skip(f"no bubblewrap: {local.available()}")
    docker_url = request.getfixturevalue("docker_url") if name == "docker" else ""
    data = tmp_path / "data"
    env = {**os.environ, "ARENA_NATS_URL": nats_server.url, "ARENA_DATA_DIR": str(data),
           "ARENA_SANDBOX_PROVIDER": name, "ARENA_SANDBOX_OWNER": OWNER, "ARENA_DOCKER_URL": docker_url,
           "ARENA_LOG_LEVEL": "WARNING"}
    repo, agent = tmp_path / "repo", tmp_path / "agent"
    repo.mkdir()
    agent.mkdir()
    (repo / "f.txt").write_text("x\n")
    (agent / "agent.py").write_text("import time\ntime.sleep(1000)\n")
    task = Task(id="t", repo=str(repo), instructions="-", verifier=TestsVerifier(), budget=Budget(wall_clock_s=600),
                agent=AgentSpec(command=["python3", "/sandbox/agent/agent.py"], path=str(agent)))
    await bus.publish(subjects.sandbox_run(name), SandboxJob(rollout_id="rk", task=task, proxy_url="http://127.0.0.1:9/v1",
                                                             api_key="k"), msg_id="rk:sandbox-job:1")
    sandboxes = data / ("sandboxes" if name == "local" else "docker") / OWNER

    def live() -> list[Path]:
        return [p for p in sandboxes.iterdir()] if sandboxes.is_dir() else []

    def containers() -> list:
        import docker

        client = docker.DockerClient(base_url=docker_url)
        try:
            return client.api.containers(all=True, filters={"label": f"arena.owner={OWNER}"})
        finally:
            client.close()

    first = _start(name, env)
    try:
        await _wait_for(lambda: live() and (name != "docker" or containers()))
        await asyncio.sleep(0.3)  # the agent is running
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert live(), "the killed service's sandbox is still there (an orphan)"
        if name == "docker":
            assert containers()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
    orphan = {p.name for p in live()}
    second = _start(name, env)
    try:
        # reaped at start-up (the job comes back after ack_wait and would start a new one later)
        await _wait_for(lambda: not orphan & {p.name for p in live()}, timeout=60)
        if name == "docker":
            await _wait_for(lambda: all(c["Labels"].get("arena.sandbox_id") not in orphan for c in containers()))
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(30)
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait(10)
    if name == "docker":  # the redelivered job, if it started, was stopped with the service
        await _wait_for(lambda: not containers(), timeout=30)
