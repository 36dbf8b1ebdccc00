"""A lean NATS client connection for Arena's high-rate paths.

nats-py spends about 10 us of Python on every message it receives (a regex parse, a
``Msg``, a header dict, a queue hop and a coroutine call per message) and about 24 us on
every JetStream ``publish_async``. At tens of thousands of steps per second that is most
of the trajectory plane's work. ``NatsLink`` speaks the same client protocol
(https://docs.nats.io/reference/reference-protocols/nats-protocol) on one
``asyncio.Protocol``:

- incoming ``MSG``/``HMSG`` frames are cut out of the receive buffer in place and handed
  to a plain callback (no task, no coroutine, no header parsing unless asked);
- outgoing commands are queued and written once per event-loop turn, so a batch of
  JetStream acks or publishes is one ``write``.

It is a connection, not a client: no reconnect. When the connection drops every user
sees ``LinkClosed`` and opens a new link (``Bus.link()`` does it); JetStream redelivers
whatever was not acknowledged, and publishes carry ``Nats-Msg-Id``, so nothing is lost or
doubled. Streams, KV and object stores stay on nats-py (``Bus.js``).

Supported: ``nats://`` and ``tls://`` URLs (TLS also when the server requires it), user
and password or a token in the URL, several comma-separated servers (tried in order).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Callable
from urllib.parse import unquote, urlparse

log = logging.getLogger("arena_core.natslink")

#: ``on_msg(subject, reply, headers, data)``: ``headers`` is the raw header block
#: (``NATS/1.0...\r\n\r\n``) or ``None``; called on the event loop, must not block.
OnMsg = Callable[[str, "str | None", "bytes | None", bytes], None]

_CRLF = b"\r\n"
_H, _M = ord("H"), ord("M")
_VERSION = "arena-natslink/1"


class LinkError(Exception):
    """A NATS protocol or connection problem."""


class LinkClosed(LinkError):
    """The connection is gone (closed by us, by the server, or by the network)."""


class PayloadTooLarge(LinkError):
    """A message is bigger than the server's ``max_payload``."""


