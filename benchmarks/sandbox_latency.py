"""Sandbox latency: p50/p99 of create -> exec `true` -> destroy, cold and warm (from a
warm pool), for `local` and `docker`, and sandboxes per second at concurrency 1, 8, 32.

    python benchmarks/sandbox_latency.py [--docker-url unix:///path.sock] [--n 40]

Without --docker-url (or ARENA_DOCKER_URL / DOCKER_HOST) the docker rows are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from arena_sandbox.pool import WarmPool
from arena_sandbox.provider import CreateSpec
from arena_sandbox.testing import make_provider


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def one(provider, pool: WarmPool | None, spec: CreateSpec) -> tuple[float, float]:
    t0 = time.perf_counter()
    sandbox = await (pool.acquire(spec) if pool else provider.create(spec))
    acquired = time.perf_counter() - t0
    result = await sandbox.exec(["true"], env={}, timeout_s=60)
    assert result.exit_code == 0, result
    await sandbox.destroy()
    return acquired, time.perf_counter() - t0


async def bench(name: str, url: str, n: int, data: Path) -> list[tuple]:
    provider = make_provider(name, data, docker_url=url, owner="bench")
    reason = await provider.health()
    if reason:
        return [(name, "skipped: " + reason)]
    spec = CreateSpec()
    rows = []
    await one(provider, None, spec)  # warm caches
    cold = [await one(provider, None, spec) for _ in range(n)]
    rows.append((name, "cold", pct([c[1] for c in cold], 50), pct([c[1] for c in cold], 99),
                 pct([c[0] for c in cold], 50)))
    pool = WarmPool(provider, size=4)
    await pool.prefill(spec)
    warm = []
    for _ in range(n):
        await pool.prefill(spec)  # measure acquisition from a full pool
        warm.append(await one(provider, pool, spec))
    await pool.close()
    rows.append((name, "warm", pct([w[1] for w in warm], 50), pct([w[1] for w in warm], 99),
                 pct([w[0] for w in warm], 50)))
    for conc in (1, 8, 32):
        total = max(conc * 2, 16)
        sem = asyncio.Semaphore(conc)

        async def limited():
            async with sem:
                await one(provider, None, spec)

        t0 = time.perf_counter()
        await asyncio.gather(*(limited() for _ in range(total)))
        rows.append((name, f"throughput c={conc}", total / (time.perf_counter() - t0)))
    await provider.close()
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docker-url", default=os.environ.get("ARENA_DOCKER_URL", os.environ.get("DOCKER_HOST", "")))
    ap.add_argument("--n", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = await bench("local", "", args.n, Path(tmp))
        if args.docker_url:
            rows += await bench("docker", args.docker_url, args.n, Path(tmp))
        else:
            rows.append(("docker", "skipped: no --docker-url"))
    print(f"{'provider':8} {'mode':18} {'p50 ms':>8} {'p99 ms':>8} {'acquire p50 ms':>15}")
    for row in rows:
        if len(row) == 5:
            print(f"{row[0]:8} {row[1]:18} {row[2]*1e3:8.1f} {row[3]*1e3:8.1f} {row[4]*1e3:15.2f}")
        elif len(row) == 3:
            print(f"{row[0]:8} {row[1]:18} {row[2]:8.1f} sandboxes/s")
        else:
            print(f"{row[0]:8} {row[1]}")


if __name__ == "__main__":
    asyncio.run(main())
