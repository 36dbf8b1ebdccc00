"""Harbor's Terminus-2, unmodified (PyPI ``harbor``), in Arena's sandbox on the local (bubblewrap)
provider, through the real stack: its LLM calls go through Arena's proxy to the scripted backend,
which plays JSON answers (analysis, plan, keystrokes for its tmux session, task_complete); Terminus-2
types them into tmux in the sandbox and confirms the task complete; Arena captures each call as a
step, verifies the workspace and keeps Terminus-2's own records (ATIF trajectory, rollout details).

Its virtualenv (harbor on Python 3.12, ~3 min to build) is not part of ``make test``: the test is
skipped unless ``python -m arena_core.scaffolds.install terminus-2`` has run (``make test-agents``).
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
PLAYS = Path(__file__).with_name("plays") / "terminus2_quickstart.json"
#: swebench-mini's jpvanhal__inflection-1: grep, the sed fix and the issue's example, task_complete twice.
INFLECTION_PLAYS = Path(__file__).with_name("plays") / "terminus2_inflection.json"
SCAFFOLDS = ROOT / ".arena" / "scaffolds"
#: The plays' turns: look, fix and test, task_complete, task_complete again (Terminus-2 asks to confirm).
TURNS = 4


def script(directory: Path) -> Path:
    """The scripted backend's plays: the quickstart's (right and wrong, drawn by the seed) and
    inflection-1's (its own ``match``), in one file."""
    plays = [p for f in (PLAYS, INFLECTION_PLAYS) for p in json.loads(f.read_text())["plays"]]
    path = directory / "terminus2_plays.json"
    path.write_text(json.dumps({"plays": plays}))
    return path


def _installed() -> bool:
    try:
        return install.installed("terminus-2", SCAFFOLDS)
    except ValueError:
        return False


pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    pytest.mark.skipif(not _installed(), reason="terminus-2 is not installed "
                       "(python -m arena_core.scaffolds.install terminus-2, or make test-agents)"),
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-terminus2")
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
        stack = Stack(settings, llm_script=script(data_dir), nats_sync="1s", log=lambda m: None)
        asyncio.run(stack.start())
    try:
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)
    finally:
        stack.stop()


def terminus_task(task: Task, **config) -> Task:
    agent = AgentSpec(scaffold=ScaffoldSpec(name="terminus-2", model="scripted", config=config))
    # its prompt (~3 KB) comes back with every call: a turn budget, no token budget
    return msgspec.structs.replace(task, agent=agent, budget=Budget(max_turns=10, wall_clock_s=300))


def artifact(stack: Stack, traj: Trajectory, name: str):
    key = traj.sandbox.artifacts[name]

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
        assert step.api == "openai.chat" and step.token_ids_source == "backend" and step.policy_version == "0"
        assert len(step.completion_token_ids) == step.usage.completion_tokens == len(step.logprobs)
    # each call's messages extend the one before with its answer and the terminal's output
    assert len(traj.sequences) == 1, traj.sequence_breaks
    (seq,) = traj.sequences
    assert seq.step_indexes == list(range(turns))
    assert len(seq.token_ids) == len(seq.loss_mask) == len(seq.logprobs)
    assert sum(seq.loss_mask) == sum(len(s.completion_token_ids) for s in traj.steps)
    assert len(seq.token_ids) == len(traj.steps[-1].prompt_token_ids) + len(traj.steps[-1].completion_token_ids)


