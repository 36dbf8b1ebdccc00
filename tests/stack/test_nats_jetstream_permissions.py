"""JetStream per service, on a real nats-server with natsauth's users and the topology made by
the administrator (``arena_stack.topology``): a compromised sandbox worker's credentials can
neither create, delete nor purge a stream, nor read the verifier bucket (direct get, message
get, a KV watch), nor publish a verdict, nor touch another service's consumer; every service's
user binds to its own streams and does its ordinary work; a service user cannot make the
topology, and a service started before it stops with a clear error.

A refusal is seen as the server reports it (a permissions violation naming the subject, on the
connection's error callback) and then in the state the administrator reads back: the stream,
its messages, the consumer are all still there, the verdict never arrived."""

from __future__ import annotations

import asyncio
import json

import msgspec
import nats
import pytest
from nats.js import api as jsapi

from arena_core import access, subjects
from arena_core.bus import Bus, TopologyError
from arena_stack import natsauth, topology

VERIFIERS = f"KV_{subjects.KV_VERIFIERS}"
PRIVATE = f"OBJ_{subjects.OBJECT_PRIVATE}"  # verifiers too large for their bucket


@pytest.fixture
async def arena(server):
    """The server with the topology made as the administrator, a hidden test in the verifier
    bucket, a rollout state and the rollout service's result consumer; (server, passwords, admin nc)."""
    srv, secrets = server
    await topology.create(natsauth.with_user(srv.url, "admin", secrets["admin"]))
    admin = await nats.connect(natsauth.with_user(srv.url, "admin", secrets["admin"]))
    js = admin.jetstream()
    await (await js.key_value(subjects.KV_VERIFIERS)).put("abc", b'{"hidden": "the tests"}')
    await (await js.object_store(subjects.OBJECT_PRIVATE)).put("verifiers/big", b"a large hidden test patch")
    await js.publish(subjects.rollout_state("r1"), b"{}")
    await js.add_consumer("ARENA_RESULTS", jsapi.ConsumerConfig(
        durable_name="rollout-results-verify", filter_subject="arena.verify.done.*", ack_policy=jsapi.AckPolicy.EXPLICIT))
    try:
        yield srv, secrets, admin
    finally:
        await admin.close()


