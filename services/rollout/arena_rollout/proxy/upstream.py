"""Sending one call to a backend replica: queueing, failover, error mapping, ``/tokenize``.

``UpstreamClient`` is an aiohttp session (pooled keep-alive connections); ``open_call``
sends a call on a slot the router grants (failing over to another replica) and
``count_prompt`` asks the serving replica for a prompt's exact token count. Why aiohttp
and what it costs: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from arena_core.errors import UpstreamError, UpstreamRejected
from arena_core.schemas import Failover

from arena_rollout.proxy.routing import Router, Slot

log = logging.getLogger("arena.rollout.proxy")

#: Statuses after which another replica is tried (and the replica marked down for the last three).
_RETRY = {500, 502, 503, 504}
_DOWN = {502, 503, 504}
_JSON = {"Content-Type": "application/json"}

#: What a failed exchange with a replica raises: no connection, a connection that broke
#: (before or mid-answer), an answer that is not HTTP, a timeout.
TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def describe(exc: BaseException) -> str:
    """An exchange's failure, for failovers, logs and the agent's error."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class UpstreamClient:
    """The proxy's HTTP client for its backends: one aiohttp session, opened on first use.

    Connections are pooled per origin and kept alive; the pool is not bounded here (each
    replica's in-flight bound is the router's). ``read_timeout`` bounds each wait for
    data, not a whole answer (a long generation streams for minutes)."""

    def __init__(self, *, connect_timeout: float = 5.0, read_timeout: float = 600.0):
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                timeout=self.timeout, cookie_jar=aiohttp.DummyCookieJar(),
                # the answer is relayed as it came: no compression asked for
                skip_auto_headers=("Accept-Encoding", "User-Agent"), auto_decompress=False)
        return self._session

    async def post(self, url: str, body: bytes, *,
                   timeout: aiohttp.ClientTimeout | None = None) -> aiohttp.ClientResponse:
        """POST a JSON ``body``; the response once its status and headers are in. A
        connection the server closed unanswered (an idle keep-alive one it timed out as
        the request went) is tried once more: the server never read the request."""
        session = self.session
        for attempt in (1, 2):
            try:
                if timeout is None:
                    return await session.request("POST", url, data=body, headers=_JSON)
                return await session.request("POST", url, data=body, headers=_JSON, timeout=timeout)
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class Upstream:
    """An open answer from one replica; ``close`` frees its in-flight slot (once). A whole
    answer's ``body`` is read already; a stream is read with ``chunks``. ``queued_ms``: the
    call's waits for a slot (all its tries); ``off_clock_ms``: the part its rollout's wall
    clock leaves out (``Slot``)."""

    __slots__ = ("replica", "response", "body", "queued_ms", "off_clock_ms", "sent_at", "failovers", "_slot",
                 "_closed")

    def __init__(self, *, slot: Slot, response: aiohttp.ClientResponse, body: bytes | None,
                 queued_ms: float, off_clock_ms: float, sent_at: float, failovers: list[Failover]):
        self.replica = slot.replica
        self.response = response
        self.body = body
        self.queued_ms = queued_ms
        self.off_clock_ms = off_clock_ms
        self.sent_at = sent_at
        self.failovers = failovers
        self._slot = slot
        self._closed = False

    def chunks(self) -> AsyncIterator[bytes]:
        """What arrives, read by read (a read holds whatever the socket had: often several
        SSE events). Raises one of ``TRANSPORT_ERRORS`` when the replica breaks off."""
        return self.response.content.iter_any()

    def close(self) -> None:
        """Free the replica's slot; an answer not read to its end drops its connection."""
        if self._closed:
            return
        self._closed = True
        try:
            self.response.close()
        finally:
            self._slot.release()


async def _error_message(response: aiohttp.ClientResponse) -> str:
    """The start of an error answer's body, for the message (never raises)."""
    try:
        text = (await response.read()).decode("utf-8", "replace")
    except TRANSPORT_ERRORS as exc:
        return f"(body unreadable: {describe(exc)})"
    finally:
        response.close()
    return text.strip()[:500] or "(empty body)"


