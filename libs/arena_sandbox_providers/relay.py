"""The host side of a sandbox's LLM relay: HTTP/1.1 in from the agent, only its rollout's proxy routes out.

Every connection the agent opens to ``127.0.0.1:<port>`` inside its sandbox ends here (through the
sandbox's network namespace, or the shim's Unix socket). Each request is parsed (h11) and either
forwarded to the rollout service, when it is one of the proxy routes of *this* rollout
(``/proxy/{rollout_id}/...``: :data:`arena_core.proxy_routes.ROUTES`, the list the rollout
service's proxy-only port lets through too), or answered here with the API's 404 error shape
without reaching the API. Answers stream back as they come (server-sent events included) and a
connection is kept alive between calls. A call whose connection to the proxy was refused or broke
before its answer ended (Arena's side died, not the backend's answer) is remembered: ``fault``.
See docs/sandbox.md ("The LLM relay").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import h11
import httptools
import msgspec

from arena_core import llm_errors
from arena_core.proxy_routes import ROUTES as ROUTES  # re-exported: the routes it lets through
from arena_core.proxy_routes import route_of

log = logging.getLogger("arena.sandbox.relay")

#: Hop-by-hop headers: each side of the relay frames its own connection (h11 does).
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade", b"expect"})
_CHUNK = 65536
#: A kept-alive connection to the proxy idle longer than this is not reused (uvicorn closes
#: idle ones after its keep-alive timeout; a request sent as it closes would look like a cut).
_REUSE_S = 2.0
#: On every answer the relay gives itself (a refused request, an unreachable proxy).
ANSWERED_BY = (b"x-arena-relay", b"refused")
#: The most of a refused request's body read (and dropped) to keep its connection alive.
_DISCARD_MAX = 1024 * 1024


# --------------------------------------------------------------------------- error answers


class _ArenaBody(msgspec.Struct):
    code: str
    message: str


class _ArenaError(msgspec.Struct):
    error: _ArenaBody


def error_body(status: int, code: str, message: str, target: bytes, anthropic_version: bool) -> bytes:
    """The API's error shape for ``target`` (the rollout service's, arena_rollout/proxy/errors.py):
    on a proxy path OpenAI's, or Anthropic's for the Messages API (or a call sending
    ``anthropic-version``); elsewhere Arena's ``{"error": {"code", "message"}}``."""
    path = target.split(b"?", 1)[0]
    if b"/proxy/" not in path:
        return msgspec.json.encode(_ArenaError(error=_ArenaBody(code=code, message=message)))
    text = path.decode("latin-1")
    return llm_errors.body(llm_errors.flavor_of(text, anthropic_version), status, code, message)


def _request_id() -> bytes:
    return b"req_" + os.urandom(12).hex().encode()


# --------------------------------------------------------------------------- the relay


class _Cut(Exception):
    """The connection to the proxy was refused or broke before the call's answer ended
    (``started``: after part of the answer went to the agent)."""

    def __init__(self, message: str, *, started: bool = False):
        super().__init__(message)
        self.started = started


class _ClientGone(Exception):
    """The agent closed its connection (or broke HTTP/1.1) mid-call."""


