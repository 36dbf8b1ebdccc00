"""Sending one call to a backend replica, with queueing, failover and error mapping.

``open_call`` tries the router's candidates in order: it waits for a free in-flight
slot on the replica (the queue), sends, and on a connection failure or a 5xx moves to
the next replica, recording each failure as a ``Failover``. A backend 4xx is the
caller's problem and comes back as ``UpstreamRejected`` with the backend's message.
"""

from __future__ import annotations

import time

import httpx

from arena.errors import UpstreamError, UpstreamRejected
from arena.schemas import Failover

from arena_rollout.proxy.routing import ReplicaState, Router

#: Statuses after which another replica is tried (and the replica marked down for the last three).
_RETRY = {500, 502, 503, 504}
_DOWN = {502, 503, 504}


class ClientPool:
    """Several httpx clients used round-robin for upstream calls.

    httpcore scans every pooled connection (with a readability syscall each) on every
    request and release, so one big pool costs O(connections) CPU per call; a few small
    pools keep the scans short. Concurrency is bounded per replica by the router, not here.
    """

    def __init__(self, clients: list[httpx.AsyncClient]):
        if not clients:
            raise ValueError("ClientPool needs at least one client")
        self.clients = clients
        self._next = 0

    @classmethod
    def create(cls, shards: int = 8, *, timeout: httpx.Timeout | None = None) -> ClientPool:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        return cls([httpx.AsyncClient(timeout=timeout or httpx.Timeout(600.0, connect=5.0), limits=limits)
                    for _ in range(shards)])

    def pick(self) -> httpx.AsyncClient:
        self._next = (self._next + 1) % len(self.clients)
        return self.clients[self._next]

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


class Upstream:
    """An open response from one replica; ``close`` frees its in-flight slot (once)."""

    def __init__(self, *, replica: ReplicaState, response: httpx.Response, queued_ms: float, sent_at: float,
                 failovers: list[Failover]):
        self.replica = replica
        self.response = response
        self.queued_ms = queued_ms
        self.sent_at = sent_at
        self.failovers = failovers
        self._closed = False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.response.aclose()
        finally:
            self.replica.release()


def _error_message(resp_text: str) -> str:
    return resp_text.strip()[:500] or "(empty body)"


async def open_call(*, router: Router, http: httpx.AsyncClient | ClientPool, rollout_id: str, model: str,
                    path: str, body: bytes) -> Upstream:
    """Send ``body`` to ``{replica}/{path}`` on the first replica that answers."""
    failovers: list[Failover] = []
    candidates = router.candidates(rollout_id, model)
    pinned = router.sticky(rollout_id)
    if pinned is not None and candidates[0].id != pinned and pinned in router.replicas:
        state = router.replicas[pinned]
        failovers.append(Failover(replica=pinned, error=f"not used: {state.last_error or 'unhealthy'}",
                                  at=time.time()))
    errors: list[str] = []
    for state in candidates:
        queued_ms = await state.acquire()
        url = state.replica.url.rstrip("/") + path
        sent_at = time.perf_counter()
        client = http.pick() if isinstance(http, ClientPool) else http
        try:
            request = client.build_request("POST", url, content=body, headers={"content-type": "application/json"})
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            state.release()
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            router.mark_down(state.id, why)
            failovers.append(Failover(replica=state.id, error=why, at=time.time()))
            errors.append(f"{state.id}: {why}")
            continue
        if response.status_code in _RETRY:
            text = (await response.aread()).decode("utf-8", "replace")
            await response.aclose()
            state.release()
            why = f"answered {response.status_code}: {_error_message(text)}"
            if response.status_code in _DOWN:
                router.mark_down(state.id, why)
            failovers.append(Failover(replica=state.id, error=why, at=time.time()))
            errors.append(f"{state.id}: {why}")
            continue
        if response.status_code >= 400:
            text = (await response.aread()).decode("utf-8", "replace")
            await response.aclose()
            state.release()
            if response.status_code == 429:
                raise UpstreamError(f"backend replica {state.id} is overloaded (429): {_error_message(text)}")
            raise UpstreamRejected(f"backend replica {state.id} rejected the request "
                                   f"({response.status_code}): {_error_message(text)}")
        router.stick(rollout_id, state.id)
        return Upstream(replica=state, response=response, queued_ms=queued_ms, sent_at=sent_at,
                        failovers=failovers)
    raise UpstreamError(f"every backend replica failed ({len(errors)} tried): " + "; ".join(errors))


def sse_events(buffer: bytearray, data: bytes) -> list[bytes]:
    """Append ``data`` to ``buffer`` and pop every complete SSE event's ``data:`` payload."""
    buffer += data
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


