"""Progress on the CLI's waits (``submit --wait``, ``tasks validate``, ``tasks import``), on stderr.

On a terminal: one bar redrawn in place, with the counts (completed / failed / infrastructure),
the elapsed time and an ETA (from the mean time per finished item). Elsewhere (a log file, a
pipe, CI): no bar, one line per finished item, so logs stay readable. stdout is left to results.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Literal, TextIO, TypeVar

from arena_core.schemas import RolloutView

Outcome = Literal["completed", "failed", "infrastructure"]
T = TypeVar("T")
R = TypeVar("R")

BAR_WIDTH = 24


def outcome_of(view: RolloutView) -> Outcome:
    """A final rollout's outcome: completed, ended by an infrastructure error, or failed otherwise."""
    if view.state.value == "completed":
        return "completed"
    return "infrastructure" if view.infrastructure else "failed"


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class WaitProgress:
    """Counts of finished items out of ``total``; ``tty=None`` asks the stream."""

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.counts: dict[Outcome, int] = {"completed": 0, "failed": 0, "infrastructure": 0}
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.tty and total:
            self._draw()
            self._ticker = threading.Thread(target=self._tick, name="arena-progress", daemon=True)
            self._ticker.start()

    @property
    def done(self) -> int:
        return sum(self.counts.values())

    def eta(self) -> float | None:
        """Seconds left at the mean pace so far; None before the first item finishes."""
        if not self.done:
            return None
        elapsed = self._clock() - self._start
        return elapsed / self.done * (self.total - self.done)

    def status(self) -> str:
        """``3/10 · 2 completed, 1 failed, 0 infrastructure · 12s elapsed, ETA 28s``."""
        c = self.counts
        eta = self.eta()
        return (f"{self.done}/{self.total} · {c['completed']} completed, {c['failed']} failed, "
                f"{c['infrastructure']} infrastructure · {_duration(self._clock() - self._start)} elapsed"
                + ("" if self.done == self.total else f", ETA {'?' if eta is None else _duration(eta)}"))

    def _bar(self) -> str:
        filled = int(BAR_WIDTH * self.done / self.total) if self.total else BAR_WIDTH
        return f"{self.label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.status()}"

    def _draw(self) -> None:
        self.stream.write("\r\x1b[2K" + self._bar())
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                self._draw()

    def finished(self, item: str, outcome: Outcome) -> None:
        """One item finished: the bar moves (a terminal), or a line for it (elsewhere)."""
        with self._lock:
            self.counts[outcome] += 1
            if self.tty:
                self._draw()
            else:
                self.stream.write(f"{self.label} [{self.done}/{self.total}] {item}: {outcome} ({self.status()})\n")
                self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.tty and self.total:
            with self._lock:
                self._draw()
                self.stream.write("\n")
                self.stream.flush()

    def __enter__(self) -> WaitProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def as_finished(items: Iterable[T], wait: Callable[[T], R], *, workers: int = 16) -> Iterator[tuple[T, R]]:
    """``(item, wait(item))`` in the order they finish (``wait`` run in threads): a slow first
    rollout does not hold back the progress of the others."""
    items = list(items)
    if not items:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items))), thread_name_prefix="arena-wait") as pool:
        futures = {pool.submit(wait, item): item for item in items}
        for future in as_completed(futures):
            yield futures[future], future.result()
