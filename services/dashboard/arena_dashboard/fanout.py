"""Live events to browsers, with bounded work: one queue per SSE stream (a slow tab is dropped,
never waited for), state changes batched per tick, and "refresh" notices debounced per page
kind so a burst of rollouts costs each page one re-fetch every ``interval`` seconds.

Pure asyncio: the NATS side (``live``) calls ``LiveFeed.on_*``; ``LiveFeed.tick`` is called
on a timer (``LiveFeed.run``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import msgspec

from arena_core.schemas import DEFAULT_PROJECT

#: Page kinds a refresh notice names (the single-page app's views that show aggregates).
KINDS = ("overview", "verify", "tokens", "training", "tasks", "leaderboard", "rollouts")
#: Kinds whose aggregates change when a rollout reaches a final state.
ON_FINAL = ("overview", "verify", "tokens", "training", "tasks")


class SseEvent(msgspec.Struct, frozen=True):
    """One Server-Sent Event, encoded once and shared by every stream (of ``project``'s sessions
    only when set: a session of another project never receives it; docs/projects.md)."""

    event: str
    data: bytes
    project: str | None = None

    def frame(self) -> bytes:
        return b"event: " + self.event.encode() + b"\ndata: " + self.data + b"\n\n"


#: What a dropped stream receives last: it then ends, and the browser reconnects and re-seeds.
DROPPED = SseEvent("dropped", b'{"reason":"this tab fell behind the live events"}')
CLOSING = SseEvent("closing", b'{"reason":"the dashboard is stopping"}')


class Subscriber:
    """One SSE stream's queue; ``closed`` once it was dropped or the hub closed."""

    def __init__(self, size: int, project: str | None = None):
        self.queue: asyncio.Queue[SseEvent] = asyncio.Queue(size + 1)  # +1: room for the last word
        self.size = size
        self.closed = False
        #: the session's project (its key's); None: every project's events (keys off, an admin key)
        self.project = project

    def offer(self, event: SseEvent) -> bool:
        """Queue ``event``; False (and the stream ends with ``DROPPED``) if the queue is full."""
        if self.closed:
            return False
        if self.queue.qsize() >= self.size:
            self.close(DROPPED)
            return False
        self.queue.put_nowait(event)
        return True

    def close(self, last: SseEvent) -> None:
        if self.closed:
            return
        self.closed = True
        while self.queue.qsize() >= self.size:  # keep the room for the last word
            self.queue.get_nowait()
        self.queue.put_nowait(last)

    async def frames(self, *, heartbeat: float = 15.0):
        """The stream's bytes: events as they come, a comment every ``heartbeat`` seconds of
        silence (proxies close idle connections), until it is closed."""
        while True:
            try:
                event = await asyncio.wait_for(self.queue.get(), heartbeat)
            except asyncio.TimeoutError:
                yield b": keep-alive\n\n"
                continue
            yield event.frame()
            if self.closed and self.queue.empty():
                return


class TooManyStreams(Exception):
    pass


class Hub:
    """Broadcast ``SseEvent``s to every subscriber; O(subscribers) per event, never blocking."""

    def __init__(self, *, queue_size: int = 256, max_subscribers: int = 200):
        self.queue_size = queue_size
        self.max_subscribers = max_subscribers
        self.subscribers: set[Subscriber] = set()
        self.dropped = 0
        self.closed = False

    def subscribe(self, project: str | None = None) -> Subscriber:
        """A stream of every event (``project`` None) or of ``project``'s and everyone's."""
        if self.closed:
            raise TooManyStreams("the dashboard is stopping")
        if len(self.subscribers) >= self.max_subscribers:
            raise TooManyStreams(f"{self.max_subscribers} live streams are open already")
        sub = Subscriber(self.queue_size, project)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def publish(self, event: SseEvent) -> None:
        for sub in list(self.subscribers):
            if event.project is not None and sub.project is not None and sub.project != event.project:
                continue  # another project's
            if not sub.offer(event):
                self.subscribers.discard(sub)
                self.dropped += 1

    def close(self) -> None:
        self.closed = True
        for sub in self.subscribers:
            sub.close(CLOSING)
        self.subscribers.clear()


