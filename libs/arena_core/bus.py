"""NATS JetStream helpers on nats-py: connect, declare the topology, publish idempotently, consume.

The ack policy lives here and only here:

- the handler returns            -> ``ack``
- it raises ``Retryable``        -> ``nak(delay)``
- it raises ``Permanent`` or the message does not decode
                                 -> dead letter to ``arena.dead.{stream}``, then ``term``
- it raises anything else        -> ``nak`` with backoff, and dead letter + ``term`` on the
                                    last allowed delivery.

Long handlers keep their message alive with ``in_progress`` heartbeats.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar
from urllib.parse import unquote, urlparse

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import AuthorizationError, ConnectionClosedError, OutboundBufferLimitError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.api import PubAck
from nats.js.errors import APIError, BadRequestError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from arena_core import subjects, telemetry
from arena_core.batching import BatchFailed, Batcher, NotBatched
from arena_core.packing import NotPacked, PackFailed, Packer
from arena_core.errors import Permanent, Retryable, Unavailable
from arena_core.schemas import DeadLetter, Packed, encode

log = logging.getLogger("arena_core.bus")

T = TypeVar("T")

#: JetStream de-duplication window: a re-publish with the same Nats-Msg-Id inside it
#: is dropped by the server.
DUPLICATE_WINDOW_S = 120.0


#: Seconds a JetStream publish waits for its ``PubAck`` before ``Bus.publish`` tries again.
PUBLISH_TIMEOUT_S = 5.0


class PublishRefused(Permanent):
    """JetStream refused a publish: no stream takes the subject, or a check the message
    asked for failed (``Nats-Expected-*``); ``code``: JetStream's error code (0 for no stream).
    Publishing again cannot help, so ``Bus.publish`` raises it at once."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


class TopologyError(Unavailable):
    """A stream, KV bucket or object store cannot be declared as asked (e.g. with more
    replicas than the NATS servers can hold), or one a service binds to does not exist (the
    topology step has not run); the message names it and the reason. ``Unavailable``: the CLI
    and the APIs say it in one line (503), never with a traceback."""


def topology_replicas() -> int:
    """``ARENA_NATS_REPLICAS`` (``Settings.nats_replicas``), else 1."""
    raw = os.environ.get("ARENA_NATS_REPLICAS", "").strip()
    try:
        return int(raw) if raw else 1
    except ValueError:
        raise TopologyError(f"ARENA_NATS_REPLICAS={raw!r} is not an integer") from None


def _replicas_refused(name: str, replicas: int, exc: APIError) -> str:
    return (f"JetStream refused stream {name} with {replicas} replica(s) (ARENA_NATS_REPLICAS): "
            f"{exc.description or exc} (error {exc.err_code}); a single nats-server holds 1, "
            f"a cluster at most as many as it has servers")


