"""Admission holds under concurrency: 300 rollouts fired at once as 75 concurrent group POSTs
of 4, at a cold start, against the real stack (nats-server, the four services, bubblewrap
sandboxes, 8 sandbox slots: fewer than a host sized from memory has, so the queue must hold
back most of the burst) with a short queue limit. What the queue cannot start in
time is refused with 429 and Retry-After, and none of what was admitted expires in the queue.
Before the fix every POST read the same empty queue and all 300 were admitted."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import msgspec
import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core import apikeys
from arena_core.bus import Bus
from arena_core.schemas import Budget, RolloutState
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
GROUPS, SIZE = 75, 4
QUEUE_TIMEOUT_S, WALL_CLOCK_S = 30, 10.0

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.timeout(600)]


async def test_300_rollouts_at_once_get_429s_and_none_expires_in_the_queue(tmp_path):
    rp = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"), rollout_port=rp,
                        trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}", auth="keys",
                        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0",
                        queue_timeout_s=QUEUE_TIMEOUT_S, sandbox_concurrency=8)
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    await stack.start()
    try:
        bus = await Bus.connect(stack.settings.nats_url, "test-admin")
        try:
            key, _ = await apikeys.issue(bus, "burst", ["submit", "read"])
        finally:
            await bus.close()
        await asyncio.sleep(0.5)  # the services' key watches see it
        task = msgspec.structs.replace(load_task(QUICKSTART / "task.json"),
                                       budget=Budget(max_turns=4, max_total_tokens=8192, wall_clock_s=WALL_CLOCK_S))
        with ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=key) as client:
            body = {"task": msgspec.to_builtins(await asyncio.to_thread(client.prepare, task)), "n": SIZE}
        headers = {"authorization": f"Bearer {key}"}
        limits = httpx.Limits(max_connections=GROUPS, max_keepalive_connections=GROUPS)
        async with httpx.AsyncClient(base_url=settings.rollout_url, headers=headers, timeout=120,
                                     limits=limits) as http:
            answers = await asyncio.gather(*(http.post("/v1/rollout-groups", json={**body, "sampling": {"seed": g}})
                                             for g in range(GROUPS)))
            admitted = [rid for a in answers if a.status_code == 201 for rid in a.json()["rollout_ids"]]
            refused = [a for a in answers if a.status_code == 429]
            assert len(admitted) + SIZE * len(refused) == GROUPS * SIZE, \
                sorted({(a.status_code, a.text[:200]) for a in answers if a.status_code not in (201, 429)})
            assert refused, "every one of 300 rollouts was admitted at once"
            assert admitted, "nothing was admitted"
            for answer in refused:
                assert answer.json()["error"]["code"] == "overloaded"
                assert int(answer.headers["retry-after"]) >= 1

            finals = []
            for rid in admitted:
                got = await http.get(f"/v1/rollouts/{rid}/wait", params={"timeout": 300}, timeout=330)
                assert got.status_code == 200, got.text
                finals.append(got.json())
        expired = [(v["rollout_id"], v["reason"]) for v in finals
                   if "never ran" in v["reason"] or "in the queue" in v["reason"]]
        assert not expired, expired
        assert all(RolloutState(v["state"]).is_final for v in finals)
        ran = [v for v in finals if any(h["to_state"] == "running" for h in v.get("history", []))]
        assert len(ran) == len(admitted), [(v["state"], v["reason"]) for v in finals if v not in ran]
    finally:
        stack.stop()
