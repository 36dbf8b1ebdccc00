"""``PullFeed`` (the trajectory consumers' fetch) against a real nats-server."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api as jsapi

from arena_trajectory.batching import delivery
from arena_trajectory.pull import FeedError, PullFeed


async def consumer(bus, durable: str, ack_wait: float = 30.0) -> None:
    await bus.js.add_stream(name="PULL_TEST", subjects=["pull.test.>"])
    await bus.js.add_consumer("PULL_TEST", jsapi.ConsumerConfig(
        durable_name=durable, ack_policy=jsapi.AckPolicy.EXPLICIT, ack_wait=ack_wait, max_ack_pending=1000))


async def publish(bus, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        await bus.js.publish(f"pull.test.{i}", str(i).encode(), headers={"Nats-Msg-Id": f"m{i}"})


async def test_batches_in_order_then_a_timeout_when_drained(bus):
    await consumer(bus, "d1")
    await publish(bus, 25)
    feed = await PullFeed(bus.nc, "PULL_TEST", "d1").start()
    try:
        first = await feed.fetch(10, timeout=1.0)
        rest = await feed.fetch(100, timeout=1.0, linger=0.05)
        got = [m.data for m in first + rest]
        assert got == [str(i).encode() for i in range(25)] and len(first) == 10
        d = delivery(rest[-1])  # the reply subject's numbers, as nats-py reads them
        meta = rest[-1].metadata
        assert (d.num_delivered, d.stream_seq) == (meta.num_delivered, meta.sequence.stream) == (1, 25)
        assert d.headers["Nats-Msg-Id"] == "m24" and d.subject == "pull.test.24"
        for m in first + rest:
            await m.ack()
        started = time.monotonic()
        with pytest.raises(NatsTimeout):
            await feed.fetch(10, timeout=0.3)
        assert time.monotonic() - started < 2.0
    finally:
        await feed.stop()


async def test_linger_collects_messages_published_while_waiting(bus):
    await consumer(bus, "d2")
    feed = await PullFeed(bus.nc, "PULL_TEST", "d2").start()
    try:
        await publish(bus, 1)
        pending = asyncio.create_task(feed.fetch(5, timeout=3.0, linger=2.0))  # returns once 5 are in
        await asyncio.sleep(0.1)
        await publish(bus, 4, start=1)
        msgs = await pending
        assert [m.data for m in msgs] == [b"0", b"1", b"2", b"3", b"4"]
    finally:
        await feed.stop()


async def test_an_unacked_message_is_delivered_again(bus):
    await consumer(bus, "d3", ack_wait=0.5)
    await publish(bus, 1)
    feed = await PullFeed(bus.nc, "PULL_TEST", "d3").start()
    try:
        (first,) = await feed.fetch(5, timeout=1.0)
        (again,) = await feed.fetch(5, timeout=3.0)  # not acked: back after ack_wait
        assert again.data == first.data and delivery(again).num_delivered == 2
        await again.ack()
    finally:
        await feed.stop()


async def test_a_missing_consumer_is_an_error_not_a_silent_wait(bus):
    await bus.js.add_stream(name="PULL_TEST", subjects=["pull.test.>"])
    feed = await PullFeed(bus.nc, "PULL_TEST", "nobody").start()
    try:
        with pytest.raises(FeedError, match="503"):  # no responders: the consumer does not exist
            await feed.fetch(5, timeout=0.5)
    finally:
        await feed.stop()


async def test_stop_hands_buffered_messages_back_at_once(bus):
    await consumer(bus, "d4", ack_wait=30.0)
    await publish(bus, 1)
    feed = await PullFeed(bus.nc, "PULL_TEST", "d4").start()
    (first,) = await feed.fetch(5, timeout=2.0)  # the request stays open for 4 more
    await first.ack()
    await publish(bus, 3, start=1)
    await asyncio.sleep(0.3)  # they land in the feed's buffer, not handed out
    await feed.stop()
    again = await PullFeed(bus.nc, "PULL_TEST", "d4").start()
    try:
        started = time.monotonic()
        msgs = await again.fetch(5, timeout=2.0, linger=0.3)
        assert sorted(m.data for m in msgs) == [b"1", b"2", b"3"]  # redeliveries: any order
        assert all(delivery(m).num_delivered == 2 for m in msgs) and time.monotonic() - started < 2.0
    finally:
        await again.stop()
