"""The trajectory plane's ``BatchConsumer`` on a nats-py pull subscription, against a real
nats-server: batches of at most N acked only once stored, verdicts (retry, dead letter),
a body from the object store, and a NATS server restart under the consumer."""

from __future__ import annotations

import asyncio
import time

import msgspec

from arena_core import subjects
from arena_core.bus import Bus
from arena_core.schemas import DeadLetter
from arena_stack.natsserver import NatsServer
from arena_trajectory.batching import BatchConsumer, Dead, Retry


async def wait_for(condition, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def settled(bus: Bus, stream: str, durable: str, expected_floor: int, timeout: float = 15.0) -> None:
    """Until the consumer's ack floor reaches ``expected_floor`` with nothing pending."""
    deadline = time.monotonic() + timeout
    while True:
        info = await bus.js.consumer_info(stream, durable)
        if info.num_ack_pending == 0 and info.ack_floor.stream_seq >= expected_floor:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{durable}: ack floor {info.ack_floor.stream_seq}, {info.num_ack_pending} pending")
        await asyncio.sleep(0.1)


async def _consumer(bus: Bus, handler, *, durable: str = "batch", **kw) -> BatchConsumer:
    await bus.js.add_stream(name="BATCH_TEST", subjects=["batch.test.>"])
    return BatchConsumer(bus, stream="BATCH_TEST", durable=durable, filter_subjects=["batch.test.>"],
                         message_type=msgspec.Raw, handler=handler, **kw)


async def test_batches_of_at_most_n_acked_only_after_the_handler_stored_them(bus):
    stored: list[int] = []
    sizes: list[int] = []
    failed_once = asyncio.Event()

    async def handler(items):
        sizes.append(len(items))
        if not failed_once.is_set() and any(bytes(raw) == b"13" for raw, _ in items):
            failed_once.set()
            raise RuntimeError("the store is down")  # the whole batch comes back
        stored.extend(int(bytes(raw)) for raw, _ in items)

    consumer = await _consumer(bus, handler, batch_size=10, linger=0.2, max_backoff=0.2)
    for i in range(40):
        await bus.publish(f"batch.test.{i}", str(i).encode(), msg_id=f"b{i}")
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await wait_for(lambda: set(stored) == set(range(40)), what="every message stored")
        await settled(bus, "BATCH_TEST", "batch", 40)
    finally:
        stop.set()
        await task
    assert max(sizes) == 10 and failed_once.is_set()


async def test_verdicts_retry_and_dead_letter_single_messages(bus):
    seen: list[tuple[str, int]] = []

    async def handler(items):
        verdicts = []
        for raw, delivery in items:
            seen.append((bytes(raw).decode(), delivery.num_delivered))
            if bytes(raw) == b"retry" and delivery.num_delivered == 1:
                verdicts.append(Retry("not yet", delay=0.1))
            elif bytes(raw) == b"poison":
                verdicts.append(Dead("never"))
            else:
                verdicts.append(None)
        return verdicts

    consumer = await _consumer(bus, handler, durable="verdicts", batch_size=10, linger=0.05)
    for name in ("ok", "retry", "poison"):
        await bus.publish(f"batch.test.{name}", name.encode(), msg_id=name)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    dead = await bus.js.pull_subscribe("arena.dead.BATCH_TEST", durable="dead-reader", stream="ARENA_DEAD")
    try:
        [letter_msg] = await dead.fetch(1, timeout=10)
        await wait_for(lambda: ("retry", 2) in seen, what="the retried message")
        await settled(bus, "BATCH_TEST", "verdicts", 3)
    finally:
        stop.set()
        await task
    letter = msgspec.json.decode(letter_msg.data, type=DeadLetter)
    assert (letter.subject, letter.error, letter.consumer) == ("batch.test.poison", "never", "verdicts")
    assert ("ok", 1) in seen and ("ok", 2) not in seen


async def test_the_batch_consumer_survives_a_server_restart(tmp_path):
    server = NatsServer(tmp_path / "nats", sync="1s").start()
    bus = await Bus.connect(server.url, "test")
    stored: set[int] = set()

    async def handler(items):
        stored.update(int(bytes(raw)) for raw, _ in items)

    stop = asyncio.Event()
    task = None
    try:
        # acks the server had not written to disk when it was killed come back after ack_wait
        consumer = await _consumer(bus, handler, batch_size=50, linger=0.05, ack_wait=2.0)
        for i in range(20):
            await bus.publish(f"batch.test.{i}", str(i).encode(), msg_id=f"b{i}")
        task = asyncio.create_task(consumer.run(stop))
        await wait_for(lambda: stored >= set(range(20)), what="the first messages")
        server.kill()
        await asyncio.sleep(1.5)  # fetches fail meanwhile
        server.start()
        for i in range(20, 60):
            await bus.publish(f"batch.test.{i}", str(i).encode(), msg_id=f"b{i}")
        await wait_for(lambda: stored >= set(range(60)), timeout=30, what="messages after the restart")
        await settled(bus, "BATCH_TEST", "batch", 60, timeout=30)
    finally:
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 15)
        await bus.close()
        server.stop()