class User:
    """A connection as one of natsauth's users that records the server's permission refusals."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    @classmethod
    async def connect(cls, srv, secrets, user: str) -> User:
        self = cls()

        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(natsauth.with_user(srv.url, user, secrets[user]), error_cb=on_error,
                                     allow_reconnect=False, connect_timeout=5)
        return self

    async def refused(self, subject: str, attempt) -> None:
        """Run ``attempt`` (a coroutine) until the server reports a permissions violation on
        ``subject``; the attempt itself then fails or is abandoned (its request has no answer)."""
        task = asyncio.ensure_future(attempt)
        for _ in range(600):  # the server's report arrives on the connection: no clock is asserted on
            if any("permissions violation" in e.lower() and subject.lower() in e.lower() for e in self.errors):
                break
            if task.done() and task.exception() is None:
                raise AssertionError(f"{subject} was allowed: {task.result()!r}")
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"no permissions violation for {subject}: {self.errors}")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        await self.nc.close()


def _request(nc, subject: str, body: dict | None = None):
    return nc.request(subject, json.dumps(body or {}).encode(), timeout=30)


async def test_a_sandbox_workers_credentials_cannot_destroy_streams_read_hidden_tests_or_forge_verdicts(arena):
    srv, secrets, admin = arena
    ajs = admin.jetstream()
    sandbox = await User.connect(srv, secrets, "sandbox")
    try:
        nc = sandbox.nc
        await sandbox.refused("$JS.API.STREAM.DELETE.ARENA_ROLLOUTS", _request(nc, "$JS.API.STREAM.DELETE.ARENA_ROLLOUTS"))
        await sandbox.refused("$JS.API.STREAM.PURGE.ARENA_ROLLOUTS", _request(nc, "$JS.API.STREAM.PURGE.ARENA_ROLLOUTS"))
        await sandbox.refused(f"$JS.API.STREAM.DELETE.{VERIFIERS}", _request(nc, f"$JS.API.STREAM.DELETE.{VERIFIERS}"))
        await sandbox.refused(f"$JS.API.STREAM.PURGE.{VERIFIERS}", _request(nc, f"$JS.API.STREAM.PURGE.{VERIFIERS}"))
        await sandbox.refused("$JS.API.STREAM.CREATE.EVIL", _request(nc, "$JS.API.STREAM.CREATE.EVIL", {
            "name": "EVIL", "subjects": ["arena.verify.done.*"]}))
        await sandbox.refused("$JS.API.STREAM.UPDATE.ARENA_RESULTS", _request(nc, "$JS.API.STREAM.UPDATE.ARENA_RESULTS", {
            "name": "ARENA_RESULTS", "subjects": ["arena.sandbox.done.*"]}))
        await sandbox.refused("$JS.API.STREAM.LIST", _request(nc, "$JS.API.STREAM.LIST"))
        # the verifier bucket, every way nats-py reads a bucket
        key = f"$KV.{subjects.KV_VERIFIERS}.abc"
        await sandbox.refused(f"$JS.API.DIRECT.GET.{VERIFIERS}.{key}",
                              nc.request(f"$JS.API.DIRECT.GET.{VERIFIERS}.{key}", b"", timeout=30))
        await sandbox.refused(f"$JS.API.DIRECT.GET.{VERIFIERS}", _request(nc, f"$JS.API.DIRECT.GET.{VERIFIERS}",
                                                                          {"last_by_subj": key}))
        await sandbox.refused(f"$JS.API.STREAM.MSG.GET.{VERIFIERS}",
                              _request(nc, f"$JS.API.STREAM.MSG.GET.{VERIFIERS}", {"last_by_subj": key}))
        await sandbox.refused(f"$JS.API.STREAM.INFO.{VERIFIERS}", nc.jetstream(timeout=30).key_value(subjects.KV_VERIFIERS))
        watch = {"stream_name": VERIFIERS, "config": {"deliver_subject": "_INBOX.steal", "filter_subject": f"$KV.{subjects.KV_VERIFIERS}.>",
                                                        "ack_policy": "none", "deliver_policy": "last_per_subject"}}
        await sandbox.refused(f"$JS.API.CONSUMER.CREATE.{VERIFIERS}", _request(nc, f"$JS.API.CONSUMER.CREATE.{VERIFIERS}", watch))
        await sandbox.refused(f"$JS.API.CONSUMER.CREATE.{VERIFIERS}.steal",
                              _request(nc, f"$JS.API.CONSUMER.CREATE.{VERIFIERS}.steal.$KV.{subjects.KV_VERIFIERS}.>", watch))
        await sandbox.refused(f"$JS.API.CONSUMER.DURABLE.CREATE.{VERIFIERS}.steal",
                              _request(nc, f"$JS.API.CONSUMER.DURABLE.CREATE.{VERIFIERS}.steal", watch))
        # a large hidden test, in the private object store: not even its existence
        await sandbox.refused(f"$JS.API.STREAM.INFO.{PRIVATE}", nc.jetstream(timeout=30).object_store(subjects.OBJECT_PRIVATE))
        await sandbox.refused(f"$JS.API.CONSUMER.CREATE.{PRIVATE}", _request(nc, f"$JS.API.CONSUMER.CREATE.{PRIVATE}", {
            "stream_name": PRIVATE, "config": {"deliver_subject": "_INBOX.steal", "ack_policy": "none"}}))
        await sandbox.refused(f"$JS.API.DIRECT.GET.{PRIVATE}", _request(nc, f"$JS.API.DIRECT.GET.{PRIVATE}", {"seq": 1}))
        await sandbox.refused(f"$JS.API.STREAM.PURGE.{PRIVATE}", _request(nc, f"$JS.API.STREAM.PURGE.{PRIVATE}"))
        # the bucket's own subjects, as a core subscription: refused too (subscribe permissions)
        await nc.subscribe(f"$KV.{subjects.KV_VERIFIERS}.>")
        await sandbox.refused(f"$KV.{subjects.KV_VERIFIERS}.>", nc.flush())
        # a forged verdict, and another service's consumer
        await sandbox.refused("arena.verify.done.r1", nc.jetstream(timeout=30).publish("arena.verify.done.r1", b"{}"))
        # a forged dead letter of a verify job (the rollout service would end its rollout on it)
        await sandbox.refused("arena.dead.ARENA_VERIFY_JOBS",
                              nc.jetstream(timeout=30).publish("arena.dead.ARENA_VERIFY_JOBS", b"{}"))
        await sandbox.refused("$JS.API.CONSUMER.DELETE.ARENA_RESULTS.rollout-results-verify",
                              _request(nc, "$JS.API.CONSUMER.DELETE.ARENA_RESULTS.rollout-results-verify"))
        await sandbox.refused("$JS.API.CONSUMER.CREATE.ARENA_ROLLOUTS", _request(nc, "$JS.API.CONSUMER.CREATE.ARENA_ROLLOUTS"))
    finally:
        await sandbox.close()
    # what the administrator reads back: nothing was changed, nothing forged
    names = {s.config.name for s in await ajs.streams_info()}
    assert {s.name for s in subjects.STREAMS} | {VERIFIERS} <= names and "EVIL" not in names
    assert (await ajs.stream_info("ARENA_ROLLOUTS")).state.messages == 1
    assert (await (await ajs.key_value(subjects.KV_VERIFIERS)).get("abc")).value == b'{"hidden": "the tests"}'
    assert (await (await ajs.object_store(subjects.OBJECT_PRIVATE)).get("verifiers/big")).data == b"a large hidden test patch"
    assert (await ajs.stream_info("ARENA_RESULTS")).state.messages == 0  # no verdict
    assert (await ajs.stream_info("ARENA_DEAD")).state.messages == 0  # no forged dead letter
    assert (await ajs.consumer_info("ARENA_RESULTS", "rollout-results-verify")).name == "rollout-results-verify"
    assert (await ajs.stream_info("ARENA_RESULTS")).config.subjects == next(
        s.subjects for s in subjects.STREAMS if s.name == "ARENA_RESULTS")


@pytest.mark.parametrize("user", [u for u in natsauth.PERMISSIONS if u != "admin"])
async def test_no_service_user_may_delete_purge_or_create_a_stream(arena, user):
    srv, secrets, admin = arena
    one = await User.connect(srv, secrets, user)
    try:
        for stream in ("ARENA_ROLLOUTS", "ARENA_TRAJECTORIES", f"KV_{subjects.KV_API_KEYS}"):
            await one.refused(f"$JS.API.STREAM.DELETE.{stream}", _request(one.nc, f"$JS.API.STREAM.DELETE.{stream}"))
        await one.refused("$JS.API.STREAM.PURGE.ARENA_TRAJECTORIES",
                          _request(one.nc, "$JS.API.STREAM.PURGE.ARENA_TRAJECTORIES"))
        await one.refused("$JS.API.STREAM.CREATE.MINE", _request(one.nc, "$JS.API.STREAM.CREATE.MINE",
                                                                  {"name": "MINE", "subjects": ["mine.>"]}))
    finally:
        await one.close()
    assert (await admin.jetstream().stream_info("ARENA_ROLLOUTS")).state.messages == 1


def test_the_rendered_permissions_allow_no_stream_administration_to_a_service():
    for user, (publish, _) in natsauth.PERMISSIONS.items():
        if user == "admin":
            continue
        assert "$JS.API.>" not in publish and ">" not in publish and "$JS.>" not in publish, user
        for forbidden in ("STREAM.CREATE", "STREAM.UPDATE", "STREAM.DELETE", "STREAM.LIST", "STREAM.MSG.DELETE",
                          "STREAM.SNAPSHOT", "STREAM.RESTORE", "SERVER.", "ACCOUNT."):
            assert not any(s.startswith(f"$JS.API.{forbidden}") for s in publish), (user, forbidden)
        purges = {s for s in publish if s.startswith("$JS.API.STREAM.PURGE.")}
        assert purges <= {f"$JS.API.STREAM.PURGE.OBJ_{subjects.OBJECT_ARTIFACTS}", f"$JS.API.STREAM.PURGE.{PRIVATE}",
                          f"$JS.API.STREAM.PURGE.KV_{subjects.KV_API_KEYS}"}, (user, purges)
        reads_verifiers = any(VERIFIERS in s for s in publish if s.startswith(("$JS.API.DIRECT", "$JS.API.STREAM.MSG",
                                                                              "$JS.API.CONSUMER")))
        assert reads_verifiers == (user == "verification"), user
        assert any(PRIVATE in s for s in publish) == (user in ("rollout", "verification")), user


@pytest.mark.parametrize("user", [u for u in access.SERVICES])
async def test_each_service_binds_to_its_own_streams_and_buckets(arena, user):
    srv, secrets, _ = arena
    bus = await Bus.connect(natsauth.with_user(srv.url, user, secrets[user]), user)
    try:
        await bus.bind_topology(access.SERVICES[user].streams())
        for bucket in access.SERVICES[user].kv_reads:  # a watch of the whole bucket (keys lists them so)
            try:
                await (await bus.kv(bucket)).keys()
            except nats.js.errors.NoKeysError:  # the watch ran: the bucket is empty
                pass
    except Exception as exc:  # noqa: BLE001 - name the user in the failure
        raise AssertionError(f"{user}: {type(exc).__name__}: {exc}") from exc
    finally:
        await bus.close()


async def test_a_service_works_its_own_consumer_and_publishes_its_own_results(arena):
    """The sandbox worker's round: bind, declare its consumer, take a job, ack it, publish its outcome,
    read a rollout record and a bundle; the verifier then reads the hidden test and publishes the verdict."""
    srv, secrets, admin = arena
    await admin.jetstream().publish(subjects.sandbox_run("local"), b'{"job": 1}')
    await (await admin.jetstream().key_value(subjects.KV_ROLLOUTS)).put("r1", b"{}")
    sandbox = await Bus.connect(natsauth.with_user(srv.url, "sandbox", secrets["sandbox"]), "sandbox")
    verifier = await Bus.connect(natsauth.with_user(srv.url, "verification", secrets["verification"]), "verification")
    try:
        await sandbox.bind_topology(access.SERVICES["sandbox"].streams())
        await sandbox.js.add_consumer("ARENA_SANDBOX_JOBS", jsapi.ConsumerConfig(
            durable_name="sandbox-local", ack_policy=jsapi.AckPolicy.EXPLICIT, filter_subject="arena.sandbox.run.local"))
        sub = await sandbox.js.pull_subscribe_bind("sandbox-local", "ARENA_SANDBOX_JOBS")
        (job,) = await sub.fetch(1, timeout=30)
        await job.ack_sync()
        assert (await (await sandbox.kv(subjects.KV_ROLLOUTS)).get("r1")).value == b"{}"
        await (await sandbox.artifacts()).put("bundles/x", b"bundle")
        assert await sandbox.read_object("bundles/x") == b"bundle"
        await sandbox.publish(subjects.sandbox_done("r1"), b"{}", msg_id="r1:done:0")
        await verifier.bind_topology(access.SERVICES["verification"].streams())
        assert (await (await verifier.kv(subjects.KV_VERIFIERS)).get("abc")).value == b'{"hidden": "the tests"}'
        assert (await (await verifier.objects(subjects.OBJECT_PRIVATE)).get("verifiers/big")).data.startswith(b"a large")
        assert (await verifier.js.get_last_msg("ARENA_RESULTS", subjects.sandbox_done("r1"))).data == b"{}"
        await verifier.publish(subjects.verify_done("r1"), b"{}", msg_id="r1:verify:0")
    finally:
        await sandbox.close()
        await verifier.close()
    assert (await admin.jetstream().stream_info("ARENA_RESULTS")).state.messages == 2


async def test_only_the_administrator_makes_the_topology_and_a_service_before_it_is_told_so(server):
    srv, secrets = server
    with pytest.raises(Exception):  # the rollout service's user may not create streams
        await topology.create(natsauth.with_user(srv.url, "rollout", secrets["rollout"]))
    bus = await Bus.connect(natsauth.with_user(srv.url, "sandbox", secrets["sandbox"]), "sandbox")
    try:
        with pytest.raises(TopologyError, match="does not exist.*topology step creates it"):
            await bus.bind_topology(access.SERVICES["sandbox"].streams())
    finally:
        await bus.close()
    admin = await nats.connect(natsauth.with_user(srv.url, "admin", secrets["admin"]))
    try:
        with pytest.raises(nats.js.errors.NotFoundError):
            await admin.jetstream().stream_info("ARENA_ROLLOUTS")
    finally:
        await admin.close()
