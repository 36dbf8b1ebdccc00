"""mini-swe-agent, unmodified (its ``mini`` command from PyPI), in Arena's sandbox on the local
(bubblewrap) provider, through the real stack: its LLM calls go through Arena's proxy to the
scripted backend, which plays a multi-turn script of bash tool calls (or, in mini's text-based
mode, fenced commands); mini runs them in the sandbox and submits; Arena captures each call as
a step, verifies the workspace and keeps mini's own trajectory file as an artifact.

The scaffold's virtualenv is built once under ``.arena/scaffolds`` (``make scaffolds-venv``;
about 90 s on a fresh machine) and bound read-only into the sandboxes.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import msgspec
import pytest

from arena.datasets import checkout, mirror_of, read_rows, to_task
from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.bus import Bus
from arena_core.scaffolds import install
from arena_core.schemas import AgentSpec, Budget, PathSource, SamplingParams, ScaffoldSpec, Task, Trajectory
from arena_stack.stack import Stack, free_port_settings

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart"
SWEBENCH = ROOT / "examples" / "swebench-mini"
SCAFFOLDS = ROOT / ".arena" / "scaffolds"

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.timeout(900)]


def bash(thought: str, command: str) -> dict:
    """A turn of mini's default (tool-calling) mode: reasoning text and one bash tool call."""
    return {"content": f"THOUGHT: {thought}",
            "tool_calls": [{"name": "bash", "arguments": json.dumps({"command": command})}]}


