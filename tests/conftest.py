"""Shared fixtures: a real nats-server with JetStream on a free port, per test."""

from __future__ import annotations

import pytest

from arena.natsserver import NatsServer


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats", sync="1s").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def bus(nats_server):
    from arena.bus import Bus

    b = await Bus.connect(nats_server.url, "test")
    await b.ensure_topology()
    try:
        yield b
    finally:
        await b.close()