async def open_call(*, router: Router, http: UpstreamClient, rollout_id: str, model: str,
                    path: str, body: bytes, whole: bool = False) -> Upstream:
    """Send ``body`` to ``{replica}/{path}`` on the first replica that answers, each try on
    a slot the router grants (waiting in its queue when every replica is full): a
    connection failure or a 5xx frees the slot and queues for another replica (a
    ``Failover``); a 4xx is the caller's (``UpstreamRejected``). With ``whole`` the answer's
    body is read here, so a replica that breaks off mid-answer is such a failure too
    (nothing was relayed yet)."""
    failovers: list[Failover] = []
    pinned = router.sticky(rollout_id)
    router.serving(model)  # Unavailable when no replica serves it
    if pinned is not None and pinned in router.replicas and not router.replicas[pinned].healthy:
        state = router.replicas[pinned]
        failovers.append(Failover(replica=pinned, error=f"not used: {state.last_error or 'unhealthy'}",
                                  at=time.time()))
    errors: list[str] = []
    tried: set[str] = set()
    queued_ms = off_clock_ms = 0.0
    while True:
        if tried and not router.untried(model, tried):
            raise UpstreamError(f"every backend replica failed ({len(errors)} tried): " + "; ".join(errors))
        slot = await router.acquire(rollout_id, model, tried)
        state = slot.replica
        tried.add(state.id)
        queued_ms += slot.queued_ms
        off_clock_ms += slot.off_clock_ms
        url = state.replica.url.rstrip("/") + path
        sent_at = time.perf_counter()
        response = None
        try:
            response = await http.post(url, body)
            status = response.status
            data = await response.read() if whole and status < 400 else None
        except TRANSPORT_ERRORS as exc:
            if response is not None:
                response.close()
            slot.release()
            why = describe(exc)
            router.mark_down(state.id, why)
            failovers.append(Failover(replica=state.id, error=why, at=time.time()))
            errors.append(f"{state.id}: {why}")
            continue
        except BaseException:  # cancelled while waiting for the answer: the slot is free again
            if response is not None:
                response.close()
            slot.release()
            raise
        if status in _RETRY:
            try:
                text = await _error_message(response)
            finally:
                slot.release()
            why = f"answered {status}: {text}"
            if status in _DOWN:
                router.mark_down(state.id, why)
            failovers.append(Failover(replica=state.id, error=why, at=time.time()))
            errors.append(f"{state.id}: {why}")
            continue
        if status >= 400:
            try:
                text = await _error_message(response)
            finally:
                slot.release()
            if status == 429:
                raise UpstreamError(f"backend replica {state.id} is overloaded (429): {text}")
            raise UpstreamRejected(f"backend replica {state.id} rejected the request ({status}): {text}")
        router.stick(rollout_id, state.id)
        return Upstream(slot=slot, response=response, body=data, queued_ms=queued_ms, off_clock_ms=off_clock_ms,
                        sent_at=sent_at, failovers=failovers)


# ---------------------------------------------------------------------------- /tokenize

#: Answers of a replica without vLLM's ``/tokenize`` (Ollama, servers without the route).
_NO_TOKENIZE = {404, 405, 501}
#: How long such a replica is not asked again (a restart may bring the route).
NO_TOKENIZE_TTL_S = 60.0
#: Longest wait for a count; tokenizing is cheap, a replica this slow is failing.
TOKENIZE_TIMEOUT_S = 10.0
_TOKENIZE_TIMEOUT = aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)
#: Chat request fields that change how the prompt is rendered, sent along to ``/tokenize``
#: (vLLM's ``TokenizeChatRequest``).
_CHAT_RENDERING = ("tools", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                   "chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs")


class _TokenizeAnswer(msgspec.Struct):
    count: int


_tokenize_answer = msgspec.json.Decoder(_TokenizeAnswer)


def tokenize_url(base_url: str) -> str:
    """vLLM serves ``/tokenize`` at its root: ``http://h:8000/v1`` -> ``http://h:8000/tokenize``."""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    return base + "/tokenize"