class Debouncer:
    """At most one notice per kind every ``interval`` seconds, each at least ``settle`` seconds
    after the first event that asked for it (what the event changed needs that long to be
    stored and queryable), and one more ``again`` seconds after the last ask (a trajectory
    stored later than ``settle`` is still seen)."""

    def __init__(self, *, interval: float = 2.0, settle: float = 1.5, again: float = 6.0):
        self.interval = interval
        self.settle = settle
        self.again = again
        self.pending: dict[str, float] = {}  # kind -> when first asked since its last notice
        self.later: dict[str, float] = {}  # kind -> when to ask once more
        self.last: dict[str, float] = {}

    def mark(self, kinds: Iterable[str], now: float) -> None:
        for kind in kinds:
            self.pending.setdefault(kind, now)
            if self.again:
                self.later[kind] = now + self.again

    def due(self, now: float) -> list[str]:
        for kind, at in list(self.later.items()):
            if now >= at:
                del self.later[kind]
                self.pending.setdefault(kind, at - self.settle)
        out = [k for k, since in self.pending.items()
               if now - since >= self.settle and now - self.last.get(k, -1e18) >= self.interval]
        for kind in out:
            del self.pending[kind]
            self.last[kind] = now
        return sorted(out)


class LiveFeed:
    """What NATS delivers, turned into a bounded stream of SSE events: ``states`` (the state
    changes since the last tick, at most ``max_batch``; ``overflow`` counts the rest),
    ``trainer`` and ``duel`` as they come, ``refresh`` (debounced page kinds), ``reseed``
    (after a NATS outage)."""

    def __init__(self, hub: Hub, *, tick: float = 0.25, max_batch: int = 500, debouncer: Debouncer | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.hub = hub
        self.tick_s = tick
        self.max_batch = max_batch
        self.debouncer = debouncer or Debouncer()
        self.clock = clock
        self.states: list[dict] = []
        self.overflow: dict[str, int] = {}  # by project
        self.received = 0

    def on_state(self, change: dict) -> None:
        """One rollout state change (a ``RolloutStateChanged`` as a small dict: ``compact_state``)."""
        self.received += 1
        if len(self.states) < self.max_batch:
            self.states.append(change)
        else:
            project = change.get("project", DEFAULT_PROJECT)
            self.overflow[project] = self.overflow.get(project, 0) + 1
        if change.get("final"):
            self.debouncer.mark(ON_FINAL, self.clock())

    def on_trainer(self, metrics: dict, project: str = DEFAULT_PROJECT) -> None:
        self.hub.publish(SseEvent("trainer", msgspec.json.encode(metrics), project))
        self.debouncer.mark(("training",), self.clock())

    def on_duel(self, notice: dict, project: str = DEFAULT_PROJECT) -> None:
        self.hub.publish(SseEvent("duel", msgspec.json.encode(notice), project))
        self.debouncer.mark(("leaderboard",), self.clock())

    def on_reconnect(self) -> None:
        """Events may have been missed while NATS was away: counters re-seed, pages re-fetch."""
        self.hub.publish(SseEvent("reseed", b"{}"))
        self.debouncer.mark(KINDS, self.clock())

    def tick(self) -> None:
        if self.states or self.overflow:  # one batch per project: each session gets its own project's
            by_project: dict[str, list[dict]] = {}
            for change in self.states:
                by_project.setdefault(change.get("project", DEFAULT_PROJECT), []).append(change)
            for project in sorted(set(by_project) | set(self.overflow)):
                body = {"changes": by_project.get(project, []), "overflow": self.overflow.get(project, 0)}
                self.hub.publish(SseEvent("states", msgspec.json.encode(body), project))
            self.states, self.overflow = [], {}
        kinds = self.debouncer.due(self.clock())
        if kinds:
            self.hub.publish(SseEvent("refresh", msgspec.json.encode({"kinds": kinds})))

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until ``stop``; then end every stream (so the HTTP server can drain)."""
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), self.tick_s)
                except asyncio.TimeoutError:
                    pass
                self.tick()
        finally:
            self.hub.close()


def compact_state(event, *, reason_max: int = 300) -> dict:
    """The fields of a ``RolloutStateChanged`` the pages show (never its history or metadata
    beyond a few short labels)."""
    labels = {k: v[:64] for k, v in list(event.metadata.items())[:8]} if event.metadata else {}
    return {"rollout_id": event.rollout_id, "task_id": event.task_id, "group_id": event.group_id,
            "group_index": event.group_index, "from": event.from_state.value if event.from_state else None,
            "to": event.to_state.value, "at": event.at, "reward": event.reward, "reason": event.reason[:reason_max],
            "steps": event.steps, "final": event.to_state.is_final, "infrastructure": event.infrastructure,
            "labels": labels, "project": event.project}
