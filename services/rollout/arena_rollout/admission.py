"""Admission: a submission the queue could not start within its queue limit is refused with 429
and ``Retry-After`` (nothing created) instead of expiring in the queue. See docs/reliability.md.
"""

from __future__ import annotations

import math
import time
from collections import deque

from arena_core.errors import Overloaded


class Admission:
    """Estimates how fast the queue drains (rollouts leaving ``pending``/``provisioning`` per
    second over the last ``window_s``) and refuses work that would wait longer than
    ``queue_timeout_s``; with no estimate yet (a cold start) only ``max_queued`` bounds it."""

    def __init__(self, *, queue_timeout_s: float, max_queued: int, window_s: float = 120.0, min_samples: int = 4):
        if queue_timeout_s <= 0 or max_queued < 1 or window_s <= 0:
            raise ValueError("admission: queue_timeout_s and window_s must be > 0, max_queued >= 1")
        self.queue_timeout_s = queue_timeout_s
        self.max_queued = max_queued
        self.window_s = window_s
        self.min_samples = min_samples
        self._left: deque[float] = deque()

    def left_queue(self, now: float | None = None) -> None:
        """One rollout left the queue (its sandbox started, or it ended before that)."""
        self._left.append(time.monotonic() if now is None else now)

    def drain_rate(self, now: float | None = None) -> float | None:
        """Rollouts leaving the queue per second, or ``None`` without enough recent samples."""
        now = time.monotonic() if now is None else now
        while self._left and self._left[0] < now - self.window_s:
            self._left.popleft()
        if len(self._left) < self.min_samples:
            return None
        span = max(now - self._left[0], 1.0)
        return len(self._left) / span

    def check(self, *, queued: int, adding: int, now: float | None = None) -> None:
        """Raise ``Overloaded`` if ``adding`` more rollouts behind ``queued`` would not all start in
        time; ``Retry-After`` is when enough of the queue will have drained."""
        total = queued + adding
        if adding > self.max_queued:
            raise Overloaded(f"{adding} rollouts at once exceed this server's queue of {self.max_queued}; "
                             "submit them in smaller groups", retry_after=0)
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


def _seconds(wait: float) -> float:
    return float(min(max(math.ceil(wait), 1), 3600))
