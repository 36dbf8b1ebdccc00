"""A durable pull consumer that hands its handler a whole fetch batch at once.

The per-message ``arena_core.bus.Consumer`` costs one ClickHouse insert per message; this one
fetches up to ``batch_size`` messages, decodes them, lets the handler store them in one
statement, then settles every message with the verdict the handler returned:

- the handler returns ``None`` for a message (or returns ``None`` overall) -> ``ack``
- ``Retry(delay)``                                                         -> ``nak(delay)``
- ``Dead(reason)`` or an undecodable message                                -> dead letter + ``term``
- the handler raises                                                        -> every message of the
  batch is ``nak``-ed with backoff (dead-lettered on its last allowed delivery)

So an ack still means "stored", and a redelivered batch is harmless because every table
it writes is idempotent (ReplacingMergeTree).

Batches come from a nats-py pull subscription bound to the durable consumer
(``fetch(batch, timeout)``); after the first messages arrive the consumer lingers up to
``linger`` seconds fetching more, so a steady flow makes a few large inserts instead of
many small ones (a ClickHouse insert has a fixed cost however few rows it carries). Acks
are published without waiting for a flush each (nats-py writes them out together). A
fetch that fails for anything but a timeout (a NATS restart) binds the subscription again.
With ``concurrency`` > 1 the next batch is fetched and decoded while the previous one is
being stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from arena_core import subjects
from arena_core.bus import BodyMissing, Bus, Delivery, PackedDelivery, PullConsumer, body_object, settle
from arena_core.errors import Unavailable
from arena_core.packing import unpack
from arena_core.schemas import Packed

log = logging.getLogger("arena.trajectory")

T = TypeVar("T")


@dataclass(frozen=True)
class Retry:
    """Deliver this message again after ``delay`` seconds."""

    reason: str
    delay: float = 0.25


@dataclass(frozen=True)
class Dead:
    """Dead-letter this message: retrying cannot help."""

    reason: str


Verdict = Retry | Dead | None
Item = tuple[Any, Delivery]
BatchHandler = Callable[[list[Item]], Awaitable[Sequence[Verdict] | None]]

#: A batch that is not full after its first fetch waits for more in this many pauses of
#: ``linger / LINGER_STEPS``, each followed by a fetch that returns at once with what came;
#: a pause in which nothing came ends the wait (the flow stopped: the last batch of a burst
#: waits one pause, not the whole ``linger``).
LINGER_STEPS = 10
#: How long such a fetch waits when nothing came during its pause (then the batch goes as it is).
LINGER_FETCH_TIMEOUT = 0.005
#: About the most bytes in one batch (messages are asked for by count; their mean size sets how many).
MAX_BATCH_BYTES = 16 * 1024 * 1024


class BatchConsumer(PullConsumer, Generic[T]):
    """Fetch up to ``batch_size`` messages, handle them together, settle each."""

    def __init__(
        self,
        bus: Bus,
        *,
        stream: str,
        durable: str,
        filter_subjects: Sequence[str],
        message_type: type[T] | Any,
        handler: BatchHandler,
        batch_size: int = 512,
        max_deliver: int = 40,
        ack_wait: float = 30.0,
        fetch_timeout: float = 0.5,
        linger: float = 0.1,
        max_backoff: float = 30.0,
        concurrency: int = 1,
        max_bytes: int = MAX_BATCH_BYTES,
    ):
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        super().__init__(bus, stream=stream, durable=durable, filter_subjects=filter_subjects,
                         message_type=message_type, max_deliver=max_deliver, ack_wait=ack_wait,
                         max_backoff=max_backoff, max_ack_pending=batch_size * (concurrency + 3))
        self.handler = handler
        # a ``Raw`` handler decodes (and validates) the bytes itself: they are handed over as they are
        self.passthrough = message_type is msgspec.Raw
        self.batch_size = batch_size
        self.fetch_timeout = fetch_timeout
        self.linger = linger
        self.concurrency = concurrency
        self.max_bytes = max_bytes
        #: the stream's pack subject (``arena_core.packing``): its messages are unpacked, each an item
        self.packs = next((spec.packs for spec in subjects.STREAMS if spec.name == stream), "")
        self._mean_size = 0.0  # of the messages fetched so far (a pack is many messages' bytes)
        self._carry: list[Msg] = []  # fetched beyond a batch: the next batch's first

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch, handle and settle batches until ``stop`` is set (the batches in hand are
        finished). With ``concurrency`` > 1, the next batch is fetched and decoded while
        earlier ones are still being stored (their order does not matter to the handler)."""
        sub = None
        slots = asyncio.Semaphore(self.concurrency)
        in_flight: set[asyncio.Task] = set()
        try:
            while not stop.is_set():
                await slots.acquire()
                if stop.is_set():
                    slots.release()
                    break
                try:
                    if sub is None:
                        sub = await self._subscribe()
                    msgs = await self.fetch(sub)
                except (NatsTimeout, asyncio.TimeoutError):
                    slots.release()
                    continue
                except Exception as exc:  # noqa: BLE001 - a server restart surfaces as many types
                    slots.release()
                    if stop.is_set():
                        break
                    log.warning("fetch on %s failed, retrying: %s", self.durable, exc,
                                extra={"consumer": self.durable})
                    if sub is not None:  # bind again: a pull consumer can go silent after a server restart
                        await _unsubscribe(sub)
                        sub = None
                    await asyncio.sleep(0.5)
                    continue
                if self.concurrency == 1:
                    try:
                        await self.process(msgs)
                    finally:
                        slots.release()
                    continue
                task = asyncio.create_task(self.process(msgs))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                task.add_done_callback(lambda _: slots.release())
        finally:
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)
            if sub is not None:
                await _unsubscribe(sub)

    async def fetch(self, sub) -> list[Msg]:
        """Up to ``batch_size`` messages or about ``max_bytes``: waits up to ``fetch_timeout``
        for the first (else nats-py's ``TimeoutError``), then, while the batch is not full,
        lets more gather for up to ``linger`` seconds (a few pauses, each followed by a fetch of
        what came: a fetch per message that trickles in would cost more than the messages).
        How many to ask for follows the mean size of the messages so far (packs are large)."""
        msgs, self._carry = self._carry, []
        if not msgs:
            msgs = await sub.fetch(self._wanted(0, 0), timeout=self.fetch_timeout)
        size = self._note(msgs)
        if self.linger <= 0:
            return self._at_most_a_batch(msgs)
        deadline = time.monotonic() + self.linger
        pause = self.linger / LINGER_STEPS
        while (want := self._wanted(len(msgs), size)) > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(pause, left))
            try:
                more = await sub.fetch(want, timeout=LINGER_FETCH_TIMEOUT)
            except Exception:  # noqa: BLE001 - a timeout, or trouble the next fetch meets again
                break
            msgs += more
            size += self._note(more)
        return self._at_most_a_batch(msgs)

    def _at_most_a_batch(self, msgs: list[Msg]) -> list[Msg]:
        """``batch_size`` of ``msgs``, the rest kept for the next batch: messages the server sent for a
        pull that timed out wait in the subscription and come with the next fetch, beyond what it
        asked for (seen under load: a batch of 11 of 10)."""
        if len(msgs) > self.batch_size:
            msgs, self._carry = msgs[:self.batch_size], msgs[self.batch_size:] + self._carry
        return msgs

    def _wanted(self, count: int, size: int) -> int:
        """How many more messages to ask for, with ``count`` of ``size`` bytes in hand."""
        if not self._mean_size:  # nothing seen yet: one, to learn how large they are (a pack can be 1 MiB)
            return 0 if count else 1
        room = min(self.batch_size - count, int((self.max_bytes - size) / self._mean_size))
        return max(room, 0) if count else max(room, 1)

    def _note(self, msgs: list[Msg]) -> int:
        size = sum(len(m.data) for m in msgs)
        if msgs:
            mean = size / len(msgs)
            self._mean_size = mean if not self._mean_size else 0.8 * self._mean_size + 0.2 * mean
        return size

    async def process(self, msgs: list[Msg]) -> None:
        items: list[Item] = []
        #: per item, the message it came in and, for a message of a pack, its place and itself
        origins: list[tuple[Msg, tuple[int, Packed] | None]] = []
        kept: list[Msg] = []
        unsettled: set[int] = set()  # packs one of whose messages could not be dead-lettered: again later
        for msg in msgs:
            try:
                if self.packs and msg.subject == self.packs:
                    for place in enumerate(unpack(msg.data)):
                        try:
                            body = place[1].data if self.passthrough else self.decoder.decode(place[1].data)
                        except msgspec.DecodeError as exc:
                            log.error("dead-lettering undecodable %s in a pack: %s", place[1].subject, exc,
                                      extra={"consumer": self.durable})
                            if not await self._dead_packed(msg, place, f"undecodable message: {exc}"):
                                unsettled.add(id(msg))
                            continue
                        items.append((body, PackedDelivery(msg, place[1])))
                        origins.append((msg, place))
                else:
                    data = msg.data if body_object(msg) is None else await self.bus.body(msg)
                    items.append((data if self.passthrough else self.decoder.decode(data), Delivery(msg)))
                    origins.append((msg, None))
                kept.append(msg)
            except (msgspec.DecodeError, BodyMissing) as exc:
                log.error("dead-lettering undecodable %s: %s", msg.subject, exc, extra={"consumer": self.durable})
                await self._dead(msg, f"undecodable message: {exc}")
            except Unavailable as exc:  # its body cannot be read now: again later
                log.warning("%s: %s", self.durable, exc, extra={"consumer": self.durable})
                await self._fail(msg, str(exc))
        if not kept:
            return
        verdicts: Sequence[Verdict] = []
        if items:
            beat = asyncio.create_task(self._heartbeat(kept))
            started = time.perf_counter()
            try:
                verdicts = await self.handler(items) or [None] * len(items)
                log.debug("%s: %d messages handled in %.3f s", self.durable, len(items), time.perf_counter() - started,
                          extra={"consumer": self.durable})
            except Exception as exc:  # noqa: BLE001 - a store outage or a bug: retry the whole batch
                log.warning("%s: batch of %d failed: %s: %s", self.durable, len(items), type(exc).__name__, exc,
                            extra={"consumer": self.durable})
                for msg in kept:
                    await self._fail(msg, f"{type(exc).__name__}: {exc}")
                return
            finally:
                beat.cancel()
        if len(verdicts) != len(items):
            raise AssertionError(f"{self.durable}: handler returned {len(verdicts)} verdicts for {len(items)} messages")
        # a message is settled by its items' verdicts: a pack is acked once all of its messages are
        # stored or dead-lettered, and delivered again (all of it: stores are idempotent) if one asks to be
        retries = dict.fromkeys(unsettled, self.backoff(1))
        dead: set[int] = set()  # messages dead-lettered (and terminated) whole
        for (msg, place), verdict in zip(origins, verdicts):
            if isinstance(verdict, Retry):
                retries[id(msg)] = max(retries.get(id(msg), 0.0), verdict.delay)
            elif isinstance(verdict, Dead):
                log.error("dead-lettering %s: %s", place[1].subject if place else msg.subject, verdict.reason,
                          extra={"consumer": self.durable})
                if place is None:
                    dead.add(id(msg))
                    await self._dead(msg, verdict.reason)
                elif not await self._dead_packed(msg, place, verdict.reason):
                    retries[id(msg)] = max(retries.get(id(msg), 0.0), self.backoff(1))
        settled = [msg for msg in kept if id(msg) not in dead]
        try:
            for msg in settled:  # queued on the connection, written out together (no flush awaited per ack)
                if id(msg) not in retries:
                    await msg.ack()
        except Exception as exc:  # noqa: BLE001 - the connection is gone: they are redelivered, and stored idempotently
            log.warning("%s: could not ack %d messages: %s", self.durable, len(settled), exc)
        for msg in settled:
            if id(msg) in retries:
                await settle(msg.nak(delay=retries[id(msg)]))

    async def _dead_packed(self, msg: Msg, place: tuple[int, Packed], error: str) -> bool:
        """Dead-letter one message of the pack ``msg`` (the pack itself is settled as a whole);
        whether it was."""
        try:
            await self.bus.dead_letter(stream=self.stream, msg=msg, consumer=self.durable, error=error, packed=place)
        except Exception:  # noqa: BLE001 - the pack is not acked then: it comes again
            log.exception("could not dead-letter %s of a pack; the pack comes again", place[1].subject)
            return False
        return True

    async def _fail(self, msg: Msg, error: str) -> None:
        if self.last_delivery(msg):
            await self._dead(msg, error)
        else:
            await settle(msg.nak(delay=self.backoff(msg.metadata.num_delivered)))


async def _unsubscribe(sub) -> None:
    try:
        await sub.unsubscribe()
    except Exception:  # noqa: BLE001 - the connection may be gone: nothing to undo then
        pass
