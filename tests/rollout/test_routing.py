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


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_in_flight_limit_queues_the_excess_and_a_freed_slot_goes_to_the_queue():
    router = Router(replicas(1, max_inflight=2))
    state = router.replicas["r0"]
    first, second = await router.acquire("a", "default"), await router.acquire("a", "default")
    assert first.queued_ms == 0 and state.inflight == 2
    third = asyncio.create_task(router.acquire("a", "default"))
    await settle()
    assert not third.done() and router.queued == 1 and state.inflight == 2
    first.release()
    first.release()  # once only
    slot = await asyncio.wait_for(third, 1)
    assert slot.replica is state and state.inflight == 2 and router.queued == 0
    second.release(), slot.release()
    assert state.inflight == 0


async def test_a_call_takes_a_free_replica_rather_than_wait_for_its_sticky_one():
    router = Router(replicas(2, max_inflight=1))
    router.stick("a", "r0")
    held = await router.acquire("a", "default")
    assert held.replica.id == "r0"  # the sticky replica while it has a free slot
    moved = await router.acquire("a", "default")
    assert moved.replica.id == "r1" and moved.queued_ms == 0  # full: the other one, at once
    waiting = [asyncio.create_task(router.acquire("a", "default")) for _ in range(2)]
    await settle()
    assert router.queued == 2
    moved.release()  # the first replica to free a slot takes the oldest waiting call
    assert (await asyncio.wait_for(waiting[0], 1)).replica.id == "r1"
    held.release()
    assert (await asyncio.wait_for(waiting[1], 1)).replica.id == "r0"
    assert router.queued == 0 and [s.inflight for s in router.replicas.values()] == [1, 1]


def test_the_least_loaded_replica_for_its_limit_is_picked_and_unhealthy_ones_only_when_no_healthy_one_serves():
    router = Router([BackendReplica(replica_id="small", url="http://s/v1", max_inflight=2),
                     BackendReplica(replica_id="big", url="http://b/v1", max_inflight=8)])
    router.replicas["small"].inflight, router.replicas["big"].inflight = 1, 3
    assert router.pick("x", "default").id == "big"  # 3/8 < 1/2
    router.mark_down("big", "boom")
    assert router.pick("x", "default").id == "small"
    router.replicas["small"].inflight = 2
    assert router.pick("x", "default") is None  # the healthy one is full: wait for it
    router.mark_down("small", "boom")
    assert router.pick("x", "default").id == "big"  # none healthy: unhealthy rather than fail
    assert router.pick("x", "default", tried={"big"}) is None  # small is full


async def test_the_queue_takes_rollouts_in_turn_so_one_with_many_calls_does_not_starve_the_others():
    router = Router(replicas(1, max_inflight=1))
    held = await router.acquire("greedy", "default")
    order: list[str] = []

    async def call(rid: str) -> None:
        slot = await router.acquire(rid, "default")
        order.append(rid)
        await asyncio.sleep(0)
        slot.release()

    tasks = [asyncio.create_task(call("greedy")) for _ in range(8)]
    await settle()
    tasks += [asyncio.create_task(call(rid)) for rid in ("a", "b", "a", "b")]
    await settle()
    assert router.queued == 12 and router.queued_for("greedy") == 8
    held.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order[:6] == ["greedy", "a", "b", "greedy", "a", "b"] and order[6:] == ["greedy"] * 6
    assert router.replicas["r0"].inflight == 0


async def test_a_call_cancelled_while_queued_leaves_no_slot_or_place_behind():
    router = Router(replicas(1, max_inflight=1))
    held = await router.acquire("a", "default")
    gone = asyncio.create_task(router.acquire("a", "default"))
    await settle()
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert router.queued == 0 and router.replicas["r0"].inflight == 1
    # cancelled in the moment its slot was granted (before it ran again): the slot is freed
    granted_then_cancelled = asyncio.create_task(router.acquire("a", "default"))
    after = asyncio.create_task(router.acquire("b", "default"))
    await settle()
    held.release()  # granted to the first waiter, whose task has not run yet
    granted_then_cancelled.cancel()
    assert isinstance((await asyncio.gather(granted_then_cancelled, return_exceptions=True))[0],
                      asyncio.CancelledError)
    slot = await asyncio.wait_for(after, 1)  # the freed slot went on to the next call
    assert slot.replica.inflight == 1 and router.queued == 0
    slot.release()
    assert router.replicas["r0"].inflight == 0


