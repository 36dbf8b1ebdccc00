"""The attack that worked on ``arena up``: a local user with no credentials connected to its
nats-server, put an admin API key into the keys' bucket (which the rollout API then
accepted) and read the private verifiers. The embedded stack, started as ``arena up`` starts
it, now refuses that client everything, and keeps its credentials and data to its own user."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import httpx
import msgspec
import nats
import pytest

from arena_core import apikeys, subjects
from arena_core.bus import Bus
from arena_core.settings import Settings
from arena_stack import natsauth
from arena_stack.natsserver import free_port, js_api_info
from arena_stack.stack import Stack

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def connect_refused(url: str) -> str:
    """Connect to ``url`` as the attacker did; the error the server answered (the test fails
    if it let the client in)."""
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    try:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0,
                                error_cb=on_error)
    except Exception as exc:  # noqa: BLE001 - what nats-py raises for a refusal varies by version
        return f"{exc!r} {errors!r}"
    await nc.close()
    raise AssertionError(f"{url} accepted a client without credentials")


async def test_a_local_user_without_credentials_can_do_nothing_on_the_bus(tmp_path):
    data_dir = tmp_path / "arena"
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data_dir),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        dashboard_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                        backend_url=f"http://127.0.0.1:{free_port()}/v1")
    stack = Stack(settings, log=lambda m: None)  # as `arena up`: Settings from the environment's defaults
    await stack.start()
    try:
        bare = stack.nats.url  # what the attacker knew: the port
        assert "@" not in bare
        refusal = await connect_refused(bare)
        assert "authorization" in refusal.lower(), refusal
        # a guessed password, or a service's name without its password, is refused the same way
        assert "authorization" in (await connect_refused(natsauth.with_user(bare, "admin", "admin"))).lower()
        assert "authorization" in (await connect_refused(natsauth.with_user(bare, "rollout", ""))).lower()
        # the JetStream API (the keys' bucket is a stream behind it) does not answer a bare client
        assert js_api_info(stack.nats.port) is None
        assert js_api_info(stack.nats.port, credentials=("admin", stack.nats_passwords["admin"])) is not None

        # the key the attacker would have put: the API does not know it
        forged, record = apikeys.new_key("attacker", ["admin"])
        async with httpx.AsyncClient(timeout=5) as http:
            r = await http.get(f"{settings.rollout_url}/v1/rollouts", headers=apikeys.auth_headers(forged))
            assert r.status_code == 401, r.text
            # while the key the stack issued for this machine's CLI works
            r = await http.get(f"{settings.rollout_url}/v1/rollouts", headers=apikeys.auth_headers(stack.api_key))
            assert r.status_code not in (401, 403), r.text

        # as the administrator: the bucket holds the CLI's key only, not the forged one
        bus = await Bus.connect(stack.settings.nats_url, "test")
        try:
            names = [k.name for k in await apikeys.listing(bus)]
            assert names == ["local-cli"] and record.key_id not in names
            await bus.kv(subjects.KV_VERIFIERS)  # the verifiers' bucket exists, readable by its users only
        finally:
            await bus.close()

        # the credentials, the key and the data are this user's only
        kept = data_dir / natsauth.CREDENTIALS_FILE
        assert mode(kept) == 0o600
        assert set(json.loads(kept.read_text())) >= set(natsauth.PERMISSIONS)
        assert mode(data_dir / "api-key") == 0o600
        assert mode(stack.nats.store_dir / "nats-server.conf") == 0o600  # it holds the passwords
        for directory in (data_dir, data_dir / "logs", stack.nats.store_dir, stack.nats.store_dir / "jetstream"):
            assert mode(directory) == 0o700, directory
        logs = list((data_dir / "logs").iterdir())
        assert {p.name for p in logs} >= {"nats-server.log", "rollout.log", "sandbox.log"}
        assert all(mode(p) == 0o600 for p in logs), [(p.name, oct(mode(p))) for p in logs]
    finally:
        stack.stop()


async def test_a_service_user_cannot_forge_keys_or_read_the_verifiers(tmp_path):
    """Credentials of one worker (say a sandbox host's) are no master key either: the
    sandbox user may neither write nor read the keys' bucket, nor read the verifiers."""
    from arena_stack.natsserver import NatsServer

    passwords = natsauth.load_or_create(tmp_path / natsauth.CREDENTIALS_FILE)
    srv = NatsServer(tmp_path / "nats", sync="1s", extra_config=natsauth.authorization_block(passwords)).start()
    admin = None
    try:
        admin = await Bus.connect(natsauth.with_user(srv.url, "admin", passwords["admin"]), "admin")
        await admin.ensure_topology()
        await (await admin.kv(subjects.KV_VERIFIERS)).put("task-1", b"the hidden tests")
        await admin.kv(subjects.KV_API_KEYS)

        violations: list[str] = []

        async def on_error(exc: Exception) -> None:
            violations.append(str(exc))

        nc = await nats.connect(natsauth.with_user(srv.url, "sandbox", passwords["sandbox"]),
                                allow_reconnect=False, error_cb=on_error)
        try:
            js = nc.jetstream(timeout=2)
            _, record = apikeys.new_key("forged", ["admin"])
            with pytest.raises(nats.errors.TimeoutError):  # the server drops the publish: no ack comes
                await nc.request(f"$KV.{subjects.KV_API_KEYS}.{record.key_id}", msgspec.json.encode(record),
                                 timeout=2)
            for bucket, key in ((subjects.KV_VERIFIERS, "task-1"), (subjects.KV_API_KEYS, record.key_id)):
                with pytest.raises(nats.errors.TimeoutError):
                    await nc.request(f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.{key}", b"", timeout=2)
                with pytest.raises(nats.errors.TimeoutError):
                    await nc.request(f"$JS.API.STREAM.MSG.GET.KV_{bucket}",
                                     json.dumps({"last_by_subj": f"$KV.{bucket}.{key}"}).encode(), timeout=2)
                with pytest.raises(Exception):  # noqa: B017 - a watch needs a consumer, which is refused
                    await (await js.key_value(bucket)).get(key)
            # what it needs still works: its own bucket
            await (await js.key_value(subjects.KV_WORKERS)).put("w-1", b"{}")
        finally:
            await nc.close()
        assert any("permissions violation" in v.lower() for v in violations), violations
        assert [k.key_id for k in await apikeys.listing(admin)] == []  # the forged key never landed
    finally:
        if admin is not None:
            await admin.close()
        srv.stop()


async def _ignore(exc: Exception) -> None:
    return None


def test_the_passwords_are_kept_private_and_reused(tmp_path):
    path = tmp_path / natsauth.CREDENTIALS_FILE
    first = natsauth.load_or_create(path)
    assert mode(path) == 0o600 and set(first) == {*natsauth.PERMISSIONS, natsauth.ROUTE_USER}
    path.chmod(0o644)  # widened by hand: narrowed again, the same passwords kept
    assert natsauth.load_or_create(path) == first and mode(path) == 0o600


def test_the_cli_reaches_nats_as_admin_with_the_password_arena_up_kept(tmp_path, monkeypatch):
    """`arena keys` after `arena up`: the URL without a user gets the kept admin password; a URL
    with a user is used as given; without the file (another user's data dir) nothing is added."""
    from arena.cli import _nats_url

    monkeypatch.setenv("ARENA_DATA_DIR", str(tmp_path))
    assert _nats_url("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"
    passwords = natsauth.load_or_create(tmp_path / natsauth.CREDENTIALS_FILE)
    assert _nats_url("nats://127.0.0.1:4222") == natsauth.with_user("nats://127.0.0.1:4222", "admin",
                                                                    passwords["admin"])
    assert _nats_url("nats://sandbox:pw@127.0.0.1:4222") == "nats://sandbox:pw@127.0.0.1:4222"
