"""End to end: a multi-step ``reward_file`` task's step gate through the real stack (nats-server with
its per-service users, the four services as processes, bubblewrap sandboxes): the rollout ends at the
first step under its minimum, the agent gets no further turn, and the reward is what the task's
``multi_step_reward_strategy`` gives for the steps graded; a task whose steps all reach their minimum
gets every turn, and the final verification takes the gate's grades as they are."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest

from arena.sdk import ArenaClient
from arena_core.schemas import AgentSpec, Budget, RewardFileStep, RewardFileVerifier, Task, TaskStep
from arena_stack.stack import Stack, free_port_settings

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

#: Each turn appends its step to turns.log (the agent's own record of the turns it got) and writes
#: <step>.txt: what ANSWER_<step> says, else "ok".
AGENT = ('echo "$ARENA_STEP" >> turns.log; eval "v=\\${ANSWER_$ARENA_STEP:-ok}"; echo "$v" > "$ARENA_STEP.txt"; '
         "touch /sandbox/.arena/done")
#: Step <name>'s test: reward 1 for "ok", 0.5 for "half", else 0, and a random nonce beside it (a
#: grading done twice would not give the same one).
TEST = """#!/bin/sh
case "$(cat {name}.txt)" in ok) r=1;; half) r=0.5;; *) r=0;; esac
n=$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')
echo "{{\\"reward\\": $r, \\"nonce\\": $n}}" > /logs/verifier/reward.json
"""
NAMES = ["plan", "build", "ship"]


def gated_task(tmp: Path, answers: dict[str, str]) -> Task:
    repo = tmp / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    (repo / "README").write_text("three steps\n")
    env = " ".join(f"ANSWER_{k}={v}" for k, v in answers.items())
    return Task(
        id="three-steps", repo=str(repo), instructions="three steps", budget=Budget(wall_clock_s=120.0),
        agent=AgentSpec(command=["sh", "-c", f"export {env}; {AGENT}" if env else AGENT]),
        steps=[TaskStep(name=n, instructions=f"do {n}") for n in NAMES],
        verifier=RewardFileVerifier(timeout_s=60.0, strategy="mean", steps=[
            RewardFileStep(name=n, files={"test.sh": TEST.format(name=n).encode()}, min_reward=1.0) for n in NAMES]),
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-gate")
    settings = free_port_settings(data_dir, sandbox_concurrency=2, verify_concurrency=2)
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    try:
        yield ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key)
    finally:
        stack.stop()


def turns_logged(diff: str) -> list[str]:
    """The steps the agent wrote to turns.log, read from the rollout's final diff."""
    body = diff.split("+++ b/turns.log\n", 1)[1].split("diff --git", 1)[0]
    return [line[1:] for line in body.splitlines() if line.startswith("+") and not line.startswith("+++")]


def test_the_rollout_ends_at_the_first_step_under_its_minimum_and_every_step_at_it_gets_its_turn(stack, tmp_path):
    client = stack
    halfway = client.submit(gated_task(tmp_path / "halfway", {"plan": "half"}))
    passing = client.submit(gated_task(tmp_path / "passing", {}))
    halfway, passing = client.wait(halfway.rollout_id, timeout=180), client.wait(passing.rollout_id, timeout=180)

    # step 1 scored 0.5, under its minimum 1: the agent had one turn, not three
    assert halfway.state.value == "completed", halfway.reason
    traj = client.wait_trajectory(halfway.rollout_id, timeout=60)
    assert turns_logged(traj.sandbox.diff) == ["plan"]
    assert [t.name for t in traj.sandbox.step_turns] == ["plan"]
    assert "the rollout ended at step 1 of 3 (plan): under its minimum: reward=0.5 below min_reward 1" \
        in traj.sandbox.reason
    # the strategy (mean) over the steps graded: step 1 alone, 0.5 (all three would be 0.5 / 3)
    assert halfway.reward == 0.5 and traj.reward == 0.5
    assert "stopped after step plan: reward=0.5 below min_reward 1" in traj.verification.reason
    assert not any(key.startswith(("build.", "ship.")) for key in traj.verification.components)

    # every step reached its minimum: three turns, reward 1
    assert passing.state.value == "completed", passing.reason
    traj = client.wait_trajectory(passing.rollout_id, timeout=60)
    assert turns_logged(traj.sandbox.diff) == NAMES
    assert [t.name for t in traj.sandbox.step_turns] == NAMES
    assert passing.reward == 1.0
    components = traj.verification.components
    assert components["plan.reward"] == components["build.reward"] == components["ship.reward"] == 1.0
    # steps 1 and 2 were graded by their gates during the rollout, and the final verification took
    # those grades as they were: the nonce the gate saw is the one in the verdict
    for turn in traj.sandbox.step_turns[:2]:
        seen = re.search(r"step gate: reached its minimum: nonce=(\d+), reward=1", turn.reason)
        assert seen is not None, turn.reason
        assert components[f"{turn.name}.nonce"] == float(seen.group(1))
