"""A trainer stand-in for the reliability test: reads groups with ``TrajectoryStream`` and
records, durably, what it was handed and what it committed.

    python trajectory_stream_consumer.py NATS_URL NAME LOG_FILE

Each batch appends ``Y <group ids>`` (yielded) before ``commit()`` and ``C <group ids>``
after it returns, each line fsynced. The test kills this process with SIGKILL at any
point and starts it again; the log then shows what was committed and what came back.
"""

from __future__ import annotations

import asyncio
import os
import sys

from arena.stream import TrajectoryStream


def record(log, tag: str, ids: list[str]) -> None:
    log.write(f"{tag} {' '.join(ids)}\n")
    log.flush()
    os.fsync(log.fileno())


async def main(url: str, name: str, path: str) -> None:
    with open(path, "a") as log:
        record(log, "S", [str(os.getpid())])
        async with TrajectoryStream(url, name=name, ack_wait=5.0) as stream:
            async for batch in stream.groups(batch_size=4, max_wait=0.3):
                ids = [g.group_id for g in batch]
                for g in batch:
                    assert len(g.trajectories) == g.size and not g.partial, g.group_id
                record(log, "Y", ids)
                await batch.commit()
                record(log, "C", ids)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
