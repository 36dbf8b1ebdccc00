"""Bus faults against the four services as processes, each reaching nats-server through a TCP
relay the test controls: the server killed and restarted, a protocol error forced on every live
connection, and a partition. After each, every service is ready again (by reconnecting, or by
exiting non-zero and being restarted by ``arena up``'s supervisor) and a rollout completes;
none lives on half-dead."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.schemas import RolloutState
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

from tests.faults import TcpRelay

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.timeout(600), pytest.mark.asyncio(loop_scope="module")]


async def statuses(http: httpx.AsyncClient, urls: dict[str, str], path: str) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name, url in urls.items():
        try:
            out[name] = (await http.get(url.replace("/healthz", path))).status_code
        except httpx.HTTPError:
            out[name] = None
    return out


async def until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        ok, last = await check()
        if ok:
            return last
        await asyncio.sleep(0.25)
    raise AssertionError(f"{what} not within {timeout} s; last: {last}")


async def all_ready(http, stack) -> tuple[bool, dict]:
    got = await statuses(http, stack.health_urls(), "/readyz")
    return all(v == 200 for v in got.values()), got


async def one_rollout_completes(client: ArenaClient) -> None:
    task = load_task(QUICKSTART / "task.json")
    view = await asyncio.to_thread(client.submit, task)
    final = await asyncio.to_thread(client.wait, view.rollout_id, timeout=120)
    assert final.state == RolloutState.COMPLETED and final.reward is not None and not final.infrastructure, final


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def relayed(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bus-faults")
    nats_port = free_port()
    relay = await TcpRelay(nats_port).start()
    rp = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{relay.port}", data_dir=str(tmp_path / "arena"), rollout_port=rp,
                        trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0",
                        sandbox_concurrency=2, verify_concurrency=1)
    logged: list[str] = []
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=logged.append,
                  nats_port=nats_port)
    await stack.start()
    stop = asyncio.Event()
    supervisor = asyncio.create_task(stack.supervise(stop, interval=0.5))
    client = ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key)
    try:
        async with httpx.AsyncClient(timeout=3.0) as http:
            await until(lambda: all_ready(http, stack), 60, "every service ready")
            yield stack, relay, client, http, logged
    finally:
        client.close()
        stop.set()
        await supervisor
        stack.stop()
        await relay.close()


async def test_services_reconnect_by_themselves_after_nats_server_restarts(relayed):
    """The supervisor starts nats-server again on its store; the services reconnect by themselves
    (their unreadiness meanwhile: tests/stack/test_supervision.py, without a supervisor)."""
    stack, relay, client, http, logged = relayed
    pids = {c.name: c.pid for c in stack.children}
    old = stack.nats.proc.pid
    stack.nats.kill()

    async def restarted() -> tuple[bool, object]:
        proc = stack.nats.proc
        return proc.pid != old and proc.poll() is None, proc.pid

    await until(restarted, 30, "nats-server started again")
    await until(lambda: all_ready(http, stack), 60, "every service ready after the restart")
    assert {c.name: c.pid for c in stack.children} == pids  # they reconnected; nobody was restarted
    await one_rollout_completes(client)


async def test_a_protocol_error_never_leaves_a_service_half_dead(relayed):
    stack, relay, client, http, logged = relayed
    # nats-py treats an -ERR (other than a stale connection) as final and closes the client
    assert await relay.send_to_clients(b"-ERR 'Unknown Protocol Operation'\r\n") >= 4
    await asyncio.sleep(2)
    for child in stack.children:  # each either exited non-zero or still answers as ready
        code = child.proc.poll()
        assert code is None or code != 0, (child.name, code)
    await until(lambda: all_ready(http, stack), 90, "every service ready again")
    await one_rollout_completes(client)


async def test_a_partition_makes_services_unready_then_they_heal(relayed):
    stack, relay, client, http, logged = relayed
    pids = {c.name: c.pid for c in stack.children}
    relay.partition()
    await until(lambda: _all(statuses(http, stack.health_urls(), "/readyz"), 503), 60, "not ready while partitioned")
    alive = await statuses(http, stack.health_urls(), "/healthz")
    assert all(v == 200 for v in alive.values()), alive
    relay.heal()
    await until(lambda: all_ready(http, stack), 90, "every service ready after the partition healed")
    assert {c.name: c.pid for c in stack.children} == pids
    await one_rollout_completes(client)


async def _all(pending, status: int) -> tuple[bool, dict]:
    got = await pending
    return all(v == status for v in got.values()), got