class NatsLink(asyncio.Protocol):
    """One NATS connection: subscribe with a plain callback, publish without awaiting."""

    def __init__(self, name: str):
        self.name = name
        self.info: dict = {}
        self.max_payload = 1024 * 1024
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._need = 0  # bytes the buffer must hold before parsing again (a partial frame)
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._subs: dict[int, OnMsg] = {}
        self._next_sid = 1
        self._pongs: list[asyncio.Future] = []
        self._info_ready: asyncio.Future = self._loop.create_future()
        self._writable = asyncio.Event()
        self._writable.set()
        self._closed = False
        self.error: str | None = None  # why it closed, if not by us
        self._on_close: list[Callable[[], None]] = []
        self._pinger: asyncio.Task | None = None
        self._last_rx = time.monotonic()

    # ----------------------------------------------------------------- opening

    @classmethod
    async def open(cls, url: str, *, name: str, timeout: float = 5.0, tls: ssl.SSLContext | None = None,
                   ping_interval: float = 20.0) -> NatsLink:
        """Connect to the first reachable server of ``url`` (comma-separated), finish the
        handshake (INFO, TLS if needed, CONNECT, PING/PONG) and return the open link.
        Raises ``LinkError`` with the server's or the network's reason."""
        errors = []
        for one in [u.strip() for u in url.split(",") if u.strip()]:
            try:
                return await asyncio.wait_for(cls._open_one(one, name=name, tls=tls, ping_interval=ping_interval),
                                              timeout)
            except (OSError, LinkError, asyncio.TimeoutError, ssl.SSLError) as exc:
                errors.append(f"{_redact(one)}: {type(exc).__name__}: {exc}".rstrip(": "))
        raise LinkError("cannot connect to NATS: " + "; ".join(errors))

    @classmethod
    async def _open_one(cls, url: str, *, name: str, tls: ssl.SSLContext | None, ping_interval: float) -> NatsLink:
        parsed = urlparse(url if "://" in url else f"nats://{url}")
        if parsed.scheme not in ("nats", "tls"):
            raise LinkError(f"unsupported NATS URL scheme {parsed.scheme!r} (nats:// or tls://)")
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
        loop = asyncio.get_running_loop()
        link = cls(name)
        await loop.create_connection(lambda: link, host, port)
        try:
            info = await link._info_ready
            if parsed.scheme == "tls" or info.get("tls_required") or tls is not None:
                context = tls or ssl.create_default_context()
                link._transport = await loop.start_tls(link._transport, link, context, server_hostname=host)
            connect: dict = {"verbose": False, "pedantic": False, "lang": "python", "version": _VERSION,
                             "protocol": 1, "headers": True, "no_responders": True, "name": name}
            if parsed.username and parsed.password is not None:
                connect["user"], connect["pass"] = unquote(parsed.username), unquote(parsed.password)
            elif parsed.username:
                connect["auth_token"] = unquote(parsed.username)
            link._queue(b"CONNECT " + json.dumps(connect).encode() + _CRLF)
            await link.flush(timeout=5.0)
        except BaseException:
            link.abort()
            raise
        if ping_interval > 0:
            link._pinger = loop.create_task(link._keepalive(ping_interval))
        return link

    # ----------------------------------------------------------------- protocol callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._closed and self.error is None:
            self.error = f"connection lost: {exc}" if exc else "connection closed by the server"
        self._shut()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def data_received(self, data: bytes) -> None:
        self._last_rx = time.monotonic()
        buf = self._buf
        if buf:  # a frame was cut at the end of the last read: complete it first
            buf += data
            if len(buf) < self._need:  # a large frame still arriving: no re-parse per read
                return
            data = bytes(buf)
            buf.clear()
        self._need = 0
        pos, end_of_data = 0, len(data)
        subs = self._subs
        while pos < end_of_data:
            eol = data.find(_CRLF, pos)
            if eol < 0:
                break
            first = data[pos]
            if first == _H or first == _M:  # HMSG subject sid [reply] hdr_len total_len / MSG subject sid [reply] len
                head = data[pos:eol].split()
                total = int(head[-1])
                start = eol + 2
                if start + total + 2 > end_of_data:
                    self._need = start + total + 2 - pos
                    break
                if first == _H:
                    hdr_len = int(head[-2])
                    reply = head[3].decode() if len(head) == 6 else None
                    headers = data[start:start + hdr_len]
                    data_start = start + hdr_len
                else:
                    reply = head[3].decode() if len(head) == 5 else None
                    headers = None
                    data_start = start
                payload = data[data_start:start + total]
                pos = start + total + 2
                callback = subs.get(int(head[2]))
                if callback is not None:
                    try:
                        callback(head[1].decode(), reply, headers, payload)
                    except Exception:  # noqa: BLE001 - one bad callback must not kill the connection
                        log.exception("natslink %s: message callback failed", self.name)
            else:
                self._control(data[pos:eol])
                pos = eol + 2
        if pos < end_of_data:
            buf += memoryview(data)[pos:]

    def _control(self, line: bytes) -> None:
        if line == b"PING":
            self._queue(b"PONG\r\n")
        elif line == b"PONG":
            if self._pongs:
                waiter = self._pongs.pop(0)
                if not waiter.done():
                    waiter.set_result(None)
        elif line.startswith(b"INFO"):
            self.info = json.loads(line[5:])
            self.max_payload = int(self.info.get("max_payload", self.max_payload))
            if not self._info_ready.done():
                self._info_ready.set_result(self.info)
        elif line.startswith(b"-ERR"):
            message = line[4:].strip().strip(b"'").decode(errors="replace")
            log.warning("natslink %s: server error: %s", self.name, message)
            # a fatal one (authorization, parser) is followed by the server closing the
            # connection: ``connection_lost`` then reports this reason to every waiter
            self.error = f"server error: {message}"
        # +OK (verbose is off) and anything unknown: ignored

    # ----------------------------------------------------------------- commands

    @property
    def closed(self) -> bool:
        return self._closed

    def new_inbox(self) -> str:
        return "_INBOX." + _token()

    def subscribe(self, subject: str, on_msg: OnMsg) -> int:
        sid = self._next_sid
        self._next_sid += 1
        self._subs[sid] = on_msg
        self._queue(f"SUB {subject} {sid}\r\n".encode())
        return sid

    def unsubscribe(self, sid: int) -> None:
        if self._subs.pop(sid, None) is not None and not self._closed:
            self._queue(f"UNSUB {sid}\r\n".encode())

    def publish(self, subject: str, data: bytes = b"", *, reply: str | None = None, headers: bytes | None = None) -> None:
        """Queue a message (``headers``: an encoded block, see ``encode_headers``). Written
        on the next loop turn; ``await drain()`` after many large ones."""
        size = len(data) + (len(headers) if headers else 0)
        if size > self.max_payload:
            raise PayloadTooLarge(f"{subject}: {size} bytes exceed the server's max_payload of {self.max_payload}")
        target = f"{subject} {reply}" if reply else subject
        if headers:
            self._queue(f"HPUB {target} {len(headers)} {size}\r\n".encode(), headers, data, _CRLF)
        else:
            self._queue(f"PUB {target} {size}\r\n".encode(), data, _CRLF)

    def write(self, commands: bytes) -> None:
        """Queue raw protocol bytes (e.g. a batch of ``PUB`` acks built by the caller)."""
        self._queue(commands)

    async def flush(self, timeout: float = 5.0) -> None:
        """Until the server has processed everything queued so far (a PING/PONG round trip)."""
        waiter = self._loop.create_future()
        self._pongs.append(waiter)
        self._queue(b"PING\r\n")
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise LinkError(f"no PONG from the server within {timeout}s") from None

    async def drain(self) -> None:
        """Wait while the socket's send buffer is over its high-water mark."""
        if self._closed:
            raise LinkClosed(self.error or "closed")
        await self._writable.wait()
        if self._closed:
            raise LinkClosed(self.error or "closed")

    def on_close(self, callback: Callable[[], None]) -> None:
        """``callback()`` once, when the link closes (at once if it is closed)."""
        if self._closed:
            callback()
        else:
            self._on_close.append(callback)

    async def close(self) -> None:
        """Write what is queued and close."""
        if self._closed:
            return
        try:
            await self.flush(timeout=2.0)
        except LinkError:
            pass
        if self._transport is not None:
            self._transport.close()
        self._shut()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()
        self._shut()

    # ----------------------------------------------------------------- internals

    def _queue(self, *parts: bytes) -> None:
        if self._closed:
            raise LinkClosed(self.error or "closed")
        self._out.extend(parts)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._write_out)

    def _write_out(self) -> None:
        self._flush_scheduled = False
        if self._closed or not self._out:
            return
        out, self._out = self._out, []
        self._transport.writelines(out)  # one send of many buffers, no joined copy

    async def _keepalive(self, interval: float) -> None:
        """A PING when nothing came for ``interval``; no PONG in time closes the link (a
        half-open TCP connection otherwise looks alive forever)."""
        try:
            while not self._closed:
                await asyncio.sleep(interval)
                if time.monotonic() - self._last_rx < interval:
                    continue
                try:
                    await self.flush(timeout=interval)
                except LinkError as exc:
                    self.error = f"stale connection: {exc}"
                    self.abort()
        except (asyncio.CancelledError, LinkClosed):
            pass

    def _shut(self) -> None:
        if self._closed:
            return
        self._closed = True
        closed = LinkClosed(self.error or "closed")
        for waiter in self._pongs:
            if not waiter.done():
                waiter.set_exception(closed)
        self._pongs.clear()
        if not self._info_ready.done():
            self._info_ready.set_exception(LinkError(self.error or "closed before the server's INFO"))
        self._writable.set()
        if self._pinger is not None and self._pinger is not asyncio.current_task():
            self._pinger.cancel()
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - every user must hear about it
                log.exception("natslink %s: on_close callback failed", self.name)


