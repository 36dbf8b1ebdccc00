"""JetStream over a ``NatsLink``: pull batches with batched acks, pipelined publishes.

``PullFeed`` speaks JetStream's pull protocol: one private inbox, one pull request
(``{"batch": n, "expires": ns}`` to ``$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}``) per
fetch and one wait per fetch, where nats-py's ``fetch`` pays a timer and a task per
message. Messages are ``JsMsg``: the subset of nats-py's ``Msg`` that Arena's consumers
use (``subject``, ``data``, ``headers``, ``metadata``, ``ack/nak/term/in_progress``), and
``ack_all(msgs)`` acknowledges a whole batch in one write.

``JsPublisher`` publishes with a reply inbox and resolves a future with the stream's
``PubAck`` (or the server's error), so many publishes are in flight at once and a batch
of them is one write.

Delivery semantics are JetStream's and do not change: a message is settled explicitly; one
the feed holds but never hands out is handed back (``nak``) when the feed stops, or
redelivered after ``ack_wait`` if the process dies; status messages (404 no messages, 408
request expired, 409 conflicts, 100 heartbeats) only end a wait, never reach a handler.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import msgspec

from arena_core.natslink import LinkClosed, LinkError, NatsLink, encode_headers, parse_headers

API_PREFIX = "$JS.API"
_HEARTBEAT = "100"
#: statuses that end a pull request without an error (no messages, request expired)
_END = {"404", "408"}
#: 409s that only end a request (a later one may succeed); any other 409 is an error
_END_409 = ("Exceeded Max", "Batch Completed", "Leadership Change", "Server Shutdown")


class FeedError(LinkError):
    """The server refused the pull request (e.g. the consumer was deleted): re-bind."""


class FetchTimeout(LinkError):
    """No message came within the fetch's timeout."""


class NoResponders(LinkError):
    """No stream listens on the subject (or the server is restarting)."""


