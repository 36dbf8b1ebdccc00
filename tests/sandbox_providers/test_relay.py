"""The host side of the sandbox's LLM relay (``arena_sandbox_providers.relay``) between real
sockets: an HTTP/1.1 upstream standing in for the proxy and raw clients standing in for the
agent. What it lets through, what it answers itself, keep-alive, HTTP/1.0, 100-continue, and
which broken connections count as a call cut on Arena's side. The relay from inside a real
sandbox, against the real rollout service: tests/security/test_agent_reaches_only_its_own_proxy.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from arena_sandbox_providers import relay

PREFIX = "/proxy/r-1"
OWN = f"{PREFIX}/v1/chat/completions".encode()


@pytest.mark.parametrize(("method", "target", "route"), [
    (b"POST", b"/proxy/r-1/v1/chat/completions", "/v1/chat/completions"),
    (b"POST", b"/proxy/r-1/v1/messages?beta=true", "/v1/messages"),
    (b"POST", b"/proxy/r-1/v1/messages/count_tokens", "/v1/messages/count_tokens"),
    (b"GET", b"/proxy/r-1/v1/models", "/v1/models"),
    (b"POST", b"/proxy/r-1/tokenize", "/tokenize"),
    (b"POST", b"/proxy/r-1/v1/responses", "/v1/responses"),
    (b"POST", b"/proxy/r-1/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse",
     "/v1beta/models/gemini-2.5-pro:streamGenerateContent"),
    (b"POST", b"/proxy/r-1/v1/models/gemini-2.5-pro:generateContent", "/v1/models/gemini-2.5-pro:generateContent"),
    (b"POST", b"/proxy/r-1/v1beta/models/g:countTokens?key=k", "/v1beta/models/g:countTokens"),
    (b"GET", b"/proxy/r-1/v1beta/models/g:generateContent", None),
    (b"POST", b"/proxy/r-1/v1beta/models/g:embedContent", None),
    (b"POST", b"/proxy/r-1/v1beta/models/a/b:generateContent", None),
    (b"POST", b"/proxy/r-1/v1beta/models/g%3AgenerateContent", None),
    (b"POST", b"/proxy/r-2/v1beta/models/g:generateContent", None),
    (b"GET", b"/proxy/r-1/v1/chat/completions", None),
    (b"POST", b"/proxy/r-2/v1/chat/completions", None),
    (b"POST", b"/proxy/r-1/../r-2/v1/chat/completions", None),
    (b"POST", b"/proxy/r-1/v1/./chat/completions", None),
    (b"POST", b"/proxy/r-1/v1/chat%2Fcompletions", None),
    (b"POST", b"http://127.0.0.1/proxy/r-1/v1/chat/completions", None),
    (b"GET", b"/v1/rollouts", None),
    (b"OPTIONS", b"*", None),
    (b"POST", b"/proxy/r-1/v1/chat/completions#x", None),
])
def test_route_of_lets_through_only_the_rollouts_proxy_routes(method, target, route):
    assert relay.route_of(method, target, PREFIX) == route


@pytest.mark.parametrize(("target", "anthropic", "shape"), [
    (b"/v1/rollouts", False, {"code": "not_found", "message": "m"}),
    (b"/proxy/r-1/v1/embeddings", False, {"message": "m", "type": "not_found_error", "param": None,
                                          "code": "not_found"}),
    (b"/proxy/r-1/v1/responses?x=1", False, {"message": "m", "type": "not_found_error", "param": None,
                                             "code": "not_found"}),
    (b"/proxy/r-1/v1/messages/x", False, {"type": "not_found_error", "message": "m"}),
    (b"/proxy/r-1/v1beta/models/g:embedContent?key=k", False, {"code": 404, "message": "m", "status": "NOT_FOUND"}),
])
def test_a_refusal_has_the_error_shape_of_the_api_its_path_names(target, anthropic, shape):
    assert json.loads(relay.error_body(404, "not_found", "m", target, anthropic))["error"] == shape


class Upstream:
    """A minimal HTTP/1.1 server: answers each request with its own target and body, whole or
    (``stream``) chunked; ``hang`` keeps the request unanswered, ``half`` breaks off an answer
    after its first event; counts what it saw."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.hang = asyncio.Event()
        self.half = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> Upstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ", 2)[1]
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.seen.append(target)
                if self.hang.is_set():
                    await asyncio.sleep(3600)
                if self.half.is_set():  # the head and one event, then the process dies
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
                    await writer.drain()
                    writer.transport.abort()
                    return
                answer = json.dumps({"target": target.decode(), "body": body.decode()}).encode()
                if b'"stream"' in body:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                    for piece in (b"data: 1\n\n", b"data: [DONE]\n\n"):
                        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(answer), answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()

    async def stop(self) -> None:
        self.server.close()


