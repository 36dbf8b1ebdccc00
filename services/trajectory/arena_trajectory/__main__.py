"""``python -m arena_trajectory``: the three consumers and the query API in one event loop.

SIGTERM or SIGINT stops both: the consumers finish their in-flight messages, the HTTP
server drains its connections, then the bus and the store close; exit 0. A second
SIGINT skips the HTTP drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

import uvicorn

from arena import logs, telemetry
from arena.bus import Bus, run_consumers
from arena.settings import Settings
from arena_trajectory.app import create_app
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.worker import TrajectoryWorker

log = logging.getLogger("arena.trajectory")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: ``main`` owns the signals and stops the
    server and the consumers together (uvicorn would otherwise re-raise the signal after
    its shutdown and kill the process before the consumers finish)."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


async def _serve(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn calls sys.exit when it cannot bind
        raise RuntimeError(f"HTTP server could not start (exit {exc.code})") from None


async def main(settings: Settings) -> int:
    store = TrajectoryStore.open(settings)
    try:
        await store.init()
        bus = await Bus.connect(settings.nats_url, "trajectory")
        try:
            await bus.ensure_topology()
            return await serve(settings, bus, store)
        finally:
            await bus.close()
    finally:
        await store.close()


async def serve(settings: Settings, bus: Bus, store: TrajectoryStore) -> int:
    """Run the consumers and the HTTP API until a signal (0) or until one of them fails (1)."""
    worker = TrajectoryWorker(bus, store, group_timeout=settings.trajectory_group_timeout_s)
    server = _Server(uvicorn.Config(create_app(store), host=settings.host, port=settings.trajectory_port,
                                    log_level="warning"))
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            server.force_exit = True  # second signal: do not wait for open connections
            return
        log.info("%s: stopping", sig.name)
        stop.set()
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    consumers = asyncio.create_task(run_consumers(worker.consumers(), stop), name="consumers")
    serving = asyncio.create_task(_serve(server), name="http")
    stopping = asyncio.create_task(stop.wait())
    log.info("trajectory service on %s", settings.trajectory_url)
    code = 0
    try:
        await asyncio.wait({consumers, serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set():  # the server or the consumers ended on their own: a failure
            code = 1
            stop.set()
        server.should_exit = True
        for task in (consumers, serving):
            try:
                await task
            except Exception as exc:  # noqa: BLE001 - report and exit non-zero
                log.error("%s failed: %s", task.get_name(), exc)
                code = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        stopping.cancel()
    log.info("stopped")
    return code


def run() -> int:
    settings = Settings.from_env()
    logs.setup("trajectory", settings.log_level)
    telemetry.setup("trajectory")
    return asyncio.run(main(settings))


if __name__ == "__main__":
    sys.exit(run())
