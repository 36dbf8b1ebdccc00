"""The record cache's memory of ended rollouts: bounded, oldest forgotten first, and still
keeping stale revisions of the rollouts it remembers out."""

from __future__ import annotations

import logging

import msgspec
import pytest

from arena_core.schemas import AgentSpec, RolloutRecord, RolloutState, SamplingParams, Task, TestsVerifier
from arena_rollout.store import MAX_ENDED, RecordCache

S = RolloutState


def rec(rid: str, state: RolloutState = S.RUNNING, steps: int = 0) -> RolloutRecord:
    task = Task(id="t", repo="/r", instructions="i", agent=AgentSpec(command=["a"]),
                verifier=TestsVerifier(fail_to_pass=["x"]))
    return RolloutRecord(rollout_id=rid, task=task, sampling=SamplingParams(), model="m", provider="local",
                         api_key="k", state=state, created_at=0.0, updated_at=0.0, steps=steps)


def test_ended_rollouts_are_remembered_up_to_the_bound_oldest_forgotten_first():
    cache = RecordCache(max_ended=100)
    cache.watching = True
    revision = 0
    for i in range(10_000):  # many rollouts start and end through one process
        revision += 1
        cache.put(rec(f"r{i}"), revision)
        revision += 1
        cache.put(rec(f"r{i}", S.COMPLETED), revision)
        cache.seen_revision = revision  # the watch keeps up
    assert len(cache._final) == 100 and not cache._live  # bounded, whatever the traffic
    assert cache.ended("r9999") and cache.ended("r9900") and not cache.ended("r9899")
    assert list(cache._final)[:2] == ["r9900", "r9901"]  # insertion order: the oldest go first
    assert MAX_ENDED == RecordCache().max_ended == 100_000
    with pytest.raises(ValueError, match="max_ended"):
        RecordCache(max_ended=0)


def test_a_remembered_rollout_stays_ended_whatever_arrives_late():
    cache = RecordCache(max_ended=2)
    cache.watching = True
    cache.put(rec("a"), 1)
    cache.put(rec("a", S.CANCELLED), 5)  # this process's own final write
    # the watch, behind, still delivers the revisions before it: they change nothing
    assert not cache.newer("a", 3)
    cache.put(rec("a", steps=1), 3)
    assert cache.get("a") is None and cache.live() == []
    # ending more rollouts than the bound forgets "a", and only "a"
    cache.put(rec("b", S.FAILED), 6)
    cache.put(rec("c", S.COMPLETED), 7)
    assert not cache.ended("a") and cache.ended("b") and cache.ended("c")
    assert not cache.newer("b", 4) and not cache.newer("c", 2)
    # a live rollout still lives in the cache beside the memory
    cache.put(rec("d"), 8)
    assert cache.get("d").state == S.RUNNING and cache.newer("d", 9) and not cache.newer("d", 8)


def test_forgetting_a_rollout_the_watch_has_not_passed_yet_is_logged(caplog):
    cache = RecordCache(max_ended=1)
    cache.seen_revision = 10
    cache.put(rec("old", S.COMPLETED), 9)
    with caplog.at_level(logging.WARNING, logger="arena.rollout.store"):
        cache.put(rec("newer", S.COMPLETED), 11)  # forgets "old" (9 <= 10: passed): silent
        assert caplog.text == ""
        cache.put(rec("newest", S.COMPLETED), 12)  # forgets "newer" (11 > 10: not passed yet)
    assert "forgot ended rollout newer before the KV watch passed its final revision 11" in caplog.text
    assert "ARENA_ROLLOUT_CACHE_ENDED" in caplog.text
    assert list(cache._final) == ["newest"]


def test_only_a_watching_cache_promises_a_live_rollouts_final_record():
    cache = RecordCache()
    cache.put(rec("a"), 1)
    assert cache.until_final("a") is None  # not watching: it may never learn the end
    cache.watching = True
    assert cache.until_final("unknown") is None  # not seen yet: the bucket answers
    cache.put(rec("b", S.COMPLETED), 2)
    assert cache.until_final("b") is None  # ended already: only its revision is remembered


async def test_a_waiter_gets_the_final_record_from_this_process_or_from_another_through_the_watch(bus):
    import asyncio

    from arena_core import subjects
    from arena_rollout.store import RolloutStore

    kv = await bus.kv(subjects.KV_ROLLOUTS)
    here = RolloutStore(kv)  # this process: its cache follows the bucket
    elsewhere = RolloutStore(kv, cache=RecordCache())  # another replica, whose writes only the watch brings
    stop = asyncio.Event()
    watch = asyncio.create_task(here.cache.watch(kv, stop))
    while not here.cache.watching:
        await asyncio.sleep(0.01)
    for rid in ("mine", "theirs"):
        await here.create(rec(rid, S.PENDING))
    mine, theirs = here.cache.until_final("mine"), here.cache.until_final("theirs")

    await here.update("mine", lambda r: msgspec.structs.replace(r, state=S.RUNNING))
    assert not mine.done()  # a state on the way is no end
    await here.update("mine", lambda r: msgspec.structs.replace(r, state=S.COMPLETED, reward=1.0))
    got = await asyncio.wait_for(mine, 10)
    assert (got.state, got.reward) == (S.COMPLETED, 1.0)

    await elsewhere.update("theirs", lambda r: msgspec.structs.replace(r, state=S.CANCELLED, reason="by user"))
    got = await asyncio.wait_for(theirs, 10)
    assert (got.state, got.reason) == (S.CANCELLED, "by user")
    assert got == (await here.get("theirs"))[0]  # what the bucket holds

    await here.create(rec("later", S.PENDING))
    later = here.cache.until_final("later")
    stop.set()  # the watch ends: nobody would tell the waiter, so it is told to look for itself
    await watch
    assert await asyncio.wait_for(later, 10) is None
