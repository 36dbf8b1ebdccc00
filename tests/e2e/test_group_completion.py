"""Group completion policies (first k of n, a deadline) and a rollout's hard lifetime through the real
stack: nats-server, the scripted LLM and the services as processes, a trainer on ``TrajectoryStream``.
Members a policy cancels are marked, reclaimed, and never reach the trainer as rewards."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import msgspec
import pytest

from arena.sdk import ArenaClient
from arena.stream import TrajectoryStream
from arena.tasks import load_task
from arena_core.schemas import GroupCompleted
from arena_stack.stack import Stack, free_port_settings

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

#: The quickstart agent, except that an agent the scripted LLM answered wrongly (seeds 0 and 2 of a
#: group submitted with seed 0) waits instead of finishing: the straggler a policy cuts off.
SLOW_WHEN_WRONG = """\
import sys, time
sys.path.insert(0, "/sandbox/agent")
import agent
answer = agent.chat
def chat(messages):
    content = answer(messages)
    if "]) // 2" in content:  # the wrong patch
        time.sleep(300)
    return content
agent.chat = chat
sys.exit(agent.main())
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-groups")
    settings = free_port_settings(data_dir, sandbox_concurrency=4, verify_concurrency=3)
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    try:
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key)
    finally:
        stack.stop()


#: The deadline test's group deadline, seconds.
DEADLINE_S = 40


def _slow_when_wrong(tmp_path: Path):
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    shutil.copy(QUICKSTART / "agent" / "agent.py", agent_dir / "agent.py")
    (agent_dir / "slow.py").write_text(SLOW_WHEN_WRONG)
    task = load_task(QUICKSTART)
    agent = msgspec.structs.replace(task.agent, path=str(agent_dir), command=["python3", "/sandbox/agent/slow.py"])
    return msgspec.structs.replace(task, id=f"stragglers-{tmp_path.name}"[:64], agent=agent)


async def _trainer_groups(stack: Stack, wanted: set[str], timeout: float = 60.0) -> dict[str, GroupCompleted]:
    """The groups ``wanted`` as a trainer reads them from the stream (partial ones too)."""
    got: dict[str, GroupCompleted] = {}

    async def read(stream: TrajectoryStream) -> None:
        async for batch in stream.groups(batch_size=1, max_wait=0.5):
            for group in batch:
                got[group.group_id] = group
            await batch.commit()
            if wanted <= set(got):
                return

    name = "t" + "-".join(sorted(wanted))[-40:]
    async with TrajectoryStream(stack.nats_url_for("trainer"), name=name, partial_groups="yield") as stream:
        await asyncio.wait_for(read(stream), timeout)
    return {gid: got[gid] for gid in wanted}


def _check_cancelled_members_never_reach_the_trainer(client, group: GroupCompleted, views, why: str) -> None:
    cancelled = [v for v in views if v.group_cancelled]
    for v in cancelled:
        assert v.state.value == "cancelled" and v.reward is None and why in v.reason, (v.state, v.reason)
        traj = client.wait_trajectory(v.rollout_id, timeout=30)
        # stored and marked, with no reward (never a 0); its sandbox was cancelled, not left running
        assert traj.group_cancelled and traj.reward is None and not traj.infrastructure
        if traj.sandbox is not None:
            assert traj.sandbox.outcome.value == "cancelled"
    members = {t.rollout_id for t in group.trajectories}
    assert members.isdisjoint(v.rollout_id for v in cancelled)
    assert sorted(group.cancelled_indexes) == sorted(v.group_index for v in cancelled)
    assert not any(t.group_cancelled for t in group.trajectories)
    assert len(group.rewards) == len(group.advantages) == len(group.trajectories)
    assert group.rewards == [t.reward for t in group.trajectories] and not group.partial


