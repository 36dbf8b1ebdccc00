"""Which sandbox providers some worker serves right now: each sandbox worker advertises its
providers in the ``arena_workers`` bucket (refreshed every few seconds, gone with it), and the
rollout service refuses at once a submission to a provider nobody serves, instead of letting it
wait out its queue limit. docs/rollout.md ("Submission").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable

import msgspec

from arena_core import subjects
from arena_core.bus import follow_kv
from arena_core.errors import InvalidRequest, ProviderUnserved
from arena_core.schemas import WorkerInfo

log = logging.getLogger("arena.workers")

#: A worker refreshes its entry this often; an entry older than ``STALE_S`` is a worker gone.
REFRESH_S = 5.0
STALE_S = 20.0


class Advertiser:
    """A sandbox worker's entries, one per provider it serves; removed when it stops."""

    def __init__(self, bus, providers: list[str], *, owner: str, slots: int,
                 scaffolds: Callable[[str], list[str] | None] | None = None):
        """``scaffolds(provider)``: the presets its sandboxes can launch now (``None``: not known);
        asked at every refresh, so a scaffold installed while the worker runs is soon advertised."""
        self.bus, self.providers, self.slots = bus, providers, slots
        self.scaffolds = scaffolds or (lambda provider: None)
        self.worker = f"{subjects.token(owner)}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.durable = "advertiser"

    async def announce(self) -> None:
        kv = await self.bus.kv(subjects.KV_WORKERS)
        for provider in self.providers:
            info = WorkerInfo(provider=provider, worker=self.worker, slots=self.slots, at=time.time(),
                              scaffolds=self.scaffolds(provider))
            await kv.put(f"{provider}.{self.worker}", msgspec.json.encode(info))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), REFRESH_S)
            if stop.is_set():
                break
            try:
                await self.announce()
            except Exception as exc:  # noqa: BLE001 - a partition: the entry goes stale, and comes back
                log.warning("cannot refresh this worker's entry in %s: %s", subjects.KV_WORKERS, exc)
        # the entries are left to go stale (STALE_S): a restarting worker does not turn
        # submissions away meanwhile

class Workers:
    """The rollout service's view of ``arena_workers`` (a watch; a miss is read afresh)."""

    def __init__(self, bus) -> None:
        self.bus = bus
        self.entries: dict[str, WorkerInfo] = {}
        #: when this process last saw each entry written (its own clock: the workers' may differ)
        self.seen: dict[str, float] = {}
        self.durable = "workers-watch"
        self._decoder = msgspec.json.Decoder(WorkerInfo)

    async def run(self, stop: asyncio.Event) -> None:
        def on_entry(entry) -> None:
            if entry.value is None or entry.operation is not None:  # deleted or purged
                self.entries.pop(entry.key, None)
                return
            with contextlib.suppress(msgspec.DecodeError):
                self.entries[entry.key] = self._decoder.decode(entry.value)
                self.seen[entry.key] = time.monotonic()

        await follow_kv(await self.bus.kv(subjects.KV_WORKERS), stop, on_entry)

    def _live(self, provider: str) -> bool:
        now = time.monotonic()
        return any(i.provider == provider and now - self.seen.get(k, -1e9) < STALE_S for k, i in self.entries.items())

    def slots(self) -> int | None:
        """Sandboxes the live workers run at once (a worker serving several providers counted
        once), or ``None`` when no live worker is known (admission then goes by the queue's drain)."""
        now = time.monotonic()
        per_worker: dict[str, int] = {}
        for key, info in self.entries.items():
            if now - self.seen.get(key, -1e9) < STALE_S:
                per_worker[info.worker] = max(per_worker.get(info.worker, 0), info.slots)
        return sum(per_worker.values()) or None

    def check_scaffold(self, provider: str, scaffold: str) -> None:
        """Raise :class:`InvalidRequest` when every live worker of ``provider`` advertises the
        scaffolds it can launch and none lists ``scaffold`` (a worker that does not say is
        trusted: its image may ship it). Call after :meth:`check`."""
        now = time.monotonic()
        live = [i for k, i in self.entries.items() if i.provider == provider and now - self.seen.get(k, -1e9) < STALE_S]
        if not live or any(i.scaffolds is None or scaffold in i.scaffolds for i in live):
            return
        ready = sorted({name for i in live for name in i.scaffolds or ()})
        raise InvalidRequest(
            f"scaffold {scaffold!r} is not installed on any {provider!r} sandbox worker (they can launch: "
            f"{', '.join(ready) or 'none'}); install it where the workers run: `make scaffolds-venv` "
            f"(mini-swe-agent) or `python -m arena_core.scaffolds.install {scaffold}` (into ARENA_SCAFFOLDS_DIR, "
            "default <data dir>/scaffolds); workers advertise it within a few seconds")

    async def check(self, provider: str) -> None:
        """Raise :class:`ProviderUnserved` unless a live worker serves ``provider`` (an entry
        written within ``STALE_S``, by this process's clock; a miss is read afresh, where the
        bucket's TTL, by the server's clock, bounds an entry's age)."""
        if self._live(provider):
            return
        kv = await self.bus.kv(subjects.KV_WORKERS)
        try:
            keys = await kv.keys()
        except Exception:  # noqa: BLE001 - nats raises NoKeysError on an empty bucket
            keys = []
        for key in keys:
            if key.startswith(f"{provider}."):
                with contextlib.suppress(Exception):
                    entry = await kv.get(key)
                    self.entries[key] = self._decoder.decode(entry.value)
                    self.seen[key] = time.monotonic()  # the bucket keeps an entry STALE_S (its TTL, by the server's clock)
        if not self._live(provider):
            now = time.monotonic()
            served = sorted({i.provider for k, i in self.entries.items() if now - self.seen.get(k, -1e9) < STALE_S})
            raise ProviderUnserved(
                f"no sandbox worker serves provider {provider!r} (served now: {', '.join(served) or 'none'}); "
                "start one with ARENA_SANDBOX_PROVIDER including it, or submit to a provider that is served")
