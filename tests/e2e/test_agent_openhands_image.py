"""OpenHands, unmodified (the V1 CLI, PyPI ``openhands``, in ``arena/openhands``), in a docker sandbox
(Podman) through the real stack: the same scripted plays as the local provider's test
(tests/e2e/test_agent_openhands.py, imported), here with OpenHands from the image's ``/opt/openhands``
(its virtualenv on its own Python 3.12; the preset's ``Context.home`` is empty), its terminal in the
image's tmux, and the verifier in the same image.

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
from tests.e2e.test_agent_openhands import (PLAYS, QUICKSTART, TOOLS, TURNS, artifact, check_steps, observations,
                                            openhands_task)

IMAGE = "arena/openhands:latest"

pytestmark = [pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def engine(docker_url):
    return require_image(docker_url, IMAGE)


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-openhands-image")
    with docker_stack(engine, data_dir, PLAYS, "oh") as (stack, settings):
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)


def test_openhands_in_its_image_solves_the_quickstart_task_and_a_wrong_play_scores_zero(stack):
    stack_, client = stack
    task = msgspec.structs.replace(openhands_task(load_task(QUICKSTART)), image=IMAGE)
    started = time.monotonic()
    # seed 1 draws the right play, seed 0 the wrong one
    rids = [client.submit(task, sampling=SamplingParams(seed=seed), provider="docker").rollout_id for seed in (1, 0)]
    views = [client.wait(rid, timeout=600) for rid in rids]
    elapsed = time.monotonic() - started
    assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
    assert [v.reward for v in views] == [1.0, 0.0]
    assert [v.steps for v in views] == [TURNS, TURNS]
    print(f"\ntwo quickstart rollouts with OpenHands in {IMAGE} (concurrently): {elapsed:.1f} s")

    for view, expected in zip(views, ("(ordered[mid - 1] + ordered[mid]) / 2", "(ordered[mid - 1] + ordered[mid]) // 2"),
                              strict=True):
        traj = client.wait_trajectory(view.rollout_id, timeout=60)
        assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
        check_steps(traj, TURNS)  # one training sequence
        seq = traj.sequences[0]
        print(f"{view.rollout_id}: reward {view.reward}, {len(traj.steps)} steps, one sequence of "
              f"{len(seq.token_ids)} tokens, loss mask {sum(seq.loss_mask)}")
        assert f"+    return {expected}" in traj.sandbox.diff
        assert [c.name for s in traj.steps for c in s.tool_calls] == TOOLS
        result = traj.sandbox.result
        assert result["execution_status"] == "finished" and result["exit_code"] == 0 and result["errors"] == []
        # OpenHands ran its tools in the container: their outputs are in its own record
        conversation = json.loads(artifact(stack_, traj, "openhands.conversation.json"))
        assert conversation["base_state"]["execution_status"] == "finished"
        outputs = observations(conversation)
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in outputs[0]  # the view, before the edit
        assert "has been edited" in outputs[1]
        assert ("7 passed" if view.reward == 1.0 else "failed") in outputs[2], outputs[2][-3000:]  # pytest, in tmux
        # the second call carried the view's output back to the model
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in json.dumps(traj.steps[1].request_messages)
