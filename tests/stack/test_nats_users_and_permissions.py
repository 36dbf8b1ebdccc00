"""NATS users per service on a real nats-server: each publishes only its own subjects (a
sandbox worker cannot publish verification results nor a verification worker sandbox
outcomes), a wrong password is refused, and the credentials travel in the service's URL."""

from __future__ import annotations

import asyncio

import nats
import pytest

from arena_stack import natsauth


async def connect(srv, user: str, password: str):
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(natsauth.with_user(srv.url, user, password), error_cb=on_error,
                            allow_reconnect=False, connect_timeout=5)
    return nc, errors


async def published(nc, errors: list[str], subject: str) -> bool:
    """Whether a core publish on ``subject`` went through (the server answers a refused one
    with a permissions violation)."""
    before = len(errors)
    await nc.publish(subject, b"{}")
    await nc.flush()
    await asyncio.sleep(0.3)
    return not any("permissions violation" in e.lower() for e in errors[before:])


async def refused(nc, errors: list[str], subject: str, timeout: float = 15.0) -> bool:
    """Whether the server refuses a core publish on ``subject`` (its permissions violation comes)."""
    before = len(errors)
    await nc.publish(subject, b"{}")
    await nc.flush()
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if any("permissions violation" in e.lower() for e in errors[before:]):
            return True
        await asyncio.sleep(0.05)
    return False


async def arrives(nc, errors: list[str], seen, subject: str) -> None:
    """A core publish on ``subject`` reaches the listener ``seen``, unrefused."""
    before = len(errors)
    await nc.publish(subject, b"{}")
    await nc.flush()
    got = await seen.next_msg(timeout=15.0)
    assert got.subject == subject, (got.subject, subject)
    assert not errors[before:], errors[before:]


async def test_each_service_publishes_only_its_own_subjects(server):
    srv, secrets = server
    listener, _ = await connect(srv, "admin", secrets["admin"])
    sandbox, sandbox_errors = await connect(srv, "sandbox", secrets["sandbox"])
    verifier, verifier_errors = await connect(srv, "verification", secrets["verification"])
    trainer, trainer_errors = await connect(srv, "trainer", secrets["trainer"])
    try:
        seen = await listener.subscribe("arena.>")
        await listener.flush()
        # each allowed publish is waited for where it arrives, each refused one for the server's
        # violation (no fixed pause: a loaded host delays both by seconds)
        await arrives(sandbox, sandbox_errors, seen, "arena.sandbox.done.r1")
        assert await refused(sandbox, sandbox_errors, "arena.verify.done.r1")  # a forged verdict
        assert await refused(sandbox, sandbox_errors, "arena.trajectory.t.r1")
        await arrives(verifier, verifier_errors, seen, "arena.verify.done.r1")
        assert await refused(verifier, verifier_errors, "arena.sandbox.done.r1")
        assert await refused(trainer, trainer_errors, "arena.step.r1")
        with pytest.raises(nats.errors.TimeoutError):  # the refused ones never arrived
            extra = await seen.next_msg(timeout=1.0)
            raise AssertionError(f"a refused publish arrived: {extra.subject}")
    finally:
        for nc in (listener, sandbox, verifier, trainer):
            await nc.close()


async def test_only_the_sandbox_asks_step_gates_and_only_verification_keeps_their_grades(server):
    srv, secrets = server
    listener, _ = await connect(srv, "admin", secrets["admin"])
    sandbox, sandbox_errors = await connect(srv, "sandbox", secrets["sandbox"])
    verifier, verifier_errors = await connect(srv, "verification", secrets["verification"])
    trajectory, trajectory_errors = await connect(srv, "trajectory", secrets["trajectory"])
    try:
        seen = await listener.subscribe("arena.verify.step.>")
        await listener.flush()
        assert await published(sandbox, sandbox_errors, "arena.verify.step.r1")
        assert not await published(trajectory, trajectory_errors, "arena.verify.step.r2")
        await verifier.subscribe("arena.verify.step.*", queue="verifier-gates")  # refused: an error, not silence
        await verifier.flush()
        await asyncio.sleep(0.3)
        assert not any("permissions violation" in e.lower() for e in verifier_errors)
        assert (await seen.next_msg(timeout=2)).subject == "arena.verify.step.r1"
        assert await published(verifier, verifier_errors, "$KV.arena_step_grades.r1.0")
        assert not await published(sandbox, sandbox_errors, "$KV.arena_step_grades.r1.0")  # a forged grade
        read = "$JS.API.DIRECT.GET.KV_arena_step_grades.$KV.arena_step_grades.r1.0"
        assert not await published(sandbox, sandbox_errors, read)
    finally:
        for nc in (listener, sandbox, verifier, trajectory):
            await nc.close()


async def test_a_wrong_password_is_refused(server):
    srv, secrets = server
    with pytest.raises(Exception, match="(?i)authorization"):
        await nats.connect(natsauth.with_user(srv.url, "sandbox", secrets["sandbox"] + "x"),
                           allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0)


def test_credentials_go_into_every_url_of_a_server_list():
    url = natsauth.with_user("nats://a:4222,nats://b:4223", "sandbox", "p@ss/word")
    assert url == "nats://sandbox:p%40ss%2Fword@a:4222,nats://sandbox:p%40ss%2Fword@b:4223"
    block = natsauth.authorization_block({u: "pw" for u in natsauth.PERMISSIONS})
    assert block.count("user:") == len(natsauth.PERMISSIONS) and '"arena.verify.done.>"' in block
