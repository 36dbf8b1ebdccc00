"""Admission: a submission the queue could not start within its queue limit is refused with 429
and ``Retry-After`` (nothing created) instead of expiring in the queue. See docs/reliability.md
and docs/rollout.md ("Admission").

The decision and the count it rests on are one step: :meth:`Admission.reserve` decides on the
queue as the record cache sees it *plus* what it admitted and not yet created (its
reservations), and reserves what it admits before returning, with no ``await`` between. A
submission releases its reservation as each rollout's record is created (it is then in the
queue count) or fails. So concurrent submissions cannot all be admitted on one stale count.
"""

from __future__ import annotations

import math
import time
from collections import deque

from arena_core.errors import Overloaded


class Reservation:
    """Queue places admitted to one submission, given back one by one (:meth:`release`) as its
    rollouts are created or fail; whatever is left goes back on :meth:`close` (``with``)."""

    def __init__(self, admission: Admission, places: int, project: str | None = None):
        self.admission, self.left, self.project = admission, places, project

    def release(self, places: int = 1) -> None:
        places = min(places, self.left)
        self.left -= places
        self.admission.reserved -= places
        if self.project is not None:
            self.admission.reserved_by[self.project] -= places

    def close(self) -> None:
        self.release(self.left)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Admission:
    """Whether the queue can start more rollouts within ``queue_timeout_s``.

    With the sandbox slots known (the workers' ``slots``), the queue drains at ``slots / hold``
    rollouts per second, where ``hold`` is how long a sandbox is held: the mean of the last
    ones measured, or before ``min_samples`` of them (a cold start) the submitted task's wall
    clock, its upper bound. Free slots start at once; the rest wait their turn; an empty queue
    takes any submission up to ``max_queued`` (refused there, it would be refused forever). Without the
    slots, the rate of rollouts leaving ``pending``/``provisioning`` over the last ``window_s``
    is the estimate, and with none yet only ``max_queued`` bounds the queue."""

    def __init__(self, *, queue_timeout_s: float, max_queued: int, window_s: float = 120.0, min_samples: int = 4):
        if queue_timeout_s <= 0 or max_queued < 1 or window_s <= 0:
            raise ValueError("admission: queue_timeout_s and window_s must be > 0, max_queued >= 1")
        self.queue_timeout_s = queue_timeout_s
        self.max_queued = max_queued
        self.window_s = window_s
        self.min_samples = min_samples
        #: places admitted whose rollouts are not in the queue count yet
        self.reserved = 0
        #: the same, per project (a project's own queue limit, docs/projects.md)
        self.reserved_by: dict[str, int] = {}
        self._left: deque[float] = deque()
        self._holds: deque[tuple[float, float]] = deque()  # (when, seconds a sandbox was held)

    def left_queue(self, now: float | None = None) -> None:
        """One rollout left the queue (its sandbox started, or it ended before that)."""
        self._left.append(time.monotonic() if now is None else now)

    def released_sandbox(self, held_s: float, now: float | None = None) -> None:
        """A rollout's sandbox slot is free again after ``held_s`` seconds: held from when the
        rollout left the queue for a worker (``provisioning``) to its sandbox's end."""
        self._holds.append((time.monotonic() if now is None else now, max(held_s, 0.0)))

    def drain_rate(self, now: float | None = None) -> float | None:
        """Rollouts leaving the queue per second, or ``None`` without enough recent samples."""
        now = time.monotonic() if now is None else now
        while self._left and self._left[0] < now - self.window_s:
            self._left.popleft()
        if len(self._left) < self.min_samples:
            return None
        span = max(now - self._left[0], 1.0)
        return len(self._left) / span

    def hold_s(self, now: float | None = None) -> float | None:
        """Mean seconds a sandbox was held, over the last ``window_s``; ``None`` without enough samples."""
        now = time.monotonic() if now is None else now
        while self._holds and self._holds[0][0] < now - self.window_s:
            self._holds.popleft()
        if len(self._holds) < self.min_samples:
            return None
        return max(sum(h for _, h in self._holds) / len(self._holds), 0.1)

    def reserve(self, *, queued: int, adding: int, now: float | None = None, slots: int | None = None,
                running: int = 0, hold_s: float | None = None, project: str | None = None,
                project_queued: int = 0, project_max_queued: int = 0,
                project_slots: int | None = None) -> Reservation:
        """Admit ``adding`` rollouts behind ``queued`` (and the places reserved already) and
        reserve their places, or raise ``Overloaded``. Synchronous on purpose: nothing else
        runs between the decision and the reservation. ``project``: whose submission it is;
        with ``project_max_queued`` (its own queue limit, 0: none), ``project_queued`` of its
        rollouts waiting already (plus its reservations) bound it too."""
        if project is not None and project_max_queued:
            self.check_project(project, queued=project_queued + self.reserved_by.get(project, 0), adding=adding,
                               max_queued=project_max_queued, slots=project_slots or slots, now=now, hold_s=hold_s)
        self.check(queued=queued + self.reserved, adding=adding, now=now, slots=slots, running=running,
                   hold_s=hold_s)
        self.reserved += adding
        if project is not None:
            self.reserved_by[project] = self.reserved_by.get(project, 0) + adding
        return Reservation(self, adding, project)

    def check_project(self, project: str, *, queued: int, adding: int, max_queued: int, slots: int | None,
                      now: float | None = None, hold_s: float | None = None) -> None:
        """Raise ``Overloaded`` naming the project's own limit when ``adding`` more of its rollouts
        behind its ``queued`` would exceed ``max_queued``; ``Retry-After``: when enough of its
        queue will have started (``slots``: the sandboxes it may hold at once)."""
        if queued + adding <= max_queued:
            return
        measured = self.hold_s(now)
        hold = measured if measured is not None else (hold_s or 1.0)
        excess = queued + adding - max_queued
        wait = excess * hold / max(slots or 1, 1)
        raise Overloaded(f"project {project!r} has {queued} rollouts waiting for a sandbox and may queue at most "
                         f"{max_queued} (its max_queued; `arena projects set {project} --max-queued N`): "
                         f"{adding} more would exceed it", retry_after=_seconds(wait))

    def check(self, *, queued: int, adding: int, now: float | None = None, slots: int | None = None,
              running: int = 0, hold_s: float | None = None) -> None:
        """Raise ``Overloaded`` if ``adding`` more rollouts behind ``queued`` would not all start in
        time; ``Retry-After`` is when enough of the queue will have drained. ``slots``: the
        sandboxes the workers run at once, ``running`` of them busy; ``hold_s``: the submitted
        task's wall clock (how long a sandbox is held at most)."""
        total = queued + adding
        if adding > self.max_queued:
            raise Overloaded(f"{adding} rollouts at once exceed this server's queue of {self.max_queued}; "
                             "submit them in smaller groups", retry_after=0)
        if slots:
            self._check_slots(queued, adding, now, slots, running, hold_s)
            return
        rate = self.drain_rate(now)
        if total > self.max_queued:
            excess = total - self.max_queued
            wait = excess / rate if rate else self.queue_timeout_s / 4
            raise Overloaded(f"the queue is full: {queued} rollouts waiting (at most {self.max_queued})",
                             retry_after=_seconds(wait))
        if rate is None:
            return
        expected = total / rate
        if expected > self.queue_timeout_s:
            wait = (total - rate * self.queue_timeout_s) / rate
            raise Overloaded(f"the queue cannot start {adding} more within the queue limit of "
                             f"{self.queue_timeout_s:g} s: {queued} waiting, draining at {rate:.2f}/s",
                             retry_after=_seconds(wait))

    def _check_slots(self, queued: int, adding: int, now: float | None, slots: int, running: int,
                     hold_s: float | None) -> None:
        measured = self.hold_s(now)
        hold = measured if measured is not None else hold_s
        total = queued + adding
        if total > self.max_queued:
            wait = (total - self.max_queued) * (hold or 1.0) / slots
            raise Overloaded(f"the queue is full: {queued} rollouts waiting (at most {self.max_queued})",
                             retry_after=_seconds(wait))
        if hold is None or queued == 0:
            return  # an empty queue takes a submission whole: refused now, it would be refused forever
        rate = slots / hold
        behind = total - max(slots - running, 0)  # those that wait for a slot to free
        if behind > 0 and behind / rate > self.queue_timeout_s:
            wait = (behind - rate * self.queue_timeout_s) / rate
            how = f"a sandbox is held {hold:.1f} s on average" if measured is not None else \
                f"a sandbox may be held the task's wall clock of {hold:g} s"
            raise Overloaded(f"the queue cannot start {adding} more within the queue limit of "
                             f"{self.queue_timeout_s:g} s: {queued} waiting for {slots} sandbox slots "
                             f"({running} busy; {how})", retry_after=_seconds(wait))


def _seconds(wait: float) -> float:
    return float(min(max(math.ceil(wait), 1), 3600))
