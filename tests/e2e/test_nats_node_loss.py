"""A NATS node lost mid-run (``make test-cluster``): the embedded stack on a JetStream cluster of
three nats-servers (streams and buckets at 3 replicas), 100 quickstart rollouts on the local
provider, and the node leading most of Arena's streams (or the meta leader) killed with SIGKILL
mid-run and restarted on its store a few seconds later. No service is restarted: every one
must ride it out on the other two nodes. Every rollout must reach a final state and every
trajectory be stored exactly once (one row per rollout in the store, one message per rollout
on ``ARENA_TRAJECTORIES``). Opt-in (minutes on two cores): ``ARENA_NATS_CLUSTER=1``
(``ARENA_NATS_ROLLOUTS`` = another count); figures go to stdout (``-s``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core import apikeys, subjects
from arena_core.bus import Bus
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
ROLLOUTS, GROUP = int(os.environ.get("ARENA_NATS_ROLLOUTS", "100")), 4
DOWN_S = 5.0  # how long the killed node stays down

TOPOLOGY = ([s.name for s in subjects.STREAMS]
            + [f"KV_{b}" for b in (subjects.KV_ROLLOUTS, subjects.KV_BACKENDS, subjects.KV_VERIFIERS)]
            + [f"OBJ_{subjects.OBJECT_ARTIFACTS}"])

pytestmark = [
    pytest.mark.skipif(not os.environ.get("ARENA_NATS_CLUSTER"), reason="opt-in: make test-cluster"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
    pytest.mark.timeout(1800),
]


async def _info(js, name: str):
    try:
        return await js.stream_info(name)
    except Exception:  # noqa: BLE001 - between leaders
        return None


async def infos(bus: Bus) -> dict:
    """Each stream's (and bucket's) info, None while it has no leader to answer (asked at once)."""
    js = bus.nc.jetstream(timeout=1)  # no answer while a group has no leader
    return dict(zip(TOPOLOGY, await asyncio.gather(*(_info(js, name) for name in TOPOLOGY)), strict=True))


async def leaders(bus: Bus) -> dict[str, str | None]:
    return {name: info.cluster.leader if info and info.cluster else None for name, info in (await infos(bus)).items()}


async def all_current(bus: Bus) -> bool:
    for info in (await infos(bus)).values():
        peers = (info.cluster.replicas or []) if info and info.cluster else []
        if not peers or not info.cluster.leader or len(peers) != 2 or not all(
                p.current and not p.offline for p in peers):
            return False
    return True


async def test_a_hundred_rollouts_survive_a_nats_node_sigkill(tmp_path):
    data = tmp_path / "arena"
    rp = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data), rollout_port=rp,
                        trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0",
                        sandbox_concurrency=4, verify_concurrency=2, queue_timeout_s=600)
    logged: list[str] = []
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=logged.append,
                  nats_cluster=3)
    assert stack.settings.nats_replicas == 3 and stack.settings.nats_url.count("nats://") == 3
    await stack.start()
    cluster = stack.nats_cluster
    settings = stack.settings
    bus = await Bus.connect(settings.nats_url, "test")
    client = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=60.0, api_key=stack.api_key)
    figures: dict[str, object] = {}
    try:
        # the services declared everything at 3 replicas
        for name in TOPOLOGY:
            assert (await bus.js.stream_info(name)).config.num_replicas == 3, name

        task = load_task(QUICKSTART / "task.json")
        started = time.monotonic()
        groups = [await asyncio.to_thread(client.submit_group, task, n=GROUP, seed=g)
                  for g in range(ROLLOUTS // GROUP)]
        ids = [rid for g in groups for rid in g.rollout_ids]
        assert len(ids) == ROLLOUTS
        figures["submitted_s"] = round(time.monotonic() - started, 1)

        finals: dict[str, object] = {}

        async def poll_finals() -> None:
            for rid in ids:
                if rid in finals:
                    continue
                try:
                    view = await asyncio.to_thread(client.get, rid)
                except Exception:  # noqa: BLE001 - a moment without a KV leader
                    return
                if view.state.is_final:
                    finals[rid] = view

        # mid-run: once about a fifth are final
        while len(finals) < ROLLOUTS // 5 and time.monotonic() - started < 600:
            await poll_finals()
            await asyncio.sleep(1)
        before = await leaders(bus)
        meta = cluster.meta_leader()
        led = Counter(v for v in before.values() if v)
        led[meta] += 1  # the meta leader counts too
        victim_name = led.most_common(1)[0][0]
        victim = cluster.index(victim_name)
        figures["victim"] = (f"{victim_name} (meta leader: {meta == victim_name}, leading "
                             f"{sorted(k for k, v in before.items() if v == victim_name)})")
        figures["final_at_kill"] = len(finals)
        cluster.nodes[victim].stop(kill=True)
        killed_at = time.monotonic()
        figures["killed_at_s"] = round(killed_at - started, 1)

        # every stream it led gets a new leader on the other two
        while True:
            now = await leaders(bus)
            if all(now[k] and now[k] != victim_name for k in now) and cluster.meta_leader():
                break
            assert time.monotonic() - killed_at < 60, f"no new leaders after 60 s: {now}"
            await asyncio.sleep(0.2)
        figures["new_leaders_s"] = round(time.monotonic() - killed_at, 2)
        finals_then = len(finals)
        while time.monotonic() - killed_at < DOWN_S or (len(finals) == finals_then and
                                                        time.monotonic() - killed_at < 120):
            await poll_finals()
            if len(finals) > finals_then and "first_final_after_kill_s" not in figures:
                figures["first_final_after_kill_s"] = round(time.monotonic() - killed_at, 1)
            await asyncio.sleep(0.5)
        figures["down_s"] = round(time.monotonic() - killed_at, 1)
        figures["finished_while_down"] = len(finals) - finals_then

        await asyncio.to_thread(cluster.start_node, victim)
        restarted_at = time.monotonic()
        while not await all_current(bus):
            assert time.monotonic() - restarted_at < 120, "the restarted node did not catch up in 120 s"
            await asyncio.sleep(0.2)
        figures["rejoined_s"] = round(time.monotonic() - restarted_at, 2)

        deadline = time.monotonic() + 1200
        while len(finals) < ROLLOUTS and time.monotonic() < deadline:
            await poll_finals()
            await asyncio.sleep(1)
        elapsed = time.monotonic() - started
        assert len(finals) == ROLLOUTS, f"{ROLLOUTS - len(finals)} rollouts never reached a final state"

        trajectories = {rid: await asyncio.to_thread(client.wait_trajectory, rid, timeout=300) for rid in ids}
        async with httpx.AsyncClient(timeout=30, headers=apikeys.auth_headers(stack.api_key)) as http:
            counts = (await http.get(f"{settings.trajectory_url}/v1/counts",
                                     params={"table": "trajectories"})).json()
            raw = (await http.get(f"{settings.trajectory_url}/v1/counts",
                                  params={"table": "trajectories", "final": "false"})).json()
            stored: Counter = Counter()
            params: dict = {"limit": 500}
            while True:
                page = (await http.get(f"{settings.trajectory_url}/v1/export/trajectories", params=params)).json()
                stored.update(t["rollout_id"] for t in page["trajectories"])
                if not page.get("next"):
                    break
                params = {"limit": 500, "after_group": page["next"][0], "after_rollout": page["next"][1]}
        published = (await bus.js.stream_info("ARENA_TRAJECTORIES", subjects_filter="arena.trajectory.>")).state
        on_stream = Counter({subject.rsplit(".", 1)[1]: n for subject, n in (published.subjects or {}).items()})

        states = Counter(v.state.value for v in finals.values())
        figures.update(rollouts=ROLLOUTS, elapsed_s=round(elapsed, 1), rollouts_per_s=round(ROLLOUTS / elapsed, 2),
                       states=dict(states), infrastructure=sum(v.infrastructure for v in finals.values()),
                       stored_final=counts, stored_raw=raw, trajectory_messages=published.messages)
        print("\nnats node loss: " + "; ".join(f"{k} {v}" for k, v in figures.items()))

        # every trajectory stored exactly once: one row per rollout, none missing, none extra
        assert set(trajectories) == set(ids)
        assert set(stored) == set(ids) and max(stored.values()) == 1, stored.most_common(3)
        assert counts["trajectories"] == ROLLOUTS, counts
        # and published exactly once on the training log, through the fail-over
        assert set(on_stream) == set(ids) and max(on_stream.values()) == 1, on_stream.most_common(3)
        # no service died: each rode the node loss out on the other two
        dead = [(c.name, c.proc.returncode) for c in stack.children if not c.alive()]
        assert dead == [], dead
    finally:
        client.close()
        await bus.close()
        stack.stop()