def tokenize_body(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """The ``/tokenize`` request for a chat or completions body as it will be sent."""
    out: dict[str, Any] = {"model": body.get("model")} if body.get("model") else {}
    if chat:
        out["messages"] = body.get("messages")
        for key in _CHAT_RENDERING:
            if body.get(key) is not None:
                out[key] = body[key]
    else:
        out["prompt"] = body.get("prompt")
        if body.get("add_special_tokens") is not None:
            out["add_special_tokens"] = body["add_special_tokens"]
    return out


class Counted(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt's count by a replica: ``tokens`` None when the replica cannot count (``why``).
    ``failovers``: replicas left on the way (a sticky one down, a failed ``/tokenize``)."""

    tokens: int | None
    replica: str
    why: str = ""
    failovers: list[Failover] = []


async def count_prompt(*, router: Router, http: UpstreamClient, rollout_id: str, model: str,
                       body: dict[str, Any], chat: bool) -> Counted:
    """The exact prompt tokens of ``body`` by the replica that will serve it (the rollout's
    sticky one while healthy, which it becomes), or ``tokens=None`` when that replica has
    no ``/tokenize`` (404 / 405 / 501, or an answer without ``count``). A connection
    failure, timeout or 5xx moves to the next replica, like a call; a 4xx is the request's
    fault (``UpstreamRejected``); every replica failing is an ``UpstreamError``."""
    request = tokenize_body(body, chat=chat)
    payload = msgspec.json.encode(request)
    named = str(request.get("model") or "")
    errors: list[str] = []
    failovers: list[Failover] = []
    candidates = router.candidates(rollout_id, model)
    pinned = router.sticky(rollout_id)
    if pinned is not None and candidates[0].id != pinned and pinned in router.replicas:
        why = router.replicas[pinned].last_error or "unhealthy"
        failovers.append(Failover(replica=pinned, error=f"not used: {why}", at=time.time()))
    for state in candidates:
        until, why = state.no_tokenize.get(named, (0.0, ""))
        if until > time.monotonic():
            router.stick(rollout_id, state.id)
            return Counted(tokens=None, replica=state.id, why=why, failovers=failovers)
        url = tokenize_url(state.replica.url)
        try:
            response = await http.post(url, payload, timeout=_TOKENIZE_TIMEOUT)
            try:
                data = await response.read()
            finally:
                response.close()
        except TRANSPORT_ERRORS as exc:
            why = describe(exc)
            router.mark_down(state.id, why)
            failovers.append(Failover(replica=state.id, error=f"/tokenize: {why}", at=time.time()))
            errors.append(f"{state.id}: {why}")
            continue
        status = response.status
        text = data[:300].decode("utf-8", "replace").strip()
        if status == 200:
            try:
                count = _tokenize_answer.decode(data).count
            except (msgspec.DecodeError, msgspec.ValidationError):
                count = -1
            if count >= 0:
                router.stick(rollout_id, state.id)
                return Counted(tokens=count, replica=state.id, failovers=failovers)
            why = f"replica {state.id} answered /tokenize without a count: {text[:120]!r}"
        elif status in _NO_TOKENIZE:
            why = f"replica {state.id} has no /tokenize ({status})"
        elif status in _RETRY:
            why = f"/tokenize answered {status}: {text}"
            if status in _DOWN:
                router.mark_down(state.id, why)
            failovers.append(Failover(replica=state.id, error=why, at=time.time()))
            errors.append(f"{state.id}: {why}")
            continue
        elif status == 429:
            raise UpstreamError(f"backend replica {state.id} is overloaded (429) counting the prompt: {text}")
        else:
            raise UpstreamRejected(f"backend replica {state.id} rejected counting the prompt ({status}): {text}")
        state.no_tokenize[named] = (time.monotonic() + NO_TOKENIZE_TTL_S, why)
        log.warning("%s: token budgets fall back to an upper bound of the prompt on it (model %r) for %g s",
                    why, named, NO_TOKENIZE_TTL_S)
        router.stick(rollout_id, state.id)
        return Counted(tokens=None, replica=state.id, why=why, failovers=failovers)
    raise UpstreamError(f"every backend replica failed counting the prompt ({len(errors)} tried): "
                        + "; ".join(errors))


def sse_events(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append ``data`` to ``buffer`` and pop every complete SSE event's ``data:`` payload."""
    if buffer:  # the start of an event a previous read cut
        buffer += data
        raw = bytes(buffer)
        buffer.clear()
    else:
        raw = data
    if b"\r" in raw:  # CRLF line ends (or a lone CR): the general, slower reading
        buffer += raw
        return _sse_events_crlf(buffer)
    events = raw.split(b"\n\n")
    rest = events.pop()  # after the last blank line: an event not complete yet (or nothing)
    if rest:
        buffer += rest
    out: list[bytes] = []
    for event in events:
        if event.startswith(b"data: ") and b"\n" not in event:  # what every backend sends: one data line
            out.append(event[6:])
            continue
        lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines))
    return out


def _sse_events_crlf(buffer: bytearray) -> list[bytes]:
    out: list[bytes] = []
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            crlf = buffer.find(b"\r\n\r\n")
            if crlf < 0:
                return out
            event, cut = bytes(buffer[:crlf]), crlf + 4
        else:
            event, cut = bytes(buffer[:end]), end + 2
        del buffer[:cut]
        lines = [line[5:].lstrip() for line in event.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines))


