"""The rollout API as it runs (the real app, a real nats-server), API keys off: these tests
attack what keys do not guard (bodies, sizes, sources, ids)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from arena_core import subjects
from arena_core.runtime import serve
from arena_core.settings import Settings
from arena_rollout.app import create_app
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore
from arena_rollout.worker import consumers


@pytest.fixture
def api_settings() -> Settings:
    return Settings(auth="off", nats_url="nats://127.0.0.1:1", backend_url="http://127.0.0.1:9/v1",
                    public_url="http://arena:9090", max_body_bytes=64 * 1024)


@pytest.fixture
async def api(bus, api_settings):
    stop = asyncio.Event()
    backend = httpx.AsyncClient()
    service = RolloutService(bus=bus, store=RolloutStore(await bus.kv(subjects.KV_ROLLOUTS)),
                             settings=api_settings, http=backend)
    runner = asyncio.create_task(serve(stop, consumers=consumers(bus, service)))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)), base_url="http://arena")
    try:
        yield client
    finally:
        stop.set()
        await runner
        await client.aclose()
        await service.upstream.aclose()
        await backend.aclose()
