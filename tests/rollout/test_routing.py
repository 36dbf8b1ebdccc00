"""Replica routing: sticky per rollout, health, model matching, in-flight bounds."""

from __future__ import annotations

import asyncio

import pytest

from arena_core.errors import Unavailable
from arena_core.schemas import BackendReplica
from arena_rollout.proxy.routing import Router


def replicas(n: int, **kw) -> list[BackendReplica]:
    return [BackendReplica(replica_id=f"r{i}", url=f"http://h{i}/v1", **kw) for i in range(n)]


def test_a_rollout_sticks_to_its_replica_while_it_is_healthy():
    router = Router(replicas(3))
    first = router.candidates("roll-1", "default")[0].id
    router.stick("roll-1", first)
    for _ in range(5):
        assert router.candidates("roll-1", "default")[0].id == first
    router.mark_down(first, "connection refused")
    moved = router.candidates("roll-1", "default")
    assert moved[0].id != first and moved[-1].id == first  # the dead one is tried last, not dropped
    router.mark_up(first)
    assert router.candidates("roll-1", "default")[0].id == first


def test_rollouts_spread_over_replicas_and_models_are_matched():
    router = Router(replicas(4))
    assert len({router.candidates(f"roll-{i}", "default")[0].id for i in range(40)}) > 1
    router.upsert(BackendReplica(replica_id="big", url="http://big/v1", models=["qwen-72b"]))
    assert [s.id for s in router.candidates("x", "qwen-72b")][0] in {"big", "r0", "r1", "r2", "r3"}
    router = Router([BackendReplica(replica_id="big", url="http://big/v1", models=["qwen-72b"])])
    with pytest.raises(Unavailable, match="no backend replica serves model 'llama'"):
        router.candidates("x", "llama")


def test_policy_version_updates_in_place_keep_health_and_slots():
    router = Router(replicas(1, policy_version="1"))
    router.mark_down("r0", "boom")
    router.upsert(BackendReplica(replica_id="r0", url="http://h0/v1", policy_version="2"))
    state = router.replicas["r0"]
    assert state.replica.policy_version == "2" and not state.healthy


async def test_in_flight_bound_queues_the_excess():
    router = Router(replicas(1, max_inflight=2))
    state = router.replicas["r0"]
    assert await state.acquire() < 50 and await state.acquire() < 50
    third = asyncio.create_task(state.acquire())
    await asyncio.sleep(0.05)
    assert not third.done() and state.waiting == 1
    state.release()
    queued_ms = await asyncio.wait_for(third, 1)
    assert queued_ms >= 40 and state.inflight == 2
