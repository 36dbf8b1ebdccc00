"""API keys are on unless the user turns them off: the default settings ask for them on
loopback too (another local user reaches a loopback port as well), a running service
refuses a request without one, and ``ARENA_AUTH=off`` is said out loud at every start."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from arena_core import apikeys
from arena_core.settings import Settings
from arena_stack import topology
from arena_stack.natsserver import free_port


def test_the_default_settings_ask_for_keys_on_loopback():
    default = Settings()
    assert default.host == "127.0.0.1" and apikeys.enforced(default.auth, default.host)
    from_env = Settings.from_env({})
    assert from_env.auth == default.auth and apikeys.enforced(from_env.auth, "localhost")
    assert apikeys.enforced(from_env.auth, "::1") and apikeys.enforced(from_env.auth, "0.0.0.0")
    assert not apikeys.enforced(Settings.from_env({"ARENA_AUTH": "off"}).auth, "127.0.0.1")


def start_rollout(nats_url: str, tmp_path: Path, **env: str) -> tuple[subprocess.Popen, str, Path]:
    """The rollout service as ``python -m arena_rollout`` runs it, with the environment's
    defaults (no ARENA_AUTH unless given); (process, base URL, log)."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("ARENA_AUTH", "ARENA_HOST")}
    base.update(ARENA_NATS_URL=nats_url, ARENA_ROLLOUT_PORT=str(port), ARENA_DATA_DIR=str(tmp_path / "data"),
                ARENA_BACKEND_URL=f"http://127.0.0.1:{free_port()}/v1", **env)
    log = tmp_path / "rollout.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "arena_rollout"], env=base, stdout=out, stderr=out)
    return proc, f"http://127.0.0.1:{port}", log


def answer(proc: subprocess.Popen, url: str, headers: dict[str, str] | None = None, *, until_not: tuple = (),
           timeout: float = 60.0) -> httpx.Response:
    """GET ``url`` until it answers something other than ``until_not`` (the service is starting)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the service exited with {proc.returncode}"
        try:
            r = httpx.get(url, headers=headers or {}, timeout=2)
            if r.status_code not in until_not:
                return r
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer in {timeout} s"
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def test_a_service_with_default_settings_refuses_a_request_without_a_key(nats_server, bus, tmp_path):
    key, _ = await apikeys.issue(bus, "reader", ["read"])
    proc, base, _ = start_rollout(nats_server.url, tmp_path)
    try:
        assert answer(proc, f"{base}/healthz").status_code == 200
        refused = answer(proc, f"{base}/v1/rollouts", until_not=(503,))  # 503: the keys are still loading
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "unauthorized"
        assert answer(proc, f"{base}/v1/rollouts", apikeys.auth_headers(key), until_not=(401, 503)).status_code == 200
    finally:
        stop(proc)


def test_auth_off_is_a_warning_at_every_start_even_on_loopback(nats_server, tmp_path):
    asyncio.run(topology.create(nats_server.url))  # what `arena up` does before its services
    for start in (1, 2):
        proc, base, log = start_rollout(nats_server.url, tmp_path, ARENA_AUTH="off", ARENA_HOST="127.0.0.1")
        try:
            assert answer(proc, f"{base}/v1/rollouts").status_code == 200  # off: no key asked
        finally:
            stop(proc)
        warnings = [line for line in map(json.loads, filter(str.strip, log.read_text().splitlines()))
                    if line["level"] == "warning" and "ARENA_AUTH=off" in line["msg"]]
        assert len(warnings) == start, log.read_text()[-2000:]
