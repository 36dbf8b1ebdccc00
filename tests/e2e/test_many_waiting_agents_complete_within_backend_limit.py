"""Many agents waiting on a slow backend at once, through the real stack: every rollout completes
with reward 1, and the proxy keeps the backend at its in-flight limit or below while the rest
queue (the stand-in backend has no bound of its own here, so any excess would reach it). No
timing is asserted; benchmarks/density.py measures the same workload (docs/performance.md)."""

from __future__ import annotations

import asyncio
import shutil

import msgspec
import pytest

from arena.sdk import ArenaClient
from arena_core.schemas import RolloutState
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack
from arena_stack.waiting_agents import StandInBackend, agent_env, waiting_task, write_agent

AGENTS, TURNS, LATENCY_S, LIMIT = 128, 2, 0.2, 8

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


async def test_many_waiting_agents_complete_and_the_backend_never_sees_more_than_its_limit(tmp_path):
    agent_dir = write_agent(tmp_path / "agent")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("a task whose agent mostly waits\n")
    with StandInBackend(free_port(), median_s=LATENCY_S, limit=0, log=tmp_path / "backend.log") as backend:
        rp = free_port()
        # sandbox concurrency is Arena's default (sized from the host's memory): the rollouts
        # that do not fit wait in the queue, which changes nothing asserted here
        settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                            rollout_port=rp, trajectory_port=free_port(), dashboard_port=free_port(),
                            public_url=f"http://127.0.0.1:{rp}", backend_url=backend.url,
                            backend_policy_version="0", backend_max_inflight=LIMIT, allow_host_paths=True)
        stack = Stack(settings, log=lambda m: None)
        await stack.start()
        client = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)
        try:
            task = client.prepare(waiting_task(repo, agent_dir, index=0, turns=TURNS, wall_clock_s=300))

            def submit_all() -> list[str]:
                return [client.submit(msgspec.structs.replace(
                    task, agent=msgspec.structs.replace(task.agent, env=agent_env(i, TURNS)))).rollout_id
                    for i in range(AGENTS)]

            rids = await asyncio.to_thread(submit_all)
            finals = await asyncio.to_thread(lambda: [client.wait(rid, timeout=300) for rid in rids])
        finally:
            client.close()
            stack.stop()
        stats = backend.stats()
    assert [(v.state, v.reward) for v in finals] == [(RolloutState.COMPLETED, 1.0)] * AGENTS, \
        [(v.state, v.reason) for v in finals if v.state is not RolloutState.COMPLETED][:5]
    assert len(stats.calls) == AGENTS * TURNS
    assert {(c.agent, c.turn) for c in stats.calls} == {(str(i), t) for i in range(AGENTS) for t in range(TURNS)}
    assert stats.max_seen <= LIMIT
