"""Progress on the CLI's waits (``arena.progress``): on a terminal (a real pseudo-terminal here) a
bar redrawn in place with the counts and an ETA; elsewhere one line per finished item and no bar.
Waits are run concurrently and reported in the order they finish. ``arena submit --wait`` through a
real stack: tests/client/test_task_authoring_loop.py."""

from __future__ import annotations

import io
import os
import threading
import time

from arena.progress import WaitProgress, as_finished


class Clock:
    """A clock the test moves by hand, so elapsed time and the ETA are exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_without_a_terminal_one_line_per_finished_item_with_counts_and_eta():
    out = io.StringIO()
    clock = Clock()
    progress = WaitProgress(4, "rollouts", stream=out, clock=clock)
    assert progress.tty is False and out.getvalue() == ""  # nothing before the first item finishes
    clock.now += 10
    progress.finished("r-1", "completed")
    clock.now += 10
    progress.finished("r-2", "failed")
    clock.now += 10
    progress.finished("r-3", "infrastructure")
    progress.finished("r-4", "completed")
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "rollouts [1/4] r-1: completed (1/4 · 1 completed, 0 failed, 0 infrastructure · 10s elapsed, ETA 30s)",
        "rollouts [2/4] r-2: failed (2/4 · 1 completed, 1 failed, 0 infrastructure · 20s elapsed, ETA 20s)",
        "rollouts [3/4] r-3: infrastructure (3/4 · 1 completed, 1 failed, 1 infrastructure · 30s elapsed, ETA 10s)",
        "rollouts [4/4] r-4: completed (4/4 · 2 completed, 1 failed, 1 infrastructure · 30s elapsed)",
    ]
    assert "\r" not in out.getvalue() and "#" not in out.getvalue()


def test_on_a_terminal_a_bar_redrawn_in_place_ending_in_one_line():
    master, slave = os.openpty()
    tty = os.fdopen(slave, "w")
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: _drain(master, chunks), daemon=True)
    reader.start()
    clock = Clock()
    progress = WaitProgress(2, "validate", stream=tty, clock=clock)
    assert progress.tty is True
    clock.now += 5
    progress.finished("task-a gold", "completed")
    clock.now += 5
    progress.finished("task-a empty", "failed")
    progress.close()
    tty.close()
    reader.join(timeout=10)
    os.close(master)
    text = b"".join(chunks).decode()
    assert "validate [............................]" not in text  # BAR_WIDTH is 24
    assert "validate [........................] 0/2" in text and "ETA ?" in text
    assert "validate [############............] 1/2 · 1 completed, 0 failed, 0 infrastructure · 5s elapsed, " \
           "ETA 5s" in text
    assert text.rstrip("\r\n").endswith("validate [########################] 2/2 · 1 completed, 1 failed, "
                                        "0 infrastructure · 10s elapsed")
    assert "task-a" not in text  # the items themselves are the command's output (stdout), not the bar's


def _drain(fd: int, into: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the other end closed
            return
        if not chunk:
            return
        into.append(chunk)


def test_waits_are_reported_in_the_order_they_finish():
    delays = {"slow": 0.6, "fast": 0.0, "middle": 0.3}

    def wait(item: str) -> str:
        time.sleep(delays[item])
        return item.upper()

    assert list(as_finished(delays, wait)) == [("fast", "FAST"), ("middle", "MIDDLE"), ("slow", "SLOW")]
    assert list(as_finished([], wait)) == []


def test_an_export_in_a_log_prints_plain_lines_not_a_redrawn_bar():
    """Exports: stderr that is no terminal gets a plain line now and then (here every update) and a
    last one, never carriage returns; a terminal gets the bar redrawn in place."""
    import io

    from arena.export_io import Progress

    log = io.StringIO()
    progress = Progress(4, stream=log, log_every_s=0.0)
    for done in range(1, 5):
        progress.update(done, done * 3)
    progress.finish()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 5
    assert lines[0].startswith("export: [") and "1/4 trajectories" in lines[0]
    assert "4/4 trajectories" in lines[-1] and "12 rows" in lines[-1]
    quiet = io.StringIO()  # a short export in a log: no line at all, its summary says it
    Progress(4, stream=quiet).finish()
    assert quiet.getvalue() == ""
