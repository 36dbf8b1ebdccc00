"""Dashboard sign-in: a login from another site is refused (login CSRF); the link ``arena up``
prints carries a one-time, short-lived sign-in token that works once and opens a read-only
session; no API key is taken from an address. The dashboard app with its real key gate,
tokens issued into and redeemed from a real nats-server's API keys bucket; what the session
may do is asked of the rollout API behind its real key guard."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from arena_core import apikeys, subjects
from arena_core.settings import Settings
from arena_dashboard import auth
from arena_dashboard.app import create_app
from arena_dashboard.fanout import Hub
from arena_dashboard.upstream import TrajectoryApi
from arena_rollout.app import create_app as create_rollout_app
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore

from tests.rollout.test_service import task_json

pytestmark = pytest.mark.timeout(120)

OWN = "http://dash"  # the dashboard's origin as the test client addresses it
FORM = {"content-type": "application/x-www-form-urlencoded"}
TYPED = {"sec-fetch-site": "none"}  # what a browser sends for an address typed or opened from a terminal


class Signed:
    def __init__(self, bus, ring: apikeys.KeyRing, dashboard: httpx.AsyncClient):
        self.bus, self.ring, self.dashboard = bus, ring, dashboard

    async def seen(self, key_id: str) -> None:
        for _ in range(200):
            if key_id in self.ring.keys:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"the key watch never saw {key_id}")

    async def token(self, **kw) -> str:
        token = await apikeys.issue_sign_in_token(self.bus, **kw)
        await self.seen(token[len(apikeys.SIGN_IN_PREFIX):].split("_")[0])
        return token

    async def key(self, name: str, scopes: list[str]) -> str:
        key, record = await apikeys.issue(self.bus, name, scopes)
        await self.seen(record.key_id)
        return key


@pytest.fixture
async def signed(bus):
    ring = apikeys.KeyRing(bus)
    stop = asyncio.Event()
    watch = asyncio.create_task(ring.run(stop))
    await asyncio.wait_for(ring.ready.wait(), 10)

    async def redeem(token: str) -> str:
        return await apikeys.redeem_sign_in_token(bus, token)

    app = create_app(TrajectoryApi("http://127.0.0.1:9"), Hub(), gate=auth.Gate(ring, redeem=redeem))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=OWN) as dashboard:
        try:
            yield Signed(bus, ring, dashboard)
        finally:
            stop.set()
            await watch


def session_of(answer: httpx.Response) -> str:
    assert answer.status_code == 303, answer.text
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith(f"{auth.COOKIE}=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    return cookie.split(";")[0].split("=", 1)[1]


async def test_a_login_from_another_site_is_refused(signed):
    reader = await signed.key("me", ["read"])
    c = signed.dashboard
    for headers in ({"origin": "http://evil.example"}, {"origin": "null"},
                    {"sec-fetch-site": "cross-site", "origin": OWN}, {"sec-fetch-site": "same-site"},
                    {"referer": "http://evil.example/attack.html"}):
        r = await c.post("/login", content=f"key={reader}", headers={**FORM, **headers})
        assert r.status_code == 403, (headers, r.status_code)
        assert "set-cookie" not in r.headers
        assert "another site" in r.text or "not from this dashboard" in r.text
    token = await signed.token()
    r = await c.get(f"/?token={token}", headers={"sec-fetch-site": "cross-site"})  # a link on another site
    assert r.status_code == 403 and "set-cookie" not in r.headers
    # refused before it was used: the user's own click still works
    assert session_of(await c.get(f"/?token={token}", headers=TYPED))
    ok = await c.post("/login", content=f"key={reader}", headers={**FORM, "origin": OWN, "sec-fetch-site": "same-origin"})
    assert session_of(ok) == reader


async def test_a_sign_in_token_works_once(signed):
    c = signed.dashboard
    token = await signed.token()
    session = session_of(await c.get(f"/?token={token}", headers=TYPED))
    assert session != token
    again = await c.get(f"/?token={token}", headers=TYPED)
    assert again.status_code == 401 and "set-cookie" not in again.headers
    assert "already used" in again.text
    c.cookies.set(auth.COOKIE, session)
    assert (await c.get("/")).status_code == 200  # the session opens the dashboard

    # used at once by two tabs (or a replayed link racing the user): one gets in
    c.cookies.clear()
    token = await signed.token()
    answers = await asyncio.gather(*(c.get(f"/?token={token}", headers=TYPED) for _ in range(5)))
    assert sorted(a.status_code for a in answers) == [303, 401, 401, 401, 401]


async def test_an_expired_or_unknown_token_does_not_sign_in(signed):
    c = signed.dashboard
    token = await signed.token(ttl_s=0.5)
    await asyncio.sleep(0.8)
    r = await c.get(f"/?token={token}", headers=TYPED)
    assert r.status_code == 401 and "expired" in r.text
    for bogus in ("st_nope_secret", "ak_abc_def", token[:-2] + "xx", ""):
        r = await c.get("/", params={"token": bogus}, headers=TYPED)
        assert r.status_code == 401 and "set-cookie" not in r.headers, bogus


async def test_the_session_a_token_opens_may_read_and_nothing_else(signed, tmp_path):
    session = session_of(await signed.dashboard.get(f"/?token={await signed.token()}", headers=TYPED))
    record = signed.ring.check(session)
    assert record is not None and record.scopes == ["read"] and record.expires_at > 0
    settings = Settings(auth="keys", allow_host_paths=True, nats_url="nats://127.0.0.1:1", public_url="http://arena")
    backend = httpx.AsyncClient()
    service = RolloutService(bus=signed.bus, store=RolloutStore(await signed.bus.kv(subjects.KV_ROLLOUTS)),
                             settings=settings, http=backend)
    api = apikeys.KeyGuard(create_rollout_app(service), signed.ring)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://arena") as rollout:
            as_session = {"authorization": f"Bearer {session}"}
            assert (await rollout.get("/v1/rollouts", headers=as_session)).status_code == 200
            submit = await rollout.post("/v1/rollouts", json={"task": task_json(tmp_path)}, headers=as_session)
            assert submit.status_code == 403 and submit.json()["error"]["code"] == "forbidden"
            # the token itself is no API key, before or after its use
            token = await signed.token()
            assert (await rollout.get("/v1/rollouts", headers={"authorization": f"Bearer {token}"})).status_code == 401
    finally:
        await service.upstream.aclose()
        await backend.aclose()


async def test_an_api_key_in_the_address_does_not_sign_in(signed):
    """``arena up`` used to print ``/?key=<the CLI's submit key>``: a key in an address, kept by
    the history, and more than read in the browser's cookie."""
    c = signed.dashboard
    cli_key = await signed.key("cli", ["submit", "read"])
    reader = await signed.key("me", ["read"])
    for key in (cli_key, reader):
        r = await c.get(f"/?key={key}", headers=TYPED)
        assert r.status_code == 400 and "set-cookie" not in r.headers
    # nor may the form put more than read into the cookie, nor does such a cookie pass
    r = await c.post("/login", content=f"key={cli_key}", headers={**FORM, "origin": OWN})
    assert r.status_code == 401 and "set-cookie" not in r.headers
    c.cookies.set(auth.COOKIE, cli_key)
    assert (await c.get("/api/stats/live")).status_code == 401
    # a script's bearer key with read (and more) still reads
    assert (await c.get("/", headers={"authorization": f"Bearer {cli_key}"})).status_code == 200


@pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="bubblewrap is not installed")
async def test_the_link_signs_in_once_on_the_real_stack(tmp_path):
    """The embedded stack (each service its own NATS user): the token an administrator issues
    signs a browser in once, and the session reads the trajectory API through the dashboard."""
    import os
    import subprocess
    import sys

    from arena_stack.natsserver import free_port
    from arena_stack.stack import Stack

    rp = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"), rollout_port=rp,
                        trajectory_port=free_port(), dashboard_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                        auth="keys")
    stack = Stack(settings, log=lambda m: None)
    await stack.start()
    try:
        assert stack.dashboard_started
        # `arena keys sign-in`, as a person runs it beside `arena up`: NATS's administrator from the
        # passwords the stack keeps in its data directory, the link on stdout
        env = {**os.environ, "ARENA_DATA_DIR": str(stack.data_dir), "ARENA_NATS_URL": stack.nats.url}
        cli = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "arena.cli", "keys", "sign-in",
                                                       "--dashboard-url", stack.dashboard_url],
                                      env=env, capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        link = cli.stdout.strip()
        assert link.startswith(f"{stack.dashboard_url}/?token=st_") and "one use" in cli.stderr
        token = link.split("?token=", 1)[1]
        async with httpx.AsyncClient(base_url=stack.dashboard_url, timeout=30) as browser:
            for _ in range(100):
                first = await browser.get(f"/?token={token}", headers=TYPED)
                if first.status_code != 503:  # the dashboard's key watch is up
                    break
                await asyncio.sleep(0.1)
            session = session_of(first)
            again = await browser.get(f"/?token={token}", headers=TYPED)
            assert again.status_code == 401
            browser.cookies.set(auth.COOKIE, session)
            assert (await browser.get("/")).status_code == 200
            live = await browser.get("/api/stats/live")
            assert live.status_code == 200, live.text
    finally:
        stack.stop()
