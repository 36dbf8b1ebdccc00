"""OpenEnv episodes at density: N unmodified OpenEnv clients (``openenv-core``'s async
``GenericEnvClient``) hold episodes on Arena's ``/openenv/{name}`` endpoint at once, each
thinking a while before every action (an LLM's latency, lognormal, median L), as a trainer's
rollout workers do.

Each episode: ``reset`` (a rollout of a small task, its sandbox), T ``shell`` steps (``echo``,
one command in the episode's sandbox each), then ``submit`` with the answer, graded by the
task's ``exact`` verifier (reward 1). Arena runs with its defaults (keys on, the key in the
client's base URL as docs/openenv.md says), the environment's ``max_concurrent`` set to N.

Reported: episodes that ended with reward 1, and how the others failed; wall time against the
ideal (the slowest episode's own think time); Arena's CPU per episode and per step (every
service's process tree from /proc, as ``density.py`` counts it); the host's MemAvailable drop
per open episode at the peak; the most episodes open at once; the time per step (the client's
round trip) p50/p99. Baseline beside it: the same clients' think time alone (the ideal).

    .venv/bin/python benchmarks/openenv_density.py [--episodes 256] [--steps 5] [--latency 1]

Figures: docs/performance.md ("OpenEnv episodes at density").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import math
import random
import re
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from density import mem_available, pct, services_cpu  # noqa: E402

from arena.sdk import ArenaClient  # noqa: E402
from arena_core.schemas import AgentSpec, Budget, BundleSource, ExactVerifier, Task  # noqa: E402
from arena_core.settings import Settings  # noqa: E402
from arena_stack.natsserver import free_port  # noqa: E402
from arena_stack.stack import Stack  # noqa: E402

ANSWER = "42"


def think_s(median: float, seed: int, episode: int, step: int) -> float:
    return median * math.exp(0.5 * random.Random(f"{seed}:{episode}:{step}").gauss(0.0, 1.0))


async def episode(url: str, i: int, args, open_now: list[int], peak: list[int], step_ms: list[float],
                  failures: collections.Counter) -> float | None:
    """One episode; its reward, or ``None`` (why in ``failures``)."""
    from openenv.core import GenericEnvClient

    phase = "connect"
    try:
        async with GenericEnvClient(base_url=url, message_timeout_s=600, connect_timeout_s=120) as env:
            phase = "reset"
            await env.reset()
            open_now[0] += 1
            peak[0] = max(peak[0], open_now[0])
            try:
                for s in range(args.steps):
                    await asyncio.sleep(think_s(args.latency, args.seed, i, s))
                    phase = f"step {s + 1}"
                    t0 = time.perf_counter()
                    got = await env.step({"type": "call_tool", "tool_name": "shell",
                                          "arguments": {"command": f"echo episode {i} step {s}"}})
                    step_ms.append((time.perf_counter() - t0) * 1000)
                    if got.observation.get("result", {}).get("output") != f"episode {i} step {s}\n":
                        failures[f"step output {str(got.observation)[:80]}"] += 1
                        return None
                phase = "submit"
                final = await env.step({"type": "call_tool", "tool_name": "submit", "arguments": {"answer": ANSWER}})
            finally:
                open_now[0] -= 1
            if not final.done:
                failures["submit did not end the episode"] += 1
                return None
            return final.reward
    except Exception as exc:  # noqa: BLE001 - a benchmark counts every way an episode fails
        # one line per kind of failure: rollout ids and numbers out of the message
        why = re.sub(r"\d+(\.\d+)?", "N", re.sub(r"r-[0-9a-f]{20}", "r-…", str(exc)))
        failures[f"at {phase}: {type(exc).__name__}: {why[:140]}"] += 1
        return None


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--latency", type=float, default=1.0, help="median think time before each action, s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", metavar="DIR", help="run the stack in DIR and keep it (its logs: DIR/arena/logs)")
    args = ap.parse_args()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=False)
    with contextlib.nullcontext(args.keep) if args.keep else \
            tempfile.TemporaryDirectory(prefix="arena-openenv-density-") as tmp_:
        tmp = Path(tmp_)
        repo = tmp / "repo"
        repo.mkdir()
        (repo / "README.md").write_text("Answer 42.\n")
        rp = free_port()
        settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp / "arena"), rollout_port=rp,
                            trajectory_port=free_port(), dashboard_port=free_port(),
                            public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{free_port()}/v1",
                            backend_policy_version="0", openenv_idle_s=600)
        stack = Stack(settings, log=lambda m: None)
        await stack.start(timeout=120)
        try:
            roots = {"nats-server": stack.nats.proc.pid, **{c.name: c.pid for c in stack.children if c.pid}}
            with ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key) as client:
                digest = client.push_bundle(repo)
                task = Task(id="openenv-density", source=BundleSource(digest=digest), instructions="Say 42.",
                            agent=AgentSpec(external=True), verifier=ExactVerifier(answers=[ANSWER]),
                            budget=Budget(wall_clock_s=600 + args.steps * args.latency * 8))
                client.put_environment("density", task, max_concurrent=args.episodes)
                url = client.openenv_url("density")
            open_now, peak, step_ms = [0], [0], []
            failures: collections.Counter = collections.Counter()
            mem0 = mem_available()
            low = [mem0]

            async def watch() -> None:
                while True:
                    low[0] = min(low[0], mem_available())
                    await asyncio.sleep(0.5)

            watcher = asyncio.create_task(watch())
            cpu0 = services_cpu(roots)
            t0 = time.time()
            rewards = await asyncio.gather(*(episode(url, i, args, open_now, peak, step_ms, failures)
                                             for i in range(args.episodes)))
            wall = time.time() - t0
            cpu1 = services_cpu(roots)
            watcher.cancel()
        finally:
            stack.stop()
    by = {k: (sum(cpu1[k]) - sum(cpu0[k])) * 1000 for k in cpu1 if k in cpu0}
    total_ms = sum(by.values())
    n, steps = args.episodes, args.episodes * (args.steps + 2)
    ideal = max(sum(think_s(args.latency, args.seed, i, s) for s in range(args.steps)) for i in range(n))
    ok = sum(1 for r in rewards if r == 1.0)
    print(f"openenv density: {n} episodes x {args.steps} shell steps, think time lognormal median "
          f"{args.latency:g} s; 2 cores; Arena settings changed: none (max_concurrent {n})")
    print(f"ended with reward 1          {ok:8d} of {n} ({100 * ok / n:.1f}%)")
    for why, count in failures.most_common(12):
        print(f"    failed: {count} x {why}")
    print(f"wall                         {wall:8.1f} s (ideal: the slowest episode's think time {ideal:.1f} s; "
          f"x{wall / ideal:.2f})")
    print(f"most episodes open at once   {peak[0]:8d}")
    print(f"Arena CPU per episode        {total_ms / n:8.1f} ms ({', '.join(f'{k} {v / n:.1f}' for k, v in sorted(by.items(), key=lambda kv: -kv[1]))})")
    print(f"Arena CPU per exchange       {total_ms / steps:8.1f} ms (reset, {args.steps} steps, submit)")
    print(f"step round trip p50 / p99    {pct(step_ms, 50):8.1f} / {pct(step_ms, 99):.1f} ms")
    print(f"host MemAvailable drop       {(mem0 - low[0]) / max(1, peak[0]) / 2**20:8.2f} MB per open episode at the peak "
          f"({(mem0 - low[0]) / 2**30:.2f} GiB; noisy on a shared host)")


if __name__ == "__main__":
    asyncio.run(main())