def test_first_k_of_n_cancels_the_stragglers_and_publishes_the_group_with_k(stack, tmp_path):
    st, client = stack
    group = client.submit_group(_slow_when_wrong(tmp_path), n=4, seed=0, first_k=2)
    views = [client.wait(rid, timeout=120) for rid in group.rollout_ids]
    # seeds 1 and 3 get the right patch and finish (reward 1); 0 and 2 wait, cancelled once 1 and 3 scored
    assert [v.state.value for v in views] == ["cancelled", "completed", "cancelled", "completed"], \
        [(v.state, v.reason) for v in views]
    assert [v.group_cancelled for v in views] == [True, False, True, False]
    assert [v.reward for v in views] == [None, 1.0, None, 1.0]
    assert "the first 2 of 4 members ended with a reward" in views[0].reason

    published = asyncio.run(_trainer_groups(st, {group.group_id}))[group.group_id]
    assert [t.group_index for t in published.trajectories] == [1, 3]
    assert published.rewards == [1.0, 1.0] and published.cancelled_indexes == [0, 2]
    _check_cancelled_members_never_reach_the_trainer(client, published, views, "first 2 of 4")


def test_a_deadline_cancels_the_unfinished_and_publishes_those_that_finished(stack, tmp_path):
    st, client = stack
    # 40 s: the two right members end well within it, even on a loaded machine where the members wait
    # for the slots the last test's cancelled stragglers still hold (at 15 s none had ended once)
    group = client.submit_group(_slow_when_wrong(tmp_path), n=4, seed=0, deadline_s=DEADLINE_S)
    views = [client.wait(rid, timeout=180) for rid in group.rollout_ids]
    assert [v.state.value for v in views] == ["cancelled", "completed", "cancelled", "completed"], \
        [(v.state, v.reason) for v in views]
    assert f"deadline of {DEADLINE_S} s after submission passed with 2 of 4 members ended" in views[0].reason
    cancelled_at = views[0].history[-1].at
    assert cancelled_at - views[0].created_at >= DEADLINE_S - 0.5  # not before the deadline

    published = asyncio.run(_trainer_groups(st, {group.group_id}))[group.group_id]
    assert [t.group_index for t in published.trajectories] == [1, 3] and published.cancelled_indexes == [0, 2]
    _check_cancelled_members_never_reach_the_trainer(client, published, views, f"deadline of {DEADLINE_S} s")


def test_a_policy_outside_one_to_n_is_refused(stack):
    _, client = stack
    from arena_core.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"completion.first_k must be between 1 and n \(2\), got 3"):
        client.submit_group(load_task(QUICKSTART), n=2, first_k=3)


def test_a_rollout_past_its_hard_lifetime_is_ended_and_what_it_holds_reclaimed(stack):
    """The agent finishes at once, its verification takes 40 s: at 15 s from submission (room for
    the agent's run on a loaded host) the rollout is ended while verifying (an infrastructure
    outcome, no reward) and its verification abandoned."""
    _, client = stack
    task = load_task(QUICKSTART)
    verifier = msgspec.structs.replace(task.verifier, command="sleep 40; " + task.verifier.command)
    budget = msgspec.structs.replace(task.budget, wall_clock_s=12, max_lifetime_s=15)
    task = msgspec.structs.replace(task, id="lifetime", verifier=verifier, budget=budget)
    view = client.wait(client.submit(task).rollout_id, timeout=90)
    assert view.state.value == "timed_out" and view.infrastructure and view.reward is None, (view.state, view.reason)
    assert "hard lifetime exceeded" in view.reason and "(limit 15 s, queue + run + verify) while verifying" in view.reason
    assert view.history[-1].at - view.created_at < 15 + 5
    traj = client.wait_trajectory(view.rollout_id, timeout=30)
    assert traj.final_state.value == "timed_out" and traj.infrastructure and traj.reward is None
    # the verification it held is abandoned at once (its sandbox killed), not run to its end
    stack_, _ = stack
    log = stack_.data_dir / "logs" / "verification.log"
    until = time.monotonic() + 10
    while time.monotonic() < until and not _abandoned(log, view.rollout_id):
        time.sleep(0.2)
    assert _abandoned(log, view.rollout_id), log.read_text()[-2000:]


def _abandoned(log: Path, rollout_id: str) -> bool:
    return any("verification abandoned" in line and rollout_id in line
               for line in log.read_text().splitlines()) if log.exists() else False