class Bus:
    """A connection to NATS with JetStream (nats-py), owned by one service.

    ``nc`` reconnects for ever after a drop; what it publishes meanwhile is buffered (up to
    nats-py's ``pending_size``) and sent once it is back."""

    def __init__(self, nc: NATS, js: JetStreamContext, service: str, *, url: str):
        self.nc = nc
        self.js = js
        self.service = service
        self.url = url
        self._kv: dict[str, Any] = {}
        #: JetStream replicas of what ``ensure_topology`` declares (and ``kv``/``artifacts`` create)
        self.replicas = topology_replicas()
        self.closing = False
        self.publish_timeout = PUBLISH_TIMEOUT_S  # per attempt of ``publish``
        #: streams whose publishes go out in atomic batches (``arena_core.batching``): those
        #: ``ensure_topology`` found allowing them; a stream's ``Batcher``
        self.batchers: dict[str, Batcher] = {}
        #: streams whose publishes made together go out as one ``Pack`` (``arena_core.packing``):
        #: those of ``subjects.STREAMS`` with a pack subject, once ``ensure_topology`` declared them
        self.packers: dict[str, Packer] = {}
        #: Set when nats-py closed the connection for good without ``close`` (a protocol error
        #: from the server is final to it): the service must exit non-zero for its supervisor.
        self.lost = asyncio.Event()

    @classmethod
    async def connect(cls, url: str, service: str, *, connect_timeout: float = 10.0,
                      tls: ssl.SSLContext | None = None) -> Bus:
        """Connect to ``url`` (comma-separated servers; ``tls://`` or a server that requires
        TLS: verified with ``tls``, else the system's CAs), trying for up to
        ``connect_timeout`` seconds while no server answers. A refusal that trying again
        cannot cure (authorization, a certificate that does not verify) fails at once.
        Raises ``Unavailable`` with the reason (never the URL's credentials)."""
        holder: list[Bus] = []
        loop = asyncio.get_running_loop()
        fatal: asyncio.Future = loop.create_future()  # a refusal during the first connect
        errors: list[BaseException] = []

        async def on_error(exc: Exception) -> None:
            if not holder:  # still connecting
                errors.append(exc)
                if _refused(exc) and not fatal.done():
                    fatal.set_result(exc)
                return
            log.warning("nats error: %s", exc)

        async def on_disconnect() -> None:
            if holder and not holder[0].closing:
                log.warning("nats disconnected")

        async def on_reconnect() -> None:
            log.info("nats reconnected")

        async def on_closed() -> None:
            if holder and not holder[0].closing:
                log.error("the NATS connection is closed for good (%s); the %s service must restart",
                          nc.last_error or "no error given", service)
                holder[0].lost.set()

        servers, credentials = split_url(url)
        nc = NATS()
        connecting = asyncio.ensure_future(nc.connect(
            servers,
            **credentials,
            name=f"arena-{service}",
            max_reconnect_attempts=-1,  # for ever, the first connection too: bounded by the wait below
            reconnect_time_wait=0.5,
            connect_timeout=2,
            # a partition (nothing arrives, the socket stays open) is found within ~15 s
            ping_interval=5,
            max_outstanding_pings=3,
            tls=tls,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            closed_cb=on_closed,
        ))
        await asyncio.wait({connecting, fatal}, timeout=connect_timeout, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done() or connecting.exception() is not None:
            reason = fatal.result() if fatal.done() else (
                connecting.exception() if connecting.done() else (errors[-1] if errors else "timed out"))
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - never connected: nothing to flush
                pass
            what = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else reason
            raise Unavailable(f"cannot connect to NATS at {redact(url)}: {what}")
        fatal.cancel()
        bus = cls(nc, nc.jetstream(timeout=10), service, url=url)
        holder.append(bus)
        return bus

    def watch(self) -> LostWatch:
        """A runner for ``arena_core.runtime.serve`` that fails once the connection is lost for
        good, so the service exits non-zero and its supervisor restarts it."""
        return LostWatch(self)

    async def publisher(self) -> JetStreamContext:
        """The JetStream context ``publish`` goes through (nats-py's ``self.js``)."""
        return self.js

    async def close(self) -> None:
        """Flush what was published and close. (Acks are explicit, so nothing in flight
        is lost: an unacked message is redelivered to the next worker.)"""
        self.closing = True
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.flush(), 2)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            try:
                await self.nc.close()
            except OSError as exc:  # the server is gone (nats-py drains the socket on close)
                log.debug("closing the %s bus: %s", self.service, exc)

    # ----------------------------------------------------------------- topology

    async def ensure_topology(self, replicas: int | None = None) -> None:
        """Create every stream, KV bucket and object store, each with ``replicas`` copies
        (JetStream ``num_replicas``; default ``ARENA_NATS_REPLICAS``, else 1). Idempotent.
        The topology step's, with the administrator's credentials (``arena_stack.topology``):
        a service's own user may not create, update or delete streams, it binds
        (``bind_topology``).

        One that exists with another replica count is scaled to ``replicas`` (a cluster moves
        its data); if JetStream refuses (a single server cannot hold more than 1, a cluster
        has too few servers), ``TopologyError`` says which one and why."""
        replicas = topology_replicas() if replicas is None else replicas
        if replicas < 1:
            raise TopologyError(f"replicas must be >= 1, got {replicas}")
        self.replicas = replicas
        for spec in subjects.STREAMS:
            config = jsapi.StreamConfig(
                name=spec.name,
                description=spec.description,
                subjects=list(spec.subjects),
                retention=(
                    jsapi.RetentionPolicy.WORK_QUEUE
                    if spec.retention == "workqueue"
                    else jsapi.RetentionPolicy.LIMITS
                ),
                storage=jsapi.StorageType.FILE,
                duplicate_window=DUPLICATE_WINDOW_S,
                max_age=spec.max_age_s or None,
                num_replicas=replicas,
                allow_atomic=True,  # batched publishes (nats-server 2.12+; older ones ignore it)
                allow_direct=True,  # reads by subject from any replica (a group's members, by TrajectoryStream)
            )
            try:
                try:
                    await self.js.add_stream(config)
                except BadRequestError:  # it exists with another configuration: make it this one
                    await self.js.update_stream(config)
            except ServiceUnavailableError:  # JetStream not ready (no leader yet): not a refusal
                raise
            except APIError as exc:
                raise TopologyError(_replicas_refused(spec.name, replicas, exc)) from exc
        for bucket in subjects.KV_BUCKETS:
            try:
                await self.js.key_value(bucket)
            except (NotFoundError, nats.js.errors.BucketNotFoundError):
                try:
                    await self.js.create_key_value(jsapi.KeyValueConfig(
                        bucket=bucket, history=1, storage=jsapi.StorageType.FILE, replicas=replicas,
                        ttl=subjects.KV_TTL_S.get(bucket)))
                except ServiceUnavailableError:
                    raise
                except APIError as exc:
                    raise TopologyError(_replicas_refused(f"KV_{bucket}", replicas, exc)) from exc
            await self._scale(f"KV_{bucket}", replicas)
        for store in subjects.OBJECT_STORES:
            try:
                await self.js.object_store(store)
            except (NotFoundError, nats.js.errors.BucketNotFoundError):
                try:
                    await self.js.create_object_store(
                        store, config=jsapi.ObjectStoreConfig(storage=jsapi.StorageType.FILE, replicas=replicas))
                except ServiceUnavailableError:
                    raise
                except APIError as exc:
                    raise TopologyError(_replicas_refused(f"OBJ_{store}", replicas, exc)) from exc
            await self._scale(f"OBJ_{store}", replicas)
        await self.bind_topology([spec.name for spec in subjects.STREAMS])

    async def bind_topology(self, streams: Sequence[str]) -> None:
        """Check that ``streams`` (a service's: ``arena_core.access``; buckets' and stores' too)
        exist, and publish to them as they allow (atomic batches, packs). Creates nothing: one
        that is missing raises ``TopologyError`` naming it and the step that creates it."""
        for name in streams:
            try:
                info = await self.js.stream_info(name)
            except NotFoundError:
                raise self._missing(f"the JetStream stream {name}") from None
            spec = next((s for s in subjects.STREAMS if s.name == name), None)
            if spec is None:
                continue
            if info.config.allow_atomic:
                self.batchers.setdefault(name, Batcher(self.nc, timeout=self.publish_timeout))
            if spec.packs and spec.packs in (info.config.subjects or []):
                self.packers.setdefault(name, Packer(self.js, spec.packs, timeout=self.publish_timeout,
                                                     max_bytes=self.nc.max_payload - BODY_HEADROOM))

    async def _scale(self, stream: str, replicas: int) -> None:
        """Give ``stream`` (a bucket's) ``replicas`` copies if it has another count."""
        info = await self.js.stream_info(stream)
        if (info.config.num_replicas or 1) == replicas:
            return
        log.warning("stream %s has %s replicas; scaling it to %d", stream, info.config.num_replicas or 1, replicas)
        try:
            await self.js.update_stream(info.config.evolve(num_replicas=replicas))
        except ServiceUnavailableError:
            raise
        except APIError as exc:
            raise TopologyError(_replicas_refused(stream, replicas, exc)) from exc

    def _missing(self, what: str) -> TopologyError:
        return TopologyError(f"{what} does not exist on {redact(self.url)}: the topology step creates it with the "
                             f"administrator's credentials (`arena up` does; compose's topology service, "
                             f"Kubernetes' arena-topology Job, or `python -m arena_stack.topology`)")

    async def kv(self, bucket: str):
        """The KV bucket ``bucket``, bound (never created: ``TopologyError`` when it is missing)."""
        if bucket not in self._kv:
            try:
                self._kv[bucket] = await self.js.key_value(bucket)
            except (NotFoundError, nats.js.errors.BucketNotFoundError):
                raise self._missing(f"the KV bucket {bucket}") from None
        return self._kv[bucket]

    async def artifacts(self):
        """The object store ``arena_artifacts``, bound (never created)."""
        return await self.objects(subjects.OBJECT_ARTIFACTS)

    async def objects(self, store: str):
        """The object store ``store`` (``subjects.OBJECT_STORES``), bound (never created)."""
        try:
            return await self.js.object_store(store)
        except (NotFoundError, nats.js.errors.BucketNotFoundError):
            raise self._missing(f"the object store {store}") from None

    # ----------------------------------------------------------------- publish

    async def publish(
        self,
        subject: str,
        message: Any,
        *,
        msg_id: str,
        headers: dict[str, str] | None = None,
        attempts: int = 20,
    ) -> PubAck:
        """Publish ``message`` with ``Nats-Msg-Id`` and the current trace context and wait
        for the stream's ``PubAck`` (nats-py's ``js.publish``).

        A publish that gets no answer (a NATS restart: the connection reconnects and sends
        what it buffered) is tried again, up to ``attempts`` times in all, then
        ``Unavailable``; a duplicate inside the de-duplication window is acknowledged by the
        server and dropped (``PubAck.duplicate``), so trying again is safe. A body over the
        server's ``max_payload`` goes to the object store first. A refusal by JetStream (no
        stream takes the subject, a failed ``Nats-Expected-*`` check) raises
        ``PublishRefused`` at once.
        """
        data = message if isinstance(message, bytes) else encode(message)
        extra = telemetry.inject(dict(headers) if headers else {})  # besides its id: trace context
        stream = (subjects.stream_of(subject) or "") if self.batchers or self.packers else ""
        expects = bool(headers) and any(k.startswith("Nats-Expected") for k in headers)
        packer = self.packers.get(stream)
        if packer is not None and subject != packer.subject and packer.fits(data) and not expects:
            try:  # with the publishes of this loop turn to the same stream: one message
                return await packer.publish(subject, data, msg_id, extra)
            except NotPacked:
                pass
            except PackFailed as exc:
                log.debug("publish to %s: %s; publishing it alone", subject, exc)
        hdrs = extra
        hdrs["Nats-Msg-Id"] = msg_id
        batcher = self.batchers.get(stream)
        if batcher is not None and len(data) <= self.nc.max_payload - BODY_HEADROOM and not expects:
            try:  # with the publishes of this loop turn to the same stream: one commit
                return await batcher.publish(subject, data, hdrs)
            except NotBatched:
                pass
            except BatchFailed as exc:
                log.debug("publish to %s: %s; publishing it alone", subject, exc)
        delay = 0.1
        for attempt in range(1, attempts + 1):
            try:
                if len(data) > self.nc.max_payload - BODY_HEADROOM:
                    # too big for one message: the body goes to the object store first,
                    # the message carries its name (readers: ``Bus.body``)
                    name = body_object_name(msg_id)
                    await self._put_body(name, data)
                    return await self.js.publish(subject, b"", timeout=self.publish_timeout,
                                                 headers={**hdrs, BODY_OBJECT_HEADER: name})
                return await self.js.publish(subject, data, timeout=self.publish_timeout, headers=hdrs)
            except NoStreamResponseError as exc:
                # no stream answered: none takes the subject, or one is between leaders
                if await self._no_stream_takes(subject):
                    raise PublishRefused(f"cannot publish to {subject}: no stream takes this subject") from exc
                error: Exception = exc
            except ServiceUnavailableError as exc:  # JetStream is there but not ready (e.g. starting)
                error = exc
            except APIError as exc:
                raise PublishRefused(f"JetStream refused the publish to {subject}: "
                                     f"{exc.description or exc} (error {exc.err_code})", exc.err_code or 0) from exc
            except ConnectionClosedError as exc:
                raise Unavailable(f"publish to {subject}: the {self.service} bus's NATS connection is closed") from exc
            except (NatsTimeout, asyncio.TimeoutError, OutboundBufferLimitError, Unavailable) as exc:
                error = exc
            if attempt == attempts or self.closing:
                raise Unavailable(f"publish to {subject} failed after {attempt} attempts: "
                                  f"{type(error).__name__}: {error}") from error
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")

    async def _no_stream_takes(self, subject: str) -> bool:
        """Whether JetStream says that no stream takes ``subject`` (``False`` when it cannot say now)."""
        try:
            await self.js.find_stream_name_by_subject(subject)
        except NotFoundError:
            return True
        except Exception:  # noqa: BLE001 - no answer now: treat it as a passing outage
            return False
        return False

    async def _put_body(self, name: str, data: bytes) -> None:
        try:
            store = await self.artifacts()
            await store.put(name, data)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise Unavailable(f"cannot store a {len(data)}-byte message body as {name}: {exc}") from exc

    async def body(self, msg: Any) -> bytes:
        """The body of a consumed message (a nats-py ``Msg`` or a stream message read by
        sequence): its data, or, when the publisher stored it in the
        object store because it was over ``max_payload``, that object. Raises
        ``BodyMissing`` if the object is gone, ``Unavailable`` if it cannot be read now."""
        name = body_object(msg)
        if name is None:
            return msg.data
        try:
            return await self.read_object(name)
        except nats.js.errors.ObjectNotFoundError as exc:
            raise BodyMissing(f"the message body {name} is not in {subjects.OBJECT_ARTIFACTS}") from exc
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise Unavailable(f"cannot read the message body {name}: {exc}") from exc

    async def read_object(self, name: str) -> bytes:
        """The object ``name`` of ``arena_artifacts``, its chunks written as they arrive into
        one buffer of its size that becomes the result (``ObjectStore.get`` joins them as
        ``bytes``, copying the whole object again for each chunk; with ``writeinto`` it hands
        each to a thread, and the chunks not written yet queue up). Raises nats-py's errors
        (``ObjectNotFoundError``, ``DigestMismatchError``, timeouts)."""
        store = await self.artifacts()
        info = await store.get_info(name)
        if info.is_link() or not info.nuid:
            return (await store.get(name)).data or b""
        if not info.size:
            return b""
        sink = io.BytesIO()
        sink.seek(info.size - 1)
        sink.write(b"\0")  # the whole buffer at once: no reallocation (and copy) as it fills
        sink.seek(0)
        digest = hashlib.sha256()
        got = 0
        sub = await self.js.subscribe(f"$O.{subjects.OBJECT_ARTIFACTS}.C.{info.nuid}", ordered_consumer=True)
        try:
            while got < info.size:
                chunk = (await sub.next_msg(timeout=self.publish_timeout)).data
                if got + len(chunk) > info.size:
                    break
                sink.write(chunk)
                digest.update(chunk)
                got += len(chunk)
                del chunk
        finally:
            await sub.unsubscribe()
        expected = (info.digest or "").replace("SHA-256=", "").replace("sha-256=", "")
        if got != info.size or (expected and base64.urlsafe_b64decode(expected) != digest.digest()):
            raise nats.js.errors.DigestMismatchError
        return sink.getvalue()

    async def publish_parts(self, subject: str, parts: Sequence[bytes | memoryview], *, msg_id: str) -> PubAck:
        """``publish`` of the concatenation of ``parts`` (a message's JSON around a large piece
        held apart, e.g. an agent's diff): over ``max_payload`` the parts are written to the
        object store one after the other, never joined into one more copy of the whole."""
        size = sum(len(part) for part in parts)
        if size <= self.nc.max_payload - BODY_HEADROOM:
            return await self.publish(subject, b"".join(parts), msg_id=msg_id)
        name = body_object_name(msg_id)
        try:
            store = await self.artifacts()
            await store.put(name, PartsReader(parts))
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise Unavailable(f"cannot store a {size}-byte message body as {name}: {exc}") from exc
        return await self.publish(subject, b"", msg_id=msg_id, headers={BODY_OBJECT_HEADER: name})

    async def dead_letter(self, *, stream: str, msg: Msg, consumer: str, error: str,
                          packed: tuple[int, Packed] | None = None) -> None:
        """Dead-letter ``msg``, or (``packed``: its index and itself) one message of the pack ``msg``."""
        meta = msg.metadata
        letter = DeadLetter(
            stream=stream,
            subject=packed[1].subject if packed else msg.subject,
            consumer=consumer,
            error=error,
            num_delivered=meta.num_delivered,
            data=packed[1].data if packed else msg.data,
            at=time.time(),
            body_object=None if packed else body_object(msg),
        )
        await self.publish(
            subjects.dead(stream),
            letter,
            msg_id=f"dead:{stream}:{consumer}:{meta.sequence.stream}" + (f":{packed[0]}" if packed else ""),
        )