async def test_a_body_in_the_object_store_reaches_the_batch_handler_whole(small_bus):
    server, bus = small_bus
    got: list[bytes] = []

    async def handler(items):
        got.extend(bytes(raw) for raw, _ in items)

    consumer = await _consumer(bus, handler, durable="big", batch_size=10, linger=0.05)
    big = b"y" * (server.max_payload + 1)
    await bus.publish("batch.test.big", big, msg_id="big")
    await bus.publish("batch.test.small", b"s", msg_id="small")
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await wait_for(lambda: len(got) == 2, what="both messages")
    finally:
        stop.set()
        await task
    assert sorted(got, key=len) == [b"s", big]


async def test_a_pack_is_handled_as_its_messages_and_settled_as_a_whole(bus):
    """Steps published together come as one ``Pack`` on ``arena.steps``: the handler sees each
    step with its own subject and id; a dead one is dead-lettered alone; a retry brings the
    whole pack again; an undecodable pack is dead-lettered whole."""
    seen: list[tuple[str, str, str, int]] = []

    async def handler(items):
        verdicts = []
        for raw, delivery in items:
            body = bytes(raw).decode()
            seen.append((body, delivery.subject, delivery.headers["Nats-Msg-Id"], delivery.num_delivered))
            if body == "retry" and delivery.num_delivered == 1:
                verdicts.append(Retry("not yet", delay=0.1))
            else:
                verdicts.append(Dead("never") if body == "poison" else None)
        return verdicts

    bodies = [f"s{i}" for i in range(20)] + ["poison", "retry"]
    await asyncio.gather(*(bus.publish(subjects.step(f"r{i}"), body.encode(), msg_id=f"r{i}:step:0")
                           for i, body in enumerate(bodies)))
    assert bus.packers["ARENA_STEPS"].packs == 1
    await bus.js.publish(subjects.STEP_PACKS, b"\xc1 not a pack", headers={"Nats-Msg-Id": "garbage"})
    consumer = BatchConsumer(bus, stream="ARENA_STEPS", durable="packs",
                             filter_subjects=["arena.step.*", subjects.STEP_PACKS], message_type=msgspec.Raw,
                             handler=handler, batch_size=10, linger=0.05, max_backoff=0.2)
    dead = await bus.js.pull_subscribe("arena.dead.ARENA_STEPS", durable="dead-reader", stream="ARENA_DEAD")
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        await wait_for(lambda: ("retry", subjects.step("r21"), "r21:step:0", 2) in seen, what="the pack again")
        await settled(bus, "ARENA_STEPS", "packs", 2)
        letters = [msgspec.json.decode(m.data, type=DeadLetter) for m in await dead.fetch(10, timeout=5)]
    finally:
        stop.set()
        await task
    assert {(body, subject, msg_id) for body, subject, msg_id, _ in seen} == {
        (body, subjects.step(f"r{i}"), f"r{i}:step:0") for i, body in enumerate(bodies)}
    assert {n for *_, n in seen} == {1, 2}  # the whole pack came twice, for the one retry
    by_subject = {letter.subject: letter for letter in letters}
    assert set(by_subject) == {subjects.step("r20"), subjects.STEP_PACKS}
    assert (by_subject[subjects.step("r20")].data, by_subject[subjects.step("r20")].error) == (b"poison", "never")
    assert by_subject[subjects.STEP_PACKS].data == b"\xc1 not a pack"


async def test_the_batch_asks_for_fewer_messages_when_they_are_large(bus):
    got: list[int] = []

    async def handler(items):
        got.append(len(items))

    consumer = await _consumer(bus, handler, durable="bytes", batch_size=100, linger=0.05, max_bytes=64 * 1024)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        for i in range(40):
            await bus.publish(f"batch.test.{i}", b"z" * 8 * 1024, msg_id=f"z{i}")
            if i == 4:  # the first batch teaches it their size
                await wait_for(lambda: sum(got) == 5, what="the first messages")
        await wait_for(lambda: sum(got) == 40, what="every message")
    finally:
        stop.set()
        await task
    # once their size is known, about 64 KiB a batch (8 of them; a fetch that timed out may still
    # bring a few more): without that, most of the 35 would come in one
    assert len(got) >= 4 and max(got[1:]) <= 16