def test_terminus2_solves_the_quickstart_task_and_a_wrong_play_scores_zero(stack):
    stack_, client = stack
    task = terminus_task(load_task(QUICKSTART))
    started = time.monotonic()
    rids = [client.submit(task, sampling=SamplingParams(seed=seed)).rollout_id for seed in (1, 0)]
    views = [client.wait(rid, timeout=600) for rid in rids]
    elapsed = time.monotonic() - started
    assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
    assert [v.reward for v in views] == [1.0, 0.0]
    assert [v.steps for v in views] == [TURNS, TURNS]
    print(f"\ntwo quickstart rollouts with Terminus-2 (concurrently): {elapsed:.1f} s")

    for view, expected in zip(views, ("(ordered[mid - 1] + ordered[mid]) / 2", "(ordered[mid - 1] + ordered[mid]) // 2"),
                              strict=True):
        traj = client.wait_trajectory(view.rollout_id, timeout=60)
        check_steps(traj, TURNS)
        seq = traj.sequences[0]
        print(f"{view.rollout_id}: reward {view.reward}, {len(traj.steps)} steps, one sequence of "
              f"{len(seq.token_ids)} tokens, loss mask {sum(seq.loss_mask)}")
        assert f"+    return {expected}" in traj.sandbox.diff
        assert traj.sandbox.result["task_complete"] is True and traj.sandbox.result["error"] is None
        assert traj.sandbox.result["episodes"] == TURNS
        # Terminus-2 asked for token ids and logprobs (collect_rollout_details): the proxy passed
        # the backend's through, the same ids it captured
        details = artifact(stack_, traj, "terminus-2.rollout-details.json")
        assert len(details) == 1
        assert details[0]["completion_token_ids"] == [s.completion_token_ids for s in traj.steps]
        assert details[0]["prompt_token_ids"] == [s.prompt_token_ids for s in traj.steps]
        # its ATIF trajectory: the keystrokes went to tmux in the sandbox, the pane came back
        atif = artifact(stack_, traj, "terminus-2.trajectory.json")
        agent_steps = [s for s in atif["steps"] if s["source"] == "agent"]
        assert len(agent_steps) == TURNS
        first, *later = (json.dumps(s["observation"]) for s in agent_steps)
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in first  # grep, before the fix
        # pytest in the sandbox's tmux: the play waits 20 s for it (a slow start under load)
        assert ("7 passed" if view.reward == 1.0 else "failed") in "".join(later)
        # the second call carried the pane back to the model
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in json.dumps(traj.steps[1].request_messages)


def test_terminus2_solves_a_swebench_task(stack, tmp_path):
    stack_, client = stack
    row = next(r for r in read_rows(SWEBENCH / "dataset.jsonl") if r.instance_id == "jpvanhal__inflection-1")
    checkout(mirror_of(SWEBENCH / "repos", row.repo), row.base_commit, tmp_path / "repo")
    task = terminus_task(to_task(row, source=PathSource(path=str(tmp_path / "repo")), timeout_s=120))
    started = time.monotonic()
    view = client.wait(client.submit(task).rollout_id, timeout=600)
    elapsed = time.monotonic() - started
    assert view.state.value == "completed", view.reason
    assert view.reward == 1.0 and view.steps == TURNS
    traj = client.wait_trajectory(view.rollout_id, timeout=60)
    check_steps(traj, TURNS)  # one training sequence, the loss mask exactly the completions
    seq = traj.sequences[0]
    print(f"\nswebench-mini inflection-1 with Terminus-2: {elapsed:.1f} s, {len(traj.steps)} steps, one sequence of "
          f"{len(seq.token_ids)} tokens, loss mask {sum(seq.loss_mask)}")
    assert '+    word = re.sub(r"_id$", "", word)' in traj.sandbox.diff
    assert traj.verification.counts.f2p_failed == 0
    assert traj.sandbox.result["task_complete"] is True and traj.sandbox.result["episodes"] == TURNS
    # the example ran in the sandbox's tmux: its output is in the pane Terminus-2 read
    atif = artifact(stack_, traj, "terminus-2.trajectory.json")
    agent_steps = [s for s in atif["steps"] if s["source"] == "agent"]
    assert "word = re.sub(r" in json.dumps(agent_steps[0]["observation"])  # grep's line, before the fix
    assert "User identity" in json.dumps(agent_steps[1]["observation"])
    assert "User identity" in json.dumps(traj.steps[2].request_messages[-1])  # and back to the model
