"""Reading a rollout's captured steps back from ``ARENA_STEPS`` in tests, as the trajectory service does:
a step travels alone on ``arena.step.{rollout_id}`` or, when the proxy publishes several in the same
moment (a loaded host), inside one ``Pack`` on ``arena.steps`` (``arena_core.packing``)."""

from __future__ import annotations

import time

import msgspec
from nats.js import api as jsapi

from arena_core import subjects
from arena_core.packing import unpack
from arena_core.schemas import Step


async def read_steps(bus, rollout_id: str, n: int | None = None, *, within: float = 30.0) -> list[Step]:
    """The rollout's steps by index: until ``n`` are read or ``within`` seconds pass (``n`` None: until
    a fetch finds nothing more)."""
    subject = subjects.step(rollout_id)
    durable = f"test-steps-{rollout_id}"
    await bus.js.add_consumer("ARENA_STEPS", jsapi.ConsumerConfig(
        durable_name=durable, ack_policy=jsapi.AckPolicy.EXPLICIT, deliver_policy=jsapi.DeliverPolicy.ALL,
        filter_subjects=[subject, subjects.STEP_PACKS]))
    sub = await bus.js.pull_subscribe_bind(durable, "ARENA_STEPS")
    out: list[Step] = []
    deadline = time.monotonic() + within
    try:
        while (n is None or len(out) < n) and time.monotonic() < deadline:
            try:
                msgs = await sub.fetch(batch=50, timeout=0.5)
            except Exception:  # noqa: BLE001 - fetch timeout
                if n is None:
                    break
                continue
            for m in msgs:
                bodies = ([p.data for p in unpack(m.data) if p.subject == subject]
                          if m.subject == subjects.STEP_PACKS else [m.data])
                out += [msgspec.json.decode(b, type=Step) for b in bodies]
                await m.ack()
    finally:
        await sub.unsubscribe()
        await bus.js.delete_consumer("ARENA_STEPS", durable)
    return sorted(out, key=lambda s: s.step_index)
