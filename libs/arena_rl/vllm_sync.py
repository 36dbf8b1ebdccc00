"""Weight sync to vLLM replicas by LoRA adapter, through vLLM's documented runtime API.

For each new policy version the trainer writes a PEFT-format LoRA adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``) where the replicas can read it,
then :meth:`VLLMLoraSync.sync` on every replica:

1. ``POST {base}/v1/load_lora_adapter`` ``{"lora_name": "policy-v{N}", "lora_path": dir}``
   (vLLM started with ``--enable-lora --max-lora-rank R`` and
   ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``);
2. re-registers the replica in ``arena_backends`` with ``policy_version=N`` and
   ``models=["policy-v{N}"]``, so the proxy routes the next calls to the new adapter;
3. ``POST {base}/v1/unload_lora_adapter`` ``{"lora_name": "policy-v{N-keep}"}`` for
   adapters older than ``keep`` versions (in-flight calls on them finish first: vLLM
   unloads an adapter only between requests).

Agents then call the model ``policy-v{N}`` (or Arena's rollout ``model`` setting). No GPU
here: tests run it against a local stand-in that speaks these endpoints (docs/rl.md).
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
