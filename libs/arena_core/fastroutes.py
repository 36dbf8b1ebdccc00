"""HTTP/1.1 routes answered by the server's protocol itself, before ASGI.

uvicorn turns every request into an ASGI cycle: a scope, ``receive`` and ``send``
messages, a check of every response header, and writes that a corked transport holds to
the end of the loop turn. On a service's hot route (the rollout proxy: every LLM call of
every agent) those costs are a large share of the proxy's added latency (figures in
docs/rollout.md). An app that carries ``fast_routes`` (a ``FastRoutes``) has those
routes answered straight from the parser by ``runtime.serve``:

- the handler's task starts when the headers are in and reads the body with one
  ``await`` (no receive loop, no messages);
- it answers with bytes: a whole body in one write (``respond``), or a stream of chunks
  (``begin_stream`` then ``write``), each write leaving at once, with the transport's
  flow control honoured;
- after an answer's last write the server yields its CPU (``os.sched_yield``), so the
  client it just woke runs before the server's own follow-up work;
- an ``Exchange`` stands in for uvicorn's request cycle on the connection, so keep-alive,
  pipelining, graceful shutdown (the server waits for the handler's task) and the
  keep-alive timeout stay uvicorn's; ``Expect: 100-continue`` is answered as uvicorn
  does, when the handler reads the body; the rest of a body over the limit is read and
  dropped after the answer, as uvicorn does (closing at once would reset a client still
  sending it before it reads the 413).

Every other request, on the same connection too, goes to the ASGI app as before; the app
should serve the same routes itself (it does under any other server, and in tests that
call it in-process). This leans on ``HttpToolsProtocol``'s parser callbacks and request
state; ``protocol_with_routes`` checks what it needs and falls back to plain ASGI, with a
warning, when a uvicorn release lacks it.
"""

from __future__ import annotations

import asyncio
import http
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

log = logging.getLogger("arena.http")

#: Whether an answer's last write is followed by ``os.sched_yield`` (see ``Exchange._complete``).
YIELD_AFTER_ANSWER = hasattr(os, "sched_yield")

Handler = Callable[["Exchange"], Awaitable[None]]


class FastRoutes(Protocol):
    """The routes an app answers on the protocol. ``match`` sees the method and the raw
    request target (path and query, as sent); it returns the handler, or None for ASGI."""

    body_limit: int

    def match(self, method: bytes, target: bytes) -> Handler | None: ...


