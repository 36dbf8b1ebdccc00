"""Process plumbing shared by the service entry points: signals, uvicorn, consumers.

A service owns SIGTERM/SIGINT itself (``stop_on_signals``) and ``serve`` stops the HTTP
server and the consumers together: the consumers finish their in-flight messages, the
server drains its connections. A second signal skips the HTTP drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

import uvicorn

from arena_core.fastroutes import FastRoutes, protocol_with_routes

log = logging.getLogger("arena_core.runtime")


class Runner(Protocol):
    """A consumer, or any loop that runs until ``stop`` is set."""

    async def run(self, stop: asyncio.Event) -> None: ...


async def every(stop: asyncio.Event, interval: float, action: Callable[[], Awaitable[Any] | Any], *,
                what: str) -> None:
    """Run ``action`` every ``interval`` seconds (the first time after one interval) until
    ``stop`` is set. A failure is logged and the next run comes as usual: a periodic job
    (a sweep, a health check) never dies of one error."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), interval)
            return
        except asyncio.TimeoutError:
            pass
        try:
            result = action()
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # noqa: BLE001 - logged; the next run retries
            log.warning("%s failed, again in %.1f s: %s: %s", what, interval, type(exc).__name__, exc)


class StopEvent(asyncio.Event):
    """Set by the first signal; ``repeated`` by any later one."""

    def __init__(self) -> None:
        super().__init__()
        self.repeated = asyncio.Event()


def stop_on_signals() -> StopEvent:
    """An event set on SIGTERM or SIGINT, so a service can stop cleanly."""
    stop = StopEvent()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            stop.repeated.set()
            return
        log.info("%s: stopping", sig.name)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return stop


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service owns the signals (uvicorn would
    otherwise re-raise a signal after its shutdown, before the consumers finish)."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


class CorkedTransport:
    """A transport whose writes within one event-loop turn leave in one ``send``.

    uvicorn writes a response's head as soon as the app starts it, then its body: two
    segments, and the first wakes the client, which on a small machine can take the core
    before the second is written (a whole answer then costs the client two wake-ups, and
    the proxy's added latency grows by the time the client runs). Corked, the head and
    whatever the app sends in the same turn go out together at the start of the next
    turn. Past ``limit`` bytes a write goes out at once, so a large response streamed
    without pause is neither held in memory nor kept from the real transport's flow
    control. Closing flushes first; everything else is the real transport's."""

    __slots__ = ("_transport", "_loop", "_pending", "_size", "limit")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, *, limit: int = 1 << 16):
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._size = 0
        self.limit = limit

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)
        self._size += len(data)
        if self._size >= self.limit:
            self.flush()

    def write_now(self, data: bytes) -> None:
        """Write ``data`` (after anything pending, in the same ``send``) without waiting for
        the end of the turn: for a writer whose every write is already whole."""
        if self._pending:
            self._pending.append(data)
            self.flush()
        elif not self._transport.is_closing():
            self._transport.write(data)

    def flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        self._pending = []
        self._size = 0
        if not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._size = 0
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _corked_http_protocol(routes: FastRoutes | None = None) -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol on a ``CorkedTransport``, answering ``routes`` itself
    (``arena_core.fastroutes``); "auto" without httptools (the app then serves every route)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class CorkedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(CorkedTransport(transport, self.loop))

    return CorkedHttpToolsProtocol if routes is None else protocol_with_routes(CorkedHttpToolsProtocol, routes)


async def _serve_http(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn calls sys.exit when it cannot bind
        raise RuntimeError(f"HTTP server could not start (exit {exc.code})") from None


async def serve(stop: asyncio.Event, *, consumers: Sequence[Runner] = (), app=None, host: str = "127.0.0.1",
                port: int = 0) -> int:
    """Run ``consumers`` and, if given, the ASGI ``app`` under uvicorn until ``stop`` is set.
    An app with a ``fast_routes`` attribute has those answered by the protocol itself.

    Returns 0 after a requested stop, 1 when the server or a consumer ended on its own
    (a failure, logged)."""
    tasks = [asyncio.create_task(c.run(stop), name=getattr(c, "durable", type(c).__name__)) for c in consumers]
    server = None
    if app is not None:
        server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                        lifespan="off", timeout_keep_alive=30, proxy_headers=False,
                                        http=_corked_http_protocol(getattr(app, "fast_routes", None))))
        tasks.append(asyncio.create_task(_serve_http(server), name="http"))
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    code = 0 if stop.is_set() else 1
    stop.set()
    waiter.cancel()
    forcing = None
    if server is not None:
        server.should_exit = True
        repeated = getattr(stop, "repeated", None)
        if repeated is not None:
            async def force() -> None:
                await repeated.wait()
                server.force_exit = True  # do not wait for open connections
            forcing = asyncio.create_task(force())
    for task in tasks:
        try:
            await task
        except Exception as exc:  # noqa: BLE001 - report and exit non-zero
            log.error("%s failed: %s", task.get_name(), exc)
            code = 1
    if forcing is not None:
        forcing.cancel()
    return code


def run(main: Coroutine[Any, Any, int]) -> int:
    """Run a service's ``main`` on uvloop when it is installed (it is a dependency: the
    proxy's per-call overhead is mostly event-loop and socket work), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; a source checkout may lack it
        return asyncio.run(main)
    return uvloop.run(main)
