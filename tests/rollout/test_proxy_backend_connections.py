"""How the proxy talks to its backends, over real sockets: the rollout app under uvicorn,
a real nats-server, and backends that write exactly the bytes under test (split at awkward
places, closed at awkward moments). Connection reuse, chunked answers, failover, a
backend breaking off mid-stream, an agent leaving mid-stream, timeouts."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from arena_core import subjects
from arena_core.runtime import serve
from arena_core.schemas import AgentSpec, BackendReplica, Budget, RolloutState, SamplingParams, Step, \
    SubmitRolloutRequest, Task, TestsVerifier
from arena_core.settings import Settings
from arena_rollout.app import create_app
from arena_rollout.proxy.routing import Router
from arena_rollout.proxy.upstream import UpstreamClient
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore
from tests.steps_reader import read_steps

Piece = bytes | None | asyncio.Event


class Backend:
    """A raw HTTP/1.1 server answering each request with the next scripted reply: a list
    of pieces written with a short pause between them, ``None`` closing the connection
    there, an ``asyncio.Event`` waiting for it to be set."""

    def __init__(self, replies: list[list[Piece]]):
        self.replies = replies
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed_by_client = 0
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Backend:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.replies.pop(0):
                    if piece is None:
                        return
                    if isinstance(piece, asyncio.Event):
                        waiting = asyncio.ensure_future(piece.wait())
                        gone = asyncio.ensure_future(reader.read(1))  # b"" once the client closes
                        await asyncio.wait([waiting, gone], return_when=asyncio.FIRST_COMPLETED)
                        waiting.cancel()
                        if gone.done():
                            self.closed_by_client += 1
                            return
                        gone.cancel()
                        continue
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.002)
            if await reader.read() == b"":  # held open until the client closes it
                self.closed_by_client += 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def chat_answer(ids: list[int]) -> bytes:
    return json.dumps({"id": "c", "object": "chat.completion", "model": "m", "prompt_token_ids": [1, 2, 3],
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * len(ids)},
                                    "token_ids": ids, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": len(ids),
                                 "total_tokens": 3 + len(ids)}}).encode()


def sse_events(ids: list[int]) -> list[bytes]:
    """One SSE event per token, then the usage chunk and ``[DONE]``, as vLLM streams."""
    events = [b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m",
                                      **({"prompt_token_ids": [1, 2, 3]} if i == 0 else {}),
                                      "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [t],
                                                   "finish_reason": "stop" if i == len(ids) - 1 else None}]}
                                     ).encode() + b"\n\n" for i, t in enumerate(ids)]
    events.append(b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "choices": [],
                                          "usage": {"prompt_tokens": 3, "completion_tokens": len(ids),
                                                    "total_tokens": 3 + len(ids)}}).encode() + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def whole(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    def __init__(self, bus, service: RolloutService, url: str):
        self.bus, self.service, self.url = bus, service, url
        self.router = service.router

    async def rollout(self, tmp_path) -> tuple[str, str]:
        repo = tmp_path / "repo"
        repo.mkdir(exist_ok=True)
        task = Task(id="t", repo=str(repo), instructions="fix", agent=AgentSpec(command=["true"]),
                    verifier=TestsVerifier(fail_to_pass=["t::x"]), budget=Budget())
        record = await self.service.submit(SubmitRolloutRequest(task=task, sampling=SamplingParams()))
        await self.service.transition(record.rollout_id, RolloutState.RUNNING, reason="test")
        return f"{self.url}/proxy/{record.rollout_id}/v1/chat/completions", record.api_key

    async def steps(self, url: str, n: int) -> list[Step]:
        await self.service.proxy.drain()
        return await read_steps(self.bus, rollout_of(url), n)  # generous: a loaded machine delays the stream


@pytest.fixture
async def proxy(bus):
    stops: list = []
    clients: list[UpstreamClient] = []
    http = httpx.AsyncClient(timeout=5)

    async def build(replicas: dict[str, str], *, read_timeout: float = 30.0, max_inflight: int = 64) -> Proxy:
        router = Router([BackendReplica(replica_id=name, url=url, max_inflight=max_inflight)
                         for name, url in replicas.items()])
        settings = Settings(allow_host_paths=True, nats_url="nats://127.0.0.1:1",
                            backend_url=next(iter(replicas.values())))
        kv = await bus.kv(subjects.KV_ROLLOUTS)
        store = RolloutStore(kv)
        upstream = UpstreamClient(connect_timeout=2.0, read_timeout=read_timeout)
        clients.append(upstream)
        service = RolloutService(bus=bus, store=store, settings=settings, http=http, router=router,
                                 upstream=upstream)
        stop = asyncio.Event()
        stops.append((stop, asyncio.create_task(store.cache.watch(kv, stop))))
        port, stop = free_port(), asyncio.Event()
        stops.append((stop, asyncio.create_task(serve(stop, app=create_app(service), port=port))))
        for _ in range(200):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.02)
        for _ in range(200):
            if store.cache.watching:
                break
            await asyncio.sleep(0.01)
        return Proxy(bus, service, f"http://127.0.0.1:{port}")

    try:
        yield build
    finally:
        for stop, _ in stops:
            stop.set()
        await asyncio.gather(*(t for _, t in stops), return_exceptions=True)
        for client in clients:
            await client.aclose()
        await http.aclose()


def ask(stream: bool = False) -> dict:
    """An agent that asks for token ids itself (else the proxy keeps them out of its answers)."""
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream, "return_token_ids": True}


def rollout_of(url: str) -> str:
    return url.split("/proxy/")[1].split("/")[0]


async def post(url: str, key: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as agent:
        return await agent.post(url, json=ask(), headers={"authorization": f"Bearer {key}"})


async def read_events(response: httpx.Response) -> list[bytes]:
    raw = b"".join([piece async for piece in response.aiter_raw()])
    return [e for e in raw.split(b"\n\n") if e]


async def test_calls_share_one_keep_alive_connection_whole_chunked_and_streamed(proxy, tmp_path):
    streamed = chunked(*sse_events([7, 8, 9]))
    async with Backend([[whole(chat_answer([4, 5]))],
                        [CHUNKED_HEAD, chunked(chat_answer([6])[:20], chat_answer([6])[20:])],
                        [STREAM_HEAD + streamed[:9], streamed[9:40], streamed[40:]],
                        [whole(chat_answer([10]))]]) as backend:
        p = await proxy({"only": backend.url})
        url, key = await p.rollout(tmp_path)
        headers = {"authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=10, headers=headers) as agent:
            first = await agent.post(url, json=ask())
            second = await agent.post(url, json=ask())
            async with agent.stream("POST", url, json=ask(stream=True)) as third:
                events = await read_events(third)
            fourth = await agent.post(url, json=ask())
        assert [r.status_code for r in (first, second, fourth)] == [200, 200, 200]
        assert first.json()["choices"][0]["token_ids"] == [4, 5]
        assert second.content == chat_answer([6])  # a chunked answer, relayed as the backend sent it
        assert events[-1] == b"data: [DONE]" and len(events) == 4  # three tokens, [DONE] (no usage asked for)
        assert backend.connections == 1  # kept alive and reused for every call
        steps = await p.steps(url, 4)
    assert [s.completion_token_ids for s in steps] == [[4, 5], [6], [7, 8, 9], [10]]
    assert all(s.prompt_token_ids == [1, 2, 3] and not s.incomplete for s in steps)


async def test_a_stream_reaches_the_agent_event_by_event_while_the_backend_is_held_back(proxy, tmp_path):
    events = sse_events([11, 12, 13])
    go = asyncio.Event()
    body = chunked(*events)
    cut = len(b"%x\r\n" % len(events[0])) + len(events[0]) + 2  # the end of the first chunk
    # the rest arrives in 5-byte pieces: chunk sizes, data and CRLFs cut anywhere
    async with Backend([[STREAM_HEAD + body[:cut], go, *(body[i:i + 5] for i in range(cut, len(body), 5))]]) as backend:
        p = await proxy({"only": backend.url})
        url, key = await p.rollout(tmp_path)
        async with httpx.AsyncClient(timeout=10, headers={"authorization": f"Bearer {key}"}) as agent:
            async with agent.stream("POST", url, json=ask(stream=True)) as response:
                pieces = response.aiter_raw()
                first = await asyncio.wait_for(pieces.__anext__(), 5)  # before the backend sends more
                assert first == events[0]
                go.set()
                rest = b"".join([piece async for piece in pieces])
        assert first + rest == b"".join(e for e in events if b'"usage"' not in e)
        steps = await p.steps(url, 1)
    assert steps[0].completion_token_ids == [11, 12, 13] and steps[0].stream and not steps[0].incomplete


async def test_a_refused_connection_fails_over_to_the_next_replica(proxy, tmp_path):
    async with Backend([[whole(chat_answer([21]))]]) as healthy:
        p = await proxy({"dead": f"http://127.0.0.1:{free_port()}/v1", "healthy": healthy.url})
        url, key = await p.rollout(tmp_path)
        p.router.stick(rollout_of(url), "dead")
        answer = await post(url, key)
        assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"] == [21]
        steps = await p.steps(url, 1)
    assert steps[0].backend_replica == "healthy"
    assert [f.replica for f in steps[0].failovers] == ["dead"]
    assert "ClientConnectorError" in steps[0].failovers[0].error
    assert not p.router.replicas["dead"].healthy


async def test_a_keep_alive_connection_the_backend_dropped_is_sent_again_on_a_new_one(proxy, tmp_path):
    # the backend answers once, then closes the connection on the next request without answering
    async with Backend([[whole(chat_answer([31]))], [None], [whole(chat_answer([32]))]]) as backend:
        p = await proxy({"only": backend.url})
        url, key = await p.rollout(tmp_path)
        async with httpx.AsyncClient(timeout=10, headers={"authorization": f"Bearer {key}"}) as agent:
            first = await agent.post(url, json=ask())
            second = await agent.post(url, json=ask())
        assert (first.status_code, second.status_code) == (200, 200)
        assert second.json()["choices"][0]["token_ids"] == [32]
        assert backend.connections == 2 and len(backend.requests) == 3  # the dropped request went again, once
        steps = await p.steps(url, 2)
    assert [s.failovers for s in steps] == [[], []] and p.router.replicas["only"].healthy


async def test_a_whole_answer_cut_mid_body_fails_over_before_anything_reaches_the_agent(proxy, tmp_path):
    async with Backend([[b"HTTP/1.1 200 OK\r\ncontent-length: 400\r\n\r\n{\"cho", None]]) as dying, \
            Backend([[whole(chat_answer([41]))]]) as healthy:
        p = await proxy({"dying": dying.url, "healthy": healthy.url})
        url, key = await p.rollout(tmp_path)
        p.router.stick(rollout_of(url), "dying")
        answer = await post(url, key)
        assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"] == [41]
        steps = await p.steps(url, 1)
    assert [f.replica for f in steps[0].failovers] == ["dying"] and steps[0].backend_replica == "healthy"


async def test_a_backend_closing_mid_stream_gives_the_agent_an_error_and_records_an_incomplete_step(proxy, tmp_path):
    events = sse_events([51, 52, 53])
    async with Backend([[STREAM_HEAD + chunked(*events[:2])[:-5], None]]) as backend:  # no last chunk: cut
        p = await proxy({"only": backend.url})
        url, key = await p.rollout(tmp_path)
        async with httpx.AsyncClient(timeout=10, headers={"authorization": f"Bearer {key}"}) as agent:
            async with agent.stream("POST", url, json=ask(stream=True)) as response:
                got = await read_events(response)
        assert response.status_code == 200  # the stream had started: the error comes in it
        assert got[:2] == [e.rstrip(b"\n") for e in events[:2]]
        error = json.loads(got[2][len(b"data: "):])["error"]
        assert error["code"] == "upstream_error" and "died mid-stream" in error["message"]
        steps = await p.steps(url, 1)
    step = steps[0]
    assert step.incomplete and "died mid-stream" in step.error and step.completion_token_ids == [51, 52]
    assert not p.router.replicas["only"].healthy  # the rollout's next call moves


async def test_an_agent_leaving_mid_stream_frees_the_replica_slot_and_the_backend_connection(proxy, tmp_path):
    events = sse_events([61, 62])
    never = asyncio.Event()
    async with Backend([[STREAM_HEAD + chunked(events[0])[:-5], never],  # holds the rest back for good
                        [whole(chat_answer([63]))]]) as backend:
        p = await proxy({"only": backend.url}, max_inflight=1)  # a leaked slot would hold the next call
        url, key = await p.rollout(tmp_path)
        headers = {"authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=10, headers=headers) as agent:
            async with agent.stream("POST", url, json=ask(stream=True)) as response:
                assert await asyncio.wait_for(response.aiter_raw().__anext__(), 5) == events[0]
                assert p.router.replicas["only"].inflight == 1
        for _ in range(200):  # the agent is gone
            if p.router.replicas["only"].inflight == 0 and backend.closed_by_client:
                break
            await asyncio.sleep(0.02)
        assert p.router.replicas["only"].inflight == 0 and backend.closed_by_client == 1
        async with httpx.AsyncClient(timeout=10, headers=headers) as agent:
            after = await agent.post(url, json=ask())
        assert after.status_code == 200 and after.json()["choices"][0]["token_ids"] == [63]
        steps = await p.steps(url, 2)
    assert steps[0].incomplete and steps[0].error == "client disconnected mid-stream"
    assert steps[0].completion_token_ids == [61] and not steps[1].incomplete
    assert p.router.replicas["only"].healthy  # the agent left; the replica did nothing wrong


async def test_a_backend_that_never_answers_times_out_into_a_clear_error(proxy, tmp_path):
    async with Backend([[asyncio.Event()]]) as backend:  # reads the request, never answers
        p = await proxy({"only": backend.url}, read_timeout=0.3)
        url, key = await p.rollout(tmp_path)
        answer = await post(url, key)
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["code"] == "upstream_error" and "Timeout on reading data" in error["message"]
    assert p.router.replicas["only"].inflight == 0
