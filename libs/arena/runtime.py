"""Process plumbing shared by the service entry points: signals, uvicorn, consumers."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence

from arena.bus import Consumer


def stop_on_signals() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT, so a service can stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve(stop: asyncio.Event, *, consumers: Sequence[Consumer] = (), app=None, host: str = "127.0.0.1",
                port: int = 0) -> None:
    """Run ``consumers`` and, if given, the ASGI ``app`` under uvicorn until ``stop`` is set."""
    tasks = [asyncio.create_task(c.run(stop)) for c in consumers]
    server = None
    if app is not None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30)
        server = uvicorn.Server(config)
        server.install_signal_handlers = lambda: None  # we own the signals
        tasks.append(asyncio.create_task(server.serve()))
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        if task is not waiter and task.exception() is not None:
            stop.set()
            raise task.exception()
    stop.set()
    if server is not None:
        server.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
