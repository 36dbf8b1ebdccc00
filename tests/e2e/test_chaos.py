"""The chaos run (``make test-chaos``): 100 quickstart rollouts on the local provider while each
service in turn, and nats-server once, is killed with SIGKILL and restarted by ``arena up``'s
supervisor. Every rollout must reach a final state, every trajectory be stored exactly once, no
sandbox process or scratch directory be left, and no reward be written for an agent that never
ran. Opt-in (minutes on two cores): ``ARENA_CHAOS=1``; figures go to stdout (``-s``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import msgspec
import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core import apikeys
from arena_core.schemas import RolloutState
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

from tests.e2e.test_stack import processes_mentioning

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
ROLLOUTS, GROUP = 100, 4

pytestmark = [
    pytest.mark.skipif(not os.environ.get("ARENA_CHAOS"), reason="the chaos run is opt-in: make test-chaos"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
    pytest.mark.timeout(1800),
]


async def test_a_hundred_rollouts_survive_every_service_and_nats_being_killed(tmp_path):
    data = tmp_path / "arena"
    rp = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data), rollout_port=rp,
                        trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0",
                        sandbox_concurrency=4, verify_concurrency=2, queue_timeout_s=600)
    logged: list[str] = []
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=logged.append)
    await stack.start()
    stop = asyncio.Event()
    supervisor = asyncio.create_task(stack.supervise(stop, interval=0.5))
    client = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=60.0, api_key=stack.api_key)
    started = time.monotonic()
    try:
        task = load_task(QUICKSTART / "task.json")
        groups = [await asyncio.to_thread(client.submit_group, task, n=GROUP, seed=g) for g in range(ROLLOUTS // GROUP)]
        ids = [rid for g in groups for rid in g.rollout_ids]
        assert len(ids) == ROLLOUTS
        kills = []
        for name in ("sandbox", "verification", "trajectory", "rollout", "nats-server"):
            await asyncio.sleep(8)
            if name == "nats-server":
                pid = stack.nats.proc.pid
            else:
                pid = next(c.pid for c in stack.children if c.name == name)
            os.kill(pid, signal.SIGKILL)
            kills.append((name, round(time.monotonic() - started, 1)))

        finals: dict[str, object] = {}
        deadline = time.monotonic() + 1200
        while len(finals) < ROLLOUTS and time.monotonic() < deadline:
            for rid in ids:
                if rid in finals:
                    continue
                try:
                    view = await asyncio.to_thread(client.get, rid)
                except Exception:  # noqa: BLE001 - the rollout service is restarting
                    await asyncio.sleep(1)
                    break
                if view.state.is_final:
                    finals[rid] = view
            await asyncio.sleep(1)
        assert len(finals) == ROLLOUTS, f"{ROLLOUTS - len(finals)} rollouts never reached a final state"

        trajectories = {}
        for rid in ids:
            trajectories[rid] = await asyncio.to_thread(client.wait_trajectory, rid, timeout=300)
        async with httpx.AsyncClient(timeout=30, headers=apikeys.auth_headers(stack.api_key)) as http:
            counts = (await http.get(f"{settings.trajectory_url}/v1/counts", params={"table": "trajectories"})).json()
        states = Counter(v.state.value for v in finals.values())
        never_ran = [v for v in finals.values() if not any(h.to_state == RolloutState.RUNNING for h in v.history)]
        elapsed = time.monotonic() - started
        print(f"\nchaos run: {ROLLOUTS} rollouts in {elapsed:.0f} s; kills at {kills}; final states {dict(states)}; "
              f"never ran {len(never_ran)}; infrastructure {sum(v.infrastructure for v in finals.values())}; "
              f"trajectories stored {counts}; restarts {[line.split(';')[0] for line in logged if 'restarting' in line]}")
        # stored exactly once: the store's count (FINAL) equals the rollouts, each one found
        assert counts["trajectories"] == ROLLOUTS, counts
        assert set(trajectories) == set(ids)
        # no reward for an agent that never ran
        for v in never_ran:
            assert v.reward is None and trajectories[v.rollout_id].reward is None, msgspec.json.encode(v)
        for rid, t in trajectories.items():
            assert t.infrastructure == finals[rid].infrastructure
            if finals[rid].state == RolloutState.COMPLETED:  # the verifier's reward, stored as given
                assert t.reward == finals[rid].reward
        # the supervisor restarted each killed component
        for name, _ in kills:
            assert any(line.startswith(name) and ("restarting" in line or "exited" in line) for line in logged), name
    finally:
        client.close()
        stop.set()
        await supervisor
        stack.stop()
    # nothing left: no sandbox process, no sandbox or verification scratch
    assert processes_mentioning(str(data)) == []
    leftovers = [p for p in (data / "sandboxes").rglob("*") if p.is_dir()] if (data / "sandboxes").exists() else []
    assert [p for p in leftovers if p.parent.parent == data / "sandboxes"] == []
    assert not (data / "verify").exists() or list((data / "verify").iterdir()) == []
