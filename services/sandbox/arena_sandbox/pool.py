"""A warm pool per kind of sandbox: sandboxes created ahead so acquiring one is near-instant.

Sandboxes are never reused: the caller destroys what it acquired. See docs/sandbox.md (**Warm pool**).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from arena_sandbox_providers.provider import CreateSpec, Sandbox, SandboxProvider

log = logging.getLogger("arena.sandbox.pool")


class WarmPool:
    def __init__(self, provider: SandboxProvider, *, size: int):
        self.provider = provider
        self.size = size
        self._idle: dict[CreateSpec, list[Sandbox]] = {}
        self._filling: dict[CreateSpec, asyncio.Task] = {}
        self._closed = False

    async def prefill(self, spec: CreateSpec) -> None:
        """Fill the pool for ``spec`` to ``size`` and wait until it is full."""
        spec = self.provider.pool_key(spec)
        if self.size > 0:
            self._refill(spec)
            await asyncio.shield(self._filling[spec])

    def idle(self, spec: CreateSpec) -> int:
        return len(self._idle.get(self.provider.pool_key(spec), []))

    async def acquire(self, spec: CreateSpec) -> Sandbox:
        spec = self.provider.pool_key(spec)
        idle = self._idle.get(spec)
        sandbox = idle.pop() if idle else None
        if self.size > 0:
            self._refill(spec)
        return sandbox if sandbox is not None else await self.provider.create(spec)

    def _refill(self, spec: CreateSpec) -> None:
        task = self._filling.get(spec)
        if self._closed or (task is not None and not task.done()):
            return
        self._filling[spec] = asyncio.create_task(self._fill(spec))

    async def _fill(self, spec: CreateSpec) -> None:
        idle = self._idle.setdefault(spec, [])
        while not self._closed and len(idle) < self.size:
            try:
                sandbox = await self.provider.create(spec)
            except Exception as exc:  # noqa: BLE001 - the pool is best effort; acquire still creates
                log.warning("warm pool (%s %s): cannot create a sandbox: %s", self.provider.name, spec.image, exc)
                return
            if self._closed:
                await sandbox.destroy()
                return
            idle.append(sandbox)

    async def close(self) -> None:
        self._closed = True
        for task in self._filling.values():  # each stops after its current create (and destroys it)
            with contextlib.suppress(Exception):
                await task
        for idle in self._idle.values():
            while idle:
                await idle.pop().destroy()
