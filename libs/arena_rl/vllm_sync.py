"""Weight sync to vLLM replicas by LoRA adapter, through vLLM's documented runtime API.

:class:`VLLMLoraSync` loads each new version's adapter on every replica, re-registers the replica
in ``arena_backends`` and unloads old adapters. See docs/rl.md ("vLLM replicas").
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import httpx
import msgspec

from arena_core.schemas import BackendReplica


class VLLMSyncError(RuntimeError):
    """A replica refused an adapter load or unload; the message has its answer."""


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


class VLLMLoraSync:
    def __init__(self, replicas: dict[str, str], *, http: httpx.AsyncClient,
                 register: Callable[[BackendReplica], Awaitable[None]] | None = None, keep: int = 2):
        """``replicas``: replica id -> base URL ending in ``/v1``; ``register`` puts a
        ``BackendReplica`` in ``arena_backends`` (e.g. ``kv.put`` wrapped)."""
        self.replicas = replicas
        self.http = http
        self.register = register
        self.keep = keep

    async def _post(self, url: str, body: dict) -> None:
        resp = await self.http.post(url, json=body)
        if resp.status_code != 200:
            raise VLLMSyncError(f"{url} answered {resp.status_code}: {resp.text[:300]}")

    async def sync(self, adapter_dir: str, version: int) -> None:
        name = adapter_name(version)
        for replica_id, base in self.replicas.items():
            base = base.rstrip("/")
            await self._post(f"{base}/load_lora_adapter", {"lora_name": name, "lora_path": adapter_dir})
            if self.register is not None:
                await self.register(BackendReplica(replica_id=replica_id, url=base, models=[name],
                                                   policy_version=str(version), registered_at=time.time()))
            old = version - self.keep
            if old >= 0:
                await self._post(f"{base}/unload_lora_adapter", {"lora_name": adapter_name(old)})


def kv_register(kv) -> Callable[[BackendReplica], Awaitable[None]]:
    """``register`` for :class:`VLLMLoraSync` over an ``arena_backends`` KV handle."""

    async def put(replica: BackendReplica) -> None:
        await kv.put(replica.replica_id, msgspec.json.encode(replica))

    return put