_STATUS: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _STATUS[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")
    return line


class _Notify:
    """What uvicorn's protocol calls ``message_event``: it ``set()``s it when the
    connection is lost; the exchange is told."""

    __slots__ = ("_exchange",)

    def __init__(self, exchange: Exchange):
        self._exchange = exchange

    def set(self) -> None:
        self._exchange._lost()


class BodyTooLarge(Exception):
    """The request's body is over the routes' ``body_limit`` (its declared length, or what came)."""


class ClientGone(Exception):
    """The client went away before sending the whole body."""


class Exchange:
    """One request on a fast route: its headers and body, and the means to answer.

    The handler runs as soon as the headers are in (what it can do before the body, such
    as checking a key, overlaps the client sending it) and reads the body with ``read``.
    The attributes uvicorn's protocol reads or sets on its current cycle are kept under
    the same names (``response_complete``, ``disconnected``, ``keep_alive``,
    ``message_event``, ``run_asgi``)."""

    __slots__ = ("_protocol", "transport", "_write", "_flow", "handler", "headers", "keep_alive", "chunked",
                 "limit", "expect_100", "more_body", "too_large", "response_started",
                 "response_complete", "disconnected", "cancel_on_disconnect", "message_event", "_body", "_size",
                 "_waiter", "_task", "_head", "_default_headers")

    def __init__(self, protocol: Any, handler: Handler, *, keep_alive: bool, chunked: bool, limit: int):
        self._protocol = protocol
        self.transport = transport = protocol.transport
        #: answers leave at once: each is one write already (a corked transport would hold it a loop turn)
        self._write = getattr(transport, "write_now", transport.write)
        self._flow = protocol.flow
        self._default_headers: list[tuple[bytes, bytes]] = protocol.server_state.default_headers
        self.handler = handler
        self.headers: list[tuple[bytes, bytes]] = protocol.headers  # names lower-cased by uvicorn
        self.keep_alive = keep_alive
        self.chunked = chunked  # HTTP/1.1: a stream is chunked; HTTP/1.0: it ends with the connection
        self.limit = limit
        self.expect_100 = protocol.expect_100_continue
        self.more_body = True
        self.too_large = False
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        #: set while a stream is relayed: the client going away cancels the handler's task
        self.cancel_on_disconnect = False
        self.message_event = _Notify(self)
        self._body: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._head: bytes | None = None
        declared = self.header(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            self.too_large = True  # answered without reading it

    # ---------------------------------------------------------------- the request

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def read(self) -> bytes:
        """The whole body, once it is in. Raises ``BodyTooLarge`` or ``ClientGone``."""
        if self.more_body and not self.too_large and not self.disconnected:
            if self.expect_100 and not self.transport.is_closing():
                self.expect_100 = False
                self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._waiter = waiter = self._protocol.loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        if self.too_large:
            declared = self.header(b"content-length")
            size = f" of {declared.decode()} bytes" if declared is not None and declared.isdigit() else ""
            raise BodyTooLarge(f"request body{size} exceeds the {self.limit}-byte limit")
        if self.more_body:
            raise ClientGone("the client went away before sending the whole body")
        body = self._body
        return body[0] if len(body) == 1 else b"".join(body)

    # called by the protocol
    def feed(self, data: bytes) -> None:
        if self.response_complete or self.too_large:
            return
        self._size += len(data)
        if self._size > self.limit:
            self.too_large = True
            self._body = []
            self._wake()
            return
        self._body.append(data)

    def body_done(self) -> None:
        self.more_body = False
        self._wake()
        protocol = self._protocol
        if self.response_complete and not self.transport.is_closing() and not protocol.pipeline:
            # answered before its body was in (a 401, a 413): uvicorn armed the keep-alive timer
            # then, and the body's bytes that came since disarmed it; arm it again
            protocol._unset_keepalive_if_required()
            protocol.timeout_keep_alive_task = protocol.loop.call_later(protocol.timeout_keep_alive,
                                                                        protocol.timeout_keep_alive_handler)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def start(self) -> None:
        protocol = self._protocol
        task = protocol.loop.create_task(self.run_asgi(None))
        task.add_done_callback(protocol.tasks.discard)
        protocol.tasks.add(task)

    def _lost(self) -> None:
        if self.disconnected and self.cancel_on_disconnect and self._task is not None:
            self.cancel_on_disconnect = False
            self._task.cancel()
        self._wake()

    async def run_asgi(self, _app: Any) -> None:
        """The handler's task (uvicorn starts it by this name for a pipelined request)."""
        self._task = asyncio.current_task()
        try:
            if not self.disconnected:
                await self.handler(self)
        except asyncio.CancelledError:
            if not self.response_complete and not self.transport.is_closing():
                self.transport.close()
            raise
        except Exception:  # noqa: BLE001 - a handler's bug: logged, a 500 or a cut connection
            log.exception("unhandled error answering a request on a fast route")
            if not self.response_started or self._head is not None:  # no byte of the answer went out
                self.response_started, self._head, self.keep_alive = False, None, False
                await self.respond(500, b'{"error":{"code":"internal","message":"internal error"}}')
            elif not self.transport.is_closing():
                self.transport.close()
        else:
            if not self.response_complete and not self.disconnected:
                log.error("a fast route's handler returned without completing its response")
                if not self.transport.is_closing():
                    self.transport.close()
        finally:
            self._task = None

    # ---------------------------------------------------------------- the answer

    def _head_bytes(self, status: int, headers: list[tuple[bytes, bytes]], extra: bytes) -> bytes:
        parts = [status_line(status)]
        for name, value in self._default_headers:
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(extra)
        return b"".join(parts)

    async def respond(self, status: int, body: bytes,
                      headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]) -> None:  # noqa: B006
        """The whole answer, in one write (once the transport takes writes: a client that
        pipelines requests without reading the answers is not answered without bound)."""
        if self.response_started:
            raise RuntimeError("the response has already started")
        self.response_started = True
        if self._flow.write_paused and not self.disconnected:
            await self._flow.drain()
        if self.disconnected:
            self.response_complete = True
            return
        self._write(self._head_bytes(status, headers, b"content-length: %d\r\n\r\n" % len(body)) + body)
        self._complete()

    def begin_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Start a streamed answer; its head leaves with the first ``write``."""
        if self.response_started:
            raise RuntimeError("the response has already started")
        self.response_started = True
        if not self.chunked:
            self.keep_alive = False  # HTTP/1.0: the end of the body is the end of the connection
        self._head = self._head_bytes(status, headers,
                                      b"transfer-encoding: chunked\r\n\r\n" if self.chunked else b"\r\n")

    async def write(self, data: bytes, last: bool = False) -> None:
        """Send one piece of a stream; ``last`` ends it (in the same write)."""
        if self._flow.write_paused and not self.disconnected:
            await self._flow.drain()
        if self.disconnected or self.response_complete:
            return
        parts: list[bytes] = []
        if self._head is not None:
            parts.append(self._head)
            self._head = None
        if not self.chunked:
            parts.append(data)
        else:
            if data:
                parts += (b"%x\r\n" % len(data), data, b"\r\n")
            if last:
                parts.append(b"0\r\n\r\n")
        if parts:
            self._write(parts[0] if len(parts) == 1 else b"".join(parts))
        if last:
            self._complete()

    def _complete(self) -> None:
        self.response_complete = True
        if not self.keep_alive:
            self.transport.close()
        self._protocol.on_response_complete()
        if YIELD_AFTER_ANSWER:
            # the client this write woke is often queued on this CPU (woken by us, placed
            # beside us) and would wait for whatever we do next: recording the call, which
            # can wait. Yielding hands it the CPU now (measured: a streamed call's added
            # latency 0.92 -> 0.58 ms on two shared cores); with nothing else runnable here
            # it returns at once.
            os.sched_yield()


_NEEDS = ("on_headers_complete", "on_body", "on_message_complete", "on_response_complete", "on_url", "on_header",
          "_unset_keepalive_if_required", "timeout_keep_alive_handler")


def protocol_with_routes(base: type, routes: FastRoutes) -> type:
    """``base`` (uvicorn's ``HttpToolsProtocol`` or a subclass) answering ``routes`` itself."""
    missing = [name for name in _NEEDS if not hasattr(base, name)]
    if missing:
        log.warning("this uvicorn's HTTP protocol lacks %s: fast routes are served through ASGI",
                    ", ".join(missing))
        return base

    class FastRouteProtocol(base):  # type: ignore[misc, valid-type]
        def on_headers_complete(self) -> None:
            parser = self.parser
            if not parser.should_upgrade():
                previous = self.cycle
                try:
                    handler = routes.match(parser.get_method(), self.url)
                    if handler is not None:
                        self._fast(handler)
                        return
                except Exception:  # noqa: BLE001 - e.g. a uvicorn release without the state used here
                    log.exception("a fast route could not take the request; the ASGI app answers it")
                    self.cycle = previous
            super().on_headers_complete()

        def _fast(self, handler: Handler) -> None:
            version = self.parser.get_http_version()
            exchange = Exchange(self, handler, keep_alive=version != "1.0" and self.parser.should_keep_alive(),
                                chunked=version == "1.1", limit=routes.body_limit)
            previous, self.cycle = self.cycle, exchange
            if previous is not None and not previous.response_complete:  # pipelined: answered after
                self.flow.pause_reading()  # the request before it, as uvicorn does
                self.pipeline.appendleft((exchange, None))
            else:
                exchange.start()

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if type(cycle) is Exchange:
                cycle.feed(body)
            else:
                super().on_body(body)

        def on_message_complete(self) -> None:
            cycle = self.cycle
            if type(cycle) is Exchange:
                cycle.body_done()
            else:
                super().on_message_complete()

    return FastRouteProtocol
