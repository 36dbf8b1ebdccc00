"""Platform overhead of a rollout: a trivial agent (it writes its answer and ``done``, no LLM
call) graded by an ``exact`` verifier, through the whole embedded stack (nats-server, the four
services as processes), alone and with 256 submitted at once; per provider.

The task's repository travels as a bundle, as it does from the SDK. Baseline, beside it in the same run: the same agent in a bare sandbox of the same provider
(create, run the command, read ``done``, destroy) with no platform around it, what the agent
itself costs. Every figure is printed with its ratio to that baseline. Phases are the medians
of the rollouts' own state history: queued (pending -> running: submission, the job through
NATS, the worker taking it), sandbox (running -> verifying: workspace, sandbox, agent, diff),
verify (verifying -> completed: the verify job and the verifier), and from the last
transition to the answer of ``GET /v1/rollouts/{id}/wait``.

    .venv/bin/python benchmarks/rollout_overhead.py [--alone 20] [--burst 256] [--providers local,docker]
                                                     [--docker-url unix:///path.sock] [--slots N]

After the burst: the CPU milliseconds per rollout each process of the stack spent during it (from
/proc: nats-server, each service and the children it waited for, this benchmark as the client),
and what the machine spent besides (kernel threads, other work).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

from arena.sdk import ArenaClient
from arena_core import apikeys
from arena_core.schemas import AgentSpec, Budget, ExactVerifier, PathSource, SubmitRolloutRequest, Task
from arena_core.settings import Settings
from arena_sandbox_providers.provider import CreateSpec
from arena_sandbox_providers.testing import make_provider
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

AGENT = ["/bin/sh", "-c", "echo '{\"answer\": \"42\"}' > /sandbox/.arena/result.json && : > /sandbox/.arena/done"]


def trivial_task(repo: Path, image: str) -> Task:
    return Task(id="trivial", source=PathSource(path=str(repo)), instructions="Answer 42.",
                agent=AgentSpec(command=AGENT), verifier=ExactVerifier(answers=["42"]),
                budget=Budget(wall_clock_s=120), image=image or None)


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else float("nan")


async def bare(provider_name: str, docker_url: str, data: Path, n: int) -> float:
    """Median seconds of the agent in a bare sandbox: create, run, check done, destroy."""
    provider = make_provider(provider_name, data, docker_url=docker_url, owner="bench-bare")
    took = []
    try:
        for _ in range(n + 1):
            t0 = time.perf_counter()
            sandbox = await provider.create(CreateSpec())
            ran = await sandbox.exec(AGENT, env={}, timeout_s=60)
            assert ran.exit_code == 0 and await sandbox.exists("/sandbox/.arena/done"), ran
            await sandbox.destroy()
            took.append(time.perf_counter() - t0)
    finally:
        await provider.close()
    return statistics.median(took[1:])


def cpu_ticks(stack: Stack) -> dict[str, int]:
    """CPU clock ticks so far of each process of the stack (its waited-for children apart), of
    this benchmark (the client), and of the whole machine (busy and idle, from /proc/stat)."""
    procs = [("nats-server", stack.nats.proc.pid)] + [(c.name, c.pid) for c in stack.children if c.pid]
    out = {}
    for name, pid in procs:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            out[name] = int(fields[11]) + int(fields[12])  # utime, stime
            if int(fields[13]) + int(fields[14]):
                out[f"{name} children"] = int(fields[13]) + int(fields[14])  # cutime, cstime
    me = os.times()
    out["client (this benchmark)"] = round((me.user + me.system) * os.sysconf("SC_CLK_TCK"))
    machine = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    out["idle"] = machine[3] + machine[4]
    out["machine busy"] = sum(machine[:8]) - out["idle"]
    return out


def cpu_lines(before: dict[str, int], after: dict[str, int], n: int) -> list[str]:
    """CPU milliseconds per rollout of the burst, per process; "other" is the machine's busy
    time that none of them spent (kernel threads, other work on the machine)."""
    ms = {k: (after[k] - before.get(k, 0)) * 1000 / os.sysconf("SC_CLK_TCK") / n for k in after}
    named = sum(v for k, v in ms.items() if k not in ("idle", "machine busy"))
    parts = [f"{k} {v:.1f}" for k, v in sorted(ms.items(), key=lambda kv: -kv[1])
             if k not in ("idle", "machine busy") and v >= 0.05]
    line = (f"{'':7}   CPU ms per rollout: {', '.join(parts)}; other {ms['machine busy'] - named:.1f}; "
            f"machine busy {ms['machine busy']:.1f}, idle {ms['idle']:.1f}")
    return [line]


def phases(view: dict) -> dict[str, float]:
    at = {h["to_state"]: h["at"] for h in view["history"]}
    return {"queued": at["running"] - at["pending"], "sandbox": at["verifying"] - at["running"],
            "verify": at["completed"] - at["verifying"], "total": at["completed"] - at["pending"]}


async def run_provider(name: str, args, data: Path, repo: Path) -> list[str]:
    rp = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data / f"arena-{name}"),
                        rollout_port=rp, trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                        allow_host_paths=True, sandbox_provider=name, docker_url=args.docker_url,
                        max_queued=100_000, sandbox_concurrency=args.slots)
    image = "arena/agent-base:latest" if name == "docker" else ""
    baseline = await bare(name, args.docker_url, data / f"bare-{name}", args.alone)
    stack = Stack(settings, log=lambda m: None)
    await stack.start(timeout=120)
    out = []
    try:
        with ArenaClient(settings.rollout_url, settings.trajectory_url,
                         api_key=stack.api_key) as client:  # the repository as a bundle
            task = client.prepare(trivial_task(repo, image))
        body = msgspec.json.encode(SubmitRolloutRequest(task=task, provider=name))
        # the load is spread over several clients of 32 connections: one httpx pool of hundreds
        # scans all its connections for every request (quadratic), and the client's CPU is the
        # platform's on this machine
        async with contextlib.AsyncExitStack() as stack_:
            pools = [await stack_.enter_async_context(httpx.AsyncClient(
                base_url=settings.rollout_url, timeout=600, limits=httpx.Limits(max_connections=32),
                headers=apikeys.auth_headers(stack.api_key or "")))
                for _ in range(max(1, -(-args.burst // 32)))]

            async def one(http: httpx.AsyncClient) -> tuple[float, dict]:
                t0 = time.perf_counter()
                got = await http.post("/v1/rollouts", content=body, headers={"content-type": "application/json"})
                got.raise_for_status()
                rid = got.json()["rollout_id"]
                while True:
                    view = (await http.get(f"/v1/rollouts/{rid}/wait", params={"timeout": 60})).json()
                    if view["state"] in ("completed", "failed", "timed_out", "cancelled", "budget_exhausted"):
                        break
                assert view["state"] == "completed" and view["reward"] == 1.0, view
                return time.perf_counter() - t0, view

            await one(pools[0])  # caches, connections
            alone = [await one(pools[0]) for _ in range(args.alone)]
            e2e = median_ms([a for a, _ in alone])
            ph = {k: median_ms([phases(v)[k] for _, v in alone]) for k in ("queued", "sandbox", "verify", "total")}
            out.append(f"{name:7} alone (median of {args.alone})       {e2e:8.1f} ms  x{e2e / (baseline * 1000):5.2f} of the "
                       f"bare sandbox ({baseline * 1000:.1f} ms); platform adds {e2e - baseline * 1000:.1f} ms")
            out.append(f"{'':7}   phases: queued {ph['queued']:.1f} ms, sandbox {ph['sandbox']:.1f} ms, verify "
                       f"{ph['verify']:.1f} ms, to the wait's answer {e2e - ph['total']:.1f} ms")
            ticks = cpu_ticks(stack)
            t0 = time.perf_counter()
            burst = await asyncio.gather(*(one(pools[i % len(pools)]) for i in range(args.burst)))
            wall = time.perf_counter() - t0
            cpu = cpu_lines(ticks, cpu_ticks(stack), args.burst)
            rate = args.burst / wall
            ph = {k: median_ms([phases(v)[k] for _, v in burst]) for k in ("queued", "sandbox", "verify")}
            out.append(f"{name:7} {args.burst} at once                 {rate:8.1f} rollouts/s  x{rate * baseline:5.2f} of "
                       f"one bare sandbox at a time ({1 / baseline:.1f}/s); {wall:.1f} s in all, "
                       f"{settings.sandbox_slots} sandbox slots")
            out.append(f"{'':7}   phases (medians): queued {ph['queued']:.0f} ms, sandbox {ph['sandbox']:.0f} ms, "
                       f"verify {ph['verify']:.0f} ms")
            out += cpu
    finally:
        stack.stop()
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alone", type=int, default=20)
    ap.add_argument("--burst", type=int, default=256)
    ap.add_argument("--providers", default="local")
    ap.add_argument("--docker-url", default=os.environ.get("ARENA_DOCKER_URL", ""))
    ap.add_argument("--slots", type=int, default=0, help="sandbox slots of the worker (0: its default, 4 per core)")
    args = ap.parse_args()
    load = os.getloadavg()
    lines = []
    with tempfile.TemporaryDirectory(prefix="arena-overhead-") as tmp:
        data = Path(tmp)
        repo = data / "repo"
        repo.mkdir()
        (repo / "README.md").write_text("a trivial task\n")
        for name in args.providers.split(","):
            if name == "docker" and not args.docker_url:
                lines.append("docker  skipped: no --docker-url")
                continue
            lines += await run_provider(name, args, data, repo)
    print(f"rollout overhead: trivial agent, exact verifier; {os.cpu_count()} cores; load {load[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print("\n".join(lines))


if __name__ == "__main__":
    asyncio.run(main())
