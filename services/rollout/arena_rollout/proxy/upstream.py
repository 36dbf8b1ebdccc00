"""Sending one call to a backend replica, with queueing, failover and error mapping.

``open_call`` tries the router's candidates in order: it waits for a free in-flight
slot on the replica (the queue), sends, and on a connection failure or a 5xx moves to
the next replica, recording each failure as a ``Failover``. A backend 4xx is the
caller's problem and comes back as ``UpstreamRejected`` with the backend's message.
"""

from __future__ import annotations

import time

from arena.errors import UpstreamError, UpstreamRejected
from arena.schemas import Failover

from arena_rollout.proxy.http1 import Http1Client, Response, TransportError
from arena_rollout.proxy.routing import ReplicaState, Router

#: Statuses after which another replica is tried (and the replica marked down for the last three).
_RETRY = {500, 502, 503, 504}
_DOWN = {502, 503, 504}


class Upstream:
    """An open response from one replica; ``close`` frees its in-flight slot (once)."""

    def __init__(self, *, replica: ReplicaState, response: Response, queued_ms: float, sent_at: float,
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


async def _error_message(response: Response) -> str:
    """The start of an error answer's body, for the message (never raises)."""
    try:
        text = (await response.aread()).decode("utf-8", "replace")
    except TransportError as exc:
        return f"(body unreadable: {exc})"
    finally:
        await response.aclose()
    return text.strip()[:500] or "(empty body)"


async def open_call(*, router: Router, http: Http1Client, rollout_id: str, model: str,
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
        try:
            response = await http.post(url, body)
        except TransportError as exc:
            state.release()
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            router.mark_down(state.id, why)
            failovers.append(Failover(replica=state.id, error=why, at=time.time()))
            errors.append(f"{state.id}: {why}")
            continue
        except BaseException:  # cancelled while waiting for the answer: the slot is free again
            state.release()
            raise
        if response.status_code in _RETRY:
            text = await _error_message(response)
            state.release()
            why = f"answered {response.status_code}: {text}"
            if response.status_code in _DOWN:
                router.mark_down(state.id, why)
            failovers.append(Failover(replica=state.id, error=why, at=time.time()))
            errors.append(f"{state.id}: {why}")
            continue
        if response.status_code >= 400:
            text = await _error_message(response)
            state.release()
            if response.status_code == 429:
                raise UpstreamError(f"backend replica {state.id} is overloaded (429): {text}")
            raise UpstreamRejected(f"backend replica {state.id} rejected the request "
                                   f"({response.status_code}): {text}")
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


