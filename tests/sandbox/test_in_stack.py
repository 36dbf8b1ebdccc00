"""The contract end to end, per real provider: the quickstart agent, in a local
(bubblewrap) or docker sandbox, completes the example task through Arena's own LLM
proxy (the rollout service, in front of the scripted LLM), with every service of the
stack running as a process. Its LLM call is captured as a step, its diff verified."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import docker
import httpx
import msgspec
import pytest

from arena_core import apikeys, subjects
from arena_core.bus import Bus
from arena_stack.natsserver import free_port
from arena_core.schemas import GroupSubmitted, SamplingParams, SandboxDone, SubmitGroupRequest
from arena.sdk import ArenaClient
from arena_core.settings import Settings
from arena_stack.stack import Stack
from arena.tasks import load_task
from arena_sandbox_providers import local

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


@pytest.fixture(params=["local", "docker"])
def provider(request) -> tuple[str, str]:
    if request.param == "local":
        if local.available() is not None:
            pytest.skip(f"no bubblewrap: {local.available()}")
        return "local", ""
    return "docker", request.getfixturevalue("docker_url")


async def _sandbox_done(nats_url: str, rollout_id: str) -> SandboxDone:
    bus = await Bus.connect(nats_url, "test")
    try:
        msg = await bus.js.get_last_msg("ARENA_RESULTS", subjects.sandbox_done(rollout_id))
        return msgspec.json.decode(msg.data, type=SandboxDone)
    finally:
        await bus.close()


def test_quickstart_completes_through_arenas_proxy(provider, tmp_path):
    name, docker_url = provider
    owner = f"stack-{uuid.uuid4().hex[:8]}"
    rollout_port = free_port()
    settings = Settings(
        allow_host_paths=True,  # the task's repository is a path on this machine (embedded style)
        nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
        rollout_port=rollout_port, trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rollout_port}",
        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0",
        sandbox_provider=name, docker_url=docker_url, sandbox_owner=owner, sandbox_concurrency=2,
        verify_concurrency=1,
    )
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start(timeout=120))
    settings = stack.settings  # its NATS URL carries the administrator's credentials
    try:
        task = load_task(QUICKSTART)
        if name == "docker":
            task = msgspec.structs.replace(task, image="arena/quickstart:latest")
        # seeds 0 and 1: the scripted LLM answers the first with a wrong patch, the second right
        request = SubmitGroupRequest(task=task, n=2, sampling=SamplingParams(seed=0), provider=name)
        reply = httpx.post(f"{settings.rollout_url}/v1/rollout-groups", content=msgspec.json.encode(request),
                           headers={"content-type": "application/json", **apikeys.auth_headers(stack.api_key)},
                           timeout=30)
        assert reply.status_code < 300, reply.text
        group = msgspec.json.decode(reply.content, type=GroupSubmitted)
        client = ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key)
        views = [client.wait(rid, timeout=180) for rid in group.rollout_ids]
        assert [v.state.value for v in views] == ["completed"] * 2, [(v.state, v.reason) for v in views]
        assert [v.reward for v in views] == [0.0, 1.0]
        assert [v.steps for v in views] == [1, 1]  # the agent's LLM call went through Arena's proxy
        for rid in group.rollout_ids:
            done = asyncio.run(_sandbox_done(settings.nats_url, rid))
            assert done.provider == name and done.outcome.value == "completed", done.reason
            assert "diff --git a/textstats/core.py b/textstats/core.py" in done.diff
    finally:
        stack.stop()
    if name == "docker":
        client = docker.DockerClient(base_url=docker_url)
        try:
            assert not client.api.containers(all=True, filters={"label": f"arena.owner={owner}"})
        finally:
            client.close()
    assert not list((tmp_path / "arena" / "sandboxes").glob("*/*")) + list((tmp_path / "arena" / "docker").glob("*/*"))
