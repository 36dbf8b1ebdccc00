"""Process plumbing shared by the service entry points: signals, uvicorn, consumers.

SIGTERM/SIGINT set the service's stop event (``stop_on_signals``) and ``serve`` stops the
HTTP server and the consumers together: the consumers finish their in-flight messages, the
server drains its connections. A second signal skips the HTTP drain.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

import uvicorn

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


async def _serve_http(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn calls sys.exit when it cannot bind
        raise RuntimeError(f"HTTP server could not start (exit {exc.code})") from None


async def serve(stop: asyncio.Event, *, consumers: Sequence[Runner] = (), app=None, host: str = "127.0.0.1",
                port: int = 0, more: Sequence[tuple[Any, int]] = ()) -> int:
    """Run ``consumers`` and, if given, the ASGI ``app`` under uvicorn (httptools, on the
    running loop: uvloop under ``run``) until ``stop`` is set. uvicorn also catches SIGINT
    and SIGTERM while it serves, and sends them on once it has stopped (its documented
    behaviour when run programmatically): the loop's handlers (``stop_on_signals``) see
    them as well, so the consumers stop with the server.

    ``more``: further ``(app, port)`` listeners on ``host``, served and stopped with it (the
    rollout service's proxy-only port).

    Returns 0 after a requested stop, 1 when a server or a consumer ended on its own
    (a failure, logged)."""
    tasks = [asyncio.create_task(c.run(stop), name=getattr(c, "durable", type(c).__name__)) for c in consumers]
    servers: list[uvicorn.Server] = []
    listeners = ([(app, port)] if app is not None else []) + list(more)
    for i, (asgi, at) in enumerate(listeners):
        server = uvicorn.Server(uvicorn.Config(asgi, host=host, port=at, log_level="warning", access_log=False,
                                               lifespan="off", timeout_keep_alive=30, proxy_headers=False))
        servers.append(server)
        tasks.append(asyncio.create_task(_serve_http(server), name="http" if i == 0 else f"http:{at}"))
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    code = 0 if stop.is_set() else 1
    stop.set()
    waiter.cancel()
    forcing = None
    for server in servers:
        server.should_exit = True
    repeated = getattr(stop, "repeated", None)
    if servers and repeated is not None:
        async def force() -> None:
            await repeated.wait()
            for server in servers:
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


def freeze_startup() -> None:
    """Keep what a service's start-up allocated (modules, the app, its routes and schemas:
    50,000-80,000 objects) out of every later scan of the cyclic collector (``gc.freeze``):
    it lives as long as the process, yet each full collection walked all of it again (25-70 ms,
    while requests wait: the rollout service's collections during a burst of 256 rollouts took
    106 ms in all, 39 ms with start-up frozen; at 1,024 in flight the collector was a quarter of
    its CPU). Call it once, in the entry point, right before serving: not in tests, where what is
    frozen is never collected."""
    gc.freeze()


def run(main: Coroutine[Any, Any, int]) -> int:
    """Run a service's ``main`` on uvloop when it is installed (it is a dependency: the
    proxy's per-call overhead is mostly event-loop and socket work), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; a source checkout may lack it
        return asyncio.run(main)
    return uvloop.run(main)
