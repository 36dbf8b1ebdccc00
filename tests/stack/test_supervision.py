"""``arena up``'s supervisor and the services' health: every service answers ``/healthz`` and
``/readyz`` truthfully, and a child or nats-server killed with SIGKILL is started again."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import httpx
import pytest

from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def settings_for(tmp_path) -> Settings:
    return Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                    rollout_port=(rp := free_port()), trajectory_port=free_port(), dashboard_port=free_port(),
                    public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{free_port()}/v1",
                    sandbox_concurrency=1, verify_concurrency=1)


async def wait_status(http: httpx.AsyncClient, url: str, status: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            r = await http.get(url)
            last = (r.status_code, r.text)
            if r.status_code == status:
                return r.json()
        except httpx.HTTPError as exc:
            last = exc
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} did not answer {status} within {timeout} s; last: {last}")


async def test_every_service_reports_ready_and_not_ready_when_nats_is_gone(tmp_path):
    stack = Stack(settings_for(tmp_path), nats_sync="1s", log=lambda m: None)
    await stack.start()
    try:
        urls = stack.health_urls()
        assert set(urls) == {"rollout", "trajectory", "sandbox", "verification"}
        async with httpx.AsyncClient(timeout=5.0) as http:
            for name, url in urls.items():
                assert (await http.get(url)).status_code == 200, name
                ready = await wait_status(http, url.replace("/healthz", "/readyz"), 200)
                assert ready["status"] == "ready", name
            stack.nats.kill()
            for name, url in urls.items():
                body = await wait_status(http, url.replace("/healthz", "/readyz"), 503, timeout=20)
                assert body["problem"], name
                # reconnecting is alive: no supervisor should restart a service for a NATS outage
                assert (await http.get(url)).status_code == 200, name
            stack.nats.start()
            for name, url in urls.items():
                await wait_status(http, url.replace("/healthz", "/readyz"), 200, timeout=60)
            r = await http.get(urls["sandbox"].replace("/healthz", "/nowhere"))
            assert r.status_code == 404
    finally:
        stack.stop()


async def test_the_supervisor_restarts_killed_services_and_nats_server(tmp_path):
    logged: list[str] = []
    stack = Stack(settings_for(tmp_path), nats_sync="1s", log=logged.append)
    await stack.start()
    stop = asyncio.Event()
    supervisor = asyncio.create_task(stack.supervise(stop, interval=0.2))
    try:
        before = {c.name: c.pid for c in stack.children}
        for child in stack.children:
            os.kill(child.pid, signal.SIGKILL)
        nats_pid = stack.nats.proc.pid
        os.kill(nats_pid, signal.SIGKILL)
        async with httpx.AsyncClient(timeout=5.0) as http:
            for name, url in stack.health_urls().items():
                await wait_status(http, url.replace("/healthz", "/readyz"), 200, timeout=90)
        after = {c.name: c.pid for c in stack.children}
        assert all(after[name] != before[name] for name in before), (before, after)
        assert all(c.alive() for c in stack.children)
        assert stack.nats.proc.pid != nats_pid and stack.nats.proc.poll() is None
        assert any("nats-server exited" in line for line in logged)
        assert {name for name in before if any(line.startswith(f"{name} exited") for line in logged)} == set(before)
    finally:
        stop.set()
        await supervisor
        stack.stop()
