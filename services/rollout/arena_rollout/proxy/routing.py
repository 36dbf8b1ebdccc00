"""Replicas, sticky per-rollout routing, health, and in-flight bounds.

No I/O: the registry (``backends.py``) feeds replicas in, the health checker and the
forwarder mark them up or down. A rollout's calls go to the replica that served its
first call while that replica is healthy (prefix-cache reuse); otherwise to the least
loaded healthy replica that serves the model; unhealthy replicas are tried last rather
than failing a call outright.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import OrderedDict

from arena_core.errors import Unavailable
from arena_core.schemas import BackendReplica

MAX_STICKY = 100_000


class ReplicaState:
    """A replica as the router sees it: its record, health, and a bound on in-flight calls."""

    def __init__(self, replica: BackendReplica):
        self.replica = replica
        self.healthy = True
        self.last_error = ""
        self.down_since = 0.0
        self.inflight = 0
        self.waiting = 0
        #: per model name: until when (``time.monotonic()``) the replica is taken to have no
        #: ``/tokenize`` for it, and why (per model: vLLM answers 404 for a model it does not serve too)
        self.no_tokenize: dict[str, tuple[float, str]] = {}
        self._slots = asyncio.Semaphore(max(1, replica.max_inflight))

    @property
    def id(self) -> str:
        return self.replica.replica_id

    def serves(self, model: str) -> bool:
        return model in ("", "default") or not self.replica.models or model in self.replica.models

    @property
    def load(self) -> float:
        return (self.inflight + self.waiting) / max(1, self.replica.max_inflight)

    async def acquire(self) -> float:
        """Wait for a free slot (the queue); return the milliseconds spent waiting."""
        t0 = time.perf_counter()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.inflight += 1
        return (time.perf_counter() - t0) * 1000

    def release(self) -> None:
        self.inflight -= 1
        self._slots.release()


class Router:
    def __init__(self, replicas: list[BackendReplica] = ()):
        self.replicas: dict[str, ReplicaState] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        for r in replicas:
            self.upsert(r)

    def upsert(self, replica: BackendReplica) -> None:
        """Add a replica or update it in place (e.g. its policy version after a weight sync)."""
        current = self.replicas.get(replica.replica_id)
        if current is None or current.replica.max_inflight != replica.max_inflight or current.replica.url != replica.url:
            state = ReplicaState(replica)
            if current is not None and current.replica.url == replica.url:
                state.healthy, state.last_error = current.healthy, current.last_error
            self.replicas[replica.replica_id] = state
        else:
            current.replica = replica

    def remove(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def mark_down(self, replica_id: str, error: str) -> None:
        state = self.replicas.get(replica_id)
        if state is not None:
            if state.healthy:
                state.down_since = time.time()
            state.healthy, state.last_error = False, error

    def mark_up(self, replica_id: str) -> None:
        state = self.replicas.get(replica_id)
        if state is not None:
            state.healthy, state.last_error = True, ""

    def sticky(self, rollout_id: str) -> str | None:
        return self._sticky.get(rollout_id)

    def stick(self, rollout_id: str, replica_id: str) -> None:
        self._sticky[rollout_id] = replica_id
        self._sticky.move_to_end(rollout_id)
        while len(self._sticky) > MAX_STICKY:
            self._sticky.popitem(last=False)

    def forget(self, rollout_id: str) -> None:
        self._sticky.pop(rollout_id, None)

    def candidates(self, rollout_id: str, model: str) -> list[ReplicaState]:
        """Replicas to try for this call, in order. Raises ``Unavailable`` if none serves ``model``."""
        serving = [s for s in self.replicas.values() if s.serves(model)]
        if not serving:
            raise Unavailable(f"no backend replica serves model {model!r}; "
                              f"registered: {', '.join(sorted(self.replicas)) or 'none'}")
        salt = zlib.crc32(rollout_id.encode())
        serving.sort(key=lambda s: (not s.healthy, s.load, zlib.crc32(s.id.encode()) ^ salt))
        pinned = self._sticky.get(rollout_id)
        for i, s in enumerate(serving):
            if s.id == pinned and s.healthy:
                serving.insert(0, serving.pop(i))
                break
        return serving
