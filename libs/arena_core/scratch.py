"""Scratch directories a worker owns: the periodic sweep of entries older than any job may live
(leftovers of a failed clean-up), beside the reaping every worker does at start. See docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from arena_core.runtime import every

log = logging.getLogger("arena_core.scratch")


def sweep(roots: Sequence[Path], older_than_s: float, *, now: float | None = None) -> int:
    """Remove each entry of ``roots`` last modified more than ``older_than_s`` seconds ago."""
    cutoff = (time.time() if now is None else now) - older_than_s
    count = 0
    for root in roots:
        if not root.is_dir():
            continue
        for path in root.iterdir():
            try:
                if path.lstat().st_mtime >= cutoff:
                    continue
            except FileNotFoundError:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            count += 1
    return count


class Sweeper:
    """A runner (``arena_core.runtime.serve``'s consumers) that sweeps ``roots`` every ``interval``."""

    def __init__(self, roots: Sequence[Path], *, older_than_s: float, interval: float = 600.0, what: str = "scratch"):
        self.roots = list(roots)
        self.older_than_s = older_than_s
        self.interval = interval
        self.what = what
        self.durable = f"sweep {what}"

    async def once(self) -> int:
        n = await asyncio.to_thread(sweep, self.roots, self.older_than_s)
        if n:
            log.warning("swept %d %s entr%s older than %.0f s", n, self.what, "y" if n == 1 else "ies", self.older_than_s)
        return n

    async def run(self, stop: asyncio.Event) -> None:
        await every(stop, self.interval, self.once, what=f"sweeping {self.what}")
