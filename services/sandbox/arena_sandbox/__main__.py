"""``python -m arena_sandbox``: sandbox workers, one per provider in ARENA_SANDBOX_PROVIDER."""

from __future__ import annotations

import asyncio
import sys

import msgspec

from arena_core import access, capacity, logs, metrics, subjects, telemetry
from arena_core.health import health_app
from arena_core.scratch import Sweeper
from arena_core.bus import Bus, TopologyError
from arena_core.runtime import freeze_startup, serve, stop_on_signals
from arena_core.settings import Settings, SettingsError

from arena_core.scaffolds.install import launchable
from arena_core.workers import Advertiser
from arena_sandbox_providers.factory import build_providers, owner_of
from arena_sandbox.pool import WarmPool
from arena_sandbox_providers.provider import CreateSpec
from arena_sandbox.worker import SandboxWorker, reap_orphans


async def main(settings: Settings) -> int:
    log = logs.setup("sandbox", settings.log_level)
    telemetry.setup("sandbox", otlp_endpoint=settings.otlp_endpoint, otlp_protocol=settings.otlp_protocol)
    capacity.raise_fd_limit()  # each live sandbox holds a few descriptors
    # sized once, here: the consumer, the advertiser and the environment servers see one number
    slots = settings.sandbox_capacity()
    settings = msgspec.structs.replace(settings, sandbox_concurrency=slots.slots)
    providers = build_providers(settings)
    stop = stop_on_signals()
    bus = await Bus.connect(settings.nats_url, "sandbox")
    try:  # the topology step (admin) created them: this service's user binds, never creates
        await bus.bind_topology(access.SERVICES['sandbox'].streams())
    except TopologyError as exc:
        await bus.close()
        raise SystemExit(f"arena-sandbox: {exc}") from None
    workers, pools = [], []
    for provider in providers:
        # Whatever a killed predecessor of this owner left; if the provider cannot be
        # reached now (engine down), the worker does it before its first sandbox.
        reaped = await reap_orphans(provider) is None
        reason = await provider.health()
        if reason is not None:
            # Keep consuming: every job then ends as an `error` outcome that names the reason.
            log.error("sandbox provider %s does not work here: %s", provider.name, reason)
        pool = WarmPool(provider, size=settings.sandbox_pool_size) if settings.sandbox_pool_size else None
        if pool is not None:
            if reason is None and reaped:
                await pool.prefill(CreateSpec())
            pools.append(pool)
        workers.append(SandboxWorker(bus, settings, provider, pool=pool, stop=stop, reap_pending=not reaped))
        log.info("sandbox worker running (provider %s, concurrency %d: %s; warm pool %d)",
                 provider.name, slots.slots, slots.reason, settings.sandbox_pool_size)
    async def providers_work() -> str | None:
        for provider in providers:
            reason = await provider.health()
            if reason is not None:
                return f"sandbox provider {provider.name}: {reason}"
        return None

    health = health_app(bus, streams=["ARENA_SANDBOX_JOBS"], checks=[providers_work])
    queues = metrics.QueueDepths(bus.js, [("ARENA_SANDBOX_JOBS", subjects.CONSUMER_SANDBOX.format(provider=p.name))
                                          for p in providers])
    metrics.install("sandbox", queues)
    health = metrics.metrics_route(health, refresh=[queues.refresh])
    # no sandbox lives longer than the longest wall clock a task may ask for
    bases = [p.base for p in providers if getattr(p, "base", None) is not None]
    sweeper = Sweeper(bases, older_than_s=settings.max_wall_clock_s + 3600, what="sandbox directories")
    # the scaffold presets each provider's sandboxes can launch, read at each refresh: a provider
    # with a scaffolds directory (local; None when it does not exist yet: nothing installed), or
    # None when its images decide (docker, mock), so it does not say
    by_name = {p.name: p for p in providers}

    def scaffolds(provider: str) -> list[str] | None:
        p = by_name.get(provider)
        if p is None or not hasattr(type(p), "scaffolds_dir"):
            return None
        return launchable(p.scaffolds_dir)

    advertiser = Advertiser(bus, [p.name for p in providers], owner=owner_of(settings), slots=settings.sandbox_slots,
                            scaffolds=scaffolds)
    await advertiser.announce()  # before the consumers: a submission to these providers is accepted from now
    freeze_startup()
    code = await serve(stop, consumers=[*(w.consumer() for w in workers), sweeper, bus.watch(), advertiser],
                       app=health if settings.sandbox_health_port else None, host=settings.host,
                       port=settings.sandbox_health_port)
    for worker in workers:
        await worker.close()
    for pool in pools:
        await pool.close()
    for provider in providers:
        await provider.close()
    await bus.close()
    telemetry.shutdown()
    log.info("sandbox worker stopped")
    return code


if __name__ == "__main__":
    try:
        settings = Settings.from_env()
        code = asyncio.run(main(settings))
    except SettingsError as exc:
        sys.exit(f"arena-sandbox: {exc}")
    sys.exit(code)