class _Upstream:
    """One kept-alive HTTP/1.1 connection to the proxy (``conn``: h11's state of the call on it)."""

    __slots__ = ("conn", "reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.conn = h11.Connection(h11.CLIENT)
        self.reader, self.writer = reader, writer
        self.idle_since = time.monotonic()

    def reusable(self) -> bool:
        return (not self.reader.at_eof() and not self.writer.is_closing()
                and time.monotonic() - self.idle_since < _REUSE_S)

    def close(self) -> None:
        self.writer.close()


class Relay:
    """Serves the agent's connections (:meth:`serve`): this rollout's proxy routes go to
    ``host:port``, anything else is answered 404 here. ``fault`` says why a call was cut
    (the first one), ``calls`` and ``refused`` count what was forwarded and what was not."""

    def __init__(self, host: str, port: int, prefix: str):
        self.host, self.port, self.prefix = host, port, prefix.rstrip("/")
        self.fault: str | None = None
        self.calls = 0
        self.refused = 0
        self._closing = False
        self._writers: set[asyncio.StreamWriter] = set()

    def close(self) -> None:
        """Close every connection (the sandbox ended); what breaks from now on is no fault."""
        self._closing = True
        for writer in list(self._writers):
            writer.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = h11.Connection(h11.SERVER)
        upstream: _Upstream | None = None
        self._writers.add(writer)
        try:
            while True:
                event = await _next_event(client, reader)
                if not isinstance(event, h11.Request):
                    break  # the agent closed its connection
                route = route_of(event.method, event.target, self.prefix)
                if route is None:
                    self.refused += 1
                    keep = await self._refuse(client, reader, writer, event)
                else:
                    self.calls += 1
                    keep, upstream = await self._forward(client, reader, writer, event, upstream)
                if not keep or client.their_state is not h11.DONE:
                    break
                client = _next_cycle(client)
        except h11.RemoteProtocolError as exc:  # the agent's HTTP is broken: answer it if we still can
            if client.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                with contextlib.suppress(Exception):
                    await _answer(client, writer, exc.error_status_hint, "invalid_request",
                                  f"malformed HTTP/1.1 request: {exc}", b"/", False, close=True)
        except (OSError, _ClientGone, h11.LocalProtocolError):
            pass
        except Exception:  # noqa: BLE001 - one connection's failure, never the sandbox's
            log.exception("the relay's connection failed")
        finally:
            if upstream is not None:
                self._drop(upstream)
            writer.close()
            self._writers.discard(writer)

    async def _refuse(self, client: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      request: h11.Request) -> bool:
        """Answer a request that is not one of this rollout's routes: 404, the API's shape; its body
        read and dropped first (up to :data:`_DISCARD_MAX`, else the connection closes after it)."""
        anthropic = any(name == b"anthropic-version" for name, _ in request.headers)
        message = f"no route for {request.method.decode('ascii', 'replace')} {_path_of(request.target)}"
        keep = not client.they_are_waiting_for_100_continue
        size = 0
        while keep:
            event = await _next_event(client, reader)
            if isinstance(event, h11.EndOfMessage):
                break
            if not isinstance(event, h11.Data):
                raise _ClientGone()
            size += len(event.data)
            keep = size <= _DISCARD_MAX
        await _answer(client, writer, 404, "not_found", message, request.target, anthropic, close=not keep)
        return keep

    async def _forward(self, client: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       request: h11.Request, upstream: _Upstream | None) -> tuple[bool, _Upstream | None]:
        """One call to the proxy: whether the agent's connection stays open, and the connection to
        the proxy to keep for the next call (None: none open)."""
        if upstream is not None and not upstream.reusable():
            self._drop(upstream)
            upstream = None
        try:
            if upstream is None:
                try:
                    upstream = _Upstream(*await asyncio.open_connection(self.host, self.port))
                except OSError as exc:
                    raise _Cut(f"connection to the proxy at {self.host}:{self.port} failed: {exc}") from None
                self._writers.add(upstream.writer)
            if client.they_are_waiting_for_100_continue:
                writer.write(client.send(h11.InformationalResponse(status_code=100, headers=[])))
            up = upstream.conn = h11.Connection(h11.CLIENT)
            # the head and the body as they come, in as few writes as they arrived in
            pending = [up.send(h11.Request(method=request.method, target=request.target,
                                           headers=_end_to_end(request.headers)))]
            while True:
                event = await _next_event(client, reader, upstream, pending)
                if isinstance(event, h11.Data):
                    pending.append(up.send(h11.Data(data=event.data)))
                elif isinstance(event, h11.EndOfMessage):
                    pending.append(up.send(h11.EndOfMessage()))
                    await _send_up(upstream, pending)
                    break
                else:
                    raise _ClientGone()
            upstream_keeps = await _answer_from(upstream, client, reader, writer, raw=request.http_version == b"1.1")
        except _Cut as exc:
            if upstream is not None:
                self._drop(upstream)
            if self._closing:
                return False, None
            if self.fault is None:
                self.fault = str(exc)
            log.warning("a call through the relay was cut: %s", exc)
            if client.our_state is h11.SEND_RESPONSE and not exc.started:  # nothing of the answer went out yet
                anthropic = any(name == b"anthropic-version" for name, _ in request.headers)
                with contextlib.suppress(Exception):
                    await _answer(client, writer, 502, "proxy_unreachable", f"Arena's LLM proxy is unreachable: {exc}",
                                  request.target, anthropic, close=True)
            return False, None
        except BaseException:
            if upstream is not None:
                self._drop(upstream)
            raise
        if upstream_keeps:
            upstream.idle_since = time.monotonic()
            return True, upstream
        self._drop(upstream)
        # the proxy's raw answer told the agent its connection closes (``connection: close``)
        return request.http_version != b"1.1", None

    def _drop(self, upstream: _Upstream) -> None:
        upstream.close()
        self._writers.discard(upstream.writer)


class _End:
    """httptools' callbacks: where the proxy's answer ends."""

    __slots__ = ("complete", "keep_alive", "parser")

    def __init__(self) -> None:
        self.complete = self.keep_alive = False
        self.parser: httptools.HttpResponseParser | None = None

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # valid while the message is parsed

    def on_message_complete(self) -> None:
        self.complete = True


async def _answer_from(upstream: _Upstream, client: h11.Connection, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter, *, raw: bool) -> bool:
    """Relay the proxy's answer to the agent as it comes, watching the agent meanwhile: what it
    sends waits in h11 (a pipelined request); when it goes away, :class:`_ClientGone` (the proxy
    then sees its connection close, as without the relay). Whether the proxy keeps its connection.

    ``raw`` (an HTTP/1.1 agent): the answer's bytes go through unchanged, and httptools (C) finds
    where it ends: h11 would parse and frame each server-sent event again (~25 us each). Else the
    answer is framed again by h11 for the agent's HTTP version."""
    this = asyncio.current_task()
    pumping, gone = True, False

    def on_watch(watch: asyncio.Future) -> None:
        nonlocal gone
        if not watch.cancelled():
            watch.exception()  # retrieved: a reset is the agent going away too
            if pumping:
                gone = True
                this.cancel()

    watch = asyncio.ensure_future(_watch_client(client, reader))
    watch.add_done_callback(on_watch)
    try:
        if raw:
            return await _pass_through(upstream, writer)
        return await _reframe(upstream, client, writer)
    except asyncio.CancelledError:
        if not gone:
            raise
        this.uncancel()
        raise _ClientGone() from None
    finally:
        pumping = False
        watch.remove_done_callback(on_watch)
        if not watch.done():  # gone before the agent's connection is read again
            watch.cancel()
            await asyncio.wait((watch,))
        elif not watch.cancelled():
            watch.exception()


async def _pass_through(upstream: _Upstream, writer: asyncio.StreamWriter) -> bool:
    end = _End()
    parser = end.parser = httptools.HttpResponseParser(end)
    started = False
    while not end.complete:
        try:
            data = await upstream.reader.read(_CHUNK)
        except OSError as exc:
            raise _Cut(f"the proxy's connection broke mid-call: {exc}", started=started) from None
        if not data:
            raise _Cut("the proxy closed the connection before its answer ended", started=started)
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise _Cut(f"the proxy's answer broke HTTP/1.1: {exc}", started=started) from None
        writer.write(data)
        started = True
        await writer.drain()
    return end.keep_alive


async def _reframe(upstream: _Upstream, client: h11.Connection, writer: asyncio.StreamWriter) -> bool:
    conn = upstream.conn
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            if conn.their_state is h11.CLOSED or upstream.reader.at_eof():
                raise _Cut("the proxy closed the connection before its answer ended") from None
            raise _Cut(f"the proxy's answer broke HTTP/1.1: {exc}") from None
        if event is h11.NEED_DATA:
            try:
                data = await upstream.reader.read(_CHUNK)
            except OSError as exc:
                raise _Cut(f"the proxy's connection broke mid-call: {exc}") from None
            conn.receive_data(data)
        elif isinstance(event, h11.Response):
            writer.write(client.send(h11.Response(status_code=event.status_code, headers=_end_to_end(event.headers),
                                                  reason=event.reason)))
        elif isinstance(event, h11.Data):
            writer.write(client.send(h11.Data(data=event.data)))
            await writer.drain()
        elif isinstance(event, h11.EndOfMessage):
            writer.write(client.send(h11.EndOfMessage()))
            await writer.drain()
            return conn.our_state is h11.DONE and conn.their_state is h11.DONE
        elif isinstance(event, h11.ConnectionClosed):
            raise _Cut("the proxy closed the connection before answering")
        # an informational answer (1xx): the agent's Expect was answered by the relay


def _next_cycle(client: h11.Connection) -> h11.Connection:
    """The agent's connection ready for its next request, with what it already sent (pipelined):
    after an answer passed through unchanged h11 never saw it, so a new connection state takes over."""
    if client.our_state is h11.DONE:
        client.start_next_cycle()
        return client
    data, closed = client.trailing_data
    fresh = h11.Connection(h11.SERVER)
    if data:
        fresh.receive_data(data)
    if closed:
        fresh.receive_data(b"")
    return fresh


def _path_of(target: bytes) -> str:
    return target.split(b"?", 1)[0].decode("ascii", "replace")


def _end_to_end(headers) -> list[tuple[bytes, bytes]]:
    """The headers without hop-by-hop ones; with chunked framing, no Content-Length beside it."""
    chunked = any(name == b"transfer-encoding" for name, _ in headers)
    return [(name, value) for name, value in headers
            if name not in _HOP and not (chunked and name == b"content-length")]


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader, upstream: _Upstream | None = None,
                      pending: list[bytes] | None = None):
    """The agent's next h11 event, reading as needed (``ConnectionClosed`` at its end); what is
    ``pending`` for ``upstream`` goes out before waiting for the agent."""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            if pending:
                await _send_up(upstream, pending)
            conn.receive_data(await reader.read(_CHUNK))
            continue
        if event is h11.PAUSED:
            raise _ClientGone()
        return event