# --------------------------------------------------------------------------- headers


def encode_headers(headers: dict[str, str]) -> bytes:
    """A NATS header block: ``NATS/1.0``, one ``Name: value`` line each, a blank line."""
    lines = ["NATS/1.0"]
    for name, value in headers.items():
        if "\r" in name or "\n" in name or ":" in name or "\r" in value or "\n" in value:
            raise ValueError(f"header {name!r} cannot carry a line break or a colon in its name")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def parse_headers(block: bytes | None) -> tuple[str | None, str, dict[str, str]]:
    """``(status, description, headers)`` of a header block; ``status`` is the inline
    status code (``"404"``, ``"100"``...) of a server status message, else ``None``."""
    if not block:
        return None, "", {}
    first_end = block.find(_CRLF)
    first = block[:first_end].decode(errors="replace")
    status, description = None, ""
    rest = first[len("NATS/1.0"):].strip()
    if rest:
        code, _, description = rest.partition(" ")
        status = code if code.isdigit() else None
    headers: dict[str, str] = {}
    for line in block[first_end + 2:].split(_CRLF):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.decode(errors="replace").strip()] = value.decode(errors="replace").strip()
    return status, description, headers


def _token() -> str:
    import secrets

    return secrets.token_hex(11)


def _redact(url: str) -> str:
    """A URL without its credentials, for messages and logs."""
    parsed = urlparse(url if "://" in url else f"nats://{url}")
    if parsed.username is None:
        return url
    host = f"{parsed.hostname}:{parsed.port}" if parsed.port else str(parsed.hostname)
    return parsed._replace(netloc=host).geturl()
