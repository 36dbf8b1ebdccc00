"""A multi-step task's turns in one real sandbox (bubblewrap): each step's instruction in its own
turn's task.json, the workspace's diff after each turn, the turns ending at the first one without
done, and an agent that keeps its done from being removed gets no free turn."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from arena_core.schemas import (
    AgentSpec,
    Budget,
    RewardFileStep,
    RewardFileVerifier,
    SandboxJob,
    SandboxOutcome,
    Task,
    TaskStep,
)
from arena_sandbox import runner
from arena_sandbox_providers import local
from arena_sandbox_providers.testing import make_provider

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no bubblewrap: {local.available()}")

#: Each turn: record what it saw, write <step>.txt, then act as the step's name says.
STEP_AGENT = """
import json, os, sys
task = json.load(open('/sandbox/.arena/task.json'))
step = os.environ['ARENA_STEP']
seen = {'step': task['step'], 'index': task['step_index'], 'env_index': os.environ['ARENA_STEP_INDEX'],
        'instructions': task['task']['instructions'], 'verifier': task['task'].get('verifier'),
        'done_left': os.path.exists('/sandbox/.arena/done')}
open(step + '.txt', 'w').write(json.dumps(seen, sort_keys=True) + '\\n')
if step.startswith('quit'):
    sys.exit(2)
if step.startswith('stick'):
    os.makedirs('/sandbox/.arena/done/keep', exist_ok=True)
    sys.exit(0)
open('/sandbox/.arena/done', 'w').close()
"""


def steps_job(tmp_path: Path, names: list[str], wall_clock_s: float = 60.0) -> SandboxJob:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("base\n")
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "agent.py").write_text(STEP_AGENT)
    task = Task(
        id="steps", repo=str(repo), instructions="overview", budget=Budget(wall_clock_s=wall_clock_s),
        agent=AgentSpec(command=["python3", "/sandbox/agent/agent.py"], path=str(agent)),
        steps=[TaskStep(name=name, instructions=f"do {name}") for name in names],
        verifier=RewardFileVerifier(steps=[RewardFileStep(name=name, files={"test.sh": b"exit 0"}) for name in names]),
    )
    return SandboxJob(rollout_id="r1", task=task, proxy_url="http://127.0.0.1:9/proxy/r1/v1", api_key="ak-test")


def seen(diff: str, step: str) -> dict:
    """What the turn of ``step`` recorded, read back from a diff that adds ``<step>.txt``."""
    head = f"+++ b/{step}.txt\n@@ -0,0 +1 @@\n+"
    return msgspec.json.decode(diff.split(head, 1)[1].split("\n", 1)[0])


async def test_each_turn_sees_its_own_step_and_the_diff_is_taken_after_each(tmp_path):
    job = steps_job(tmp_path, ["first", "second", "third"])
    out = await runner.run_job(provider=make_provider("local", tmp_path / "data"), job=job, data_dir=tmp_path / "data")
    done = out.done
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason
    assert [(t.name, t.completed, t.reason) for t in done.step_turns] == [
        ("first", True, "done"), ("second", True, "done"), ("third", True, "done")]
    first, second, third = (t.diff for t in done.step_turns)
    assert "first.txt" in first and "second.txt" not in first
    assert "first.txt" in second and "second.txt" in second and "third.txt" not in second
    assert third == done.diff
    assert seen(third, "second") == {"step": "second", "index": 2, "env_index": "2", "instructions": "do second",
                                      "verifier": None, "done_left": False}
    assert seen(third, "first")["instructions"] == "do first"
    assert "turns: first: done, second: done, third: done" in done.reason


async def test_the_turns_end_at_the_first_turn_without_done(tmp_path):
    job = steps_job(tmp_path, ["first", "quit-here", "never"])
    done = (await runner.run_job(provider=make_provider("local", tmp_path / "data"), job=job,
                                 data_dir=tmp_path / "data")).done
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason  # a step was done: the steps are graded
    assert [(t.name, t.completed) for t in done.step_turns] == [("first", True), ("quit-here", False)]
    assert done.step_turns[1].reason == "exited with code 2 without writing done"
    assert "quit-here.txt" in done.step_turns[1].diff and "never.txt" not in done.diff


async def test_a_first_turn_without_done_fails_the_rollout(tmp_path):
    job = steps_job(tmp_path, ["quit-at-once", "second"])
    done = (await runner.run_job(provider=make_provider("local", tmp_path / "data"), job=job,
                                 data_dir=tmp_path / "data")).done
    assert done.outcome is SandboxOutcome.FAILED
    assert [t.name for t in done.step_turns] == ["quit-at-once"]


async def test_a_done_the_agent_keeps_from_removal_gives_the_next_step_no_turn(tmp_path):
    job = steps_job(tmp_path, ["stick", "second", "third"])
    done = (await runner.run_job(provider=make_provider("local", tmp_path / "data"), job=job,
                                 data_dir=tmp_path / "data")).done
    assert [(t.name, t.completed) for t in done.step_turns] == [("stick", True), ("second", False)]
    assert "could not be removed" in done.step_turns[1].reason
    assert "second.txt" not in done.diff  # no turn ran: the step is graded on the state the last one left