async def test_a_failing_over_call_waits_for_a_replica_it_has_not_tried_and_fails_when_none_is_left():
    router = Router(replicas(2, max_inflight=1))
    other = await router.acquire("b", "default")
    assert other.replica.id == "r0"
    retry = asyncio.create_task(router.acquire("a", "default", tried={"r1"}))
    await settle()
    assert not retry.done()  # r1 is free but tried; r0 is full
    other.release()
    assert (await asyncio.wait_for(retry, 1)).replica.id == "r0"
    with pytest.raises(Unavailable, match="left to try"):
        await router.acquire("a", "default", tried={"r0", "r1"})
    stranded = asyncio.create_task(router.acquire("c", "default", tried={"r1"}))
    await settle()
    router.remove("r0")  # nothing left for it: it fails rather than wait for good
    with pytest.raises(Unavailable, match="removed"):
        await asyncio.wait_for(stranded, 1)
    assert router.queued == 0


async def test_a_raised_limit_and_a_replica_coming_back_serve_the_queue_at_once():
    router = Router(replicas(1, max_inflight=1))
    held = await router.acquire("a", "default")
    waiting = asyncio.create_task(router.acquire("a", "default"))
    await settle()
    router.upsert(BackendReplica(replica_id="r0", url="http://h0/v1", max_inflight=2))
    assert (await asyncio.wait_for(waiting, 1)).replica.inflight == 2
    router.remove("r0")  # removed with calls in flight, registered again: they still count
    router.upsert(BackendReplica(replica_id="r0", url="http://h0/v1", max_inflight=2))
    assert router.replicas["r0"].inflight == 2 and router.pick("x", "default") is None
    held.release()
    assert router.replicas["r0"].inflight == 1


async def test_queue_time_off_the_clock_counts_a_rollouts_parallel_waits_once():
    now = [100.0]
    router = Router(replicas(1, max_inflight=1), clock=lambda: now[0])
    held = await router.acquire("a", "default")
    waits = [asyncio.create_task(router.acquire("a", "default")) for _ in range(2)]
    await settle()
    now[0] = 102.0
    held.release()
    first = await asyncio.wait_for(waits[0], 1)
    now[0] = 105.0
    first.release()
    second = await asyncio.wait_for(waits[1], 1)
    # both waited from 100: 2 s and 5 s, but the rollout lost 5 s, not 7
    assert (first.off_clock_ms, second.off_clock_ms) == (2000.0, 3000.0)
    assert held.off_clock_ms == 0.0
    second.release()


async def test_a_wait_still_going_is_off_the_clock_when_read_midway():
    # the reaper reads a rollout's queue time while a call still waits: that wait counts already
    now = [100.0]
    router = Router(replicas(1, max_inflight=1), clock=lambda: now[0])
    held = await router.acquire("a", "default")
    waiting = asyncio.create_task(router.acquire("b", "default"))
    await settle()
    now[0] = 130.0
    assert router.waiting_s("b") == 30.0 and router.waiting_s("a") == 0.0
    held.release()
    slot = await asyncio.wait_for(waiting, 1)
    assert slot.off_clock_ms == 30000.0 and router.waiting_s("b") == 0.0  # handed to the call
    slot.release()


async def test_the_metrics_see_each_replicas_calls_in_flight_its_bound_and_the_queue():
    from prometheus_client import CollectorRegistry, generate_latest

    from arena_core import metrics

    router = Router(replicas(2, max_inflight=1))
    held = [await router.acquire("a", "default") for _ in range(2)]
    waiting = asyncio.create_task(router.acquire("b", "default"))
    await settle()
    registry = CollectorRegistry()
    registry.register(metrics.BackendLoad(router.load_snapshot))
    text = generate_latest(registry).decode()
    assert 'arena_backend_inflight{replica="r0"} 1.0' in text and 'arena_backend_inflight{replica="r1"} 1.0' in text
    assert 'arena_backend_max_inflight{replica="r0"} 1.0' in text and "arena_proxy_queued_calls 1.0" in text
    held[0].release()
    (await asyncio.wait_for(waiting, 1)).release()
    held[1].release()
    assert router.load_snapshot() == ([("r0", 0, 1), ("r1", 0, 1)], 0)