@pytest.fixture
async def pair():
    upstream = await Upstream().start()
    relay_ = relay.Relay("127.0.0.1", upstream.port, PREFIX)
    server = await asyncio.start_server(relay_.serve, "127.0.0.1", 0)
    yield upstream, relay_, server.sockets[0].getsockname()[1]
    relay_.close()
    server.close()
    await upstream.stop()
    await asyncio.sleep(0.1)  # the relay's connections see their end


def _request(method: bytes, target: bytes, body: bytes = b"", *, version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    return (method + b" " + target + b" HTTP/" + version + b"\r\nhost: x\r\ncontent-length: %d\r\n" % len(body)
            + extra + b"\r\n" + body)


async def _answers(reader: asyncio.StreamReader, n: int) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    out = []
    for _ in range(n):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in lines[1:] if line)}
        if status == 100:
            continue
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while (size := int((await reader.readline()).strip(), 16)) != 0:
                body += (await reader.readexactly(size + 2))[:-2]
            await reader.readline()
        else:
            body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
        out.append((status, headers, body))
    return out


async def test_own_calls_are_kept_alive_pipelined_and_streamed_and_the_rest_refused_without_reaching_upstream(pair):
    upstream, relay_, port = pair
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(b"POST", OWN, b'{"a": 1}') + _request(b"GET", b"/v1/rollouts")
                 + _request(b"POST", b"/proxy/r-2/v1/chat/completions", b'{"b": 2}')
                 + _request(b"POST", OWN, b'{"stream": true}'))
    answers = await _answers(reader, 4)
    assert [a[0] for a in answers] == [200, 404, 404, 200]
    assert json.loads(answers[0][2]) == {"target": OWN.decode(), "body": '{"a": 1}'}
    assert answers[1][1][b"x-arena-relay"] == b"refused"
    assert json.loads(answers[1][2]) == {"error": {"code": "not_found", "message": "no route for GET /v1/rollouts"}}
    assert json.loads(answers[2][2])["error"]["type"] == "not_found_error"  # OpenAI's shape on a proxy path
    assert answers[3][2] == b"data: 1\n\ndata: [DONE]\n\n"
    assert upstream.seen == [OWN, OWN]  # the refused requests never reached it
    assert (relay_.calls, relay_.refused, relay_.fault) == (2, 2, None)
    writer.close()


async def test_an_http_1_0_agent_and_one_waiting_for_100_continue_get_their_answers(pair):
    upstream, relay_, port = pair
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(b"POST", OWN, b'{"stream": true}', version=b"1.0"))
    head, _, body = (await reader.read()).partition(b"\r\n\r\n")  # HTTP/1.0: the answer ends with the connection
    assert head.split(b" ")[1] == b"200", head
    assert body == b"data: 1\n\ndata: [DONE]\n\n"
    writer.close()

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"c": 3}'
    writer.write(b"POST " + OWN + b" HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body))
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 ")
    writer.write(body)
    (status, _, answer), = await _answers(reader, 1)
    assert status == 200 and json.loads(answer)["body"] == '{"c": 3}'
    writer.close()
    assert relay_.fault is None


async def test_a_proxy_that_dies_mid_call_is_a_cut_and_an_agent_that_leaves_is_not(pair):
    upstream, relay_, port = pair
    upstream.hang.set()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(b"POST", OWN, b"{}"))
    await _until(lambda: upstream.seen)
    writer.close()  # the agent gives up: no fault
    await asyncio.sleep(0.1)
    assert relay_.fault is None

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(b"POST", OWN, b"{}"))
    await _until(lambda: len(upstream.seen) == 2)
    await upstream.stop()
    for task in [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Upstream._serve"]:
        task.cancel()  # its connections close with it, as a killed process's do
    (status, headers, body), = await _answers(reader, 1)
    assert status == 502 and headers[b"x-should-retry"] == b"true"
    assert relay_.fault == "the proxy closed the connection before its answer ended"


async def test_a_proxy_that_dies_mid_answer_is_a_cut_and_the_agent_gets_what_was_sent_and_no_more(pair):
    upstream, relay_, port = pair
    upstream.half.set()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(b"POST", OWN, b'{"stream": true}'))
    received = await asyncio.wait_for(reader.read(), 5)  # the relay closes the agent's connection
    assert received.startswith(b"HTTP/1.1 200 OK\r\n") and received.endswith(b"data: 1\n\n\r\n")
    assert b"502" not in received
    assert relay_.fault == "the proxy closed the connection before its answer ended"
    writer.close()


async def test_a_refused_connection_to_the_proxy_is_a_cut():
    closed = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = closed.sockets[0].getsockname()[1]
    closed.close()
    await closed.wait_closed()
    relay_ = relay.Relay("127.0.0.1", port, PREFIX)
    server = await asyncio.start_server(relay_.serve, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        writer.write(_request(b"GET", b"/v1/rollouts") + _request(b"POST", OWN, b"{}"))
        answers = await _answers(reader, 2)
        assert [a[0] for a in answers] == [404, 502]
        assert relay_.fault is not None and relay_.fault.startswith("connection to the proxy at 127.0.0.1:")
        writer.close()
    finally:
        relay_.close()
        server.close()


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
