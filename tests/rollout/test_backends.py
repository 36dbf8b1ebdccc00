"""The ``arena_backends`` KV registry against a real nats-server, and health checks
against real scripted backends: replicas and policy versions change while rollouts run."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from arena_core import subjects
from arena_core.runtime import serve
from arena_core.schemas import BackendReplica
from arena_stack.scripted_llm import Script, ScriptedLLM, ScriptedResponse
from arena_stack.scripted_llm import create_app as create_llm_app
from arena_core.settings import Settings
from arena_rollout.proxy.backends import BackendRegistry, register, unregister
from arena_rollout.proxy.routing import Router

from tests.rollout.test_proxy_with_sdks import free_port, start


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_registry_follows_the_bucket_and_health_follows_the_replicas(bus):
    stops: list = []
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="x")]))
    live = await start(create_llm_app(llm), stops)
    dead = f"http://127.0.0.1:{free_port()}"
    router = Router()
    async with httpx.AsyncClient() as http:
        registry = BackendRegistry(router=router, settings=Settings(backend_url=live + "/v1", backend_max_inflight=16),
                                   http=http, health_interval_s=0.1)
        assert router.replicas["default"].limit == 16  # ARENA_BACKEND_MAX_INFLIGHT
        kv = await bus.kv(subjects.KV_BACKENDS)
        await register(kv, BackendReplica(replica_id="gpu-0", url=live + "/v1", policy_version="step-1"))
        stop = asyncio.Event()
        watch = asyncio.create_task(registry.watch(kv, stop))
        health = asyncio.create_task(registry.health_loop(stop))
        try:
            await until(lambda: "gpu-0" in router.replicas)
            assert set(router.replicas) == {"default", "gpu-0"}
            # a weight sync: the trainer bumps the policy version while rollouts run
            await register(kv, BackendReplica(replica_id="gpu-0", url=live + "/v1", policy_version="step-2",
                                              max_inflight=256))  # vLLM's --max-num-seqs
            await until(lambda: router.replicas["gpu-0"].replica.policy_version == "step-2")
            assert router.replicas["gpu-0"].limit == 256
            with pytest.raises(ValueError, match="max_inflight must be at least 1"):
                await register(kv, BackendReplica(replica_id="gpu-0", url=live + "/v1", max_inflight=0))
            await register(kv, BackendReplica(replica_id="gpu-1", url=dead + "/v1", models=["big"]))
            await until(lambda: "gpu-1" in router.replicas and not router.replicas["gpu-1"].healthy)
            assert "ConnectError" in router.replicas["gpu-1"].last_error
            assert router.replicas["gpu-0"].healthy and router.replicas["default"].healthy
            await unregister(kv, "gpu-1")
            await until(lambda: "gpu-1" not in router.replicas)
        finally:
            stop.set()
            await asyncio.gather(watch, health)
            for s, _ in stops:
                s.set()
            await asyncio.gather(*(t for _, t in stops))
