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
    batcher = bus.batchers[subjects.stream_of(subjects.step("r-1"))]
    acks = await asyncio.gather(*(bus.publish(subjects.step("r-1"), b"step %d" % i, msg_id=f"r-1:step:{i}")
                                  for i in range(100)))
    assert batcher.batches == 1 and batcher.messages == 100
    assert [a.seq for a in acks] == list(range(acks[0].seq, acks[0].seq + 100))
    sub = await bus.js.pull_subscribe(subjects.step("r-1"), durable="t", stream="ARENA_STEPS")
    got = []
    while len(got) < 100:
        got += await sub.fetch(100, timeout=5)
    assert [m.data for m in got] == [b"step %d" % i for i in range(100)]
    assert all(m.headers["Nats-Msg-Id"] == f"r-1:step:{i}" for i, m in enumerate(got))


async def test_a_batch_holding_a_message_already_stored_falls_back_one_by_one(bus: Bus):
    await bus.ensure_topology()
    first = await bus.publish(subjects.step("r-2"), b"zero", msg_id="r-2:step:0")
    again = await asyncio.gather(*(bus.publish(subjects.step("r-2"), b"x", msg_id=f"r-2:step:{i}") for i in range(4)))
    assert again[0].duplicate and again[0].seq == first.seq
    assert [a.seq for a in again[1:]] == [first.seq + 1, first.seq + 2, first.seq + 3]
    assert (await bus.js.stream_info("ARENA_STEPS")).state.messages == 4


async def test_a_stream_that_takes_no_batches_is_published_to_one_by_one(bus: Bus):
    await bus.js.add_stream(name="PLAIN", subjects=["plain.>"])
    assert "PLAIN" not in bus.batchers and subjects.stream_of("plain.x") is None
    acks = await asyncio.gather(*(bus.publish("plain.x", b"m", msg_id=f"p:{i}") for i in range(10)))
    assert sorted(a.seq for a in acks) == list(range(1, 11))
