"""mini-swe-agent, unmodified (PyPI ``mini-swe-agent``, in ``arena/mini-swe-agent``), in a docker
sandbox (Podman) through the real stack: the same scripted plays as the local provider's test
(tests/e2e/test_agent_mini_swe_agent.py, imported), here with ``mini`` from the image's ``PATH``
(the preset's ``Context.home`` is empty) and the verifier in the same image.

Needs the image (``make images``) and a Docker-API engine (the ``docker_url`` fixture); skipped
without them. ``make test-agents`` builds the images and runs this file.
"""

from __future__ import annotations

import json
import time

import docker
import msgspec
import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.schemas import SamplingParams

from tests.e2e.scaffold_stacks import docker_stack, require_image
from tests.e2e.test_agent_mini_swe_agent import QUICKSTART, SCRIPT, TURNS, check_steps, mini_task, mini_trajectory

IMAGE = "arena/mini-swe-agent:latest"

pytestmark = [pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engine(docker_url):
    return require_image(docker_url, IMAGE)


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-mini-image")
    script = data_dir / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with docker_stack(engine, data_dir, script, "mi") as (stack, settings):
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)


def test_mini_swe_agent_in_its_image_solves_the_quickstart_task_and_a_wrong_script_scores_zero(stack):
    stack_, client = stack
    task = msgspec.structs.replace(mini_task(load_task(QUICKSTART)), image=IMAGE)
    started = time.monotonic()
    # seed 1 draws the right play, seed 0 the wrong one
    rids = [client.submit(task, sampling=SamplingParams(seed=seed), provider="docker").rollout_id for seed in (1, 0)]
    views = [client.wait(rid, timeout=600) for rid in rids]
    elapsed = time.monotonic() - started
    assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
    assert [v.reward for v in views] == [1.0, 0.0]
    assert [v.steps for v in views] == [TURNS, TURNS]
    print(f"\ntwo quickstart rollouts with mini-swe-agent in {IMAGE} (concurrently): {elapsed:.1f} s")

    for view, expected in zip(views, ("(ordered[mid - 1] + ordered[mid]) / 2", "(ordered[mid - 1] + ordered[mid]) // 2"),
                              strict=True):
        traj = client.wait_trajectory(view.rollout_id, timeout=60)
        assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
        check_steps(traj, TURNS)  # one training sequence: mini replays its calls as sampled
        assert f"+    return {expected}" in traj.sandbox.diff
        assert [s.api for s in traj.steps] == ["openai.chat"] * TURNS
        assert [c.name for s in traj.steps for c in s.tool_calls] == ["bash"] * TURNS
        assert traj.sandbox.result["exit_status"] == "Submitted" and traj.sandbox.result["api_calls"] == TURNS
        # mini ran the commands in the container: their outputs are in its own trajectory
        mini = mini_trajectory(stack_, traj)
        outputs = [m for m in mini["messages"] if m["role"] == "tool"]
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in outputs[0]["content"]  # before the fix
        assert ("7 passed" if view.reward == 1.0 else "failed") in outputs[1]["content"]  # pytest in the image
        assert mini["info"]["config"]["environment"]["cwd"] == "/sandbox/workspace"
        assert "api_key" not in json.dumps(mini["info"]["config"]["model"])
