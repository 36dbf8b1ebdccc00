"""Sandbox latency: p50/p99 of create -> exec `true` -> destroy, cold and warm (from a
warm pool), for `local` and `docker`, and sandboxes per second at concurrency 1, 8, 32; and a
worker's acquisition for a job (the provider's health, then the pool), asking the provider
each time (the baseline) beside the worker's cached health.

    python benchmarks/sandbox_latency.py [--docker-url unix:///path.sock] [--n 40]

Cold: a new sandbox (docker: a new container from the image) is created, `true` runs in
it, and it is destroyed; warm: the sandbox comes from a full warm pool. The p50 of each
phase is printed too: acquire (create, or the pool's pop), exec, destroy. A destroy
returns when the sandbox is fully removed (docker: every process in it dead, the
container removed from the engine, its host directories deleted).

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
from arena_sandbox.worker import CachedHealth
from arena_sandbox_providers.provider import CreateSpec
from arena_sandbox_providers.testing import make_provider


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def one(provider, pool: WarmPool | None, spec: CreateSpec) -> tuple[float, float, float, float]:
    """(acquire, exec, destroy, total) seconds of one sandbox."""
    t0 = time.perf_counter()
    sandbox = await (pool.acquire(spec) if pool else provider.create(spec))
    t1 = time.perf_counter()
    result = await sandbox.exec(["true"], env={}, timeout_s=60)
    assert result.exit_code == 0, result
    t2 = time.perf_counter()
    await sandbox.destroy()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t3 - t0


def row(name: str, mode: str, runs: list[tuple[float, float, float, float]]) -> tuple:
    total = [r[3] for r in runs]
    return (name, mode, pct(total, 50), pct(total, 99), *(pct([r[i] for r in runs], 50) for i in range(3)))


async def bench(name: str, url: str, n: int, data: Path) -> list[tuple]:
    provider = make_provider(name, data, docker_url=url, owner="bench")
    reason = await provider.health()
    if reason:
        return [(name, "skipped: " + reason)]
    spec = CreateSpec()
    rows = []
    await one(provider, None, spec)  # warm caches
    cold = [await one(provider, None, spec) for _ in range(n)]
    rows.append(row(name, "cold", cold))
    pool = WarmPool(provider, size=4)
    await pool.prefill(spec)
    warm = []
    for _ in range(n):
        await pool.prefill(spec)  # measure acquisition from a full pool
        warm.append(await one(provider, pool, spec))
    rows.append(row(name, "warm", warm))
    # a worker's acquisition for a job: the provider's health, then the pool; the baseline asks
    # the provider each time (as the worker did), the worker now caches a healthy answer
    health = CachedHealth(provider)
    for mode, check in (("job acquire: health each job", provider.health), ("job acquire: cached health", health.check)):
        took = []
        for _ in range(n):
            await pool.prefill(spec)
            t0 = time.perf_counter()
            assert await check() is None
            sandbox = await pool.acquire(spec)
            took.append(time.perf_counter() - t0)
            await sandbox.destroy()
        rows.append((name, mode, pct(took, 50), pct(took, 99)))
    await pool.close()
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
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        rows = await bench("local", "", args.n, Path(tmp))
        if args.docker_url:
            rows += await bench("docker", args.docker_url, args.n, Path(tmp))
        else:
            rows.append(("docker", "skipped: no --docker-url"))
    load = lambda values: " ".join(f"{x:.2f}" for x in values)  # noqa: E731
    print(f"load average (1/5/15 min): {load(load_before)} before, {load(os.getloadavg())} after")
    print(f"{'provider':8} {'mode':18} {'p50 ms':>8} {'p99 ms':>8} {'acquire p50':>12} {'exec p50':>9} "
          f"{'destroy p50':>12}")
    for r in rows:
        if len(r) == 7:
            print(f"{r[0]:8} {r[1]:18} {r[2]*1e3:8.1f} {r[3]*1e3:8.1f} {r[4]*1e3:12.2f} {r[5]*1e3:9.1f} {r[6]*1e3:12.1f}")
        elif len(r) == 4:
            print(f"{r[0]:8} {r[1]:30} p50 {r[2]*1e3:8.2f} ms  p99 {r[3]*1e3:8.2f} ms")
        elif len(r) == 3:
            print(f"{r[0]:8} {r[1]:18} {r[2]:8.1f} sandboxes/s")
        else:
            print(f"{r[0]:8} {r[1]}")


if __name__ == "__main__":
    asyncio.run(main())
