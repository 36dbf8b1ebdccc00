"""``python -m arena_dashboard``: the dashboard on ``ARENA_DASHBOARD_PORT`` (9091).

SIGTERM or SIGINT ends the live streams, drains the HTTP server and closes the bus; exit 0.
"""

from __future__ import annotations

import logging
import os
import sys

from arena_core import apikeys, health, logs, runtime, telemetry
from arena_core.bus import Bus
from arena_core.runtime import stop_on_signals
from arena_core.settings import Settings
from arena_dashboard import auth, config
from arena_dashboard.app import create_app
from arena_dashboard.fanout import Hub, LiveFeed
from arena_dashboard.live import LiveSubscriptions
from arena_dashboard.upstream import TrajectoryApi

log = logging.getLogger("arena.dashboard")


async def main(settings: Settings) -> int:
    api = TrajectoryApi(config.trajectory_url(settings), api_key=os.environ.get("ARENA_API_KEY", "").strip())
    try:
        bus = await Bus.connect(settings.nats_url, "dashboard")
        try:
            return await serve(settings, bus, api)
        finally:
            await bus.close()
    finally:
        await api.close()


async def serve(settings: Settings, bus: Bus, api: TrajectoryApi) -> int:
    hub = Hub()
    feed = LiveFeed(hub)
    ring = apikeys.KeyRing(bus) if apikeys.enforced(settings.auth, settings.host) else None

    async def liveness() -> str | None:
        return health.live(bus)

    async def readiness() -> str | None:
        return None if bus.nc.is_connected else "not connected to NATS"

    async def redeem(token: str) -> str:
        return await apikeys.redeem_sign_in_token(bus, token)

    gate = auth.Gate(ring, redeem=redeem if ring else None)
    app = create_app(api, hub, gate=gate, liveness=liveness, readiness=readiness)
    stop = stop_on_signals()
    log.info("dashboard on http://%s:%d (trajectory API %s; API keys %s)", settings.host, settings.dashboard_port,
             api.base_url, "required" if ring else "off")
    runtime.freeze_startup()
    code = await runtime.serve(stop, consumers=[LiveSubscriptions(bus, feed), feed, bus.watch(),
                                                *([ring] if ring else [])],
                               app=app, host=settings.host, port=settings.dashboard_port)
    log.info("stopped")
    return code


def run() -> int:
    settings = Settings.from_env()
    logs.setup("dashboard", settings.log_level)
    telemetry.setup("dashboard", otlp_endpoint=settings.otlp_endpoint, otlp_protocol=settings.otlp_protocol)
    try:
        return runtime.run(main(settings))
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    sys.exit(run())
