"""Replicas, health, sticky routing, and each replica's in-flight limit with one fair queue.

No I/O: the registry (``backends.py``) feeds replicas in, the health checker and the
forwarder mark them up or down, ``upstream.open_call`` takes and gives back slots. The
rule, in one place (``Router.pick``): a call takes a free slot on its rollout's sticky
replica when that one is healthy and has one, else on the healthy replica serving its
model with the fewest calls in flight for its limit (unhealthy replicas only when no
healthy one serves it). A call finding no free slot waits in one queue, per rollout, taken
round-robin across rollouts; every slot freed is handed to the queue at once. Why, and the
queue time kept off the agent's clock: docs/rollout.md ("Backend limits and the queue").
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Collection

from arena_core.errors import Unavailable
from arena_core.schemas import BackendReplica

MAX_STICKY = 100_000


class ReplicaState:
    """A replica as the router sees it: its record, health, and calls in flight (at most
    ``replica.max_inflight``: vLLM's ``--max-num-seqs``)."""

    def __init__(self, replica: BackendReplica):
        self.replica = replica
        self.healthy = True
        self.last_error = ""
        self.down_since = 0.0
        self.inflight = 0
        #: per model name: until when (``time.monotonic()``) the replica is taken to have no
        #: ``/tokenize`` for it, and why (per model: vLLM answers 404 for a model it does not serve too)
        self.no_tokenize: dict[str, tuple[float, str]] = {}

    @property
    def id(self) -> str:
        return self.replica.replica_id

    @property
    def limit(self) -> int:
        return max(1, self.replica.max_inflight)

    def serves(self, model: str) -> bool:
        return model in ("", "default") or not self.replica.models or model in self.replica.models

    @property
    def free(self) -> bool:
        return self.inflight < self.limit

    @property
    def load(self) -> float:
        return self.inflight / self.limit


class Slot:
    """A slot on ``replica`` held by one call until ``release`` (once). ``queued_ms``: how
    long the call waited for it; ``off_clock_ms``: the part of that wait its rollout had no
    other call waiting (what the rollout's wall clock leaves out; parallel waits count once)."""

    __slots__ = ("replica", "queued_ms", "off_clock_ms", "_router", "_held")

    def __init__(self, router: Router, replica: ReplicaState, queued_ms: float, off_clock_ms: float):
        self._router = router
        self.replica = replica
        self.queued_ms = queued_ms
        self.off_clock_ms = off_clock_ms
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._router._free(self.replica)


class _Waiter:
    __slots__ = ("rollout_id", "model", "tried", "future")

    def __init__(self, rollout_id: str, model: str, tried: Collection[str], future: asyncio.Future):
        self.rollout_id = rollout_id
        self.model = model
        self.tried = tried
        self.future = future


class _QueueClock:
    """One rollout's waiting calls: how many, since when the count was last read, and the
    waiting time not yet handed to a call (seconds)."""

    __slots__ = ("waiting", "since", "pending")

    def __init__(self, now: float):
        self.waiting = 0
        self.since = now
        self.pending = 0.0


class Router:
    def __init__(self, replicas: list[BackendReplica] = (), *, clock: Callable[[], float] = time.monotonic):
        self.replicas: dict[str, ReplicaState] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        #: the queue: per rollout its waiting calls in arrival order; rollouts in turn order
        self._queue: OrderedDict[str, deque[_Waiter]] = OrderedDict()
        self._clocks: dict[str, _QueueClock] = {}
        #: removed replicas with calls still in flight: re-registered, they keep counting them
        self._retired: dict[str, ReplicaState] = {}
        self._now = clock
        for r in replicas:
            self.upsert(r)

    # ------------------------------------------------------------ replicas and health

    def upsert(self, replica: BackendReplica) -> None:
        """Add a replica or update it in place (its policy version after a weight sync, its
        limit): the calls in flight stay counted against it."""
        current = self.replicas.get(replica.replica_id) or self._retired.pop(replica.replica_id, None)
        if current is None:
            self.replicas[replica.replica_id] = ReplicaState(replica)
        else:
            if current.replica.url != replica.url:  # another server: its health is not known
                current.healthy, current.last_error = True, ""
            current.replica = replica
            self.replicas[replica.replica_id] = current
        self._dispatch()

    def remove(self, replica_id: str) -> None:
        state = self.replicas.pop(replica_id, None)
        if state is not None and state.inflight > 0:
            self._retired[replica_id] = state
        self._fail_unservable()

    def mark_down(self, replica_id: str, error: str) -> None:
        state = self.replicas.get(replica_id)
        if state is not None:
            if state.healthy:
                state.down_since = time.time()
            state.healthy, state.last_error = False, error
            self._dispatch()  # the last healthy one down: the queue may take unhealthy ones now

    def mark_up(self, replica_id: str) -> None:
        state = self.replicas.get(replica_id)
        if state is not None:
            state.healthy, state.last_error = True, ""
            self._dispatch()

    # ------------------------------------------------------------ stickiness

    def sticky(self, rollout_id: str) -> str | None:
        return self._sticky.get(rollout_id)

    def stick(self, rollout_id: str, replica_id: str) -> None:
        self._sticky[rollout_id] = replica_id
        self._sticky.move_to_end(rollout_id)
        while len(self._sticky) > MAX_STICKY:
            self._sticky.popitem(last=False)

    def forget(self, rollout_id: str) -> None:
        self._sticky.pop(rollout_id, None)

    # ------------------------------------------------------------ choosing

    def serving(self, model: str) -> list[ReplicaState]:
        """The replicas serving ``model``. Raises ``Unavailable`` if there are none."""
        serving = [s for s in self.replicas.values() if s.serves(model)]
        if not serving:
            raise Unavailable(f"no backend replica serves model {model!r}; "
                              f"registered: {', '.join(sorted(self.replicas)) or 'none'}")
        return serving

    def candidates(self, rollout_id: str, model: str) -> list[ReplicaState]:
        """Replicas for a call that takes no slot (``/tokenize``), in order: the sticky one
        while healthy, then healthy by load, unhealthy last. Raises ``Unavailable``."""
        serving = self.serving(model)
        salt = zlib.crc32(rollout_id.encode())
        serving.sort(key=lambda s: (not s.healthy, s.load, zlib.crc32(s.id.encode()) ^ salt))
        pinned = self._sticky.get(rollout_id)
        for i, s in enumerate(serving):
            if s.id == pinned and s.healthy:
                serving.insert(0, serving.pop(i))
                break
        return serving

    def untried(self, model: str, tried: Collection[str]) -> list[ReplicaState]:
        """The replicas serving ``model`` a call has not tried yet: the healthy ones, or all
        of them when none is healthy."""
        left = [s for s in self.replicas.values() if s.serves(model) and s.id not in tried]
        healthy = [s for s in left if s.healthy]
        return healthy or left

    def pick(self, rollout_id: str, model: str, tried: Collection[str] = ()) -> ReplicaState | None:
        """The replica a call takes a slot on now, or None when every one it may use is full:
        the rollout's sticky replica if it has a free slot, else the least loaded with one
        (ties spread rollouts by a hash of both ids)."""
        pool = self.untried(model, tried)
        pinned = self._sticky.get(rollout_id)
        best, best_key = None, None
        salt = -1
        for s in pool:
            if not s.free:
                continue
            if s.id == pinned:
                return s
            if salt < 0:
                salt = zlib.crc32(rollout_id.encode())
            key = (s.load, zlib.crc32(s.id.encode()) ^ salt)
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best

    # ------------------------------------------------------------ slots and the queue

    @property
    def queued(self) -> int:
        """Calls waiting for a slot."""
        return sum(len(q) for q in self._queue.values())

    def load_snapshot(self) -> tuple[list[tuple[str, int, int]], int]:
        """Per replica (id, calls in flight, limit), and the calls queued: the metrics' view."""
        return [(s.id, s.inflight, s.limit) for s in self.replicas.values()], self.queued

    def queued_for(self, rollout_id: str) -> int:
        q = self._queue.get(rollout_id)
        return len(q) if q is not None else 0

    def waiting_s(self, rollout_id: str) -> float:
        """Seconds of the rollout's queue time not yet handed to a call: its calls waiting now
        (parallel waits counted once), so a wall clock read mid-wait leaves it out too."""
        clock = self._clocks.get(rollout_id)
        if clock is None:
            return 0.0
        return clock.pending + ((self._now() - clock.since) if clock.waiting else 0.0)

    async def acquire(self, rollout_id: str, model: str, tried: Collection[str] = ()) -> Slot:
        """A slot for one call: at once when a replica has one free and no call waits, else
        after the calls ahead in the queue's turn. Raises ``Unavailable`` if no replica
        serves ``model`` (or none untried is left while waiting). Cancelled while waiting,
        it leaves the queue; a slot granted at that moment is freed."""
        t0 = time.perf_counter()
        if not self._queue:
            state = self.pick(rollout_id, model, tried)
            if state is not None:
                state.inflight += 1
                return Slot(self, state, 0.0, 0.0)
        if not self.untried(model, tried):
            self.serving(model)  # raises when none serves it at all
            raise Unavailable(f"no backend replica serving model {model!r} is left to try")
        waiter = _Waiter(rollout_id, model, tried, asyncio.get_running_loop().create_future())
        self._enqueue(waiter)
        self._dispatch()
        try:
            state, off_clock_s = await waiter.future
        except asyncio.CancelledError:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self._free(future.result()[0])  # granted as the call was cancelled
            else:
                self._leave(waiter, placed=False)
            raise
        return Slot(self, state, (time.perf_counter() - t0) * 1000, off_clock_s * 1000)

    def _enqueue(self, waiter: _Waiter) -> None:
        rid = waiter.rollout_id
        self._queue.setdefault(rid, deque()).append(waiter)
        clock = self._clocks.get(rid)
        if clock is None:
            clock = self._clocks[rid] = _QueueClock(self._now())
        elif clock.waiting == 0:
            clock.since = self._now()
        clock.waiting += 1

    def _leave(self, waiter: _Waiter, *, placed: bool) -> float:
        """Take ``waiter`` out of the queue; the rollout's waiting time it takes with it
        (seconds; all the rollout had not handed out when placed, else nothing)."""
        rid = waiter.rollout_id
        q = self._queue.get(rid)
        try:
            if q is None:
                raise ValueError
            q.remove(waiter)
        except ValueError:
            return 0.0  # out already
        if not q:
            del self._queue[rid]
        clock = self._clocks[rid]
        now = self._now()
        clock.pending += now - clock.since
        clock.since = now
        clock.waiting -= 1
        share = 0.0
        if placed:
            share, clock.pending = clock.pending, 0.0
        if clock.waiting == 0:  # a cancelled call's wait not handed on is not kept
            del self._clocks[rid]
        return share

    def _free(self, state: ReplicaState) -> None:
        state.inflight -= 1
        if state.inflight <= 0 and self._retired.get(state.id) is state:
            del self._retired[state.id]
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to the queue: rollouts in turn, each its oldest call that a free
        slot fits (a call that tried a replica, or names another model, may skip one); the
        rollout served goes to the back of the turn."""
        while self._queue and any(s.free for s in self.replicas.values()):
            granted = False
            for rid, q in list(self._queue.items()):
                for waiter in list(q):
                    if waiter.future.done():  # cancelled: its task takes it out
                        continue
                    state = self.pick(rid, waiter.model, waiter.tried)
                    if state is None:
                        continue
                    share = self._leave(waiter, placed=True)
                    if rid in self._queue:
                        self._queue.move_to_end(rid)
                    state.inflight += 1
                    waiter.future.set_result((state, share))
                    granted = True
                    break
                if granted:
                    break
            if not granted:
                return

    def _fail_unservable(self) -> None:
        """Waiting calls no replica is left for (removed) fail now rather than wait for good."""
        for q in list(self._queue.values()):
            for waiter in list(q):
                if not waiter.future.done() and not self.untried(waiter.model, waiter.tried):
                    self._leave(waiter, placed=False)
                    waiter.future.set_exception(Unavailable(
                        f"no backend replica serving model {waiter.model!r} is left (removed while the call waited)"))
        self._dispatch()
