"""A lean HTTP/1.1 client for the proxy's upstream calls: keep-alive pools, streamed bodies.

The proxy sends one kind of request (a POST of a JSON body) to a handful of backend
origins, thousands of times a second, and relays the answer as it arrives. A general
client (httpx/httpcore) spends most of the proxy's per-call CPU on features that path
never uses; this one is an ``asyncio.Protocol`` per connection with an incremental
response parser (status line, headers, then a ``Content-Length``, chunked or
read-until-close body), a LIFO pool of idle connections per origin, and timeouts as
loop timers rather than a task per read.

Errors are ``TransportError`` subclasses: ``ConnectError`` (nothing was sent),
``ReadTimeout`` and ``RemoteProtocolError`` (the connection broke or the peer spoke
something other than HTTP/1.1). A request on a reused keep-alive connection that the
server had already closed (no byte of an answer came back) is sent once more on a new
connection, as other clients do: the server never read it. ``post(..., whole=True)``
returns once the answer's body is in as well (its caller wakes once, not at the head and
again at the body; an answer cut mid-body fails the ``post`` itself, and the read timeout
then bounds the whole answer rather than each read).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

#: Bytes buffered for a reader that is not keeping up before the socket is paused.
_HIGH_WATER = 1 << 20
_MAX_HEAD = 64 * 1024


class TransportError(Exception):
    """The upstream exchange failed below HTTP semantics."""


class ConnectError(TransportError):
    """No connection could be opened: the request was never sent."""


class ReadTimeout(TransportError):
    """The server sent nothing for longer than the read timeout."""


class RemoteProtocolError(TransportError):
    """The connection closed mid-answer, or the answer was not valid HTTP/1.1."""


class _Dropped(RemoteProtocolError):
    """A reused connection closed before any byte of the answer: safe to send again."""


class Response:
    """One answer, read as it arrives. ``aclose`` before the end closes the connection."""

    def __init__(self, conn: _Connection, status_code: int, headers: dict[str, str]):
        self.status_code = status_code
        self.headers = headers
        self._conn: _Connection | None = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._error: TransportError | None = None
        self._waiter: asyncio.Future | None = None

    # called by the connection
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake()

    def _finish(self, error: TransportError | None = None) -> None:
        if self._complete or self._error is not None:
            return
        if error is None:
            self._complete = True
        else:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # the reader's side
    async def _next(self) -> bytes | None:
        """Everything buffered so far as one piece; None at the end of the body."""
        while True:
            if self._chunks:
                data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                return data
            if self._error is not None:
                raise self._error
            if self._complete:
                return None
            conn = self._conn
            if conn is None:
                raise RemoteProtocolError("the response was closed")
            self._waiter = conn.loop.create_future()
            timer = conn.loop.call_later(conn.read_timeout, self._timeout, self._waiter)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None

    def _timeout(self, waiter: asyncio.Future) -> None:
        if not waiter.done() and self._conn is not None:
            self._conn.abort(ReadTimeout(f"no data from the server for {self._conn.read_timeout:g} s"))

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while (data := await self._next()) is not None:
            yield data

    async def aread(self) -> bytes:
        parts = []
        while (data := await self._next()) is not None:
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not self._complete:
            conn.abort(RemoteProtocolError("the response was closed before its end"))


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection, one exchange at a time."""

    def __init__(self, pool: _Pool):
        self.pool = pool
        self.loop = pool.loop
        self.read_timeout = pool.read_timeout
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.paused = False
        self.used = 0  # exchanges started on this connection
        self._head = bytearray()
        self._state = "idle"  # idle | head | length | chunk-size | chunk-data | chunk-end | trailer | close
        self._remaining = 0
        self._keep_alive = True
        self._got_bytes = False
        self._head_waiter: asyncio.Future | None = None
        self._whole = False  # the exchange's caller wants the answer once its body is in
        self._response: Response | None = None
        self._out: list[bytes] = []  # body pieces of the read being parsed, handed over at its end

    # ---------------------------------------------------------------- protocol callbacks

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self._state == "close":  # a body delimited by the end of the connection
            self._complete()
        elif self._state != "idle":
            why = f"{type(exc).__name__}: {exc}" if exc else "the server closed the connection"
            if not self._got_bytes and self.used > 1:
                self._fail(_Dropped(f"a reused connection was closed before any answer ({why})"))
            else:
                self._fail(RemoteProtocolError(f"the connection closed mid-answer ({why})"))

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self._parse(data)
        except RemoteProtocolError as exc:
            self.abort(exc)
        if self._out:
            self._hand_over()

    def pause_writing(self) -> None:  # the server is not reading our body yet; the transport buffers it
        pass

    # ---------------------------------------------------------------- the exchange

    async def send(self, head: bytes, body: bytes, whole: bool = False) -> Response:
        self.used += 1
        self._whole = whole
        self._state = "head"
        self._got_bytes = False
        self._head.clear()
        self._head_waiter = waiter = self.loop.create_future()
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        timer = self.loop.call_later(self.read_timeout, self._head_timeout, waiter)
        try:
            return await waiter
        except asyncio.CancelledError:  # the caller gave up: this exchange can never be finished
            self.abort(RemoteProtocolError("the request was cancelled"))
            raise
        finally:
            timer.cancel()
            if self._head_waiter is waiter:  # a short answer may be over and the next call started
                self._head_waiter = None

    def _head_timeout(self, waiter: asyncio.Future) -> None:
        if not waiter.done():
            self.abort(ReadTimeout(f"no answer from the server within {self.read_timeout:g} s"))

    def abort(self, error: TransportError) -> None:
        self._fail(error)
        self.closed = True
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.abort()

    def resume(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def _fail(self, error: TransportError) -> None:
        if self._out:  # what came before the failure is read first
            self._hand_over()
        self._state = "idle"
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        response, self._response = self._response, None
        if response is not None:
            response._finish(error)

    def _complete(self) -> None:
        if self._out:
            self._hand_over()
        self._state = "idle"
        if self.paused:  # the body is buffered in the response; the socket may serve the next call
            self.resume()
        response, self._response = self._response, None
        if response is not None:
            response._finish()
            response._conn = None
            waiter, self._head_waiter = self._head_waiter, None
            if waiter is not None and not waiter.done():  # a whole answer: handed over now, complete
                waiter.set_result(response)
        if self._keep_alive and not self.closed:
            self.pool.release(self)
        elif not self.closed:
            self.closed = True
            self.transport.close()

    # ---------------------------------------------------------------- parsing

    def _parse(self, data: bytes) -> None:
        """Feed one read. Lines (the head, chunk sizes, trailers) are found in the read
        itself; only a line cut by the end of a read is kept (``_head``) and completed by
        the next one, so a read of many small chunks costs no copying beyond each piece."""
        buf = self._head  # a partial status/header block, chunk-size line or trailer
        raw, pos, n = data, 0, len(data)
        while True:
            state = self._state
            if state == "length" or state == "chunk-data":
                take = min(self._remaining, n - pos)
                if take:
                    self._emit(raw if take == n else raw[pos:pos + take])
                    pos += take
                    self._remaining -= take
                if self._remaining:
                    return
                if state == "length":
                    self._complete()
                else:
                    self._state, self._remaining = "chunk-end", 2
            elif state == "chunk-end":
                take = min(self._remaining, n - pos)
                if raw[pos:pos + take] != b"\r\n"[2 - self._remaining:2 - self._remaining + take]:
                    raise RemoteProtocolError("a chunk is not followed by CRLF")
                pos += take
                self._remaining -= take
                if self._remaining:
                    return
                self._state = "chunk-size"
            elif state == "close":
                if pos < n:
                    self._emit(raw[pos:])
                return
            elif state == "idle":
                if pos < n:
                    raise RemoteProtocolError(f"the server sent {n - pos} bytes outside an answer")
                return
            else:  # head, chunk-size, trailer: delimited by CRLFs
                if state == "chunk-size" and not buf:
                    pos = self._whole_chunks(raw, pos, n)
                if buf:  # the rest of a line the previous read cut
                    buf += raw[pos:]
                    raw, pos, n = bytes(buf), 0, len(buf)
                    buf.clear()
                if state == "trailer" and raw.startswith(b"\r\n", pos):
                    end, cut = pos, pos + 2
                else:
                    term = b"\r\n\r\n" if state == "head" else b"\r\n"
                    end = raw.find(term, pos)
                    if (end if end >= 0 else n) - pos > (_MAX_HEAD if state == "head" else 8192):
                        raise RemoteProtocolError(f"the answer's {state} exceeds its size limit")
                    if end < 0:
                        buf += raw[pos:]
                        return
                    cut = end + len(term)
                line, pos = raw[pos:end], cut
                if state == "head":
                    self._on_head(line)
                elif state == "trailer":
                    if not line:
                        self._complete()
                else:
                    size_text = line.split(b";", 1)[0].strip()
                    try:
                        size = int(size_text, 16)
                    except ValueError:
                        size = -1
                    if size < 0:
                        raise RemoteProtocolError(f"invalid chunk size {size_text[:40]!r}")
                    if size == 0:
                        self._state = "trailer"
                    else:
                        self._state, self._remaining = "chunk-data", size

    def _whole_chunks(self, raw: bytes, pos: int, n: int) -> int:
        """Take the plain chunks (a size line, the data, CRLF) that this read holds whole,
        from ``pos``; return where the first other one starts (cut by the read, the last
        chunk, a size with extensions): the state machine reads that one. A backend streams
        one SSE event per chunk, and a read often holds many."""
        out = self._out
        while True:
            end = raw.find(b"\r\n", pos, pos + 18)
            if end < 0:
                return pos
            try:
                size = int(raw[pos:end], 16)
            except ValueError:
                return pos
            start = end + 2
            stop = start + size
            if size <= 0 or stop + 2 > n:
                return pos
            if raw[stop:stop + 2] != b"\r\n":
                raise RemoteProtocolError("a chunk is not followed by CRLF")
            out.append(raw[start:stop])
            pos = stop + 2

    def _on_head(self, block: bytes) -> None:
        lines = block.split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1.") or not status_line[1].isdigit():
            raise RemoteProtocolError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        status = int(status_line[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise RemoteProtocolError(f"invalid header line: {line[:80]!r}")
            key = name.strip().lower().decode("latin-1")
            value_s = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {value_s}" if key in headers else value_s
        if 100 <= status < 200:  # 100 Continue and friends: the real answer follows
            return
        self._keep_alive = (status_line[0] == b"HTTP/1.1"
                            and "close" not in headers.get("connection", "").lower())
        response = Response(self, status, headers)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = "chunk-size"
        elif "content-length" in headers:
            try:
                self._remaining = int(headers["content-length"])
            except ValueError:
                raise RemoteProtocolError(f"invalid content-length {headers['content-length'][:40]!r}") from None
            self._state = "length"
        elif status in (204, 304):
            self._state, self._remaining = "length", 0
        else:
            self._state, self._keep_alive = "close", False
        self._response = response
        if not self._whole:  # the caller reads the body as it comes: it gets the response now
            waiter, self._head_waiter = self._head_waiter, None
            if waiter is not None and not waiter.done():
                waiter.set_result(response)
        if self._state == "length" and self._remaining == 0:
            self._complete()

    def _emit(self, piece: bytes) -> None:
        if piece:
            self._out.append(piece)

    def _hand_over(self) -> None:
        """Give the response what this read brought, as one piece (one wake-up of its reader)."""
        out, self._out = self._out, []
        response = self._response
        if response is None:
            return
        response._feed(out[0] if len(out) == 1 else b"".join(out))
        # (a whole answer is read to its end before anyone reads it: never paused)
        if response._buffered > _HIGH_WATER and not self._whole and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()


class _Pool:
    """Idle keep-alive connections to one origin, most recently used first."""

    def __init__(self, client: Http1Client, host: str, port: int, tls: bool):
        self.loop = asyncio.get_running_loop()
        self.client = client
        self.host = host
        self.port = port
        self.tls = tls
        self.read_timeout = client.read_timeout
        self.idle: list[_Connection] = []
        self.host_header = host if port in (80, 443) else f"{host}:{port}"

    async def connect(self) -> _Connection:
        conn = _Connection(self)
        kwargs = {"ssl": self.client.ssl_context, "server_hostname": self.host} if self.tls else {}
        try:
            await asyncio.wait_for(self.loop.create_connection(lambda: conn, self.host, self.port, **kwargs),
                                   self.client.connect_timeout)
        except asyncio.TimeoutError:
            raise ConnectError(f"could not connect to {self.host}:{self.port} "
                               f"within {self.client.connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(f"could not connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        return conn

    def take(self) -> _Connection | None:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        return None

    def release(self, conn: _Connection) -> None:
        if len(self.idle) < self.client.max_idle_per_origin and not self.client.closed:
            self.idle.append(conn)
        else:
            conn.closed = True
            conn.transport.close()

    def forget(self, conn: _Connection) -> None:
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def close(self) -> None:
        for conn in self.idle:
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


class Http1Client:
    """POST to ``http://`` or ``https://`` URLs over pooled HTTP/1.1 connections."""

    def __init__(self, *, connect_timeout: float = 5.0, read_timeout: float = 600.0,
                 max_idle_per_origin: int = 256, ssl_context: ssl.SSLContext | None = None):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle_per_origin = max_idle_per_origin
        self._ssl_context = ssl_context
        self._pools: dict[tuple[str, int, bool], _Pool] = {}
        self._targets: dict[str, tuple[_Pool, bytes]] = {}
        self.closed = False

    @property
    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        return self._ssl_context

    def _target(self, url: str) -> tuple[_Pool, bytes]:
        hit = self._targets.get(url)
        if hit is not None:
            return hit
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConnectError(f"unsupported upstream URL {url!r}: use http:// or https://")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        key = (parts.hostname, port, tls)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(self, parts.hostname, port, tls)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if len(self._targets) > 1024:
            self._targets.clear()
        hit = self._targets[url] = (pool, target.encode("latin-1"))
        return hit

    async def post(self, url: str, body: bytes, headers: dict[str, str] | None = None, *,
                   whole: bool = False) -> Response:
        """Send ``body``; return as soon as the answer's status and headers are in, or with
        ``whole`` once its body is in too (one wake-up of the caller for an answer a server
        writes in pieces, as uvicorn writes a head and then its body)."""
        if self.closed:
            raise ConnectError("the upstream client is closed")
        pool, target = self._target(url)
        head = bytearray(b"POST " + target + b" HTTP/1.1\r\nhost: " + pool.host_header.encode("latin-1")
                         + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n")
        for name, value in (headers or {"content-type": "application/json"}).items():
            head += f"{name}: {value}\r\n".encode("latin-1")
        head += b"\r\n"
        conn = pool.take()
        if conn is not None:
            try:
                return await conn.send(bytes(head), body, whole)
            except _Dropped:
                pass  # the server had closed it while idle; it never read the request
        conn = await pool.connect()
        return await conn.send(bytes(head), body, whole)

    async def aclose(self) -> None:
        self.closed = True
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._targets.clear()
