"""LoRA weight sync against a local stand-in for vLLM's runtime adapter endpoints
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``; no GPU here), with the replica
re-registered in ``arena_backends`` under the new version."""

from __future__ import annotations

import asyncio
import threading

import httpx
import msgspec
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from arena_core import subjects
from arena_stack.natsserver import free_port, wait_port
from arena_rl.vllm_sync import VLLMLoraSync, VLLMSyncError, kv_register
from arena_core.schemas import BackendReplica


def standin() -> tuple[FastAPI, dict]:
    """vLLM's documented shapes: JSON ``{"lora_name", "lora_path"}`` in, 200 plain text out,
    400 for an unknown adapter on unload."""
    app, loaded = FastAPI(), {}

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        body = await request.json()
        loaded[body["lora_name"]] = body["lora_path"]
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        body = await request.json()
        if loaded.pop(body["lora_name"], None) is None:
            return PlainTextResponse(f"The lora adapter '{body['lora_name']}' cannot be found.", status_code=400)
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    return app, loaded


@pytest.fixture
def vllm_standin():
    app, loaded = standin()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_port("127.0.0.1", port, 20)
    yield f"http://127.0.0.1:{port}/v1", loaded
    server.should_exit = True
    thread.join(10)


async def test_lora_sync_loads_registers_and_unloads(vllm_standin, bus):
    url, loaded = vllm_standin
    kv = await bus.kv(subjects.KV_BACKENDS)
    async with httpx.AsyncClient() as http:
        sync = VLLMLoraSync({"vllm-0": url}, http=http, register=kv_register(kv), keep=2)
        for version in range(4):
            await sync.sync(f"/ckpt/lora-v{version}", version)
        assert loaded == {"policy-v2": "/ckpt/lora-v2", "policy-v3": "/ckpt/lora-v3"}
        replica = msgspec.json.decode((await kv.get("vllm-0")).value, type=BackendReplica)
        assert replica.policy_version == "3" and replica.models == ["policy-v3"] and replica.url == url
        broken = VLLMLoraSync({"vllm-0": url}, http=http, keep=1)
        loaded.clear()
        with pytest.raises(VLLMSyncError, match="cannot be found"):
            await broken.sync("/ckpt/x", 5)  # v4 was never loaded: the replica's 400 surfaces
    await asyncio.sleep(0)