def fenced(thought: str, command: str) -> dict:
    """A turn of mini's text-based mode: a THOUGHT and one ```mswea_bash_command block."""
    return {"content": f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```"}


SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
MEDIAN = "textstats/core.py"
FIX = r"sed -i 's/(ordered\[mid\] + ordered\[mid + 1\]) \/ 2/(ordered[mid - 1] + ordered[mid]) \/ 2/' " + MEDIAN
WRONG = r"sed -i 's/(ordered\[mid\] + ordered\[mid + 1\]) \/ 2/(ordered[mid - 1] + ordered[mid]) \/\/ 2/' " + MEDIAN
TESTS = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider tests"
HUMANIZE = "inflection/__init__.py"

# The scripted backend's plays: drawn by the rollout's seed among those whose `match` is in the
# task (weights 0.5/0.5: seed 0 draws the second, seed 1 the first, as in tests/e2e/test_stack.py).
SCRIPT = {"plays": [
    {"label": "right", "match": "textstats", "weight": 0.5, "turns": [
        bash("Read the median function.", f"cat {MEDIAN} | grep -n 'ordered'"),
        bash("The two middle values are at mid - 1 and mid; fix it and run the tests.", f"{FIX} && {TESTS}"),
        bash("The tests pass; submit.", SUBMIT),
    ]},
    {"label": "wrong", "match": "textstats", "weight": 0.5, "turns": [
        bash("Read the median function.", f"cat {MEDIAN} | grep -n 'ordered'"),
        bash("Use the middle pair.", f"{WRONG} && {TESTS}"),
        bash("Submit.", SUBMIT),
    ]},
    {"label": "inflection", "match": "humanize() eats", "turns": [
        fenced("Find where humanize strips _id.", f"grep -n '_id' {HUMANIZE}"),
        fenced("Anchor the regex at the end of the word.",
               f"sed -i 's/re.sub(r\"_id\", \"\", word)/re.sub(r\"_id$\", \"\", word)/' {HUMANIZE} && "
               "python -c 'import inflection; print(inflection.humanize(\"user_identity\"))'"),
        fenced("It prints User identity; submit.", SUBMIT),
    ]},
]}
TURNS = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    install.ensure("mini-swe-agent", SCAFFOLDS)  # cached after the first build
    data_dir = tmp_path_factory.mktemp("arena-mini")
    script = data_dir / "script.json"
    script.write_text(json.dumps(SCRIPT))
    settings = free_port_settings(data_dir, sandbox_concurrency=2, verify_concurrency=2)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ARENA_SCAFFOLDS_DIR", str(SCAFFOLDS))  # the sandbox service reads it at start
        stack = Stack(settings, llm_script=script, nats_sync="1s", log=lambda m: None)
        asyncio.run(stack.start())
    try:
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)
    finally:
        stack.stop()


def mini_task(task: Task, **config) -> Task:
    agent = AgentSpec(scaffold=ScaffoldSpec(name="mini-swe-agent", model="scripted", config=config))
    # mini's prompts are long (its instance template is ~4 KB): no token budget, a turn budget
    return msgspec.structs.replace(task, agent=agent, budget=Budget(max_turns=10, wall_clock_s=300))


def mini_trajectory(stack: Stack, traj: Trajectory) -> dict:
    """mini's own trajectory file, from the artifact store."""
    key = traj.sandbox.artifacts["mini-swe-agent.traj.json"]

    async def get() -> bytes:
        bus = await Bus.connect(stack.settings.nats_url, "test")
        try:
            return (await (await bus.artifacts()).get(key)).data
        finally:
            await bus.close()

    return json.loads(asyncio.run(get()))


def check_steps(traj: Trajectory, turns: int) -> None:
    """One captured step per turn, token ids from the backend, merged into one sequence."""
    assert len(traj.steps) == turns
    for step in traj.steps:
        assert step.token_ids_source == "backend" and step.policy_version == "0"
        assert len(step.completion_token_ids) == step.usage.completion_tokens == len(step.logprobs)
    # each call's prompt extends the one before with its answer and the command's output
    assert len(traj.sequences) == 1, traj.sequence_breaks
    (seq,) = traj.sequences
    assert seq.step_indexes == list(range(turns))
    assert len(seq.token_ids) == len(seq.loss_mask) == len(seq.logprobs)
    assert sum(seq.loss_mask) == sum(len(s.completion_token_ids) for s in traj.steps)
    assert len(seq.token_ids) == len(traj.steps[-1].prompt_token_ids) + len(traj.steps[-1].completion_token_ids)


def test_mini_swe_agent_solves_the_quickstart_task_and_a_wrong_script_scores_zero(stack):
    stack_, client = stack
    task = mini_task(load_task(QUICKSTART))
    started = time.monotonic()
    rids = [client.submit(task, sampling=SamplingParams(seed=seed)).rollout_id for seed in (1, 0)]
    views = [client.wait(rid, timeout=600) for rid in rids]
    elapsed = time.monotonic() - started
    assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
    assert [v.reward for v in views] == [1.0, 0.0]
    assert [v.steps for v in views] == [TURNS, TURNS]
    print(f"\ntwo quickstart rollouts with mini-swe-agent (concurrently): {elapsed:.1f} s")

    for view, expected in zip(views, ("(ordered[mid - 1] + ordered[mid]) / 2", "(ordered[mid - 1] + ordered[mid]) // 2"),
                              strict=True):
        traj = client.wait_trajectory(view.rollout_id, timeout=60)
        check_steps(traj, TURNS)
        assert f"+    return {expected}" in traj.sandbox.diff
        assert [c.name for s in traj.steps for c in s.tool_calls] == ["bash"] * TURNS
        assert traj.sandbox.result["exit_status"] == "Submitted" and traj.sandbox.result["api_calls"] == TURNS
        # mini really ran the commands in the sandbox: their outputs are in its own trajectory
        mini = mini_trajectory(stack_, traj)
        assert mini["info"]["exit_status"] == "Submitted"
        outputs = [m for m in mini["messages"] if m["role"] == "tool"]
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in outputs[0]["content"]  # cat | grep, before the fix
        assert ("7 passed" if view.reward == 1.0 else "failed") in outputs[1]["content"]  # pytest in the sandbox
        assert mini["info"]["config"]["environment"]["cwd"] == "/sandbox/workspace"
        assert "api_key" not in json.dumps(mini["info"]["config"]["model"])
        # the second call carried the first command's output back to the model
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in json.dumps(traj.steps[1].request_messages)


def test_mini_swe_agent_in_text_mode_solves_a_swebench_task(stack, tmp_path):
    _, client = stack
    row = next(r for r in read_rows(SWEBENCH / "dataset.jsonl") if r.instance_id == "jpvanhal__inflection-1")
    checkout(mirror_of(SWEBENCH / "repos", row.repo), row.base_commit, tmp_path / "repo")
    task = to_task(row, source=PathSource(path=str(tmp_path / "repo")), timeout_s=120)
    task = mini_task(task, config_files=["mini_textbased.yaml"], model={"model_class": "litellm_textbased"})
    started = time.monotonic()
    view = client.wait(client.submit(task).rollout_id, timeout=600)
    elapsed = time.monotonic() - started
    assert view.state.value == "completed", view.reason
    assert view.reward == 1.0 and view.steps == TURNS
    print(f"\nswebench-mini inflection-1 with mini-swe-agent (text mode): {elapsed:.1f} s")
    traj = client.wait_trajectory(view.rollout_id, timeout=60)
    check_steps(traj, TURNS)
    assert '+    word = re.sub(r"_id$", "", word)' in traj.sandbox.diff
    assert traj.verification.counts.f2p_failed == 0
    assert "User identity" in json.dumps(traj.steps[2].request_messages)  # the command's output, back to the model


def test_an_exhausted_turn_budget_ends_mini_at_once_without_retries(stack):
    """mini retries every error but a few (10 times, waiting 4-60 s between): the proxy's final
    refusal is a 403, which it does not retry, so a rollout over its turn budget ends at once."""
    _, client = stack
    task = mini_task(load_task(QUICKSTART))
    task = msgspec.structs.replace(task, budget=Budget(max_turns=2, wall_clock_s=300))
    started = time.monotonic()
    view = client.wait(client.submit(task, sampling=SamplingParams(seed=1)).rollout_id, timeout=600)
    elapsed = time.monotonic() - started
    assert view.state.value == "budget_exhausted", (view.state, view.reason)
    assert view.steps == 2 and "turn budget exhausted: 2 of 2" in view.reason
    assert elapsed < 60, f"mini took {elapsed:.1f} s to stop: it retried the refusal"
    traj = client.wait_trajectory(view.rollout_id, timeout=60)
    assert traj.reward is None and not traj.infrastructure and len(traj.steps) == 2  # never verified: no reward
