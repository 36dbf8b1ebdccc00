"""``python -m arena_rollout``: the rollout API and LLM proxy on ARENA_ROLLOUT_PORT, and only the
agents' proxy routes on ARENA_PROXY_PORT when set (arena_rollout/proxy_only.py)."""

from __future__ import annotations

import asyncio
import sys

import httpx

from arena_core import access, apikeys, logs, metrics, subjects, telemetry
from arena_core.bus import Bus, TopologyError
from arena_core.runtime import freeze_startup, run, serve, stop_on_signals
from arena_core.settings import Settings, SettingsError
from arena_core.workers import Workers

from arena_rollout.app import create_app
from arena_rollout.proxy.backends import BackendRegistry
from arena_rollout.proxy.routing import Router
from arena_rollout.proxy.upstream import UpstreamClient
from arena_rollout.proxy_only import ProxyOnly
from arena_rollout.groups import GroupPolicies
from arena_rollout.reaper import Reaper
from arena_rollout.service import RolloutService
from arena_rollout.store import RecordCache, RolloutStore
from arena_rollout.worker import consumers


async def main(settings: Settings) -> int:
    log = logs.setup("rollout", settings.log_level)
    telemetry.setup("rollout", otlp_endpoint=settings.otlp_endpoint, otlp_protocol=settings.otlp_protocol)
    stop = stop_on_signals()
    bus = await Bus.connect(settings.nats_url, "rollout")
    try:  # the topology step (admin) created them: this service's user binds, never creates
        await bus.bind_topology(access.SERVICES['rollout'].streams())
    except TopologyError as exc:
        await bus.close()
        raise SystemExit(f"arena-rollout: {exc}") from None
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), limits=limits) as http:
        router = Router()
        registry = BackendRegistry(router=router, settings=settings, http=http)
        rollouts_kv = await bus.kv(subjects.KV_ROLLOUTS)
        store = RolloutStore(rollouts_kv, cache=RecordCache(max_ended=settings.rollout_cache_ended),
                             publisher=bus.publisher)
        upstream = UpstreamClient(connect_timeout=5.0, read_timeout=600.0)
        service = RolloutService(bus=bus, store=store, settings=settings, http=http, router=router,
                                 upstream=upstream, workers=Workers(bus))
        policies = GroupPolicies(lifecycle=service, records=store.cache)
        store.cache.on_final.append(policies.ended)
        background = [asyncio.create_task(registry.watch(await bus.kv(subjects.KV_BACKENDS), stop)),
                      asyncio.create_task(registry.health_loop(stop)),
                      asyncio.create_task(store.cache.watch(rollouts_kv, stop)),
                      # ends over-time rollouts nothing else would end (no LLM call, job never picked up),
                      # and fails rollouts stuck verifying past their deadline (no verification worker)
                      asyncio.create_task(Reaper(lifecycle=service, records=store.cache,
                                                 verify_deadline_s=settings.verify_deadline_s,
                                                 queue_timeout_s=settings.queue_timeout_s,
                                                 off_clock=service.proxy.off_clock_s).run(stop)),
                      # cancels the members a group's completion policy leaves out (first k, deadline)
                      asyncio.create_task(policies.run(stop))]
        log.info("rollout service listening on %s:%d", settings.host, settings.rollout_port)
        app, keys = apikeys.protect(create_app(service), bus, auth=settings.auth, host=settings.host)
        results = consumers(bus, service)
        queues = metrics.QueueDepths(bus.js, [(c.stream, c.durable) for c in results])
        metrics.install("rollout", queues, metrics.BackendLoad(router.load_snapshot))
        metrics.ROLLOUTS_QUEUED.set_function(service.queued)
        app = metrics.metrics_route(app, refresh=[queues.refresh])  # outside the key guard: scrapers carry none
        # the proxy-only port: the same app (same proxy state) behind a filter; what agents reach
        more = [(ProxyOnly(app), settings.proxy_port)] if settings.proxy_port else []
        if more:
            log.info("proxy routes only on %s:%d", settings.host, settings.proxy_port)
        freeze_startup()
        code = await serve(stop, consumers=[*results, bus.watch(), *keys, service.workers], app=app,
                           host=settings.host, port=settings.rollout_port, more=more)
        await asyncio.gather(*background, return_exceptions=True)
        await service.proxy.drain()
        await upstream.aclose()
    await bus.close()
    telemetry.shutdown()
    log.info("rollout service stopped")
    return code


if __name__ == "__main__":
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        sys.exit(f"arena-rollout: {exc}")
    sys.exit(run(main(settings)))
