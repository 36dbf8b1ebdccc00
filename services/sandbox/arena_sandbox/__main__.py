"""``python -m arena_sandbox``: the local (bubblewrap) sandbox worker."""

from __future__ import annotations

import asyncio
import sys

from arena import logs, telemetry
from arena.bus import Bus
from arena.runtime import serve, stop_on_signals
from arena.settings import Settings, SettingsError

from arena_sandbox import local
from arena_sandbox.worker import SandboxWorker


async def main(settings: Settings) -> None:
    log = logs.setup("sandbox", settings.log_level)
    telemetry.setup("sandbox")
    if settings.sandbox_provider != "local":
        raise SettingsError(f"ARENA_SANDBOX_PROVIDER={settings.sandbox_provider!r}: this worker runs 'local'")
    reason = local.available()
    if reason is not None:
        # Keep consuming: every job then ends as an `error` outcome that names the reason.
        log.error("bubblewrap sandboxes do not work on this machine: %s", reason)
    stop = stop_on_signals()
    bus = await Bus.connect(settings.nats_url, "sandbox")
    await bus.ensure_topology()
    worker = SandboxWorker(bus, settings, stop=stop)
    log.info("sandbox worker running (provider local, concurrency %d)", settings.sandbox_concurrency)
    await serve(stop, consumers=[worker.consumer()])
    await bus.close()
    log.info("sandbox worker stopped")


if __name__ == "__main__":
    try:
        settings = Settings.from_env()
        asyncio.run(main(settings))
    except SettingsError as exc:
        sys.exit(f"arena-sandbox: {exc}")
