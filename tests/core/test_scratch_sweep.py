"""The periodic sweep of a worker's scratch directories removes only what is older than any job."""

from __future__ import annotations

import asyncio
import os
import time

from arena_core.scratch import Sweeper, sweep


def test_sweep_removes_entries_older_than_the_limit_and_keeps_young_ones(tmp_path):
    old_dir = tmp_path / "a" / "old-job"
    (old_dir / "deep").mkdir(parents=True)
    (old_dir / "deep" / "f.txt").write_text("x")
    young = tmp_path / "a" / "running-job"
    young.mkdir()
    old_file = tmp_path / "b" / "stale.tar"
    old_file.parent.mkdir()
    old_file.write_bytes(b"1")
    past = time.time() - 7200
    os.utime(old_dir, (past, past))
    os.utime(old_file, (past, past))
    assert sweep([tmp_path / "a", tmp_path / "b", tmp_path / "missing"], 3600) == 2
    assert not old_dir.exists() and not old_file.exists() and young.is_dir()


async def test_the_sweeper_runs_until_stopped(tmp_path):
    leftover = tmp_path / "left"
    leftover.mkdir()
    past = time.time() - 100
    os.utime(leftover, (past, past))
    stop = asyncio.Event()
    task = asyncio.create_task(Sweeper([tmp_path], older_than_s=10, interval=0.05).run(stop))
    for _ in range(100):
        if not leftover.exists():
            break
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert not leftover.exists()
