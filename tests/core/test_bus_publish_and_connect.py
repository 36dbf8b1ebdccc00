"""``Bus.publish`` and ``Bus.connect`` on nats-py, against a real nats-server: idempotent
publishes, bodies over ``max_payload``, a server restart under a publish, refusals, and
connect errors (authorization, TLS). The trajectory plane's batch consumer:
tests/trajectory/test_batch_consumer.py."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import time

import pytest

from arena_core import subjects
from arena_core.bus import BODY_OBJECT_HEADER, Bus, PublishRefused, body_object
from arena_core.errors import Unavailable
from arena_stack.natsserver import NatsServer, free_port


# --------------------------------------------------------------------------- publish


async def test_concurrent_publishes_each_get_their_ack_and_a_repeated_msg_id_is_dropped(bus):
    acks = await asyncio.gather(*(bus.publish(subjects.sandbox_started(f"r{i}"), b"{}", msg_id=f"r{i}:started:0")
                                  for i in range(300)))
    assert {a.stream for a in acks} == {"ARENA_RESULTS"} and sorted(a.seq for a in acks) == list(range(1, 301))
    assert not any(a.duplicate for a in acks)
    again = await bus.publish(subjects.sandbox_started("r7"), b"{}", msg_id="r7:started:0")
    assert again.duplicate and again.seq == acks[7].seq
    assert (await bus.js.stream_info("ARENA_RESULTS")).state.messages == 300


async def test_a_subject_no_stream_takes_is_refused_at_once(bus):
    started = time.monotonic()
    with pytest.raises(PublishRefused, match="no stream takes this subject"):
        await bus.publish("no.stream.here", b"x", msg_id="x:1")
    assert time.monotonic() - started < 3.0  # not retried for ever (nor for the 20 attempts)


async def test_a_failed_expectation_is_refused_with_jetstreams_code(bus):
    with pytest.raises(PublishRefused) as refused:
        await bus.publish(subjects.sandbox_started("r1"), b"{}", msg_id="r1:x",
                          headers={"Nats-Expected-Stream": "OTHER"})
    assert refused.value.code == 10060  # JSStreamNotMatchErr: the stream is not the one expected


async def test_a_body_over_max_payload_goes_through_the_object_store(small_bus):
    server, bus = small_bus
    big = b'"' + b"x" * (server.max_payload + 10) + b'"'
    ack = await bus.publish(subjects.sandbox_started("huge"), big, msg_id="huge:started:0")
    msg = await bus.js.get_msg("ARENA_RESULTS", ack.seq)
    assert msg.data in (b"", None) and msg.headers[BODY_OBJECT_HEADER] == "bodies/huge:started:0"
    assert body_object(msg) == "bodies/huge:started:0" and await bus.body(msg) == big


async def test_a_publish_waits_out_a_server_restart(tmp_path):
    server = NatsServer(tmp_path / "nats", sync="1s").start()
    bus = await Bus.connect(server.url, "test")
    try:
        await bus.ensure_topology()
        server.kill()
        publishing = asyncio.create_task(bus.publish(subjects.sandbox_started("r1"), b"{}", msg_id="r1:restart"))
        await asyncio.sleep(1.0)
        assert not publishing.done()
        server.start()
        ack = await asyncio.wait_for(publishing, 30)
        assert ack.stream == "ARENA_RESULTS" and not ack.duplicate
        again = await bus.publish(subjects.sandbox_started("r1"), b"{}", msg_id="r1:restart")
        assert again.duplicate  # a retried publish that did land is not stored twice
    finally:
        await bus.close()
        server.stop()


async def test_a_publish_gives_up_with_unavailable_after_its_attempts(tmp_path):
    server = NatsServer(tmp_path / "nats", sync="1s").start()
    bus = await Bus.connect(server.url, "test")
    try:
        await bus.ensure_topology()
        server.kill()
        bus.publish_timeout = 0.5
        with pytest.raises(Unavailable, match="failed after 2 attempts"):
            await bus.publish(subjects.sandbox_started("r1"), b"{}", msg_id="r1:gone", attempts=2)
    finally:
        await bus.close()
        server.stop()


# --------------------------------------------------------------------------- connecting


async def test_an_unreachable_server_is_a_clear_error_within_the_timeout():
    started = time.monotonic()
    with pytest.raises(Unavailable, match="cannot connect to NATS at nats://127.0.0.1"):
        await Bus.connect(f"nats://127.0.0.1:{free_port()}", "test", connect_timeout=1.0)
    assert time.monotonic() - started < 5.0


async def test_user_password_and_token_authentication(tmp_path):
    users = NatsServer(tmp_path / "users", sync="1s",
                       extra_config='authorization { users = [ { user: "arena", password: "s3cr:t" } ] }\n').start()
    token = NatsServer(tmp_path / "token", sync="1s", extra_config='authorization { token: "t0ken" }\n').start()
    try:
        for url in (f"nats://arena:s3cr%3At@127.0.0.1:{users.port}", f"nats://t0ken@127.0.0.1:{token.port}"):
            ok = await Bus.connect(url, "test")
            await ok.js.account_info()
            await ok.close()
        started = time.monotonic()
        with pytest.raises(Unavailable, match="Authorization Violation") as caught:
            await Bus.connect(f"nats://arena:wrong@127.0.0.1:{users.port}", "test")
        assert time.monotonic() - started < 5.0  # not retried until the connect timeout
        assert "wrong" not in str(caught.value) and "arena:" not in str(caught.value)  # credentials never in messages
    finally:
        users.stop()
        token.stop()


async def test_tls_when_the_server_requires_it(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = NatsServer(tmp_path / "tls", sync="1s",
                        extra_config=f'tls {{ cert_file: "{cert}", key_file: "{key}" }}\n').start()
    try:
        trusted = ssl.create_default_context(cafile=str(cert))
        for url in (f"tls://127.0.0.1:{server.port}", f"nats://127.0.0.1:{server.port}"):  # INFO says TLS
            bus = await Bus.connect(url, "test", tls=trusted)
            await bus.js.account_info()
            await bus.close()
        with pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):  # the system CAs do not know it
            await Bus.connect(f"tls://127.0.0.1:{server.port}", "test")
    finally:
        server.stop()