async def _watch_client(conn: h11.Connection, reader: asyncio.StreamReader) -> None:
    """While a call is answered: whatever the agent sends next waits in h11 (a pipelined request);
    returns when the agent is gone (its end of the connection, or more than a pipelined request)."""
    buffered = 0
    while True:
        data = await reader.read(_CHUNK)
        if not data:
            return
        buffered += len(data)
        if buffered > _DISCARD_MAX:
            return
        conn.receive_data(data)


async def _send_up(upstream: _Upstream, pending: list[bytes]) -> None:
    """Write ``pending`` to the proxy (and empty it)."""
    data = b"".join(pending)
    pending.clear()
    try:
        upstream.writer.write(data)
        await upstream.writer.drain()
    except (OSError, RuntimeError) as exc:
        raise _Cut(f"the proxy's connection broke while sending a call: {exc}") from None


async def _answer(conn: h11.Connection, writer: asyncio.StreamWriter, status: int, code: str, message: str,
                  target: bytes, anthropic: bool, *, close: bool) -> None:
    body = error_body(status, code, message, target, anthropic)
    rid = _request_id()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", rid), (b"request-id", rid),
               (b"x-should-retry", b"true" if status >= 500 else b"false"), ANSWERED_BY]
    if close:
        headers.append((b"connection", b"close"))
    writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
    writer.write(conn.send(h11.Data(data=body)))
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()
