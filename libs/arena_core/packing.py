"""Publishes to a stream that takes packs (``StreamSpec.packs``: ``ARENA_STEPS``) made in the
same turn of the event loop go to JetStream as one message, a :class:`~arena_core.schemas.Pack`
on the stream's pack subject (``arena.steps``): one write, one fsync, one delivery and one ack
for all of them, where an atomic batch (``arena_core.batching``) still stores, delivers and acks
each message. That per-message work was most of nats-server's CPU per step and much of each
client's (docs/trajectory.md, "Packs").

Publisher: :class:`Packer`, used by ``Bus.publish``. Each publish's future resolves with the
pack's ``PubAck`` once the pack is stored (with the stream's fsync setting). A publish alone in
its turn is not packed; it goes out as itself. A pack JetStream refuses or does not answer
fails each of its publishes with :class:`PackFailed`, and ``Bus.publish`` then publishes them
one by one under their own ``Nats-Msg-Id``. If the pack was stored after all, those messages
are in the stream twice (once packed, once alone): a reader must store idempotently, as the
trajectory service does (steps are keyed by rollout and index).

Readers: :func:`unpack` gives the messages a pack carries, each with its subject, id, headers
and body as published.
"""

from __future__ import annotations

import asyncio
import uuid

import msgspec
from nats.js.api import PubAck

from arena_core.batching import TurnQueue, fail_all, runs
from arena_core.schemas import Pack, Packed

#: The most messages in one pack, and the most bytes (further capped by the server's ``max_payload``).
PACK_MAX = 256
PACK_MAX_BYTES = 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Pack)


class PackFailed(Exception):
    """The pack this publish was in was refused or not answered: publish it alone."""


class NotPacked(PackFailed):
    """Nothing else was published with it: publish it alone."""


_ALONE = NotPacked("published alone")


def _packed_size(packed: Packed) -> int:
    """What a message takes in a pack: its body and, about, its framing."""
    return len(packed.data) + len(packed.subject) + len(packed.msg_id) + 16


def encode_pack(messages: list[Packed]) -> bytes:
    return _encoder.encode(Pack(messages=messages))


def unpack(data: bytes) -> list[Packed]:
    """The messages of a pack's body; ``msgspec.DecodeError`` (or ``ValidationError``) if it is none."""
    return _decoder.decode(data).messages


class Packer(TurnQueue[Packed]):
    """The packs of one stream, on one JetStream context."""

    def __init__(self, js, subject: str, *, max_bytes: int, timeout: float = 5.0, max_messages: int = PACK_MAX):
        super().__init__()
        self.js, self.subject, self.timeout = js, subject, timeout
        # the most bytes of bodies in a pack: room kept for the pack's own framing
        self.max_bytes, self.max_messages = min(max_bytes, PACK_MAX_BYTES) - 1024, max_messages
        self.packs = 0  # sent as packs (for benchmarks and tests)
        self.messages = 0

    def fits(self, data: bytes) -> bool:
        return len(data) <= self.max_bytes

    def publish(self, subject: str, data: bytes, msg_id: str, headers: dict[str, str]) -> asyncio.Future:
        """A future of the ``PubAck`` of the pack this message went in (or :class:`PackFailed`).
        ``headers``: its headers but its ``Nats-Msg-Id``."""
        return self._enqueue(Packed(subject=subject, msg_id=msg_id, data=data, headers=headers))

    def _drain(self, queue: list[tuple[Packed, asyncio.Future]]) -> None:
        for pack in runs(queue, max_items=self.max_messages, max_bytes=self.max_bytes, size=_packed_size):
            self._send(pack)

    def _send(self, pack: list[tuple[Packed, asyncio.Future]]) -> None:
        if len(pack) == 1:
            fail_all(pack, _ALONE)
            return
        asyncio.ensure_future(self._publish(pack))

    async def _publish(self, pack: list[tuple[Packed, asyncio.Future]]) -> None:
        try:
            ack: PubAck = await self.js.publish(self.subject, encode_pack([packed for packed, _ in pack]),
                                                timeout=self.timeout, headers={"Nats-Msg-Id": f"pack:{uuid.uuid4().hex}"})
        except Exception as exc:  # noqa: BLE001 - every publish of the pack falls back to one by one
            fail_all(pack, PackFailed(f"pack of {len(pack)} not stored: {type(exc).__name__}: {exc}"))
            return
        self.packs += 1
        self.messages += len(pack)
        for _, future in pack:
            if not future.done():
                future.set_result(ack)
