"""What one insert into the ``steps`` table costs by its size: the trajectory service's
``BatchConsumer`` lingers so that a steady flow makes few large inserts (docs/trajectory.md,
"Batching"). Embedded chDB, the service's own ``TrajectoryStore`` and ``step_row``; CPU of
this process (chDB's threads included) per row, each size a ratio to the largest one
(the consumer's ``batch_size``, 2,000), measured in the same run.

    .venv/bin/python benchmarks/step_inserts.py [--rows 30000] [--sizes 10,100,300,1000,2000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from trajectory_throughput import step  # noqa: E402 - the benchmark's step, same size

from arena_core.schemas import encode  # noqa: E402
from arena_trajectory.clickhouse import ChdbBackend  # noqa: E402
from arena_trajectory.store import TrajectoryStore  # noqa: E402
from arena_trajectory.tables import step_row  # noqa: E402


async def run(args) -> dict[int, tuple[float, float]]:
    """(CPU us per row, wall us per row) for each insert size, each into a fresh store."""
    shape = argparse.Namespace(prompt_tokens=args.prompt_tokens, completion_tokens=args.completion_tokens)
    rows = []
    for n in range(args.rows):
        s = step(f"r{n // 50}", n % 50, shape)
        rows.append(step_row(s, body=encode(s)))
    out = {}
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="arena-inserts-") as tmp:
            store = TrajectoryStore(ChdbBackend(tmp))
            await store.init()
            cpu0, t0 = time.process_time(), time.perf_counter()
            for i in range(0, len(rows), size):
                await store.insert_step_rows(rows[i:i + size])
            out[size] = ((time.process_time() - cpu0) / len(rows) * 1e6, (time.perf_counter() - t0) / len(rows) * 1e6)
            await store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=30_000)
    parser.add_argument("--sizes", default="10,100,300,1000,2000", type=lambda v: [int(x) for x in v.split(",")])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.rows % max(args.sizes):
        raise SystemExit("--rows must be a multiple of the largest size")
    got = asyncio.run(run(args))
    base = got[max(args.sizes)][0]
    print(f"\n{args.rows} step rows into chDB, inserts of each size; baseline: inserts of {max(args.sizes)}\n")
    print(f"{'rows per insert':>16} {'CPU us/row':>11} {'x baseline':>11} {'wall us/row':>12} {'CPU ms/insert':>14}")
    for size, (cpu, wall) in got.items():
        print(f"{size:>16} {cpu:>11.1f} {cpu / base:>11.2f} {wall:>12.1f} {cpu * size / 1000:>14.1f}")


if __name__ == "__main__":
    main()
