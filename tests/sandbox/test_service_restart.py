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

from arena_core import subjects
from arena_core.schemas import AgentSpec, Budget, SandboxJob, Task, TestsVerifier
from arena_sandbox_providers import local

OWNER = f"restart-{uuid.uuid4().hex[:8]}"  # engines are shared by concurrent test runs


def _start(name: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "arena_sandbox"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _service_env(nats_url: str, data: Path, provider: str, owner: str, docker_url: str) -> dict[str, str]:
    return {**os.environ, "ARENA_NATS_URL": nats_url, "ARENA_DATA_DIR": str(data), "ARENA_SANDBOX_PROVIDER": provider,
            "ARENA_SANDBOX_OWNER": owner, "ARENA_DOCKER_URL": docker_url, "ARENA_LOG_LEVEL": "WARNING",
            "ARENA_ALLOW_HOST_PATHS": "1"}


def _task(tmp_path: Path, agent_code: str, wall_clock_s: float) -> Task:
    """A one-file repository and an agent running ``agent_code``."""
    repo, agent = tmp_path / "repo", tmp_path / "agent"
    repo.mkdir()
    agent.mkdir()
    (repo / "f.txt").write_text("x\n")
    (agent / "agent.py").write_text(agent_code)
    return Task(id="t", repo=str(repo), instructions="-", verifier=TestsVerifier(),
                budget=Budget(wall_clock_s=wall_clock_s),
                agent=AgentSpec(command=["python3", "/sandbox/agent/agent.py"], path=str(agent)))


def _stop(service: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if the service has not exited within 30 s."""
    service.send_signal(signal.SIGTERM)
    try:
        service.wait(30)
    except subprocess.TimeoutExpired:
        service.kill()
        service.wait(10)


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
    env = _service_env(nats_server.url, data, name, OWNER, docker_url)
    task = _task(tmp_path, "import time\ntime.sleep(1000)\n", wall_clock_s=600)
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
    cgroups: list[Path] = []  # the local orphan's cgroups, where cgroups are writable
    run_dirs: list[Path] = []  # and its relay directory in the runs' temp dir
    if name == "local":
        from arena_sandbox_providers.local_provider import LocalProvider

        provider = LocalProvider(data_dir=data, owner=OWNER)
        run_dirs = list(Path(local.run_tmp()).glob(f"{provider.run_prefix}*"))
        assert run_dirs, "the killed service's sandbox has no relay directory"
        if provider.use_cgroups:
            cgroups = [Path("/sys/fs/cgroup", c, "arena", provider.cgroup_owner, o)
                       for c in ("pids", "memory", "cpu", "") for o in orphan]
            cgroups = [g for g in cgroups if g.is_dir()]
            assert cgroups, "the killed service's sandbox has no cgroup"
    second = _start(name, env)
    try:
        # reaped at start-up (the job comes back after ack_wait and would start a new one later)
        await _wait_for(lambda: not orphan & {p.name for p in live()}, timeout=60)
        await _wait_for(lambda: not any(g.exists() for g in cgroups), timeout=30)
        await _wait_for(lambda: not any(d.exists() for d in run_dirs), timeout=30)
        if name == "docker":
            await _wait_for(lambda: all(c["Labels"].get("arena.sandbox_id") not in orphan for c in containers()))
    finally:
        _stop(second)
    if name == "docker":  # the redelivered job, if it started, was stopped with the service
        await _wait_for(lambda: not containers(), timeout=30)


async def _done(bus, rid: str, service: subprocess.Popen, timeout: float = 90.0):
    from nats.js.errors import NotFoundError

    import msgspec

    from arena_core.schemas import SandboxDone

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = await bus.js.get_last_msg("ARENA_RESULTS", subjects.sandbox_done(rid))
            return msgspec.json.decode(msg.data, type=SandboxDone)
        except NotFoundError:
            assert service.poll() is None, f"the service exited with code {service.returncode}"
            await asyncio.sleep(0.2)
    raise AssertionError(f"no SandboxDone for {rid}")


async def test_engine_down_at_start_then_up(request, bus, nats_server, tmp_path):
    """The docker engine is unreachable when the service starts: the service does not
    crash, answers jobs with an `error` outcome naming the engine, and once the engine
    is back reaps its predecessor's orphans before its first sandbox, then runs jobs."""
    import shutil
    import tempfile

    from arena_core.schemas import SandboxOutcome
    from arena_sandbox_providers.provider import CreateSpec
    from arena_sandbox_providers.testing import make_provider

    docker_url = request.getfixturevalue("docker_url")
    if not docker_url.startswith("unix://"):
        pytest.skip("needs the engine on a Unix socket (to make it appear later through a link)")
    owner = f"late-{uuid.uuid4().hex[:8]}"
    data = tmp_path / "data"
    crashed = make_provider("docker", data, docker_url=docker_url, owner=owner)
    orphan = await crashed.create(CreateSpec())  # what a killed predecessor of this owner left
    short = Path(tempfile.mkdtemp(prefix="arena-eng-"))  # a Unix socket path has 108 bytes
    link = short / "engine.sock"  # the engine "appears" when this link does
    env = _service_env(nats_server.url, data, "docker", owner, f"unix://{link}")
    task = _task(tmp_path, "open('f.txt', 'w').write('y\\n')\nopen('/sandbox/.arena/done', 'w')\n", wall_clock_s=120)
    service = _start("docker", env)
    try:
        await bus.publish(subjects.sandbox_run("docker"), SandboxJob(rollout_id="down", task=task,
                          proxy_url="http://127.0.0.1:9/v1", api_key="k"), msg_id="down:sandbox-job:1")
        down = await _done(bus, "down", service)
        assert down.outcome is SandboxOutcome.ERROR
        assert down.reason.startswith("the docker sandbox provider is unavailable: no Docker-API engine at unix://")
        assert service.poll() is None, "the service crashed"
        assert crashed.client.api.containers(all=True, filters={"id": orphan.container_id})  # not reaped yet
        os.symlink(docker_url.removeprefix("unix://"), link)
        await bus.publish(subjects.sandbox_run("docker"), SandboxJob(rollout_id="up", task=task,
                          proxy_url="http://127.0.0.1:9/v1", api_key="k"), msg_id="up:sandbox-job:1")
        up = await _done(bus, "up", service)
        assert up.outcome is SandboxOutcome.COMPLETED, up.reason
        assert "+y" in up.diff
        assert not crashed.client.api.containers(all=True, filters={"id": orphan.container_id})  # reaped
        assert not orphan.root.exists()
    finally:
        _stop(service)
        await orphan.destroy()
        await crashed.close()
        shutil.rmtree(short, ignore_errors=True)
    assert not crashed.client.api.containers(all=True, filters={"label": f"arena.owner={owner}"})
