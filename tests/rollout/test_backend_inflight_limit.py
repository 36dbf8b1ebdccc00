"""Each backend replica's in-flight limit, through the real proxy (uvicorn, a real
nats-server) to scripted backends that count the requests they hold at once and record
a violation (and answer 500) past their limit: the limit holds under many concurrent calls
from several rollouts and under failover, no replica sits idle while calls wait, and the
queue takes rollouts in turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
from aiohttp import web

from tests.rollout.test_proxy_backend_connections import chat_answer, proxy, rollout_of  # noqa: F401 - the fixture


class ScriptedBackend:
    """An OpenAI-compatible backend holding each chat call until the test answers it (or,
    with ``auto``, after a pause), counting calls held at once against ``limit``.
    ``fail_every``: every n-th call is answered 500 at once (the proxy fails over)."""

    def __init__(self, limit: int, *, auto: bool = False, fail_every: int = 0):
        self.limit = limit
        self.auto = auto
        self.fail_every = fail_every
        self.current = 0
        self.peak = 0
        self.arrived = 0
        self.answered = 0
        self.violations: list[int] = []
        self.senders: list[str] = []  # who sent each call, in arrival order
        self._held: list[asyncio.Future] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> ScriptedBackend:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.release_all()
        await self._runner.cleanup()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def answer_one(self) -> None:
        while self._held:
            future = self._held.pop(0)
            if not future.done():
                future.set_result(None)
                return

    def release_all(self) -> None:
        self.auto = True
        while self._held:
            self.answer_one()

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.arrived += 1
        self.senders.append(body["messages"][0]["content"])
        self.current += 1
        self.peak = max(self.peak, self.current)
        try:
            if self.current > self.limit:
                self.violations.append(self.current)
                return web.json_response({"error": {"message": f"{self.current} in flight, limit {self.limit}"}},
                                         status=500)
            if self.fail_every and self.arrived % self.fail_every == 0:
                return web.json_response({"error": {"message": "scripted failure"}}, status=500)
            if self.auto:
                await asyncio.sleep(0.005)
            else:
                future = asyncio.get_running_loop().create_future()
                self._held.append(future)
                await future
        finally:
            self.current -= 1
        self.answered += 1
        return web.Response(body=chat_answer([5]), content_type="application/json")


async def until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Wait for ``condition`` (a bound on a wait, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.005)


async def rollouts(p, tmp_path, n: int) -> list[tuple[str, str]]:
    return [await p.rollout(tmp_path) for _ in range(n)]


def fire(agent: httpx.AsyncClient, url: str, key: str, sender: str) -> asyncio.Task:
    body = {"model": "m", "messages": [{"role": "user", "content": sender}]}
    return asyncio.create_task(agent.post(url, json=body, headers={"authorization": f"Bearer {key}"}))


def agent_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=400, max_keepalive_connections=400))


async def test_replicas_never_see_more_than_their_limit_and_none_idles_while_calls_wait(proxy, tmp_path):
    limit = 4
    async with ScriptedBackend(limit) as a, ScriptedBackend(limit) as b:
        p = await proxy({"a": a.url, "b": b.url}, max_inflight=limit)
        (u0, k0), *others = await rollouts(p, tmp_path, 4)
        began = time.monotonic()
        async with agent_client() as agent:
            # one rollout fires 16 calls at once, three others 4 each: 28 calls for 8 slots
            tasks = [fire(agent, u0, k0, "greedy") for _ in range(16)]
            tasks += [fire(agent, u, k, f"r{i}") for i, (u, k) in enumerate(others) for _ in range(4)]
            await until(lambda: p.router.queued == 28 - 2 * limit and a.current + b.current == 2 * limit,
                        "all calls in: 8 held, 20 waiting")
            assert (a.current, b.current) == (limit, limit)
            # only a answers, one call at a time: each freed slot is taken by a waiting call at
            # once (never left idle while b is full), whichever replica each waiter started on
            while p.router.queued:
                arrived = a.arrived
                a.answer_one()
                await until(lambda: a.arrived == arrived + 1, "a waiting call takes the slot a freed")
                assert a.current == limit and b.current == limit
            assert p.router.queued == 0 and a.answered == 20
            a.release_all()
            b.release_all()
            answers = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        elapsed = time.monotonic() - began
        steps = await p.steps(u0, 16)
    assert [r.status_code for r in answers] == [200] * 28
    assert a.violations == [] and b.violations == []
    assert (a.peak, b.peak) == (limit, limit)
    assert [s.inflight for s in p.router.replicas.values()] == [0, 0]
    # each step says how long its call waited; the rollout's wall clock leaves out the time
    # any of its calls waited, parallel waits once (less than their sum, within the test's time)
    waited = [s.timings.queued_ms for s in steps]
    off_clock = p.service.proxy.off_clock_s(rollout_of(u0))
    assert len(steps) == 16 and sum(w > 0 for w in waited) >= 16 - 2 * limit
    assert 0 < off_clock < elapsed and off_clock < sum(waited) / 1000


async def test_a_limit_of_64_holds_and_keeps_the_backend_full_while_calls_wait(proxy, tmp_path):
    limit, calls = 64, 96
    async with ScriptedBackend(limit) as backend:
        p = await proxy({"only": backend.url}, max_inflight=limit)
        rolls = await rollouts(p, tmp_path, 4)
        async with agent_client() as agent:
            tasks = [fire(agent, u, k, f"r{i}") for i, (u, k) in enumerate(rolls) for _ in range(calls // 4)]
            await until(lambda: p.router.queued == calls - limit and backend.current == limit,
                        "64 held, the rest waiting")
            while p.router.queued:
                arrived = backend.arrived
                backend.answer_one()
                await until(lambda: backend.arrived == arrived + 1, "a waiting call takes the freed slot")
                assert backend.current == limit
            backend.release_all()
            answers = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert [r.status_code for r in answers] == [200] * calls
    assert backend.violations == [] and backend.peak == limit and backend.answered == calls


async def test_the_queue_serves_rollouts_in_turn(proxy, tmp_path):
    async with ScriptedBackend(1) as backend:
        p = await proxy({"only": backend.url}, max_inflight=1)
        (ug, kg), (ua, ka), (ub, kb) = await rollouts(p, tmp_path, 3)
        async with agent_client() as agent:
            tasks = [fire(agent, ug, kg, "greedy") for _ in range(9)]
            await until(lambda: p.router.queued == 8 and backend.current == 1,
                        "one held, the greedy rollout's 8 others waiting")
            tasks += [fire(agent, ua, ka, "a") for _ in range(2)] + [fire(agent, ub, kb, "b") for _ in range(2)]
            await until(lambda: p.router.queued == 12, "the two others' calls waiting too")
            for answered in range(1, 14):
                arrived = backend.arrived
                backend.answer_one()
                if answered < 13:
                    await until(lambda: backend.arrived == arrived + 1, "the next call in turn")
            answers = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert [r.status_code for r in answers] == [200] * 13
    after = backend.senders[1:]  # the first was sent before anything waited
    # the two small rollouts' four calls go out within two turns, not behind the greedy eight
    assert max(i for i, s in enumerate(after) if s != "greedy") < 6, after


async def test_the_limit_holds_under_failover_and_every_slot_comes_back(proxy, tmp_path):
    limit = 3
    async with ScriptedBackend(limit, auto=True, fail_every=3) as a, ScriptedBackend(limit, auto=True) as b:
        p = await proxy({"a": a.url, "b": b.url}, max_inflight=limit)
        rolls = await rollouts(p, tmp_path, 5)
        async with agent_client() as agent:
            tasks = [fire(agent, u, k, f"r{i}") for i, (u, k) in enumerate(rolls) for _ in range(8)]
            answers = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert [r.status_code for r in answers] == [200] * 40
    assert a.violations == [] and b.violations == [] and a.peak <= limit and b.peak <= limit
    assert a.arrived > a.answered  # some calls failed over from a (answered 500) to b
    assert a.answered + b.answered == 40
    assert p.router.queued == 0 and [s.inflight for s in p.router.replicas.values()] == [0, 0]
