"""End to end: a real nats-server, the scripted LLM and the four services as separate
processes (the same ``Stack`` that ``arena up`` runs), driven through the HTTP API."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import msgspec
import pytest

from arena.sdk import ArenaClient
from arena_stack.stack import Stack, free_port_settings
from arena.tasks import load_task

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def processes_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry))
    return pids


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-e2e")
    settings = free_port_settings(data_dir, sandbox_concurrency=4, verify_concurrency=2)
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    pids = [c.pid for c in stack.children] + [stack.nats.proc.pid]
    try:
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key)
    finally:
        stack.stop()
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        assert processes_mentioning(str(data_dir)) == [], "something the stack started is still running"


def test_a_group_of_four_runs_end_to_end(stack):
    _, client = stack
    task = load_task(QUICKSTART)
    group = client.submit_group(task, n=4, seed=0)
    views = [client.wait(rid, timeout=120) for rid in group.rollout_ids]
    assert [v.state.value for v in views] == ["completed"] * 4, [(v.state, v.reason) for v in views]
    # the scripted LLM answers seeds 1 and 3 with the right patch, 0 and 2 with a wrong one
    assert [v.reward for v in views] == [0.0, 1.0, 0.0, 1.0]
    for v in views:
        assert [h.to_state.value for h in v.history] == ["pending", "provisioning", "running", "verifying",
                                                         "completed"]
        assert v.steps == 1

    trajectories = [client.wait_trajectory(rid, timeout=30) for rid in group.rollout_ids]
    for view, traj in zip(views, trajectories, strict=True):
        assert traj.final_state.value == "completed" and traj.reward == view.reward
        assert traj.group_id == group.group_id and traj.group_size == 4
        assert len(traj.steps) == 1
        step = traj.steps[0]
        assert step.token_ids_source == "backend"
        assert len(step.completion_token_ids) == step.usage.completion_tokens == len(step.logprobs)
        assert len(step.prompt_token_ids) == step.usage.prompt_tokens
        assert step.policy_version == "0"
        assert traj.sandbox is not None and traj.sandbox.outcome.value == "completed"
        assert traj.sandbox.diff.startswith("diff --git")
        assert traj.verification is not None and traj.verification.reward == view.reward

    summary = client.group(group.group_id)
    assert summary["rewards"] == [0.0, 1.0, 0.0, 1.0]
    assert [round(a, 3) for a in summary["advantages"]] == [-1.0, 1.0, -1.0, 1.0]


def _task_with_agent(tmp_path: Path, name: str, source: str, wall_clock_s: float):
    agent_dir = tmp_path / name
    agent_dir.mkdir()
    (agent_dir / "agent.py").write_text(source)
    task = load_task(QUICKSTART)
    agent = msgspec.structs.replace(task.agent, path=str(agent_dir))
    budget = msgspec.structs.replace(task.budget, wall_clock_s=wall_clock_s)
    return msgspec.structs.replace(task, id=f"bad-{name}", agent=agent, budget=budget)


def test_an_agent_that_never_writes_done_times_out(stack, tmp_path):
    _, client = stack
    task = _task_with_agent(tmp_path, "sleeper", "import time\nwhile True:\n    time.sleep(1)\n", wall_clock_s=2)
    view = client.wait(client.submit(task).rollout_id, timeout=60)
    assert view.state.value == "timed_out"
    assert "wall clock" in view.reason
    traj = client.wait_trajectory(view.rollout_id, timeout=30)
    # never verified: no reward, the same in the rollout view (`arena status` shows "-") and the
    # stored trajectory, and not an infrastructure outcome (docs/trajectory.md, One meaning of reward)
    assert traj.final_state.value == "timed_out" and traj.reward is None and traj.verification is None
    assert view.reward is None and not traj.infrastructure and not view.infrastructure


def test_an_agent_that_crashes_fails_with_its_exit_code_and_log(stack, tmp_path):
    _, client = stack
    task = _task_with_agent(tmp_path, "crasher", "import sys\nprint('about to crash', file=sys.stderr)\n"
                                                 "raise SystemExit(3)\n", wall_clock_s=30)
    view = client.wait(client.submit(task).rollout_id, timeout=60)
    assert view.state.value == "failed"
    assert "code 3" in view.reason and "about to crash" in view.reason
    traj = client.wait_trajectory(view.rollout_id, timeout=30)
    assert traj.final_state.value == "failed" and traj.sandbox.exit_code == 3


def test_an_agent_that_writes_done_then_crashes_has_its_verifiers_reward_everywhere(stack, tmp_path):
    """One meaning of reward on the real stack: verified despite its exit code, the rollout view,
    the stored trajectory, the trajectory listing and the GRPO export all hold the verifier's."""
    _, client = stack
    task = _task_with_agent(tmp_path, "done-then-crash", "import pathlib\n"
                            "pathlib.Path('/sandbox/.arena/done').write_text('')\nraise SystemExit(3)\n",
                            wall_clock_s=30)
    view = client.wait(client.submit(task).rollout_id, timeout=120)
    assert view.state.value == "completed" and "exited with code 3" in view.history[-2].reason
    traj = client.wait_trajectory(view.rollout_id, timeout=30)
    assert traj.verification is not None and traj.reward == traj.verification.reward == view.reward
    listed = client._traj.get("/v1/trajectories", params={"task_id": task.id}).json()["trajectories"]
    assert [(t["rollout_id"], t["reward"]) for t in listed] == [(view.rollout_id, view.reward)]


def test_cancel_stops_a_running_sandbox(stack, tmp_path):
    _, client = stack
    task = _task_with_agent(tmp_path, "waiter", "import time\ntime.sleep(60)\n", wall_clock_s=60)
    rid = client.submit(task).rollout_id
    for _ in range(100):
        if client.get(rid).state.value == "running":
            break
        asyncio.run(asyncio.sleep(0.05))
    assert client.cancel(rid).state.value == "cancelled"
    traj = client.wait_trajectory(rid, timeout=30)
    assert traj.final_state.value == "cancelled" and traj.reward is None  # never verified: no reward


def test_a_submission_to_a_provider_nobody_serves_is_refused_at_once(stack):
    """This stack's sandbox service serves ``local`` only: ``docker`` is refused with a clear
    error at submission, not left queued until its queue limit (arena_core.workers)."""
    import time

    from arena_core.errors import ProviderUnserved

    _, client = stack
    task = load_task(QUICKSTART)
    started = time.monotonic()
    with pytest.raises(ProviderUnserved, match="no sandbox worker serves provider 'docker'.*served now: local"):
        client.submit(task, provider="docker")
    assert time.monotonic() - started < 5
    assert client.submit(task, provider="local").rollout_id  # the served one is taken
