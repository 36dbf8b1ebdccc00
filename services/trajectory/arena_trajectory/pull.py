"""A cheap pull-consumer fetch for high-rate batch consumers.

``nats-py``'s ``PullSubscription.fetch`` waits for every message with its own
``asyncio.wait_for`` (a timer and a task per message), and a fetch that lingers for more
messages has to issue one ``no_wait`` request after another. At tens of thousands of
messages per second that bookkeeping costs more than the work. ``PullFeed`` speaks the
same JetStream pull protocol with less: one private inbox with a callback that appends
to a buffer, one pull request (``{"batch": n, "expires": ns}`` to
``$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}``) per fetch, and one wait per fetch.

Delivery semantics do not change: every message is still settled explicitly by the
consumer, a message the feed holds but never hands out is handed back (``nak``) when the
feed stops, or redelivered after ``ack_wait`` if the process dies, and status messages (404 no messages, 408 request
expired, 409 conflicts, 100 heartbeats) only end a wait, never reach the handler.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

API_PREFIX = "$JS.API"
STATUS = "Status"
HEARTBEAT = "100"
#: statuses that end a pull request without an error (no messages, expired, conflicts)
_END = {"404", "408", "409"}


class FeedError(Exception):
    """The server refused the pull request (e.g. the consumer was deleted): re-bind."""


class PullFeed:
    """Pull requests to one durable consumer, answered into one buffer."""

    def __init__(self, nc: NATS, stream: str, durable: str):
        self.nc = nc
        self.subject = f"{API_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.inbox = nc.new_inbox()
        self._buffer: deque[Msg] = deque()
        self._want = 0
        self._ready = asyncio.Event()
        self._error: str | None = None
        self._ended = False
        self._sub = None

    async def start(self) -> PullFeed:
        self._sub = await self.nc.subscribe(self.inbox, cb=self._on_msg)
        return self

    async def stop(self) -> None:
        """Hand buffered messages back for immediate redelivery (``nak``) and unsubscribe."""
        while self._buffer:
            try:
                await self._buffer.popleft().nak()
            except Exception:  # noqa: BLE001 - the connection may be gone: redelivered after ack_wait
                break
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may be gone; nothing to release then
                pass
            self._sub = None

    async def _on_msg(self, msg: Msg) -> None:
        headers = msg.headers
        status = headers.get(STATUS) if headers else None
        if status is None:
            self._buffer.append(msg)
            if len(self._buffer) >= self._want:
                self._ready.set()
        elif status != HEARTBEAT:
            if status not in _END:
                self._error = f"{status} {headers.get('Description', '')}".strip()
            self._ended = True  # a request is over (possibly an older one): stop waiting
            self._ready.set()

    async def fetch(self, batch: int, *, timeout: float, linger: float = 0.0) -> list[Msg]:
        """Up to ``batch`` messages: waits up to ``timeout`` for the first, then up to
        ``linger`` seconds more while fewer than ``batch`` are in. Raises
        ``nats.errors.TimeoutError`` if none came, ``FeedError`` if the server refused."""
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self._ended = False
        if len(self._buffer) < batch:
            request = {"batch": batch - len(self._buffer), "expires": int(max(timeout, 0.01) * 1e9)}
            await self.nc.publish(self.subject, json.dumps(request).encode(), reply=self.inbox)
        deadline = time.monotonic() + timeout
        await self._wait(1, deadline)
        if self._buffer and linger > 0:
            await self._wait(batch, min(deadline, time.monotonic() + linger))
        if self._error is not None and not self._buffer:
            error, self._error = self._error, None
            raise FeedError(f"pull request on {self.subject} refused: {error}")
        if not self._buffer:
            raise NatsTimeout
        return [self._buffer.popleft() for _ in range(min(batch, len(self._buffer)))]

    async def _wait(self, want: int, deadline: float) -> None:
        """Until ``want`` messages are buffered, a request ends, or ``deadline``."""
        self._want = want
        try:
            while len(self._buffer) < want and not self._ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._ready.clear()
                try:
                    await asyncio.wait_for(self._ready.wait(), left)
                except asyncio.TimeoutError:
                    return
        finally:
            self._want = 0
