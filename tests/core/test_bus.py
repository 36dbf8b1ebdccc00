"""The bus helpers against a real nats-server: idempotent publish, ack policy, dead letters."""

from __future__ import annotations

import asyncio

import msgspec

from arena_core import subjects
from arena_core.bus import Consumer
from arena_core.errors import Permanent
from arena_core.schemas import DeadLetter, SandboxDone, SandboxOutcome, SandboxStarted


async def test_duplicate_msg_id_is_dropped(bus):
    msg = SandboxStarted(rollout_id="r1", sandbox_id="s", provider="local", at=1.0)
    first = await bus.publish(subjects.sandbox_started("r1"), msg, msg_id="r1:started:0")
    second = await bus.publish(subjects.sandbox_started("r1"), msg, msg_id="r1:started:0")
    assert not first.duplicate
    assert second.duplicate
    info = await bus.js.stream_info("ARENA_RESULTS")
    assert info.state.messages == 1


async def test_consumer_acks_retries_and_dead_letters(bus):
    seen: list[tuple[str, int]] = []

    async def handler(body: SandboxStarted, delivery) -> None:
        seen.append((body.rollout_id, delivery.num_delivered))
        if body.rollout_id == "flaky" and delivery.num_delivered == 1:
            raise RuntimeError("transient")
        if body.rollout_id == "poison":
            raise Permanent("can never work")

    for rid in ("ok", "flaky", "poison"):
        await bus.publish(subjects.sandbox_started(rid),
                          SandboxStarted(rollout_id=rid, sandbox_id="s", provider="local", at=1.0),
                          msg_id=f"{rid}:started:0")
    await bus.nc.publish(subjects.sandbox_started("garbage"), b"{not json")  # core publish, no msg id
    await bus.nc.flush()

    consumer = Consumer(bus, stream="ARENA_RESULTS", durable="t", filter_subjects=["arena.sandbox.started.*"],
                        message_type=SandboxStarted, handler=handler, concurrency=2)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    dead = await bus.js.pull_subscribe("arena.dead.*", durable="dead-reader", stream="ARENA_DEAD")
    letters = []
    for _ in range(50):
        try:
            for m in await dead.fetch(batch=10, timeout=0.5):
                letters.append(msgspec.json.decode(m.data, type=DeadLetter))
                await m.ack()
        except Exception:  # noqa: BLE001 - fetch timeout
            pass
        if len(letters) >= 2 and ("flaky", 2) in seen:
            break
    stop.set()
    await task
    assert ("ok", 1) in seen
    assert ("flaky", 1) in seen and ("flaky", 2) in seen
    assert sorted(letter.error.split(":")[0] for letter in letters) == ["can never work", "undecodable message"]
    assert {letter.subject for letter in letters} == {"arena.sandbox.started.poison", "arena.sandbox.started.garbage"}


async def test_a_message_over_max_payload_is_consumed_whole_and_dead_lettered_by_name(small_bus):
    _, bus = small_bus
    diff = "+" * (400 * 1024)  # over the server's 256 KiB max_payload
    done = SandboxDone(rollout_id="huge", sandbox_id="s", provider="local", outcome=SandboxOutcome.COMPLETED,
                       reason="", started_at=1.0, finished_at=2.0, diff=diff)
    await bus.publish(subjects.sandbox_done("huge"), done, msg_id="huge:sandbox-done")
    await bus.publish(subjects.sandbox_done("poison"), msgspec.structs.replace(done, rollout_id="poison"),
                      msg_id="poison:sandbox-done")
    seen: list[SandboxDone] = []

    async def handler(body: SandboxDone, delivery) -> None:
        if body.rollout_id == "poison":
            raise Permanent("never")
        seen.append(body)

    consumer = Consumer(bus, stream="ARENA_RESULTS", durable="big", filter_subjects=["arena.sandbox.done.*"],
                        message_type=SandboxDone, handler=handler)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    dead = await bus.js.pull_subscribe("arena.dead.*", durable="dead-reader", stream="ARENA_DEAD")
    try:
        [m] = await dead.fetch(batch=1, timeout=10)
    finally:
        stop.set()
        await task
    assert seen == [done]
    letter = msgspec.json.decode(m.data, type=DeadLetter)
    assert letter.body_object == "bodies/poison:sandbox-done" and letter.data == b""
    assert msgspec.json.decode(await bus.body(m), type=DeadLetter) == letter  # a small message: as it is
    stored = await (await bus.artifacts()).get(letter.body_object)
    assert msgspec.json.decode(stored.data, type=SandboxDone).rollout_id == "poison"