class LostWatch:
    """Ends with ``Unavailable`` when the bus's connection is closed for good; quietly on ``stop``."""

    durable = "nats connection"

    def __init__(self, bus: Bus):
        self.bus = bus

    async def run(self, stop: asyncio.Event) -> None:
        waits = {asyncio.create_task(self.bus.lost.wait()), asyncio.create_task(stop.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        if self.bus.lost.is_set() and not stop.is_set():
            raise Unavailable(f"the {self.bus.service} bus's NATS connection is closed for good "
                              f"({self.bus.nc.last_error or 'no error given'})")


#: A message whose body is in the ``arena_artifacts`` object store names it in this header
#: and has an empty payload (bodies over the server's ``max_payload``).
BODY_OBJECT_HEADER = "Arena-Body-Object"
#: Room left in a message for its headers before the body goes to the object store.
BODY_HEADROOM = 16 * 1024


class BodyMissing(Permanent):
    """A message names a body in the object store that is not there (deleted)."""


def split_url(url: str) -> tuple[list[str], dict[str, str]]:
    """``url``'s servers (comma-separated) and the credentials they carry, decoded
    (``nats://user:p%40ss@host``): ``user``/``password`` or ``token`` for nats-py, which
    takes a URL's user info as it is. Servers with different credentials keep their own."""
    servers, found = [], set()
    for one in (u.strip() for u in url.split(",")):
        if not one:
            continue
        parsed = urlparse(one if "://" in one else f"nats://{one}")
        if parsed.username is not None:
            found.add((unquote(parsed.username), None if parsed.password is None else unquote(parsed.password)))
        servers.append(one)
    if len(found) != 1:
        return servers, {}
    (user, password), = found
    credentials = {"token": user} if password is None else {"user": user, "password": password}
    return [redact(one) for one in servers], credentials


def _refused(exc: BaseException) -> bool:
    """A connect error that trying again cannot cure: the server refused the credentials,
    or its certificate does not verify."""
    return (isinstance(exc, (AuthorizationError, ssl.SSLCertVerificationError))
            or "authorization violation" in str(exc).lower())


def redact(url: str) -> str:
    """``url`` (comma-separated servers) without credentials, for messages and logs."""
    out = []
    for one in url.split(","):
        one = one.strip()
        parsed = urlparse(one if "://" in one else f"nats://{one}")
        if parsed.username is None and parsed.password is None:
            out.append(one)
            continue
        host = f"{parsed.hostname}:{parsed.port}" if parsed.port else str(parsed.hostname)
        out.append(parsed._replace(netloc=host).geturl())
    return ",".join(out)


class PartsReader(io.RawIOBase):
    """Buffers read one after the other as one stream (what ``ObjectStore.put`` takes), no
    copy of them made."""

    def __init__(self, parts: Sequence[bytes | memoryview]):
        self._parts = [memoryview(part).cast("B") for part in parts]
        self._index = 0
        self._at = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(out) and self._index < len(self._parts):
            part = self._parts[self._index]
            n = min(len(out) - filled, len(part) - self._at)
            out[filled:filled + n] = part[self._at:self._at + n]
            filled += n
            self._at += n
            if self._at == len(part):
                self._index += 1
                self._at = 0
        return filled


def body_object_name(msg_id: str) -> str:
    return f"bodies/{msg_id}"


def body_object(msg: Any) -> str | None:
    """The object-store name of ``msg``'s body, if the publisher put it there."""
    headers = msg.headers
    return headers.get(BODY_OBJECT_HEADER) if headers else None


class Delivery:
    """What a handler knows about the message besides its decoded body."""

    __slots__ = ("subject", "_msg")

    def __init__(self, msg: Msg):
        self.subject: str = msg.subject
        self._msg = msg

    @property
    def num_delivered(self) -> int:
        return self._msg.metadata.num_delivered

    @property
    def stream_seq(self) -> int:
        return self._msg.metadata.sequence.stream

    @property
    def headers(self) -> dict[str, str]:
        """A copy of the message's headers."""
        return dict(self._msg.headers or {})


class PackedDelivery(Delivery):
    """A message of a pack (``arena_core.packing``): its own subject and headers; its
    deliveries are the pack's."""

    __slots__ = ("_headers",)

    def __init__(self, msg: Msg, packed: Packed):
        super().__init__(msg)
        self.subject = packed.subject
        self._headers = {**packed.headers, "Nats-Msg-Id": packed.msg_id}

    @property
    def headers(self) -> dict[str, str]:
        return dict(self._headers)


Handler = Callable[[T, Delivery], Awaitable[None]]


async def settle(coro: Awaitable[None]) -> None:
    """Await an ack/nak/term/in_progress; a failure is logged, never raised: an unsettled
    message is redelivered, and every handler is idempotent."""
    try:
        await coro
    except Exception as exc:  # noqa: BLE001 - connection trouble
        log.warning("could not settle message: %s", exc)


class PullConsumer:
    """What every durable pull consumer shares: the consumer declaration, the retry
    backoff, dead-lettering and ``in_progress`` heartbeats. Subclasses fetch and handle."""

    def __init__(self, bus: Bus, *, stream: str, durable: str, filter_subjects: Sequence[str], message_type: Any,
                 max_deliver: int, ack_wait: float, max_backoff: float, max_ack_pending: int):
        self.bus = bus
        self.stream = stream
        self.durable = durable
        self.filter_subjects = list(filter_subjects)
        self.decoder = msgspec.json.Decoder(message_type)
        self.max_deliver = max_deliver
        self.ack_wait = ack_wait
        self.max_backoff = max_backoff
        self.max_ack_pending = max_ack_pending

    async def _subscribe(self):
        await self.declare()
        return await self.bus.js.pull_subscribe_bind(self.durable, self.stream)

    async def declare(self) -> None:
        """Create or update the durable consumer. Idempotent."""
        config = jsapi.ConsumerConfig(
            durable_name=self.durable,
            ack_policy=jsapi.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait,
            max_deliver=self.max_deliver,
            max_ack_pending=self.max_ack_pending,
            deliver_policy=jsapi.DeliverPolicy.ALL,
        )
        if len(self.filter_subjects) == 1:
            config.filter_subject = self.filter_subjects[0]
        else:
            config.filter_subjects = self.filter_subjects
        await self.bus.js.add_consumer(self.stream, config)

    def backoff(self, num_delivered: int) -> float:
        return min(2.0 ** num_delivered / 4, self.max_backoff)

    def last_delivery(self, msg: Msg) -> bool:
        return msg.metadata.num_delivered >= self.max_deliver

    async def _heartbeat(self, msgs: Sequence[Msg]) -> None:
        while True:
            await asyncio.sleep(self.ack_wait / 3)
            for msg in msgs:
                await settle(msg.in_progress())

    async def _dead(self, msg: Msg, error: str) -> None:
        try:
            await self.bus.dead_letter(stream=self.stream, msg=msg, consumer=self.durable, error=error)
        except Exception:  # noqa: BLE001 - keep the message for redelivery instead of losing it
            log.exception("could not dead-letter %s; leaving it for redelivery", msg.subject)
            return
        await settle(msg.term())


class Consumer(PullConsumer, Generic[T]):
    """A durable pull consumer that runs ``handler`` on each message with the ack policy."""

    def __init__(
        self,
        bus: Bus,
        *,
        stream: str,
        durable: str,
        filter_subjects: Sequence[str],
        message_type: type[T],
        handler: Handler[T],
        concurrency: int = 1,
        max_deliver: int = 5,
        ack_wait: float = 30.0,
        max_backoff: float = 30.0,
    ):
        super().__init__(bus, stream=stream, durable=durable, filter_subjects=filter_subjects,
                         message_type=message_type, max_deliver=max_deliver, ack_wait=ack_wait,
                         max_backoff=max_backoff, max_ack_pending=max(concurrency * 4, 64))
        self.handler = handler
        self.concurrency = concurrency
        self._tasks: set[asyncio.Task] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and handle messages until ``stop`` is set; then finish in-flight ones."""
        sub = None
        slots = asyncio.Semaphore(self.concurrency)
        while not stop.is_set():
            try:
                if sub is None:
                    sub = await self._subscribe()
                free = slots._value  # noqa: SLF001 - how many we can take now
                if free == 0:
                    await slots.acquire()
                    slots.release()
                    continue
                msgs = await sub.fetch(batch=free, timeout=1)
            except (NatsTimeout, asyncio.TimeoutError):
                continue
            except Exception as exc:  # noqa: BLE001 - server restarts surface as many types
                log.warning("fetch on %s failed, retrying: %s", self.durable, exc,
                            extra={"consumer": self.durable})
                sub = None
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await slots.acquire()
                task = asyncio.create_task(self._process(msg, slots))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _process(self, msg: Msg, slots: asyncio.Semaphore) -> None:
        delivery = Delivery(msg)
        extra = {"subject": msg.subject, "consumer": self.durable}
        beat = asyncio.create_task(self._heartbeat([msg]))
        try:
            try:
                body = self.decoder.decode(await self.bus.body(msg))
            except msgspec.DecodeError as exc:
                raise Permanent(f"undecodable message: {exc}") from exc
            with telemetry.span_from_headers(f"handle {self.durable}", delivery.headers, subject=msg.subject):
                await self.handler(body, delivery)
        except Retryable as exc:
            log.info("retrying %s in %.1fs: %s", msg.subject, exc.delay, exc, extra=extra)
            await settle(msg.nak(delay=exc.delay))
        except Permanent as exc:
            log.error("dead-lettering %s: %s", msg.subject, exc, extra=extra)
            await self._dead(msg, str(exc))
        except Exception as exc:  # noqa: BLE001 - any handler bug must not kill the worker
            if self.last_delivery(msg):
                log.exception("dead-lettering %s after %d deliveries", msg.subject, delivery.num_delivered,
                              extra=extra)
                await self._dead(msg, f"{type(exc).__name__}: {exc}")
            else:
                delay = self.backoff(delivery.num_delivered)
                log.warning("handler failed on %s (delivery %d), retrying in %.1fs: %s: %s",
                            msg.subject, delivery.num_delivered, delay, type(exc).__name__, exc, extra=extra)
                await settle(msg.nak(delay=delay))
        else:
            await settle(msg.ack())
        finally:
            beat.cancel()
            slots.release()


async def run_consumers(consumers: Sequence[Consumer], stop: asyncio.Event) -> None:
    await asyncio.gather(*(c.run(stop) for c in consumers))


async def follow_kv(kv, stop: asyncio.Event, on_entry: Callable[[Any], None],
                    on_ready: Callable[[], None] | None = None) -> None:
    """Call ``on_entry`` with every entry of a KV bucket, then with each change, until
    ``stop``; ``on_ready`` once the initial values are all in."""
    watcher = await kv.watchall()
    try:
        while not stop.is_set():
            try:
                entry = await watcher.updates(timeout=1.0)
            except Exception:  # noqa: BLE001 - nats TimeoutError: nothing changed
                continue
            if entry is None:  # the initial values are all in
                if on_ready is not None:
                    on_ready()
                continue
            on_entry(entry)
    finally:
        await watcher.stop()
