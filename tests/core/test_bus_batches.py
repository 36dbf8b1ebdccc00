"""Publishes made together to one of Arena's streams go to JetStream as one atomic batch
(``arena_core.batching``), against a real nats-server: each gets its own ``PubAck``, the
messages are stored in order, a batch with a message already stored falls back to
publishing one by one (the duplicate dropped), and a stream that takes no batches is
published to one by one."""

from __future__ import annotations

import asyncio

from arena_core import subjects
from arena_core.bus import Bus


async def test_publishes_of_one_loop_turn_are_one_batch_each_acknowledged(bus: Bus):
    await bus.ensure_topology()
    batcher = bus.batchers[subjects.stream_of(subjects.sandbox_done("r-1"))]
    acks = await asyncio.gather(*(bus.publish(subjects.sandbox_done("r-1"), b"step %d" % i, msg_id=f"r-1:step:{i}")
                                  for i in range(100)))
    assert batcher.batches == 1 and batcher.messages == 100
    assert [a.seq for a in acks] == list(range(acks[0].seq, acks[0].seq + 100))
    sub = await bus.js.pull_subscribe(subjects.sandbox_done("r-1"), durable="t", stream="ARENA_RESULTS")
    got = []
    while len(got) < 100:
        got += await sub.fetch(100, timeout=5)
    assert [m.data for m in got] == [b"step %d" % i for i in range(100)]
    assert all(m.headers["Nats-Msg-Id"] == f"r-1:step:{i}" for i, m in enumerate(got))


async def test_a_batch_holding_a_message_already_stored_falls_back_one_by_one(bus: Bus):
    await bus.ensure_topology()
    batcher = bus.batchers["ARENA_RESULTS"]
    first = await bus.publish(subjects.sandbox_done("r-2"), b"zero", msg_id="r-2:step:0")
    assert batcher.batches == 0  # one publish alone: no batch (its fixed cost would not pay)
    again = await asyncio.gather(*(bus.publish(subjects.sandbox_done("r-2"), b"x", msg_id=f"r-2:step:{i}") for i in range(20)))
    assert batcher.batches == 0  # refused whole: published one by one
    assert again[0].duplicate and again[0].seq == first.seq
    assert sorted(a.seq for a in again[1:]) == list(range(first.seq + 1, first.seq + 20))
    assert (await bus.js.stream_info("ARENA_RESULTS")).state.messages == 20


async def test_a_few_publishes_together_go_one_by_one_and_a_batch_is_cut_by_bytes(bus: Bus):
    await bus.ensure_topology()
    batcher = bus.batchers["ARENA_RESULTS"]
    acks = await asyncio.gather(*(bus.publish(subjects.sandbox_done("r-3"), b"x", msg_id=f"r-3:{i}") for i in range(5)))
    assert batcher.batches == 0 and len({a.seq for a in acks}) == 5
    big = b"y" * (600 * 1024)  # 20 of them: 12 MiB, over a batch's 4 MiB
    acks = await asyncio.gather(*(bus.publish(subjects.sandbox_done("r-4"), big, msg_id=f"r-4:{i}") for i in range(20)))
    assert batcher.batches >= 3 and len({a.seq for a in acks}) == 20


async def test_a_stream_that_takes_no_batches_is_published_to_one_by_one(bus: Bus):
    await bus.js.add_stream(name="PLAIN", subjects=["plain.>"])
    assert "PLAIN" not in bus.batchers and subjects.stream_of("plain.x") is None
    acks = await asyncio.gather(*(bus.publish("plain.x", b"m", msg_id=f"p:{i}") for i in range(10)))
    assert sorted(a.seq for a in acks) == list(range(1, 11))


async def test_the_workers_bucket_forgets_an_entry_after_its_ttl(bus: Bus):
    kv = await bus.kv(subjects.KV_WORKERS)
    status = await kv.status()
    assert status.ttl == subjects.KV_TTL_S[subjects.KV_WORKERS]


async def test_publishes_made_while_a_batch_is_under_way_wait_and_go_out_together(bus: Bus):
    await bus.ensure_topology()
    batcher = bus.batchers["ARENA_RESULTS"]
    first = [asyncio.ensure_future(bus.publish(subjects.sandbox_done(f"g{i}"), b"{}", msg_id=f"g:{i}"))
             for i in range(20)]
    await asyncio.sleep(0)  # they are published: their batch is under way
    later = []
    for turn in range(4):  # 5 a turn: alone they would each go one by one
        later += [asyncio.ensure_future(bus.publish(subjects.sandbox_done(f"h{turn}-{i}"), b"{}",
                                                    msg_id=f"h:{turn}:{i}")) for i in range(5)]
        await asyncio.sleep(0)
    acks = await asyncio.gather(*first, *later)
    assert (batcher.batches, batcher.messages) == (2, 40)  # the 20 that waited went as one batch
    assert len({a.seq for a in acks}) == 40 and not any(a.duplicate for a in acks)
