"""The ``arena_backends`` KV registry and replica health checks.

A replica is a ``BackendReplica`` under its id; registering, updating (a new
``policy_version`` after a weight sync) or deleting it takes effect on running
rollouts at once: ``BackendRegistry.run`` watches the bucket and updates the router.
``ARENA_BACKEND_URL`` is always present as replica ``default`` (at most
``ARENA_BACKEND_MAX_INFLIGHT`` calls in flight) unless the bucket holds a replica with that id.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import msgspec

from arena_core.bus import follow_kv
from arena_core.runtime import every
from arena_core.schemas import BackendReplica
from arena_core.settings import Settings

from arena_rollout.proxy.routing import Router

log = logging.getLogger("arena.rollout.backends")

_decoder = msgspec.json.Decoder(BackendReplica)


def default_replica(settings: Settings) -> BackendReplica:
    return BackendReplica(replica_id="default", url=settings.backend_url,
                          policy_version=settings.backend_policy_version,
                          max_inflight=settings.backend_max_inflight)


async def register(kv, replica: BackendReplica) -> None:
    """Put (or replace) a replica in the ``arena_backends`` bucket."""
    if not replica.replica_id or "." in replica.replica_id or " " in replica.replica_id:
        raise ValueError(f"replica id {replica.replica_id!r} must be non-empty without dots or spaces")
    if replica.max_inflight < 1:
        raise ValueError(f"replica {replica.replica_id}: max_inflight must be at least 1 (vLLM's --max-num-seqs), "
                         f"got {replica.max_inflight}")
    if replica.registered_at == 0.0:
        replica = msgspec.structs.replace(replica, registered_at=time.time())
    await kv.put(replica.replica_id, msgspec.json.encode(replica))


async def unregister(kv, replica_id: str) -> None:
    await kv.delete(replica_id)


class BackendRegistry:
    """Keeps a ``Router`` in step with the KV bucket and with replica health."""

    def __init__(self, *, router: Router, settings: Settings, http: httpx.AsyncClient,
                 health_interval_s: float = 5.0):
        self.router = router
        self.settings = settings
        self.http = http
        self.health_interval_s = health_interval_s
        self._default = default_replica(settings)
        router.upsert(self._default)

    def apply(self, key: str, value: bytes | None) -> None:
        """One KV entry (``None`` = deleted) applied to the router."""
        if value is None:
            self.router.remove(key)
            if key == "default":
                self.router.upsert(self._default)
            log.info("backend replica %s removed", key)
            return
        try:
            replica = _decoder.decode(value)
        except msgspec.DecodeError as exc:
            log.error("arena_backends key %s is not a BackendReplica: %s", key, exc)
            return
        if replica.max_inflight < 1:
            log.error("backend replica %s declares max_inflight %d: taken as 1", replica.replica_id,
                      replica.max_inflight)
        self.router.upsert(replica)
        log.info("backend replica %s at %s (policy %s, at most %d in flight)", replica.replica_id, replica.url,
                 replica.policy_version, max(1, replica.max_inflight))

    async def watch(self, kv, stop: asyncio.Event) -> None:
        def on_entry(entry) -> None:
            deleted = entry.operation is not None or entry.value is None
            self.apply(entry.key, None if deleted else entry.value)

        await follow_kv(kv, stop, on_entry)

    async def check(self) -> None:
        """Probe every replica's ``/models``; mark it up or down."""
        async def probe(state) -> None:
            url = state.replica.url.rstrip("/") + "/models"
            try:
                resp = await self.http.get(url, timeout=2.0)
                ok, why = resp.status_code < 500, f"health check answered {resp.status_code}"
            except httpx.HTTPError as exc:
                ok, why = False, f"health check failed: {type(exc).__name__}: {exc}"
            if ok and not state.healthy:
                log.info("backend replica %s is healthy again", state.id)
                self.router.mark_up(state.id)
            elif not ok and state.healthy:
                log.warning("backend replica %s is down: %s", state.id, why)
                self.router.mark_down(state.id, why)

        await asyncio.gather(*(probe(s) for s in list(self.router.replicas.values())))

    async def health_loop(self, stop: asyncio.Event) -> None:
        await every(stop, self.health_interval_s, self.check, what="backend health check")
