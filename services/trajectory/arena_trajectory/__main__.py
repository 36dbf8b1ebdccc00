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

from arena_core import access, apikeys, logs, metrics, runtime, subjects, telemetry
from arena_core.bus import Bus, TopologyError
from arena_core.runtime import stop_on_signals
from arena_core.settings import Settings
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
            try:  # the topology step (admin) created them: this service's user binds, never creates
                await bus.bind_topology(access.SERVICES['trajectory'].streams())
            except TopologyError as exc:
                await bus.close()
                raise SystemExit(f"arena-trajectory: {exc}") from None
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
    app, keys = apikeys.protect(create_app(store, bus), bus, auth=settings.auth, host=settings.host)
    queues = metrics.QueueDepths(bus.js, [("ARENA_STEPS", subjects.CONSUMER_TRAJ_STEPS),
                                          ("ARENA_RESULTS", subjects.CONSUMER_TRAJ_RESULTS),
                                          ("ARENA_ROLLOUTS", subjects.CONSUMER_TRAJ_STATES)])
    metrics.install("trajectory", queues)
    app = metrics.metrics_route(app, refresh=[queues.refresh])  # outside the key guard: scrapers carry none
    code = await runtime.serve(stop, consumers=[*worker.consumers(), CycleCollector(), bus.watch(), *keys], app=app,
                               host=settings.host, port=settings.trajectory_port)
    log.info("stopped")
    return code


def tune_gc() -> None:
    """The service decodes tens of thousands of steps a second and holds them until their
    trajectory is assembled. CPython's cyclic collector scans every young container and
    everything it references: a step's token-id lists make that ~20 ms per collection,
    ~5 us per step (measured with ``gc.callbacks`` in the throughput benchmark). Steps
    hold no reference cycles (reference counting frees them), so automatic collection is
    off here, what startup allocated is kept out of every scan, and ``CycleCollector``
    collects the cycles that other code makes (asyncio, exceptions) on a timer."""
    gc.freeze()
    gc.disable()


class CycleCollector:
    """A full ``gc.collect()`` every ``interval`` seconds (automatic collection is off:
    ``tune_gc``). It costs a few milliseconds over the steps still held at that moment."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval

    async def run(self, stop: asyncio.Event) -> None:
        await runtime.every(stop, self.interval, gc.collect, what="garbage collection")


def run() -> int:
    tune_gc()
    settings = Settings.from_env()
    logs.setup("trajectory", settings.log_level)
    telemetry.setup("trajectory", otlp_endpoint=settings.otlp_endpoint, otlp_protocol=settings.otlp_protocol)
    try:
        return runtime.run(main(settings))
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    sys.exit(run())
