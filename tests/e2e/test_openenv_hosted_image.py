"""An unmodified OpenEnv environment image (``arena/openenv-echo``: ``openenv init``'s
template, built by ``make image-openenv-echo``) hosted as an Arena task on the docker
provider: the sandbox is the image, started with its own command; OpenEnv's client drives
episodes through Arena's endpoint, two at once (one container each), and the rollouts end
with the environment's summed reward. Skipped without the image (``make test-openenv``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from openenv.core import GenericEnvClient

from arena.sdk import ArenaClient
from tests.e2e.scaffold_stacks import docker_stack, require_image

IMAGE = "arena/openenv-echo:latest"
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def engine(docker_url):
    return require_image(docker_url, IMAGE)


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory):
    # the OpenEnv protocol is under test, its clients without headers (keys on its routes:
    # tests/e2e/test_api_keys_on_every_route.py)
    with docker_stack(engine, tmp_path_factory.mktemp("openenv-image"), QUICKSTART / "llm_script.json", "oe",
                      auth="off") as (stack, settings):
        task = {"id": "echo-image", "instructions": "Say long things.", "agent": {"external": True},
                "environment": {"image": IMAGE}, "budget": {"wall_clock_s": 300}}
        got = httpx.put(f"{settings.rollout_url}/v1/environments/echo", json={"task": task, "provider": "docker"})
        assert got.status_code == 200, got.text
        yield settings


async def test_two_episodes_at_once_each_in_its_own_container(stack):
    settings = stack

    async def episode(words: list[str]) -> str:
        async with GenericEnvClient(base_url=f"{settings.rollout_url}/openenv/echo", message_timeout_s=120) as env:
            first = await env.reset()
            assert first.observation == {"echoed_message": "Echo Env environment ready!", "message_length": 0}
            for word in words:
                step = await env.step({"message": word})
                assert step.observation["echoed_message"] == word
            with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
                await env.step({"text": "not the env's field"})
            return (await env.state())["rollout_id"]

    ids = await asyncio.gather(episode(["hello", "hi"]), episode(["a" * 20]))
    client = ArenaClient(settings.rollout_url, settings.trajectory_url)
    views = [client.wait(rid, timeout=120) for rid in ids]
    assert [v.state.value for v in views] == ["completed", "completed"], [v.reason for v in views]
    assert [v.reward for v in views] == [pytest.approx(0.7), pytest.approx(2.0)]
    for rid in ids:
        traj = client.wait_trajectory(rid, timeout=60)
        assert traj.sandbox.provider == "docker"
        assert [s.kind for s in traj.sandbox.env_steps][:2] == ["reset", "step"]
        assert "Uvicorn running" in (traj.sandbox.log_tail or "") or traj.sandbox.env_steps
