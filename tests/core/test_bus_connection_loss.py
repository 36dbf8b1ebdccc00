"""A bus whose connection nats-py closed for good (a protocol error from the server) says so, and
its watch fails so the service exits non-zero; a partition is found by pings and healed by a
reconnect; ``close`` is never taken for a loss."""

from __future__ import annotations

import asyncio

import pytest

from arena_core.bus import Bus
from arena_core.errors import Unavailable

from tests.faults import TcpRelay


async def wait_for(predicate, timeout: float) -> None:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout} s")


async def test_a_protocol_error_loses_the_connection_and_the_watch_fails(nats_server):
    relay = await TcpRelay(nats_server.port).start()
    bus = await Bus.connect(f"nats://127.0.0.1:{relay.port}", "test")
    stop = asyncio.Event()
    watch = asyncio.create_task(bus.watch().run(stop))
    try:
        assert await relay.send_to_clients(b"-ERR 'Unknown Protocol Operation'\r\n") == 1
        await wait_for(bus.lost.is_set, 5)
        with pytest.raises(Unavailable, match="closed for good"):
            await asyncio.wait_for(watch, 5)
    finally:
        await bus.close()
        await relay.close()


async def test_close_is_not_a_loss_and_the_watch_ends_quietly_on_stop(nats_server):
    bus = await Bus.connect(nats_server.url, "test")
    stop = asyncio.Event()
    watch = asyncio.create_task(bus.watch().run(stop))
    stop.set()
    await asyncio.wait_for(watch, 5)
    await bus.close()
    assert not bus.lost.is_set()


async def test_a_partition_is_found_by_pings_and_the_bus_reconnects_when_it_heals(nats_server):
    relay = await TcpRelay(nats_server.port).start()
    bus = await Bus.connect(f"nats://127.0.0.1:{relay.port}", "test")
    try:
        await bus.ensure_topology()
        relay.partition()
        await wait_for(lambda: not bus.nc.is_connected, 40)  # stale: pings went unanswered
        assert not bus.lost.is_set()  # reconnecting, not lost
        relay.heal()
        await wait_for(lambda: bus.nc.is_connected, 30)
        info = await bus.js.stream_info("ARENA_ROLLOUTS")
        assert info.config.name == "ARENA_ROLLOUTS"
    finally:
        await bus.close()
        await relay.close()