class PublishRefused(LinkError):
    """JetStream answered a publish with an error (``code``: its error code)."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


class PublishTimeout(LinkError):
    """No ``PubAck`` within the timeout: the message may or may not be stored."""


# --------------------------------------------------------------------------- messages


class SequencePair:
    __slots__ = ("stream", "consumer")

    def __init__(self, stream: int, consumer: int):
        self.stream = stream
        self.consumer = consumer


class JsMetadata:
    """What the ack subject ``$JS.ACK[.<domain>.<account hash>].<stream>.<consumer>.
    <delivered>.<stream seq>.<consumer seq>.<timestamp>.<pending>[...]`` says."""

    __slots__ = ("stream", "consumer", "num_delivered", "sequence", "timestamp_ns", "num_pending")

    def __init__(self, reply: str):
        tokens = reply.split(".")
        if len(tokens) == 9 and tokens[0] == "$JS" and tokens[1] == "ACK":
            base = 2
        elif len(tokens) >= 12 and tokens[0] == "$JS" and tokens[1] == "ACK":
            base = 4
        else:
            raise ValueError(f"not a JetStream ack subject: {reply!r}")
        self.stream, self.consumer = tokens[base], tokens[base + 1]
        self.num_delivered = int(tokens[base + 2])
        self.sequence = SequencePair(int(tokens[base + 3]), int(tokens[base + 4]))
        self.timestamp_ns = int(tokens[base + 5])
        self.num_pending = int(tokens[base + 6])


class JsMsg:
    """A message delivered by JetStream through a ``PullFeed``."""

    __slots__ = ("subject", "reply", "data", "_raw_headers", "_headers", "_metadata", "_link")

    def __init__(self, link: NatsLink, subject: str, reply: str, raw_headers: bytes | None, data: bytes):
        self._link = link
        self.subject = subject
        self.reply = reply
        self.data = data
        self._raw_headers = raw_headers
        self._headers: dict[str, str] | None = None
        self._metadata: JsMetadata | None = None

    @property
    def raw_headers(self) -> bytes | None:
        """The header block as it arrived (``NATS/1.0`` and its lines), or ``None``."""
        return self._raw_headers

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            self._headers = parse_headers(self._raw_headers)[2]
        return self._headers

    @property
    def metadata(self) -> JsMetadata:
        if self._metadata is None:
            self._metadata = JsMetadata(self.reply)
        return self._metadata

    async def ack(self) -> None:
        self._link.publish(self.reply)

    async def nak(self, delay: float | None = None) -> None:
        self._link.publish(self.reply, b"-NAK" + (b' {"delay": %d}' % int(delay * 1e9) if delay else b""))

    async def term(self) -> None:
        self._link.publish(self.reply, b"+TERM")

    async def in_progress(self) -> None:
        self._link.publish(self.reply, b"+WPI")


def ack_all(msgs: list[JsMsg]) -> None:
    """Acknowledge every message of ``msgs`` (explicit acks, one write for all of them)."""
    if msgs:
        msgs[0]._link.write(b"".join(b"PUB %s 0\r\n\r\n" % m.reply.encode() for m in msgs))  # noqa: SLF001


# --------------------------------------------------------------------------- pull feed


class PullFeed:
    """Pull requests to one durable consumer, answered into one buffer."""

    def __init__(self, link: NatsLink, stream: str, durable: str):
        self.link = link
        self.subject = f"{API_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.inbox = link.new_inbox()
        self._buffer: deque[JsMsg] = deque()
        self._want = 0
        self._ready = asyncio.Event()
        self._error: str | None = None
        self._ended = False
        self._sid: int | None = None

    def start(self) -> PullFeed:
        self._sid = self.link.subscribe(self.inbox, self._on_msg)
        self.link.on_close(self._ready.set)
        return self

    async def stop(self) -> None:
        """Hand buffered messages back for immediate redelivery (``nak``) and unsubscribe."""
        if self.link.closed:
            self._buffer.clear()  # redelivered after ack_wait
            return
        while self._buffer:
            self.link.publish(self._buffer.popleft().reply, b"-NAK")
        if self._sid is not None:
            self.link.unsubscribe(self._sid)
            self._sid = None

    def _on_msg(self, subject: str, reply: str | None, headers: bytes | None, data: bytes) -> None:
        if reply is not None and not (headers and headers[8:9] == b" "):  # a message, not a status
            self._buffer.append(JsMsg(self.link, subject, reply, headers, data))
            if len(self._buffer) >= self._want:
                self._ready.set()
            return
        status, description, _ = parse_headers(headers)
        if status == _HEARTBEAT:
            return
        if status not in _END and not (status == "409" and description.startswith(_END_409)):
            self._error = f"{status} {description}".strip()
        self._ended = True  # a request is over (possibly an older one): stop waiting
        self._ready.set()

    async def fetch(self, batch: int, *, timeout: float, linger: float = 0.0) -> list[JsMsg]:
        """Up to ``batch`` messages: waits up to ``timeout`` for the first, then up to
        ``linger`` seconds more while fewer than ``batch`` are in. Raises ``FetchTimeout``
        if none came, ``FeedError`` if the server refused, ``LinkClosed`` if the
        connection is gone."""
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self._ended = False
        if len(self._buffer) < batch:
            request = b'{"batch": %d, "expires": %d}' % (batch - len(self._buffer), int(max(timeout, 0.01) * 1e9))
            self.link.publish(self.subject, request, reply=self.inbox)
        deadline = time.monotonic() + timeout
        await self._wait(1, deadline)
        if self._buffer and linger > 0:
            await self._wait(batch, min(deadline, time.monotonic() + linger))
        if not self._buffer:
            if self.link.closed:
                raise LinkClosed(self.link.error or "closed")
            if self._error is not None:
                error, self._error = self._error, None
                raise FeedError(f"pull request on {self.subject} refused: {error}")
            raise FetchTimeout(f"no message on {self.subject} within {timeout}s")
        return [self._buffer.popleft() for _ in range(min(batch, len(self._buffer)))]

    async def _wait(self, want: int, deadline: float) -> None:
        """Until ``want`` messages are buffered, a request ends, the link closes, or ``deadline``."""
        self._want = want
        try:
            while len(self._buffer) < want and not self._ended and not self.link.closed:
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


# --------------------------------------------------------------------------- publisher


class PubAck(msgspec.Struct):
    stream: str
    seq: int
    duplicate: bool = False
    domain: str | None = None


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _Reply(msgspec.Struct):
    stream: str | None = None
    seq: int | None = None
    duplicate: bool = False
    domain: str | None = None
    error: _ApiError | None = None


_reply_decoder = msgspec.json.Decoder(_Reply)


class JsPublisher:
    """JetStream publishes on a link, many in flight, each answered by its ``PubAck``."""

    def __init__(self, link: NatsLink, *, timeout: float = 5.0):
        self.link = link
        self.timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._prefix = link.new_inbox() + "."
        self._pending: dict[str, tuple[asyncio.Future, float]] = {}
        self._next = 0
        self._sweeper: asyncio.TimerHandle | None = None
        self._sid = link.subscribe(self._prefix + "*", self._on_reply)
        link.on_close(self._fail_all)

    def publish(self, subject: str, data: bytes, *, msg_id: str | None = None,
                headers: dict[str, str] | None = None) -> asyncio.Future:
        """Queue a publish; the future resolves to its ``PubAck`` or raises ``NoResponders``,
        ``PublishRefused``, ``PublishTimeout`` or ``LinkClosed``. Raises ``PayloadTooLarge``
        at once."""
        if headers:
            block: bytes | None = encode_headers({**headers, "Nats-Msg-Id": msg_id} if msg_id is not None else headers)
        elif msg_id is not None:  # the common case, without building a dict
            if "\r" in msg_id or "\n" in msg_id:
                raise ValueError(f"a Nats-Msg-Id cannot carry a line break: {msg_id!r}")
            block = b"NATS/1.0\r\nNats-Msg-Id: " + msg_id.encode() + b"\r\n\r\n"
        else:
            block = None
        self._next += 1
        token = str(self._next)
        future = self._loop.create_future()
        self.link.publish(subject, data, reply=self._prefix + token, headers=block)
        self._pending[token] = (future, time.monotonic() + self.timeout)
        if self._sweeper is None:
            self._sweeper = self._loop.call_later(self.timeout / 4, self._sweep)
        return future

    async def close(self) -> None:
        if not self.link.closed:
            self.link.unsubscribe(self._sid)
        self._fail_all()

    def _on_reply(self, subject: str, reply: str | None, headers: bytes | None, data: bytes) -> None:
        entry = self._pending.pop(subject[len(self._prefix):], None)
        if entry is None or entry[0].done():
            return  # timed out already
        future = entry[0]
        if headers and headers[8:9] == b" ":
            status, description, _ = parse_headers(headers)
            if status == "503":
                future.set_exception(NoResponders(f"no stream answered ({description or 'no responders'})"))
            else:
                future.set_exception(PublishRefused(f"status {status} {description}".strip()))
            return
        try:
            answer = _reply_decoder.decode(data)
        except msgspec.DecodeError as exc:
            future.set_exception(PublishRefused(f"unreadable PubAck: {exc}"))
            return
        if answer.error is not None:
            future.set_exception(PublishRefused(answer.error.description or f"error {answer.error.err_code}",
                                                answer.error.err_code))
        elif answer.stream is None or answer.seq is None:
            future.set_exception(PublishRefused(f"unexpected reply: {data[:200]!r}"))
        else:
            future.set_result(PubAck(stream=answer.stream, seq=answer.seq, duplicate=answer.duplicate,
                                     domain=answer.domain))

    def _sweep(self) -> None:
        self._sweeper = None
        now = time.monotonic()
        expired = [token for token, (_, deadline) in self._pending.items() if deadline <= now]
        for token in expired:
            future, _ = self._pending.pop(token)
            if not future.done():
                future.set_exception(PublishTimeout(f"no PubAck within {self.timeout}s"))
        if self._pending:
            self._sweeper = self._loop.call_later(self.timeout / 4, self._sweep)

    def _fail_all(self) -> None:
        pending, self._pending = self._pending, {}
        closed = LinkClosed(self.link.error or "closed")
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(closed)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
