"""Keys' secrets never reach a log: a real stack (``arena_stack.stack.Stack``, keys on, the
dashboard up) is called with API keys in every form it accepts (``Authorization: Bearer``,
``X-Api-Key``, the OpenEnv base URL ``/openenv/k/{key}/...`` over HTTP and WebSocket), with a
key in an address where none is taken (``?key=``, ``?api_key=``), with wrong keys in each of
those places, and the dashboard is signed in with a form's key and a one-time sign-in link.
Then every file the stack wrote under its data directory (its logs, each service's, NATS's)
is searched for each secret: the keys', the sign-in token's, and every NATS user's password
(which each service's ``ARENA_NATS_URL`` carries). Only the files that hold credentials by
design (``nats-users.json``, ``api-key``, nats-server's configuration) may hold them."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import pytest
import websockets

from arena_core import apikeys
from arena_core.bus import Bus
from arena_stack import natsauth
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack, free_port_settings

pytestmark = pytest.mark.timeout(300)

#: the files that hold credentials by design (0600), relative to the data directory
CREDENTIAL_FILES = {natsauth.CREDENTIALS_FILE, "api-key", "nats/nats-server.conf"}


def secret_of(key: str) -> str:
    """The secret part of ``ak_<id>_<secret>`` (the id alone may be logged: it names the key)."""
    return key.split("_", 2)[2]


async def test_no_key_token_or_nats_password_reaches_a_file_under_the_data_dir(tmp_path):
    data = tmp_path / "arena"
    settings = free_port_settings(data, dashboard_port=free_port(), log_level="DEBUG")
    wrong = f"{apikeys.PREFIX}{secrets.token_hex(6)}_{secrets.token_urlsafe(24)}"
    async with Stack(settings) as stack:
        key = stack.api_key
        assert key, "keys are on"
        bus = await Bus.connect(stack.direct_nats_url(), "test")
        try:
            other, _ = await apikeys.issue(bus, "other", ["read", "submit"])
            token = await apikeys.issue_sign_in_token(bus, ttl_s=300)
        finally:
            await bus.close()
        async with httpx.AsyncClient(timeout=60) as http:
            for base in (settings.rollout_url, settings.trajectory_url):
                for k in (key, other, wrong):
                    await http.get(f"{base}/v1/rollouts", headers={"authorization": f"Bearer {k}"})
                    await http.get(f"{base}/v1/rollouts", headers={"x-api-key": k})
                    await http.get(f"{base}/v1/rollouts", params={"api_key": k, "key": k})
            for k in (key, other, wrong):
                await http.get(f"{settings.rollout_url}/openenv/k/{k}/nosuch/health")
                await http.get(f"{settings.rollout_url}/openenv/k/{k}/nosuch/schema?key={k}")
                await http.post(f"{settings.rollout_url}/openenv/k/{k}/nosuch/reset", json={})
                ws = settings.rollout_url.replace("http://", "ws://") + f"/openenv/k/{k}/nosuch/ws"
                try:
                    async with websockets.connect(ws, open_timeout=30) as conn:
                        await conn.send(json.dumps({"type": "reset", "data": {}}))
                        await conn.recv()
                except Exception:  # noqa: BLE001 - refused (no such environment, or the wrong key): what is logged matters
                    pass
            dash = stack.dashboard_url
            origin = {"origin": dash, "sec-fetch-site": "same-origin"}
            await http.get(f"{dash}/", params={"key": key})
            await http.post(f"{dash}/login", data={"key": wrong}, headers=origin)
            signed = await http.post(f"{dash}/login", data={"key": other}, headers=origin)
            await http.get(f"{dash}/", params={"token": token}, headers={"sec-fetch-site": "none"})
            await http.get(f"{dash}/", params={"token": token}, headers={"sec-fetch-site": "none"})  # used: refused
            cookies = signed.cookies
            page = await http.get(f"{dash}/api/rollouts", cookies=cookies)
            for k in (key, other, token):
                assert secret_of(k) not in page.text
        passwords = natsauth.load_or_create(data / natsauth.CREDENTIALS_FILE)
    wanted = {"the stack's API key": secret_of(key), "an issued API key": secret_of(other),
              "a wrong key": secret_of(wrong), "the sign-in token": secret_of(token),
              **{f"NATS user {user}'s password": pw for user, pw in passwords.items()}}
    searched, found = 0, []
    for path in sorted(p for p in data.rglob("*") if p.is_file()):
        if str(path.relative_to(data)) in CREDENTIAL_FILES:
            continue
        text = path.read_bytes()
        searched += 1
        found += [f"{path.relative_to(data)}: {what}" for what, secret in wanted.items() if secret.encode() in text]
    logs = list((data / "logs").glob("*.log"))
    assert {p.name for p in logs} >= {"nats-server.log", "rollout.log", "sandbox.log", "verification.log",
                                      "trajectory.log", "dashboard.log"}, logs
    assert searched > len(logs) and found == [], found


def test_a_log_line_that_names_a_secret_carries_it_redacted():
    """The services' log formatter (``arena_core.logs``) takes secrets out of whatever a line says:
    its message, its exception, its fields (a key in an OpenEnv path, an API key, a sign-in token,
    a NATS URL's password), leaving the ids that name a key."""
    import logging

    from arena_core import logs

    key = f"{apikeys.PREFIX}{secrets.token_hex(6)}_{secrets.token_urlsafe(24)}"
    token = f"{apikeys.SIGN_IN_PREFIX}{secrets.token_hex(6)}_{secrets.token_urlsafe(24)}"
    url = natsauth.with_user("nats://127.0.0.1:4222,nats://10.0.0.2:4222", "sandbox", "s3cret/pw@x")
    formatter = logs.JsonFormatter("test")
    try:
        raise RuntimeError(f"cannot connect to {url} with {key}")
    except RuntimeError:
        import sys

        exc_info = sys.exc_info()
    record = logging.LogRecord("t", logging.ERROR, __file__, 1, "GET %s failed (token %s, url %s)",
                               (f"/openenv/k/{key}/echo/ws", token, url), exc_info)
    record.subject = f"/openenv/k/{key}/x"
    line = formatter.format(record)
    for secret in (secret_of(key), secret_of(token), "s3cret", key):
        assert secret not in line, line
    assert "_".join(key.split("_", 2)[:2]) + "_***" in line and "/openenv/k/***/echo/ws" in line and "nats://sandbox:***@127.0.0.1" in line
