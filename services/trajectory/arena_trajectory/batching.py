"""A durable pull consumer that hands its handler a whole fetch batch at once.

The per-message ``arena.bus.Consumer`` costs one ClickHouse insert per message; this one
fetches up to ``batch_size`` messages, decodes them, lets the handler store them in one
statement, then settles every message with the verdict the handler returned:

- the handler returns ``None`` for a message (or returns ``None`` overall) -> ``ack``
- ``Retry(delay)``                                                         -> ``nak(delay)``
- ``Dead(reason)`` or an undecodable message                                -> dead letter + ``term``
- the handler raises                                                        -> every message of the
  batch is ``nak``-ed with backoff (dead-lettered on its last allowed delivery)

So an ack still means "stored", and a redelivered batch is harmless because every table
it writes is idempotent (ReplacingMergeTree).
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

from arena.bus import Bus, Delivery, PullConsumer, settle

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
    ):
        super().__init__(bus, stream=stream, durable=durable, filter_subjects=filter_subjects,
                         message_type=message_type, max_deliver=max_deliver, ack_wait=ack_wait,
                         max_backoff=max_backoff, max_ack_pending=batch_size * 4)
        self.handler = handler
        self.batch_size = batch_size
        self.fetch_timeout = fetch_timeout
        self.linger = linger

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch, handle and settle batches until ``stop`` is set (the batch in hand is finished)."""
        sub = None
        while not stop.is_set():
            try:
                if sub is None:
                    sub = await self._subscribe()
                msgs = await self._fetch(sub)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            except Exception as exc:  # noqa: BLE001 - a server restart surfaces as many types
                if stop.is_set():
                    break
                log.warning("fetch on %s failed, retrying: %s", self.durable, exc, extra={"consumer": self.durable})
                sub = None  # re-bind: a pull consumer can go silent after a server restart
                await asyncio.sleep(0.5)
                continue
            if msgs:
                await self.process(msgs)

    async def _fetch(self, sub) -> list[Msg]:
        """Up to ``batch_size`` messages: after the first arrive, keep fetching for up to
        ``linger`` seconds so a steady flow makes a few large inserts, not many small ones
        (a ClickHouse insert costs tens of milliseconds however few rows it carries)."""
        msgs = await sub.fetch(batch=self.batch_size, timeout=self.fetch_timeout)
        deadline = time.monotonic() + self.linger
        while len(msgs) < self.batch_size:
            left = deadline - time.monotonic()
            if left < 0.01:
                break
            try:
                msgs += await sub.fetch(batch=self.batch_size - len(msgs), timeout=left)
            except (NatsTimeout, asyncio.TimeoutError):
                break
        return msgs

    async def process(self, msgs: list[Msg]) -> None:
        items: list[Item] = []
        kept: list[Msg] = []
        for msg in msgs:
            try:
                items.append((self.decoder.decode(msg.data), Delivery(msg)))
                kept.append(msg)
            except msgspec.DecodeError as exc:
                log.error("dead-lettering undecodable %s: %s", msg.subject, exc, extra={"consumer": self.durable})
                await self._dead(msg, f"undecodable message: {exc}")
        if not items:
            return
        beat = asyncio.create_task(self._heartbeat(kept))
        started = time.perf_counter()
        try:
            verdicts = await self.handler(items)
            log.debug("%s: %d messages handled in %.3f s", self.durable, len(kept), time.perf_counter() - started,
                      extra={"consumer": self.durable})
        except Exception as exc:  # noqa: BLE001 - a store outage or a bug: retry the whole batch
            log.warning("%s: batch of %d failed: %s: %s", self.durable, len(kept), type(exc).__name__, exc,
                        extra={"consumer": self.durable})
            for msg in kept:
                await self._fail(msg, f"{type(exc).__name__}: {exc}")
            return
        finally:
            beat.cancel()
        if verdicts is None:
            verdicts = [None] * len(kept)
        if len(verdicts) != len(kept):
            raise AssertionError(f"{self.durable}: handler returned {len(verdicts)} verdicts for {len(kept)} messages")
        for msg, verdict in zip(kept, verdicts):
            if verdict is None:
                await settle(msg.ack())
            elif isinstance(verdict, Retry):
                await settle(msg.nak(delay=verdict.delay))
            else:
                log.error("dead-lettering %s: %s", msg.subject, verdict.reason, extra={"consumer": self.durable})
                await self._dead(msg, verdict.reason)

    async def _fail(self, msg: Msg, error: str) -> None:
        if self.last_delivery(msg):
            await self._dead(msg, error)
        else:
            await settle(msg.nak(delay=self.backoff(msg.metadata.num_delivered)))
