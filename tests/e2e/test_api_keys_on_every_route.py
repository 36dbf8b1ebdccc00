"""API keys through the real services (``ARENA_AUTH=keys``): every route of the rollout and
trajectory APIs, as their own OpenAPI documents list them, refuses a call without a key
(401), with an unknown or revoked key (401) and with a key of the wrong scope (403), and
lets the right scope through; health and the per-rollout LLM proxy stay as they were; the
SDK with a key submits and reads."""

from __future__ import annotations

import asyncio
import re
import shutil

import httpx
import pytest

from arena.sdk import ArenaClient
from arena_core import apikeys
from arena_core.bus import Bus
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

def routes(openapi: dict) -> list[tuple[str, str]]:
    """(method, concrete path) of every operation, path parameters filled in."""
    out = []
    for path, operations in openapi["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", "r-0", path)
        out += [(method.upper(), concrete) for method in operations if method in ("get", "post", "put", "delete")]
    return out


def keyed_settings(tmp_path, **extra) -> Settings:
    rp = free_port()
    return Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"), rollout_port=rp,
                    trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}", auth="keys", **extra)


async def issue_keys(settings: Settings, wanted: list[tuple[str, list[str]]], revoke: list[str] = ()) -> list[str]:
    """Keys made in the stack's bucket (``revoke``: those made, then revoked), once the services see them."""
    bus = await Bus.connect(settings.nats_url, "test-admin")
    try:
        keys = []
        for name, scopes in wanted:
            key, record = await apikeys.issue(bus, name, scopes)
            if name in revoke:
                await apikeys.revoke(bus, record.key_id)
            keys.append(key)
    finally:
        await bus.close()
    await asyncio.sleep(0.5)  # the services' key watches see them
    return keys


async def test_every_route_needs_a_key_of_its_scope(tmp_path):
    settings = keyed_settings(tmp_path)
    stack = Stack(settings, log=lambda m: None)
    await stack.start()
    try:
        reader, submitter, admin, gone = await issue_keys(
            stack.settings, [("reader", ["read"]), ("submitter", ["submit"]), ("admin", ["admin"]), ("gone", ["admin"])],
            revoke=["gone"])
        checked = 0
        async with httpx.AsyncClient(timeout=30) as http:
            for base in (settings.rollout_url, settings.trajectory_url):
                assert (await http.get(f"{base}/healthz")).status_code == 200  # no key needed
                spec = (await http.get(f"{base}/openapi.json")).json()
                for method, path in routes(spec):
                    if path in apikeys.PUBLIC_PATHS or path.startswith(apikeys.OWN_KEYS):
                        continue
                    url = f"{base}{path}"
                    params = {"timeout": "0.1"} if path.endswith("/wait") else None

                    async def call(key: str | None) -> httpx.Response:
                        headers = {"authorization": f"Bearer {key}"} if key else {}
                        if path.endswith("/events"):  # a stream: its status is enough
                            async with http.stream(method, url, headers=headers) as resp:
                                return resp
                        return await http.request(method, url, headers=headers, params=params, json={})

                    needed = apikeys.scope_for(method, path)
                    wrong, right = {"read": (submitter, reader), "admin": (submitter, admin)}.get(
                        needed, (reader, submitter))
                    for key, expected in ((None, 401), ("ak_nope_secret", 401), (gone, 401), (wrong, 403)):
                        resp = await call(key)
                        assert resp.status_code == expected, (method, path, key and key[:10], resp.status_code)
                    for key in (right, admin):
                        resp = await call(key)
                        assert resp.status_code not in (401, 403), (method, path, resp.status_code)
                    checked += 1
            denied = await http.get(f"{settings.rollout_url}/v1/rollouts")
            assert denied.json()["error"]["code"] == "unauthorized"
            assert denied.headers["www-authenticate"].startswith("Bearer")
        assert checked >= 15, checked  # both APIs' routes were all reached
        with ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=admin) as client:
            assert client.list() == []
        with ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=reader) as client:
            assert client.list() == []
    finally:
        stack.stop()


async def test_an_openenv_client_passes_its_key_in_the_base_url(tmp_path):
    """OpenEnv's client sends no headers: ``/openenv/k/{key}/{name}`` carries the key; a
    WebSocket without one, or with a read-only key, is refused before its handshake completes."""
    import msgspec
    import websockets
    from openenv.core import GenericEnvClient

    from arena.tasks import load_task
    from arena_core.schemas import AgentSpec

    settings = keyed_settings(tmp_path, allow_host_paths=True)
    stack = Stack(settings, log=lambda m: None)
    await stack.start()
    try:
        reader, submitter = await issue_keys(stack.settings, [("reader", ["read"]), ("submitter", ["submit"])])
        from pathlib import Path

        quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
        task = msgspec.structs.replace(load_task(quickstart), agent=AgentSpec(external=True))
        async with httpx.AsyncClient(timeout=30) as http:
            put = await http.put(f"{settings.rollout_url}/v1/environments/qs", json={"task": msgspec.to_builtins(task)},
                                 headers={"authorization": f"Bearer {submitter}"})
            assert put.status_code == 200, put.text
            assert (await http.get(f"{settings.rollout_url}/openenv/qs/health")).status_code == 401
            assert (await http.get(f"{settings.rollout_url}/openenv/k/{reader}/qs/health")).json() == {
                "status": "healthy"}
        ws = f"ws://127.0.0.1:{settings.rollout_port}/openenv"
        for refused in (f"{ws}/qs/ws", f"{ws}/k/{reader}/qs/ws", f"{ws}/k/ak_nope_secret/qs/ws"):
            with pytest.raises(websockets.InvalidStatus) as exc:
                async with websockets.connect(refused):
                    pass
            assert exc.value.response.status_code == 403
        async with GenericEnvClient(base_url=f"{settings.rollout_url}/openenv/k/{submitter}/qs") as env:
            first = await env.reset()
            assert "median" in first.observation["prompt"]
            done = await env.step({"type": "call_tool", "tool_name": "submit", "arguments": {}})
            assert done.done is True and done.reward == 0.0
    finally:
        stack.stop()
