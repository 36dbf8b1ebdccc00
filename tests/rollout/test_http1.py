"""The proxy's upstream HTTP/1.1 client against real sockets on 127.0.0.1.

Each test runs a tiny asyncio server that writes exactly the bytes under test (split
at awkward places, closed at awkward moments), so framing, keep-alive, retries and
timeouts are checked on a real connection."""

from __future__ import annotations

import asyncio
import json

import pytest

from arena_stack.natsserver import free_port
from arena_stack.scripted_llm import Script, ScriptedLLM, ScriptedResponse, create_app
from arena_core.runtime import serve
from arena_rollout.proxy.http1 import ConnectError, Http1Client, ReadTimeout, RemoteProtocolError


class Canned:
    """A server that answers each request on a connection with the next scripted reply.

    A reply is a list of byte pieces written with a short pause between them; ``None``
    as a piece closes the connection there, an ``asyncio.Event`` waits for it to be set."""

    def __init__(self, replies: list[list[bytes | None | asyncio.Event]], keep_open: bool = True):
        self.replies = replies
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Canned:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

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
                        writer.close()
                        return
                    if isinstance(piece, asyncio.Event):
                        await piece.wait()
                        continue
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.002)
            await reader.read()  # hold the connection open until the client closes it
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"


async def test_content_length_body_split_anywhere_and_connection_reused():
    body = json.dumps({"choices": [{"message": {"content": "hi"}}]}).encode()
    whole = OK_HEAD + b"content-length: %d\r\n\r\n" % len(body) + body
    # the same answer cut in several places, including inside the status line and the CRLFs
    replies = [[whole[:7], whole[7:40], whole[40:]], [whole[: len(OK_HEAD) + 3], whole[len(OK_HEAD) + 3:]], [whole]]
    async with Canned(replies) as server:
        client = Http1Client(read_timeout=5)
        for _ in range(3):
            response = await client.post(server.url, b'{"x": 1}')
            assert response.status_code == 200
            assert response.headers["content-type"] == "application/json"
            assert await response.aread() == body
        await client.aclose()
    assert server.connections == 1  # kept alive and reused
    assert server.requests[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert server.requests[0].endswith(b'\r\n\r\n{"x": 1}')


async def test_chunked_stream_arrives_piece_by_piece_with_extensions_and_trailers():
    events = [b'data: {"n": %d}\n\n' % i for i in range(5)]
    stream = chunked(*events)
    stream = stream.replace(b"\r\n0\r\n\r\n", b"\r\n0;ext=1\r\nx-trailer: yes\r\n\r\n")
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"
    pieces = [head + stream[:5]] + [stream[i:i + 3] for i in range(5, len(stream), 3)]
    async with Canned([pieces, [head + chunked(b"again")]]) as server:
        client = Http1Client(read_timeout=5)
        response = await client.post(server.url, b"{}")
        got = [piece async for piece in response.aiter_raw()]
        assert b"".join(got) == b"".join(events)
        assert len(got) > 1  # relayed as it came, not buffered to the end
        again = await client.post(server.url, b"{}")  # the trailer was consumed: the connection is clean
        assert await again.aread() == b"again"
        await client.aclose()
    assert server.connections == 1


async def test_a_chunked_answer_cut_at_every_byte_reads_whole_on_one_connection():
    events = [b'data: {"n": %d}\n\n' % i for i in range(3)]
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    answer = head + chunked(*events).replace(b"\r\n0\r\n\r\n", b"\r\n0;x=1\r\nx-t: y\r\n\r\n")
    replies = [[answer[:cut], answer[cut:]] for cut in range(1, len(answer))]
    async with Canned(replies) as server:
        client = Http1Client(read_timeout=5)
        for cut in range(1, len(answer)):
            response = await client.post(server.url, b"{}")
            assert await response.aread() == b"".join(events), cut
        await client.aclose()
    assert server.connections == 1  # every answer ended exactly where it should: the connection stayed clean


async def test_a_whole_answer_is_handed_over_once_its_body_is_in_and_a_cut_one_fails_the_post():
    go = asyncio.Event()
    body = b'{"choices": []}'
    async with Canned([[OK_HEAD + b"content-length: %d\r\n\r\n" % len(body), go, body],
                       [OK_HEAD + b"transfer-encoding: chunked\r\n\r\n", chunked(b"a", b"b")],
                       [OK_HEAD + b"content-length: 10\r\n\r\nhalf", None]]) as server:
        client = Http1Client(read_timeout=5)
        pending = asyncio.create_task(client.post(server.url, b"{}", whole=True))
        await asyncio.sleep(0.2)
        assert not pending.done()  # the head is in, the body is not: nothing handed over yet
        go.set()
        response = await pending
        assert response.status_code == 200 and await response.aread() == body
        assert await (await client.post(server.url, b"{}", whole=True)).aread() == b"ab"
        with pytest.raises(RemoteProtocolError, match="closed mid-answer"):  # for the proxy: a failover
            await client.post(server.url, b"{}", whole=True)
        await client.aclose()
    assert server.connections == 1


async def test_body_until_close_and_connection_close_are_not_reused():
    async with Canned([[b"HTTP/1.1 200 OK\r\n\r\nuntil the end", None]]) as first, \
            Canned([[OK_HEAD + b"connection: close\r\ncontent-length: 2\r\n\r\nok"], [OK_HEAD + b"content-length: 0\r\n\r\n"]]) as second:
        client = Http1Client(read_timeout=5)
        response = await client.post(first.url, b"{}")
        assert await response.aread() == b"until the end"
        assert await (await client.post(second.url, b"{}")).aread() == b"ok"
        assert await (await client.post(second.url, b"{}")).aread() == b""
        await client.aclose()
    assert second.connections == 2


async def test_informational_answer_is_skipped():
    reply = [b"HTTP/1.1 100 Continue\r\n\r\n", OK_HEAD + b"content-length: 4\r\n\r\ndone"]
    async with Canned([reply]) as server:
        client = Http1Client(read_timeout=5)
        response = await client.post(server.url, b"{}")
        assert (response.status_code, await response.aread()) == (200, b"done")
        await client.aclose()


async def test_a_reused_connection_closed_by_the_server_is_retried_once_on_a_new_one():
    body = OK_HEAD + b"content-length: 2\r\n\r\nok"
    # first connection: one answer, then the server drops it without answering the second request
    async with Canned([[body], [None], [body]]) as server:
        client = Http1Client(read_timeout=5)
        assert await (await client.post(server.url, b"{}")).aread() == b"ok"
        assert await (await client.post(server.url, b"{}")).aread() == b"ok"
        await client.aclose()
    assert server.connections == 2
    assert len(server.requests) == 3  # the dropped request was sent again, once


async def test_a_new_connection_that_breaks_mid_answer_is_an_error_not_a_short_body():
    async with Canned([[OK_HEAD + b"content-length: 100\r\n\r\npartial", None]]) as server:
        client = Http1Client(read_timeout=5)
        response = await client.post(server.url, b"{}")
        with pytest.raises(RemoteProtocolError, match="closed mid-answer"):
            await response.aread()
        await client.aclose()
    async with Canned([[None]]) as server:  # a fresh connection closed before any answer: not retried
        client = Http1Client(read_timeout=5)
        with pytest.raises(RemoteProtocolError):
            await client.post(server.url, b"{}")
        await client.aclose()
    assert len(server.requests) == 1


async def test_garbage_and_oversized_heads_are_protocol_errors():
    async with Canned([[b"SSH-2.0-OpenSSH\r\n\r\n"]]) as server:
        client = Http1Client(read_timeout=5)
        with pytest.raises(RemoteProtocolError, match="status line"):
            await client.post(server.url, b"{}")
        await client.aclose()
    big = b"HTTP/1.1 200 OK\r\n" + b"x-filler: " + b"a" * 70_000 + b"\r\n\r\n"
    async with Canned([[big]]) as server:
        client = Http1Client(read_timeout=5)
        with pytest.raises(RemoteProtocolError, match="size limit"):
            await client.post(server.url, b"{}")
        await client.aclose()
    for bad, why in ((b"zz\r\n", "chunk size"), (b"-5\r\nabc", "chunk size"),
                     (b"2\r\nok\r\n3\r\nabcXY0\r\n\r\n", "not followed by CRLF")):
        async with Canned([[b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + bad]]) as server:
            client = Http1Client(read_timeout=5)
            response = await client.post(server.url, b"{}")
            with pytest.raises(RemoteProtocolError, match=why):
                await response.aread()
            await client.aclose()


async def test_timeouts_and_refused_connections():
    async with Canned([[b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nslow"]]) as server:
        client = Http1Client(read_timeout=0.3)
        response = await client.post(server.url, b"{}")
        with pytest.raises(ReadTimeout):
            await response.aread()
        await client.aclose()
    async with Canned([[]]) as server:  # reads the request, never answers
        client = Http1Client(read_timeout=0.3)
        with pytest.raises(ReadTimeout):
            await client.post(server.url, b"{}")
        await client.aclose()
    client = Http1Client(connect_timeout=2)
    with pytest.raises(ConnectError, match="could not connect"):
        await client.post(f"http://127.0.0.1:{free_port()}/v1/x", b"{}")
    with pytest.raises(ConnectError, match="unsupported upstream URL"):
        await client.post("ftp://127.0.0.1/v1/x", b"{}")
    await client.aclose()


async def test_a_slow_reader_pauses_the_socket_and_loses_nothing():
    payload = bytes(range(256)) * 16 * 1024  # 4 MiB, over the 1 MiB high-water mark
    head = OK_HEAD + b"content-length: %d\r\n\r\n" % len(payload)
    async with Canned([[head + payload]]) as server:
        client = Http1Client(read_timeout=5)
        response = await client.post(server.url, b"{}")
        got = bytearray()
        async for piece in response.aiter_raw():
            got += piece
            await asyncio.sleep(0.01)  # slower than the socket
        assert bytes(got) == payload
        await client.aclose()


async def test_closing_a_response_early_drops_its_connection():
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    ok = OK_HEAD + b"content-length: 2\r\n\r\nok"
    async with Canned([[head + b"5\r\nfirst\r\n"], [ok]]) as server:
        client = Http1Client(read_timeout=5)
        response = await client.post(server.url, b"{}")
        assert await response.aiter_raw().__anext__() == b"first"
        await response.aclose()  # mid-stream: the connection cannot be reused
        assert await (await client.post(server.url, b"{}")).aread() == b"ok"
        await client.aclose()
    assert server.connections == 2


async def test_many_concurrent_streams_against_the_scripted_llm():
    """Short chunked answers finish before their caller resumes; the next caller takes the
    connection at once. Every one of them must still get its own answer (this once hung)."""
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="one two three four")]))
    port, stop = free_port(), asyncio.Event()
    server = asyncio.create_task(serve(stop, app=create_app(llm), port=port))
    client = Http1Client(read_timeout=10)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}).encode()
    try:
        for _ in range(200):
            try:
                await (await client.post(url, body)).aread()
                break
            except ConnectError:
                await asyncio.sleep(0.02)

        async def calls() -> int:
            done = 0
            for _ in range(15):
                answer = await (await client.post(url, body)).aread()
                assert answer.rstrip().endswith(b"data: [DONE]")
                done += 1
            return done

        assert sum(await asyncio.wait_for(asyncio.gather(*(calls() for _ in range(16))), 60)) == 240
    finally:
        await client.aclose()
        stop.set()
        await server


async def test_a_replica_that_dies_mid_whole_answer_fails_over_before_anything_is_relayed():
    from arena_core.schemas import BackendReplica
    from arena_rollout.proxy.routing import Router
    from arena_rollout.proxy.upstream import open_call

    body = b'{"choices": [{"index": 0}]}'
    async with Canned([[OK_HEAD + b"content-length: 100\r\n\r\n{\"cho", None]]) as dying, \
            Canned([[OK_HEAD + b"content-length: %d\r\n\r\n" % len(body), body]]) as healthy:
        router = Router([BackendReplica(replica_id="a", url=f"http://127.0.0.1:{dying.port}/v1"),
                         BackendReplica(replica_id="b", url=f"http://127.0.0.1:{healthy.port}/v1")])
        router.stick("r1", "a")
        client = Http1Client(read_timeout=5)
        up = await open_call(router=router, http=client, rollout_id="r1", model="", path="/chat/completions",
                             body=b"{}", whole=True)
        assert up.replica.id == "b" and await up.response.aread() == body
        assert [f.replica for f in up.failovers] == ["a"] and "closed mid-answer" in up.failovers[0].error
        assert not router.replicas["a"].healthy and router.sticky("r1") == "b"
        await up.close()
        await client.aclose()
