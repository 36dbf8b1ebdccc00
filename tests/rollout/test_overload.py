"""Overload is queueing: past what the queue may hold, a submission gets 429 ``overloaded`` with
Retry-After and creates nothing; the SDK waits such answers out; a rollout leaving the queue
makes room."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from arena.sdk import ArenaClient
from arena_core import subjects
from arena_core.errors import Overloaded
from arena_core.runtime import serve
from arena_core.schemas import RolloutState, Task
from arena_core.settings import Settings
from arena_rollout.app import create_app
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore
from arena_stack.natsserver import free_port

from tests.rollout.test_service import task_json


@pytest.fixture
async def overloaded(bus, tmp_path):
    kv = await bus.kv(subjects.KV_ROLLOUTS)
    store = RolloutStore(kv)
    stop = asyncio.Event()
    watch = asyncio.create_task(store.cache.watch(kv, stop))
    http = httpx.AsyncClient()
    settings = Settings(allow_host_paths=True, nats_url="nats://127.0.0.1:1", max_queued=3, queue_timeout_s=4)
    service = RolloutService(bus=bus, store=store, settings=settings, http=http)
    port = free_port()
    server = asyncio.create_task(serve(stop, app=create_app(service), port=port))
    api = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}")
    for _ in range(200):
        try:
            if (await api.get("/healthz")).status_code == 200 and store.cache.watching:
                break
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.02)
    try:
        yield api, service, f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.gather(watch, server)
        await api.aclose()
        await service.upstream.aclose()
        await http.aclose()


async def until_queued(service: RolloutService, n: int) -> None:
    for _ in range(200):
        if service.queued() == n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"queued {service.queued()}, not {n}")


async def test_past_the_queue_limit_submissions_get_429_with_retry_after_and_create_nothing(overloaded, tmp_path):
    api, service, _ = overloaded
    r = await api.post("/v1/rollout-groups", json={"task": task_json(tmp_path), "n": 3})
    assert r.status_code == 201, r.text
    await until_queued(service, 3)
    r = await api.post("/v1/rollouts", json={"task": task_json(tmp_path)})
    assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded", r.text
    assert int(r.headers["retry-after"]) >= 1
    r = await api.post("/v1/rollout-groups", json={"task": task_json(tmp_path), "n": 4})
    assert r.status_code == 429 and "smaller groups" in r.json()["error"]["message"]
    assert len((await api.get("/v1/rollouts")).json()["rollouts"]) == 3  # nothing created by a refusal


async def test_the_sdk_waits_out_429s_until_the_queue_drains(overloaded, tmp_path):
    api, service, url = overloaded
    group = (await api.post("/v1/rollout-groups", json={"task": task_json(tmp_path), "n": 3})).json()
    await until_queued(service, 3)
    task = msgspec.convert(task_json(tmp_path), Task)
    impatient = ArenaClient(url, overload_wait=0)
    with pytest.raises(Overloaded) as caught:
        await asyncio.to_thread(impatient.submit, task)
    assert caught.value.retry_after >= 1
    impatient.close()

    patient = ArenaClient(url, overload_wait=30)
    waiting = asyncio.create_task(asyncio.to_thread(patient.submit, task))
    await asyncio.sleep(0.5)
    assert not waiting.done()  # still told to come back later
    await service.transition(group["rollout_ids"][0], RolloutState.RUNNING, reason="sandbox started")
    view = await asyncio.wait_for(waiting, 30)
    assert view.state in (RolloutState.PENDING, RolloutState.PROVISIONING)
    patient.close()
