"""Publishes made together to ``ARENA_STEPS`` go to JetStream as one message, a ``Pack`` on
``arena.steps`` (``arena_core.packing``), against a real nats-server: each publish is
acknowledged with the pack's ``PubAck`` once it is stored, the pack carries every message as
it was published (subject, id, body, headers), a publish alone goes out as itself, packs are
cut by count and bytes, and a pack JetStream refuses falls back to publishing one by one."""

from __future__ import annotations

import asyncio

from nats.js import api as jsapi

from arena_core import subjects
from arena_core.bus import Bus
from arena_core.packing import PACK_MAX, unpack


async def stored(bus: Bus, stream: str = "ARENA_STEPS") -> list:
    """Every message of ``stream``, in order (direct gets by sequence)."""
    info = await bus.js.stream_info(stream)
    return [await bus.js.get_msg(stream, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)]


async def test_publishes_of_one_loop_turn_are_one_pack_each_acknowledged(bus: Bus):
    packer = bus.packers["ARENA_STEPS"]
    acks = await asyncio.gather(*(bus.publish(subjects.step(f"r{i % 3}"), b'{"step": %d}' % i,
                                              msg_id=subjects.msg_id(f"r{i % 3}", "step", i),
                                              headers={"traceparent": f"00-{i:032x}-{i:016x}-01"})
                                  for i in range(100)))
    assert packer.packs == 1 and packer.messages == 100
    assert len({(a.stream, a.seq) for a in acks}) == 1 and not acks[0].duplicate
    [msg] = await stored(bus)
    assert msg.subject == subjects.STEP_PACKS and msg.headers["Nats-Msg-Id"].startswith("pack:")
    packed = unpack(msg.data)
    assert [p.subject for p in packed] == [subjects.step(f"r{i % 3}") for i in range(100)]
    assert [p.msg_id for p in packed] == [subjects.msg_id(f"r{i % 3}", "step", i) for i in range(100)]
    assert [p.data for p in packed] == [b'{"step": %d}' % i for i in range(100)]
    assert packed[7].headers == {"traceparent": f"00-{7:032x}-{7:016x}-01"}


async def test_a_publish_alone_goes_out_as_itself(bus: Bus):
    ack = await bus.publish(subjects.step("r1"), b'{"alone": true}', msg_id="r1:step:0")
    assert bus.packers["ARENA_STEPS"].packs == 0
    [msg] = await stored(bus)
    assert (msg.seq, msg.subject, msg.data, msg.headers["Nats-Msg-Id"]) == (ack.seq, "arena.step.r1",
                                                                            b'{"alone": true}', "r1:step:0")
    assert (await bus.publish(subjects.step("r1"), b"again", msg_id="r1:step:0")).duplicate


async def test_packs_are_cut_by_count_and_by_bytes(bus: Bus):
    packer = bus.packers["ARENA_STEPS"]
    acks = await asyncio.gather(*(bus.publish(subjects.step("r2"), b"x", msg_id=f"r2:{i}")
                                  for i in range(PACK_MAX + 10)))
    assert packer.packs == 2 and len({a.seq for a in acks}) == 2
    big = b"y" * (300 * 1024)  # 10 of them: ~3 MiB, over a pack's 1 MiB (and the server's max_payload)
    acks = await asyncio.gather(*(bus.publish(subjects.step("r3"), big, msg_id=f"r3:{i}") for i in range(10)))
    assert packer.packs >= 2 + 3 and len({a.seq for a in acks}) >= 4
    bodies = []
    for msg in await stored(bus):
        assert len(msg.data) <= bus.nc.max_payload
        bodies += [p.data for p in unpack(msg.data)] if msg.subject == subjects.STEP_PACKS else [msg.data]
    assert bodies.count(big) == 10 and bodies.count(b"x") == PACK_MAX + 10


async def test_a_pack_jetstream_refuses_is_published_one_by_one(bus: Bus):
    packer = bus.packers["ARENA_STEPS"]
    config = (await bus.js.stream_info("ARENA_STEPS")).config
    await bus.js.update_stream(config.evolve(subjects=["arena.step.*"]))  # no stream takes arena.steps now
    acks = await asyncio.gather(*(bus.publish(subjects.step("r4"), b"s%d" % i, msg_id=f"r4:{i}") for i in range(20)))
    assert packer.packs == 0 and sorted(a.seq for a in acks) == list(range(1, 21))
    assert sorted(m.data for m in await stored(bus)) == sorted(b"s%d" % i for i in range(20))


async def test_a_stream_without_a_pack_subject_is_never_packed(bus: Bus):
    assert set(bus.packers) == {s.name for s in subjects.STREAMS if s.packs}
    await asyncio.gather(*(bus.publish(subjects.sandbox_done(f"r{i}"), b"{}", msg_id=f"sd:{i}") for i in range(20)))
    assert all(m.subject.startswith("arena.sandbox.done.") for m in await stored(bus, "ARENA_RESULTS"))


async def test_a_steps_stream_declared_without_the_pack_subject_is_given_it(bus: Bus):
    # a stream declared by an older Arena (no pack subject) is given it by ensure_topology
    await bus.js.update_stream(jsapi.StreamConfig(name="ARENA_STEPS", subjects=["arena.step.*"],
                                                  storage=jsapi.StorageType.FILE, allow_atomic=True, allow_direct=True))
    fresh = await Bus.connect(bus.url, "fresh")
    try:
        await fresh.ensure_topology()
        assert subjects.STEP_PACKS in (await fresh.js.stream_info("ARENA_STEPS")).config.subjects
        assert "ARENA_STEPS" in fresh.packers
    finally:
        await fresh.close()
