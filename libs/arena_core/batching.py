"""Publishes to one stream made in the same turn of the event loop go to JetStream as one
atomic batch (NATS ADR-50, nats-server 2.12+): the server stores them together, one commit and
one fsync, and acknowledges the batch once. With ``sync_interval: always`` that is what bounds
a publisher (benchmarks/trajectory_throughput.py; docs/trajectory.md, "Durable throughput").
While a batch to a stream is under way, the publishes to it wait and go out together when it
ends (group commit): the stream's writes are fsynced one after another anyway.

nats-py 2.16 has no batch publish, so this is the protocol's few headers over its core
publish and request: ``Nats-Batch-Id``, ``Nats-Batch-Sequence`` on each message, and
``Nats-Batch-Commit`` on the last, whose answer is the batch's ack (``stream``, ``seq`` of
the last message, ``count``). A batch the server refuses or does not answer fails each of its
publishes with :class:`BatchFailed`; ``Bus.publish`` then publishes them one by one (their
``Nats-Msg-Id`` make that safe if the batch was stored after all).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import msgspec
from nats.js.api import PubAck

#: The most messages in one batch (the server's limit is 1,000), and the most bytes.
BATCH_MAX = 256
BATCH_MAX_BYTES = 4 * 1024 * 1024
#: Fewer publishes than this in a loop turn go one by one: a batch has a fixed cost (the server
#: stages it apart, ~2.5 ms here) that only pays off from about this many messages.
BATCH_MIN = 16
_ack = msgspec.json.Decoder(dict[str, Any])
T = TypeVar("T")


class BatchFailed(Exception):
    """The batch this publish was in was refused or not answered: publish it alone."""


class NotBatched(BatchFailed):
    """Too few publishes came together to be worth a batch: publish it alone."""


_ALONE = NotBatched("too few publishes for a batch")


class TurnQueue(Generic[T]):
    """Publishes made in one turn of the event loop, handed to ``_drain`` together right after
    it (``loop.call_soon``), each with the future its publisher awaits: what ``Batcher`` and
    ``arena_core.packing.Packer`` group."""

    def __init__(self) -> None:
        self._queue: list[tuple[T, asyncio.Future]] = []
        self._scheduled = False

    def _enqueue(self, item: T) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.append((item, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._turn_ended)
        return future

    def _turn_ended(self) -> None:
        self._scheduled = False
        if self._hold():
            return
        queue, self._queue = self._queue, []
        self._drain(queue)

    def _hold(self) -> bool:
        """Whether the queue waits past this turn (it is drained by ``_resume`` then)."""
        return False

    def _resume(self) -> None:
        """Drain what waited, at the end of this turn."""
        if self._queue and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._turn_ended)

    def _drain(self, queue: list[tuple[T, asyncio.Future]]) -> None:
        raise NotImplementedError


def runs(queue: list[tuple[T, asyncio.Future]], *, max_items: int, max_bytes: int,
         size: Callable[[T], int]) -> Iterator[list[tuple[T, asyncio.Future]]]:
    """``queue`` in order, cut into runs of at most ``max_items`` whose ``size`` adds up to at most
    ``max_bytes`` (an item larger than that alone): the batches, or packs, a turn's publishes make."""
    run: list[tuple[T, asyncio.Future]] = []
    total = 0
    for item in queue:
        n = size(item[0])
        if run and (len(run) >= max_items or total + n > max_bytes):
            yield run
            run, total = [], 0
        run.append(item)
        total += n
    if run:
        yield run


def fail_all(queued: list[tuple[Any, asyncio.Future]], exc: Exception) -> None:
    """Every future of ``queued`` not done yet fails with ``exc``."""
    for _, future in queued:
        if not future.done():
            future.set_exception(exc)


Out = tuple[str, bytes, dict[str, str]]  # subject, data, headers


def _data_size(out: Out) -> int:
    return len(out[1])


class Batcher(TurnQueue[Out]):
    """The batches of one stream, on one connection."""

    def __init__(self, nc, *, timeout: float = 5.0, max_messages: int = BATCH_MAX, min_messages: int = BATCH_MIN,
                 max_bytes: int = BATCH_MAX_BYTES):
        super().__init__()
        self._sending = 0  # batches under way
        self.nc, self.timeout, self.max_messages = nc, timeout, max_messages
        self.min_messages, self.max_bytes = min_messages, max_bytes
        self.batches = 0  # sent as batches (for the benchmark)
        self.messages = 0

    def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> asyncio.Future:
        """A future of the message's ``PubAck`` (or :class:`BatchFailed`)."""
        return self._enqueue((subject, data, headers))

    def _drain(self, queue: list[tuple[Out, asyncio.Future]]) -> None:
        if len(queue) < self.min_messages:
            fail_all(queue, _ALONE)
            return
        for batch in runs(queue, max_items=self.max_messages, max_bytes=self.max_bytes, size=_data_size):
            self._start(batch)

    def _start(self, batch: list[tuple[Out, asyncio.Future]]) -> None:
        self._sending += 1  # under way from now: the publishes of the next turns wait for it
        asyncio.ensure_future(self._send(batch))

    def _hold(self) -> bool:
        """Group commit: while a batch to this stream is under way, what is published meanwhile
        waits for it (up to a full batch) and goes out together when it ends. The stream's
        writes are fsynced one after another anyway; many small sends each wait for theirs."""
        return self._sending > 0 and len(self._queue) < self.max_messages

    async def _send(self, batch: list[tuple[Out, asyncio.Future]]) -> None:
        try:
            await self._commit(batch)
        finally:
            self._sending -= 1
            self._resume()

    async def _commit(self, batch: list[tuple[Out, asyncio.Future]]) -> None:
        try:
            batch_id = uuid.uuid4().hex
            for i, ((subject, data, headers), _) in enumerate(batch[:-1], 1):
                await self.nc.publish(subject, data, headers={**headers, "Nats-Batch-Id": batch_id,
                                                              "Nats-Batch-Sequence": str(i)})
            (subject, data, headers), _ = batch[-1]
            answer = await self.nc.request(subject, data, timeout=self.timeout, headers={
                **headers, "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(len(batch)),
                "Nats-Batch-Commit": "1"})
            ack = _ack.decode(answer.data)
            if "error" in ack or ack.get("count") != len(batch) or not isinstance(ack.get("seq"), int):
                raise BatchFailed(f"batch refused: {ack.get('error') or ack}")
        except Exception as exc:  # noqa: BLE001 - every publish of the batch falls back to one by one
            fail_all(batch, exc if isinstance(exc, BatchFailed) else BatchFailed(f"{type(exc).__name__}: {exc}"))
            return
        self.batches += 1
        self.messages += len(batch)
        first = ack["seq"] - len(batch) + 1
        for i, (_, future) in enumerate(batch):
            if not future.done():
                future.set_result(PubAck(stream=ack["stream"], seq=first + i))
