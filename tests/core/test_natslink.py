"""``arena_core.natslink`` and ``arena_core.jetlink`` (the lean NATS connection of the high-rate
paths) against a real nats-server: pull batches, acks, publishes, a server going away,
authentication and TLS."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
from nats.js import api as jsapi

from arena_core.bus import Delivery
from arena_core.jetlink import (
    FeedError,
    FetchTimeout,
    JsPublisher,
    NoResponders,
    PublishRefused,
    PullFeed,
    ack_all,
)
from arena_core.natslink import LinkClosed, LinkError, NatsLink, PayloadTooLarge, encode_headers, parse_headers
from arena_stack.natsserver import NatsServer


async def consumer(bus, durable: str, ack_wait: float = 30.0) -> None:
    try:
        await bus.js.add_stream(name="PULL_TEST", subjects=["pull.test.>"])
    except Exception:  # noqa: BLE001 - declared by an earlier call of this test
        pass
    await bus.js.add_consumer("PULL_TEST", jsapi.ConsumerConfig(
        durable_name=durable, ack_policy=jsapi.AckPolicy.EXPLICIT, ack_wait=ack_wait, max_ack_pending=5000))


async def publish(bus, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        await bus.js.publish(f"pull.test.{i}", str(i).encode(), headers={"Nats-Msg-Id": f"m{i}"})


@pytest.fixture
async def link(nats_server):
    one = await NatsLink.open(nats_server.url, name="test")
    try:
        yield one
    finally:
        await one.close()


# --------------------------------------------------------------------------- pull feed


async def test_batches_in_order_then_a_timeout_when_drained(bus, link):
    await consumer(bus, "d1")
    await publish(bus, 25)
    feed = PullFeed(link, "PULL_TEST", "d1").start()
    try:
        first = await feed.fetch(10, timeout=1.0, linger=1.0)  # returns once 10 are in
        rest = await feed.fetch(100, timeout=1.0, linger=0.05)
        assert [m.data for m in first + rest] == [str(i).encode() for i in range(25)] and len(first) == 10
        d = Delivery(rest[-1])  # the reply subject's numbers
        assert (d.num_delivered, d.stream_seq, d.subject) == (1, 25, "pull.test.24")
        assert d.headers["Nats-Msg-Id"] == "m24"
        ack_all(first + rest)
        started = time.monotonic()
        with pytest.raises(FetchTimeout):
            await feed.fetch(10, timeout=0.3)
        assert time.monotonic() - started < 2.0
    finally:
        await feed.stop()
    await link.flush()
    info = await bus.js.consumer_info("PULL_TEST", "d1")
    assert info.num_ack_pending == 0 and info.ack_floor.stream_seq == 25  # one write acked all 25


async def test_linger_collects_messages_published_while_waiting(bus, link):
    await consumer(bus, "d2")
    feed = PullFeed(link, "PULL_TEST", "d2").start()
    try:
        await publish(bus, 1)
        pending = asyncio.create_task(feed.fetch(5, timeout=3.0, linger=2.0))  # returns once 5 are in
        await asyncio.sleep(0.1)
        await publish(bus, 4, start=1)
        assert [m.data for m in await pending] == [b"0", b"1", b"2", b"3", b"4"]
    finally:
        await feed.stop()


async def test_unacked_nak_delay_term_and_in_progress(bus, link):
    await consumer(bus, "d3", ack_wait=0.6)
    await publish(bus, 3)
    feed = PullFeed(link, "PULL_TEST", "d3").start()
    try:
        a, b, c = await feed.fetch(3, timeout=1.0)
        await a.nak(delay=0.2)  # back soon, as delivery 2
        await b.term()  # never again
        for _ in range(3):  # kept alive past ack_wait
            await asyncio.sleep(0.3)
            await c.in_progress()
        again = await feed.fetch(5, timeout=2.0, linger=0.2)
        assert [(m.data, m.metadata.num_delivered) for m in again] == [(b"0", 2)]
        await again[0].ack()
        await c.ack()
        with pytest.raises(FetchTimeout):
            await feed.fetch(5, timeout=1.0)  # b was terminated, c was acked in time
    finally:
        await feed.stop()


async def test_a_missing_consumer_is_an_error_not_a_silent_wait(bus, link):
    await bus.js.add_stream(name="PULL_TEST", subjects=["pull.test.>"])
    feed = PullFeed(link, "PULL_TEST", "nobody").start()
    try:
        with pytest.raises(FeedError, match="503"):  # no responders: the consumer does not exist
            await feed.fetch(5, timeout=0.5)
    finally:
        await feed.stop()


async def test_stop_hands_buffered_messages_back_at_once(bus, link):
    await consumer(bus, "d4", ack_wait=30.0)
    await publish(bus, 1)
    feed = PullFeed(link, "PULL_TEST", "d4").start()
    (first,) = await feed.fetch(5, timeout=2.0)  # the request stays open for 4 more
    await first.ack()
    await publish(bus, 3, start=1)
    await asyncio.sleep(0.3)  # they land in the feed's buffer, not handed out
    await feed.stop()
    again = PullFeed(link, "PULL_TEST", "d4").start()
    try:
        started = time.monotonic()
        msgs = await again.fetch(5, timeout=2.0, linger=0.3)
        assert sorted(m.data for m in msgs) == [b"1", b"2", b"3"]  # redeliveries: any order
        assert all(m.metadata.num_delivered == 2 for m in msgs) and time.monotonic() - started < 2.0
    finally:
        await again.stop()


async def test_large_and_many_messages_cross_read_boundaries_intact(bus, link):
    """Payloads of every size up to 3 MiB (each spans many socket reads) between small ones."""
    await bus.js.add_stream(name="BIG_TEST", subjects=["big.>"], max_msg_size=-1)
    await bus.js.add_consumer("BIG_TEST", jsapi.ConsumerConfig(durable_name="big", ack_policy=jsapi.AckPolicy.EXPLICIT))
    sizes = [0, 1, 2, 1023, 65_535, 65_536, 65_537, 3 * 1024 * 1024, 5, 300_000]
    payloads = [bytes((i * 7 + k) % 256 for k in range(n)) if n < 70_000 else bytes([i]) * n
                for i, n in enumerate(sizes)]
    for i, data in enumerate(payloads):
        await bus.js.publish(f"big.{i}", data, headers={"Nats-Msg-Id": f"b{i}", "X-Note": f"n{i}"})
    feed = PullFeed(link, "BIG_TEST", "big").start()
    try:
        got = await feed.fetch(len(sizes), timeout=3.0, linger=1.0)
        assert [m.data for m in got] == payloads
        assert [m.headers["X-Note"] for m in got] == [f"n{i}" for i in range(len(sizes))]
        ack_all(got)
    finally:
        await feed.stop()


# --------------------------------------------------------------------------- publisher


async def test_publishes_in_flight_together_each_with_its_ack(bus, link):
    publisher = JsPublisher(link)
    futures = [publisher.publish(f"arena.sandbox.started.r{i}", b"{}", msg_id=f"r{i}:x") for i in range(500)]
    acks = await asyncio.gather(*futures)
    assert {a.stream for a in acks} == {"ARENA_RESULTS"} and sorted(a.seq for a in acks) == list(range(1, 501))
    again = await publisher.publish("arena.sandbox.started.r7", b"{}", msg_id="r7:x")
    assert again.duplicate and again.seq == acks[7].seq  # de-duplicated by Nats-Msg-Id
    assert (await bus.js.stream_info("ARENA_RESULTS")).state.messages == 500


async def test_publish_errors_are_named(bus, link):
    publisher = JsPublisher(link, timeout=1.0)
    with pytest.raises(NoResponders):
        await publisher.publish("no.stream.here", b"x")
    with pytest.raises(PublishRefused, match="stream"):
        await publisher.publish("arena.sandbox.started.r1", b"{}", headers={"Nats-Expected-Stream": "OTHER"})
    with pytest.raises(PayloadTooLarge, match="max_payload"):
        publisher.publish("arena.sandbox.started.r1", b"x" * (link.max_payload + 1))
    with pytest.raises(ValueError, match="line break"):  # would break the protocol framing
        publisher.publish("arena.sandbox.started.r1", b"{}", msg_id="a\r\nPUB x 0")


async def test_headers_round_trip():
    block = encode_headers({"Nats-Msg-Id": "a:b:0", "traceparent": "00-ab-cd-01"})
    assert parse_headers(block) == (None, "", {"Nats-Msg-Id": "a:b:0", "traceparent": "00-ab-cd-01"})
    assert parse_headers(b"NATS/1.0 404 No Messages\r\n\r\n") == ("404", "No Messages", {})
    assert parse_headers(b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Stream: 9\r\n\r\n")[0::2] == (
        "100", {"Nats-Last-Stream": "9"})
    with pytest.raises(ValueError):
        encode_headers({"x": "line\r\nbreak"})


async def test_parser_splits_frames_at_any_byte():
    """The receive path cut at every position of a stream of control lines and frames."""
    link = NatsLink("parser")
    got = []
    sid = link._next_sid  # noqa: SLF001 - the sid the next subscription gets
    link._subs[sid] = lambda *m: got.append(m)  # noqa: SLF001 - no socket in this test
    frames = b"+OK\r\n" + (
        b"MSG a.b %d 5\r\nhello\r\n" % sid
        + b"HMSG c.d %d $JS.ACK.S.c.1.2.3.4.0 12 15\r\nNATS/1.0\r\n\r\nabc\r\n" % sid
        + b"MSG e %d _INBOX.x 0\r\n\r\n" % sid
    )
    expected = [("a.b", None, None, b"hello"), ("c.d", "$JS.ACK.S.c.1.2.3.4.0", b"NATS/1.0\r\n\r\n", b"abc"),
                ("e", "_INBOX.x", None, b"")]
    for cut in range(len(frames) + 1):
        got.clear()
        link._buf.clear()  # noqa: SLF001
        link._need = 0  # noqa: SLF001
        link.data_received(frames[:cut])
        link.data_received(frames[cut:])
        assert got == expected, cut


# --------------------------------------------------------------------------- the link going away


async def test_a_server_restart_closes_the_link_and_the_bus_opens_a_new_one(tmp_path):
    from arena_core.bus import Bus

    server = NatsServer(tmp_path / "nats", sync="1s").start()
    bus = await Bus.connect(server.url, "test")
    try:
        await bus.ensure_topology()
        await bus.js.add_consumer("ARENA_RESULTS", jsapi.ConsumerConfig(
            durable_name="waiter", ack_policy=jsapi.AckPolicy.EXPLICIT, filter_subject="arena.verify.done.*"))
        link = await bus.link()
        feed = PullFeed(link, "ARENA_RESULTS", "waiter")
        feed.start()
        waiting = asyncio.create_task(feed.fetch(1, timeout=30.0))
        publisher = JsPublisher(link, timeout=30.0)
        await asyncio.sleep(0.2)
        server.kill()
        with pytest.raises(LinkClosed):
            await asyncio.wait_for(waiting, 5)  # not a 30 s wait
        with pytest.raises(LinkClosed):
            publisher.publish("arena.sandbox.started.r1", b"{}")
        assert link.closed
        server.start()
        ack = await bus.publish("arena.sandbox.started.r1", b"{}", msg_id="r1:restart")  # reopens the link
        assert ack.stream == "ARENA_RESULTS" and (await bus.link()) is not link
    finally:
        await bus.close()
        server.stop()


async def test_an_unreachable_server_is_a_clear_error():
    from arena_stack.natsserver import free_port

    with pytest.raises(LinkError, match="cannot connect to NATS: nats://127.0.0.1"):
        await NatsLink.open(f"nats://127.0.0.1:{free_port()}", name="test", timeout=1.0)


async def test_user_password_and_token_authentication(tmp_path):
    users = NatsServer(tmp_path / "users", sync="1s",
                       extra_config='authorization { users = [ { user: "arena", password: "s3cr:t" } ] }\n').start()
    token = NatsServer(tmp_path / "token", sync="1s", extra_config='authorization { token: "t0ken" }\n').start()
    try:
        port = users.port
        ok = await NatsLink.open(f"nats://arena:s3cr%3At@127.0.0.1:{port}", name="test")
        await ok.flush()
        await ok.close()
        with pytest.raises(LinkError, match="Authorization Violation") as caught:
            await NatsLink.open(f"nats://arena:wrong@127.0.0.1:{port}", name="test")
        assert "wrong" not in str(caught.value)  # credentials never in messages
        ok = await NatsLink.open(f"nats://t0ken@127.0.0.1:{token.port}", name="test")
        await ok.flush()
        await ok.close()
    finally:
        users.stop()
        token.stop()


async def test_tls_when_the_server_requires_it(tmp_path):
    import ssl

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = NatsServer(tmp_path / "tls", sync="1s",
                        extra_config=f'tls {{ cert_file: "{cert}", key_file: "{key}" }}\n').start()
    try:
        trusted = ssl.create_default_context(cafile=str(cert))
        for url in (f"tls://127.0.0.1:{server.port}", f"nats://127.0.0.1:{server.port}"):  # INFO says TLS
            link = await NatsLink.open(url, name="test", tls=trusted)
            await link.flush()
            await link.close()
        with pytest.raises(LinkError, match="CERTIFICATE_VERIFY_FAILED"):  # the system CAs do not know it
            await NatsLink.open(f"tls://127.0.0.1:{server.port}", name="test")
    finally:
        server.stop()
