"""Infrastructure faults are not rewards: the rollout service (the LLM proxy) is killed with
SIGKILL while quickstart agents in real sandboxes (local provider, bubblewrap) wait on their LLM
call (a scripted LLM that answers after a delay), and the stack's supervisor restarts it. An agent
whose call was cut exits without ``done``; its rollout must end as an infrastructure outcome
(``failed``, ``infrastructure``, reward None, its trajectory out of the group's advantages),
never as a ``failed`` with reward 0 blamed on the policy. Keys on and off (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.schemas import RolloutState
from arena_core.settings import Settings
from arena_sandbox_providers import local
from arena_stack.natsserver import free_port, wait_port
from arena_stack.stack import Stack

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
ROLLOUTS = 4
LLM_DELAY_MS = 20_000  # a call not cut waits this long: the kill lands well inside it

pytestmark = [
    pytest.mark.skipif(local.available() is not None, reason=f"no bubblewrap: {local.available()}"),
    pytest.mark.timeout(600),
]


def _slow_llm(port: int, log_path: Path) -> subprocess.Popen:
    """The quickstart's scripted LLM answering each call after LLM_DELAY_MS."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "arena_stack.scripted_llm", "--script",
                                 str(QUICKSTART / "llm_script.json"), "--port", str(port),
                                 "--latency-ms", str(LLM_DELAY_MS)], stdout=log, stderr=log)
    try:
        wait_port("127.0.0.1", port, 30, proc)
    except BaseException:
        _stop(proc)
        raise
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _connections_to(port: int) -> int:
    """Established TCP connections whose server end is ``port`` on this host (the proxy's calls
    held open at the scripted LLM while it waits out its delay)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


async def _get(client: ArenaClient, rollout_id: str):
    """The rollout's view, waiting out the rollout service's restart."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return await asyncio.to_thread(client.get, rollout_id)
        except Exception:  # noqa: BLE001 - the service is restarting
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


@pytest.mark.parametrize("auth", ["keys", "off"])
async def test_calls_cut_by_a_killed_proxy_end_as_infrastructure_outcomes_without_reward(tmp_path, auth):
    llm_port, rp = free_port(), free_port()
    llm = await asyncio.to_thread(_slow_llm, llm_port, tmp_path / "llm.log")
    settings = Settings(
        allow_host_paths=True, auth=auth,
        nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
        rollout_port=rp, trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
        backend_url=f"http://127.0.0.1:{llm_port}/v1", backend_policy_version="0",
        sandbox_provider="local", sandbox_concurrency=ROLLOUTS, verify_concurrency=1,
    )
    stack = Stack(settings, nats_sync="1s", log=lambda m: None)
    stop = asyncio.Event()
    supervisor: asyncio.Task | None = None
    client: ArenaClient | None = None
    try:
        await stack.start(timeout=120)
        client = ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key, timeout=30)
        supervisor = asyncio.create_task(stack.supervise(stop, interval=0.5))
        task = load_task(QUICKSTART / "task.json")
        group = await asyncio.to_thread(client.submit_group, task, n=ROLLOUTS, seed=0)
        ids = group.rollout_ids
        deadline = time.monotonic() + 90
        while _connections_to(llm_port) < ROLLOUTS:  # every agent's call is at the LLM, waiting
            assert time.monotonic() < deadline, "the agents' calls never all reached the LLM"
            await asyncio.sleep(0.1)
        rollout = next(c for c in stack.children if c.name == "rollout")
        os.kill(rollout.pid, signal.SIGKILL)

        views = {}
        deadline = time.monotonic() + 240
        while len(views) < len(ids):
            assert time.monotonic() < deadline, f"not final: {set(ids) - set(views)}"
            for rid in ids:
                if rid not in views and (view := await _get(client, rid)).state.is_final:
                    views[rid] = view
            await asyncio.sleep(0.5)
        trajectories = {rid: await asyncio.to_thread(client.wait_trajectory, rid, timeout=120) for rid in ids}
        members = await asyncio.to_thread(client.group, group.group_id)
    finally:
        stop.set()
        if supervisor is not None:
            await supervisor
        if client is not None:
            client.close()
        stack.stop()
        _stop(llm)

    cut = [rid for rid in ids if trajectories[rid].sandbox is not None and trajectories[rid].sandbox.proxy_fault]
    # every call was in flight at the LLM when the proxy died: every one was cut
    assert sorted(cut) == sorted(ids), {rid: (v.state, v.reason) for rid, v in views.items()}
    for rid in ids:
        view, trajectory = views[rid], trajectories[rid]
        # no rollout of this run is a failure with reward 0: the policy never failed here
        assert not (view.state is RolloutState.FAILED and view.reward == 0), (rid, view.reason)
        assert not (trajectory.final_state is RolloutState.FAILED and trajectory.reward == 0), (rid, trajectory.reason)
    for rid in cut:
        view, trajectory = views[rid], trajectories[rid]
        assert view.state is RolloutState.FAILED and view.infrastructure, (rid, view.state, view.reason)
        assert view.reward is None and trajectory.reward is None and trajectory.infrastructure, (rid, view.reason)
        assert view.reason.startswith("infrastructure: "), view.reason
        assert "cut on Arena's side" in view.reason, view.reason
        assert trajectory.sandbox.outcome.value == "error"
    # out of the group's advantages: no reward, an advantage of 0
    by_member = dict(zip(members["rollout_ids"], zip(members["rewards"], members["advantages"])))
    for rid in cut:
        assert by_member[rid] == (None, 0.0), (rid, by_member)
