"""Fast routes (``arena_core.fastroutes``) under ``arena_core.runtime.serve``, over real sockets:
answered by the protocol, beside an ASGI app on the same connection, with uvicorn's
connection semantics kept (keep-alive, pipelining, 100-continue, HTTP/1.0, shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import httpx
import pytest

from arena_core.fastroutes import BodyTooLarge, ClientGone, Exchange, protocol_with_routes
from arena_core.runtime import serve

LIMIT = 1024


class App:
    """An ASGI app that echoes its path, carrying fast routes under ``/fast/``."""

    def __init__(self) -> None:
        self.asgi_paths: list[str] = []
        self.fast_routes = Routes(self)
        self.cancelled = asyncio.Event()
        self.read_errors: list[str] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.asgi_paths.append(scope["path"])
        body = b"asgi:" + scope["path"].encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})


class Routes:
    body_limit = LIMIT

    def __init__(self, app: App):
        self.app = app

    def match(self, method: bytes, target: bytes):
        if method != b"POST" or not target.startswith(b"/fast/"):
            return None
        return getattr(self, "_" + target[6:].split(b"?")[0].decode().replace("-", "_"), None)

    async def _echo(self, ex: Exchange) -> None:
        try:
            body = await ex.read()
        except (BodyTooLarge, ClientGone) as exc:
            self.app.read_errors.append(type(exc).__name__)
            await ex.respond(413 if isinstance(exc, BodyTooLarge) else 400, str(exc).encode(), [])
            return
        await ex.respond(200, b"echo:" + body, [(b"content-type", b"text/plain")])

    async def _stream(self, ex: Exchange) -> None:
        await ex.read()
        ex.begin_stream(200, [(b"content-type", b"text/plain")])
        for i in range(3):
            await ex.write(b"piece%d;" % i)
        await ex.write(b"end", last=True)

    async def _hang(self, ex: Exchange) -> None:
        await ex.read()
        ex.begin_stream(200, [(b"content-type", b"text/plain")])
        ex.cancel_on_disconnect = True
        await ex.write(b"first")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.app.cancelled.set()
            raise

    async def _slow(self, ex: Exchange) -> None:
        await ex.read()
        await asyncio.sleep(0.5)
        await ex.respond(200, b"late but whole", [])

    async def _boom(self, ex: Exchange) -> None:
        raise RuntimeError("a bug in the handler")

    async def _boom_stream(self, ex: Exchange) -> None:
        ex.begin_stream(200, [(b"content-type", b"text/plain")])
        raise RuntimeError("a bug before the stream's first piece")

    async def _early(self, ex: Exchange) -> None:  # answers without reading the body (as a 401 does)
        await ex.respond(401, b"no", [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def server():
    app, port, stop = App(), _free_port(), asyncio.Event()
    task = asyncio.create_task(serve(stop, app=app, port=port))
    for _ in range(200):
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        await asyncio.sleep(0.02)
    yield app, port, stop, task
    stop.set()
    assert await asyncio.wait_for(task, 30) == 0


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if line)}
    if status == 100:
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                assert await reader.readexactly(2) == b"\r\n"
                return status, headers, body
            body += await reader.readexactly(size)
            assert await reader.readexactly(2) == b"\r\n"
    return status, headers, await asyncio.wait_for(reader.read(), 10)  # until the server closes


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: t", f"content-length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def test_fast_and_asgi_routes_share_one_keep_alive_connection(server):
    app, port, _, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post("/fast/echo", b"one"))
    assert (await read_response(reader))[::2] == (200, b"echo:one")
    writer.write(b"GET /elsewhere HTTP/1.1\r\nhost: t\r\n\r\n")
    assert (await read_response(reader))[::2] == (200, b"asgi:/elsewhere")
    writer.write(post("/fast/echo?x=1", b"two"))
    status, headers, body = await read_response(reader)
    assert (status, body) == (200, b"echo:two")
    assert headers["content-type"] == "text/plain" and "date" in headers and "connection" not in headers
    assert app.asgi_paths == ["/elsewhere"]  # the fast route never reached the ASGI app
    writer.close()


async def test_a_body_in_pieces_and_a_chunked_body_are_read_whole(server):
    _, port, _, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = post("/fast/echo", b"abcdef")
    for piece in (request[:-6], request[-6:-3], request[-3:]):  # the head, then the body in two writes
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.05)
    assert (await read_response(reader))[::2] == (200, b"echo:abcdef")
    writer.write(b"POST /fast/echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n")
    assert (await read_response(reader))[::2] == (200, b"echo:abcdefg")
    writer.close()


async def test_a_body_over_the_limit_gets_413_declared_or_not(server):
    app, port, _, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /fast/echo HTTP/1.1\r\nhost: t\r\ncontent-length: {LIMIT + 1}\r\n\r\n".encode())
    status, _, body = await read_response(reader)  # answered before a byte of the body was sent
    assert status == 413 and f"of {LIMIT + 1} bytes exceeds the {LIMIT}-byte limit" in body.decode()
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chunk = b"x" * 600
    writer.write(b"POST /fast/echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
                 + (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 2 + b"0\r\n\r\n")
    assert (await read_response(reader))[0] == 413
    writer.write(post("/fast/echo", b"small"))  # the rest of the large body was read and dropped
    assert (await read_response(reader))[::2] == (200, b"echo:small")
    assert app.read_errors == ["BodyTooLarge", "BodyTooLarge"]
    writer.close()


async def test_a_client_gone_before_the_whole_body_is_seen_by_the_handler(server):
    app, port, _, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post("/fast/echo", b"0123456789")[:-5])  # half the body, then gone
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()
    for _ in range(100):
        if app.read_errors:
            break
        await asyncio.sleep(0.05)
    assert app.read_errors == ["ClientGone"]


async def test_expect_100_continue_is_answered_when_the_body_is_read(server):
    _, port, _, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post("/fast/echo", b"")[:-2].replace(b"content-length: 0", b"content-length: 4")
                 + b"expect: 100-continue\r\n\r\n")
    assert (await read_response(reader))[0] == 100
    writer.write(b"body")
    assert (await read_response(reader))[::2] == (200, b"echo:body")
    writer.close()


async def test_pipelined_requests_are_answered_in_order(server):
    _, port, _, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post("/fast/slow", b"1") + b"GET /between HTTP/1.1\r\nhost: t\r\n\r\n" + post("/fast/echo", b"3"))
    answers = [(await read_response(reader))[::2] for _ in range(3)]
    assert answers == [(200, b"late but whole"), (200, b"asgi:/between"), (200, b"echo:3")]
    writer.close()


async def test_a_stream_is_chunked_on_http11_and_ends_with_the_connection_on_http10(server):
    _, port, _, _ = server
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        answer = await client.post("/fast/stream", content=b"{}")
        assert answer.status_code == 200 and answer.headers["transfer-encoding"] == "chunked"
        assert answer.content == b"piece0;piece1;piece2;end"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /fast/stream HTTP/1.0\r\ncontent-length: 2\r\n\r\n{}")
    status, headers, body = await read_response(reader)  # read until the server closes
    assert (status, body) == (200, b"piece0;piece1;piece2;end")
    assert "transfer-encoding" not in headers and headers["connection"] == "close"
    writer.close()


async def test_a_client_gone_mid_stream_cancels_the_handler(server):
    app, port, _, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post("/fast/hang", b"{}"))
    await asyncio.wait_for(reader.readuntil(b"first\r\n"), 10)
    writer.close()
    await asyncio.wait_for(app.cancelled.wait(), 10)


@pytest.mark.parametrize("path", ["/fast/boom", "/fast/boom-stream"])  # before a stream's first piece too
async def test_a_handler_error_is_a_500_and_the_connection_closes(server, path):
    _, port, _, _ = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post(path, b"{}"))
    status, headers, body = await read_response(reader)
    assert status == 500 and headers["connection"] == "close" and b'"internal"' in body
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed
    writer.close()


async def test_an_answer_before_the_body_leaves_the_connection_under_the_keep_alive_timeout():
    import uvicorn
    from uvicorn.server import ServerState

    from arena_core.runtime import _corked_http_protocol

    app = App()
    config = uvicorn.Config(app, timeout_keep_alive=0.3, log_level="warning", lifespan="off")
    config.load()
    protocol_class = _corked_http_protocol(app.fast_routes)
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    await loop.connect_accepted_socket(lambda: protocol_class(config=config, server_state=ServerState(),
                                                              app_state={}), ours)
    reader, writer = await asyncio.open_connection(sock=theirs)
    request = post("/fast/early", b"body")
    writer.write(request[:-4])
    assert (await read_response(reader))[::2] == (401, b"no")  # answered before the body was sent
    await asyncio.sleep(0.1)
    writer.write(request[-4:])  # the body comes after the answer...
    assert await asyncio.wait_for(reader.read(), 10) == b""  # ...and the idle connection still times out
    writer.close()


async def test_shutdown_waits_for_a_fast_request_in_flight(server):
    _, port, stop, task = server
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        pending = asyncio.create_task(client.post("/fast/slow", content=b"{}"))
        await asyncio.sleep(0.2)
        stop.set()
        answer = await pending
    assert (answer.status_code, answer.content) == (200, b"late but whole")
    assert await asyncio.wait_for(task, 30) == 0


def test_a_protocol_without_the_parser_hooks_serves_everything_through_asgi(caplog):
    class Bare(asyncio.Protocol):
        pass

    assert protocol_with_routes(Bare, Routes(App.__new__(App))) is Bare
    assert "served through ASGI" in caplog.text


async def test_the_server_yields_its_cpu_once_per_answer_after_the_last_write(server, monkeypatch):
    import arena_core.fastroutes as fastroutes

    _, port, _, _ = server
    yields: list[int] = []
    monkeypatch.setattr(fastroutes, "YIELD_AFTER_ANSWER", True)
    monkeypatch.setattr(fastroutes.os, "sched_yield", lambda: yields.append(1))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        assert (await client.post("/fast/echo", content=b"x")).content == b"echo:x"
        assert len(yields) == 1
        assert (await client.post("/fast/stream", content=b"{}")).content == b"piece0;piece1;piece2;end"
        assert len(yields) == 2  # once for the stream, after its end: not after each piece
        assert (await client.get("/elsewhere")).content == b"asgi:/elsewhere"
        assert len(yields) == 2  # the ASGI app's answers are uvicorn's
