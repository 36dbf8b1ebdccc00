"""``python -m arena_trajectory``: the three consumers and the query API in one event loop.

SIGTERM or SIGINT stops both: the consumers finish their in-flight messages, the HTTP
server drains its connections, then the bus and the store close; exit 0. A second
SIGINT skips the HTTP drain.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys

from arena import logs, runtime, telemetry
from arena.bus import Bus
from arena.runtime import stop_on_signals
from arena.settings import Settings
from arena_trajectory.app import create_app
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.worker import TrajectoryWorker

log = logging.getLogger("arena.trajectory")


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
    stop = stop_on_signals()
    log.info("trajectory service on %s", settings.trajectory_url)
    code = await runtime.serve(stop, consumers=worker.consumers(), app=create_app(store), host=settings.host,
                               port=settings.trajectory_port)
    log.info("stopped")
    return code


def tune_gc() -> None:
    """The service decodes tens of thousands of steps a second and holds them until their
    trajectory is assembled; with CPython's default threshold (700 allocations) the cyclic
    collector runs hundreds of times a second and rescans those live steps (it tripled
    the cost of decoding one). Steps hold no cycles (reference counting frees them), so
    collect the young generation every 50,000 allocations instead, and keep what startup
    allocated out of every scan."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 10)


def run() -> int:
    tune_gc()
    settings = Settings.from_env()
    logs.setup("trajectory", settings.log_level)
    telemetry.setup("trajectory")
    return asyncio.run(main(settings))


if __name__ == "__main__":
    sys.exit(run())
