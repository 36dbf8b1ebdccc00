"""OpenHands, unmodified (the V1 CLI, PyPI ``openhands``), in Arena's sandbox on the local
(bubblewrap) provider, through the real stack: its LLM calls go through Arena's proxy to the
scripted backend, which plays OpenHands' own tools (``file_editor`` view and str_replace,
``terminal``, ``finish``: tests/e2e/openhands_plays.json); OpenHands runs them in the sandbox and
finishes; Arena captures each call as a step, verifies the workspace and keeps OpenHands' events
and conversation as artifacts.

The scaffold's virtualenv (~800 MB, Python 3.12, several minutes to build) is not part of
``make test``: ``make test-agents`` builds it (``python -m arena_core.scaffolds.install
openhands``) and runs this file; without it the tests are skipped.
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
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart"
SWEBENCH = ROOT / "examples" / "swebench-mini"
SCAFFOLDS = ROOT / ".arena" / "scaffolds"
#: The scripted backend's plays: quickstart right and wrong (drawn by the rollout's seed, weights
#: 0.5/0.5: seed 0 draws the second, seed 1 the first) and swebench-mini's inflection-1.
PLAYS = Path(__file__).with_name("openhands_plays.json")
TURNS = 4  # view, str_replace, terminal, finish
TOOLS = ["file_editor", "file_editor", "terminal", "finish"]

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.skipif(not install.installed("openhands", SCAFFOLDS),
                                 reason="no OpenHands virtualenv: python -m arena_core.scaffolds.install openhands"),
              pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-openhands")
    settings = Settings(
        nats_url=f"nats://127.0.0.1:{free_port()}",
        data_dir=str(data_dir),
        rollout_port=(rp := free_port()),
        trajectory_port=free_port(),
        public_url=f"http://127.0.0.1:{rp}",
        backend_url=f"http://127.0.0.1:{free_port()}/v1",
        backend_policy_version="0",
        sandbox_concurrency=2,
        verify_concurrency=2,
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ARENA_SCAFFOLDS_DIR", str(SCAFFOLDS))  # the sandbox service reads it at start
        stack = Stack(settings, llm_script=PLAYS, nats_sync="1s", log=lambda m: None)
        asyncio.run(stack.start())
    try:
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)
    finally:
        stack.stop()


def openhands_task(task: Task) -> Task:
    agent = AgentSpec(scaffold=ScaffoldSpec(name="openhands", model="scripted"))
    # its system prompt and tool schemas are long (~30 KB a call): no token budget, a turn budget
    return msgspec.structs.replace(task, agent=agent, budget=Budget(max_turns=10, wall_clock_s=300))


def artifact(stack: Stack, traj: Trajectory, name: str) -> bytes:
    key = traj.sandbox.artifacts[name]

    async def get() -> bytes:
        bus = await Bus.connect(stack.settings.nats_url, "test")
        try:
            return (await (await bus.artifacts()).get(key)).data
        finally:
            await bus.close()

    return asyncio.run(get())


def check_steps(traj: Trajectory, turns: int) -> None:
    """One captured step per turn, token ids from the backend, merged into one sequence."""
    assert len(traj.steps) == turns
    for step in traj.steps:
        assert step.token_ids_source == "backend" and step.policy_version == "0"
        assert len(step.completion_token_ids) == step.usage.completion_tokens == len(step.logprobs)
    # each call's prompt extends the one before with its answer and the tool's output
    assert len(traj.sequences) == 1, traj.sequence_breaks
    (seq,) = traj.sequences
    assert seq.step_indexes == list(range(turns))
    assert len(seq.token_ids) == len(seq.loss_mask) == len(seq.logprobs)
    assert sum(seq.loss_mask) == sum(len(s.completion_token_ids) for s in traj.steps)
    assert len(seq.token_ids) == len(traj.steps[-1].prompt_token_ids) + len(traj.steps[-1].completion_token_ids)


def observations(conversation: dict) -> list[str]:
    """The tools' outputs in OpenHands' own record, in order."""
    return ["".join(c.get("text", "") for c in e["observation"]["content"])
            for e in conversation["events"] if e.get("kind") == "ObservationEvent"]


def test_openhands_solves_the_quickstart_task_and_a_wrong_play_scores_zero(stack):
    stack_, client = stack
    task = openhands_task(load_task(QUICKSTART))
    started = time.monotonic()
    rids = [client.submit(task, sampling=SamplingParams(seed=seed)).rollout_id for seed in (1, 0)]
    views = [client.wait(rid, timeout=600) for rid in rids]
    elapsed = time.monotonic() - started
    assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
    assert [v.reward for v in views] == [1.0, 0.0]
    assert [v.steps for v in views] == [TURNS, TURNS]
    print(f"\ntwo quickstart rollouts with OpenHands (concurrently): {elapsed:.1f} s")

    for view, expected in zip(views, ("(ordered[mid - 1] + ordered[mid]) / 2", "(ordered[mid - 1] + ordered[mid]) // 2"),
                              strict=True):
        traj = client.wait_trajectory(view.rollout_id, timeout=60)
        check_steps(traj, TURNS)
        assert f"+    return {expected}" in traj.sandbox.diff
        assert [c.name for s in traj.steps for c in s.tool_calls] == TOOLS
        offered = {t["function"]["name"] for t in traj.steps[0].tools}
        assert {"terminal", "file_editor", "finish", "think"} <= offered, offered
        result = traj.sandbox.result
        assert result["execution_status"] == "finished" and result["exit_code"] == 0 and result["errors"] == []
        assert result["actions"] == TURNS and result["finish_message"] == "Fixed `median` for even-length lists."
        # OpenHands really ran the tools in the sandbox: their outputs are in its own record
        conversation = json.loads(artifact(stack_, traj, "openhands.conversation.json"))
        assert conversation["base_state"]["execution_status"] == "finished"
        assert conversation["base_state"]["agent"]["llm"]["api_key"] == "**********"  # masked by OpenHands
        outputs = observations(conversation)
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in outputs[0]  # the view, before the edit
        assert "has been edited" in outputs[1]
        terminal = [e for e in conversation["events"] if e.get("kind") == "ObservationEvent"][2]
        assert ("7 passed" if view.reward == 1.0 else "failed") in outputs[2], json.dumps(terminal)[:3000]
        events = artifact(stack_, traj, "openhands.events.jsonl").decode().splitlines()
        assert any('"FinishAction"' in line for line in events)
        # the second call carried the view's output back to the model
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in json.dumps(traj.steps[1].request_messages)


def test_openhands_solves_a_swebench_task(stack, tmp_path):
    _, client = stack
    row = next(r for r in read_rows(SWEBENCH / "dataset.jsonl") if r.instance_id == "jpvanhal__inflection-1")
    checkout(mirror_of(SWEBENCH / "repos", row.repo), row.base_commit, tmp_path / "repo")
    task = openhands_task(to_task(row, source=PathSource(path=str(tmp_path / "repo")), timeout_s=120))
    started = time.monotonic()
    view = client.wait(client.submit(task).rollout_id, timeout=600)
    elapsed = time.monotonic() - started
    assert view.state.value == "completed", view.reason
    assert view.reward == 1.0 and view.steps == TURNS
    print(f"\nswebench-mini inflection-1 with OpenHands: {elapsed:.1f} s")
    traj = client.wait_trajectory(view.rollout_id, timeout=60)
    check_steps(traj, TURNS)
    assert [c.name for s in traj.steps for c in s.tool_calls] == ["terminal", "file_editor", "terminal", "finish"]
    assert '+    word = re.sub(r"_id$", "", word)' in traj.sandbox.diff
    assert traj.verification.counts.f2p_failed == 0
    assert "User identity" in json.dumps(traj.steps[3].request_messages)  # the command's output, back to the model
