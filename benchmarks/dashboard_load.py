"""Latency of the dashboard's reads of the trajectory API at 100,000 stored rollouts while
rollouts keep arriving, every figure a ratio to baselines measured beside it in the same run.

Two trajectory API processes (``create_app`` served by uvicorn, embedded chDB), each with a
background task inserting ``--rate`` rollouts/s (steps, sandbox result, verification,
transitions, trajectory: the rows the trajectory worker writes) through the store's own
insert path:

- ``full``: first filled with ``--rollouts`` rollouts of ``--steps`` steps (completed over the
  past ``--days`` days, groups of 4, 500 tasks, policy versions rising with time, some
  infrastructure outcomes, flags, truncated steps and tool calls), in batches of 2,000
  through ``TrajectoryStore.insert_*``;
- ``empty``: the same service and inserts over an empty store.

Then, for each endpoint, ``--requests`` sequential requests over HTTP, each followed by the
same request to ``empty`` and a ``GET /healthz`` to ``full``. It prints p50/p95 in ms and
p50 as a ratio to ``/healthz`` (the HTTP stack and the loop, nothing stored) and to the
same request on the empty store (what the data costs).

Run: ``.venv/bin/python benchmarks/dashboard_load.py [--rollouts 100000 --steps 4 --rate 50 --requests 40]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from arena_core.schemas import (
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxOutcome,
    StateTransition,
    Step,
    TestCounts,
    Timings,
    ToolCall,
    Trajectory,
    VerificationResult,
    Usage,
)
from arena_stack.natsserver import free_port

TASKS = [f"task-{i:03d}" for i in range(500)]
FLAGS = ["tests_tampered", "test_config_touched", "git_tampered", "parse_failed", "timeout"]
STATES = [RolloutState.COMPLETED] * 70 + [RolloutState.FAILED] * 12 + [RolloutState.TIMED_OUT] * 8 + \
    [RolloutState.CANCELLED] * 3 + [RolloutState.BUDGET_EXHAUSTED] * 7


def rollout(rng: random.Random, rid: str, task: str, group: str, index: int, at: float, version: int, steps: int,
            ) -> tuple[Trajectory, SandboxDone, VerificationResult | None, list[RolloutStateChanged]]:
    """One finished rollout, as the worker would store it."""
    base = at - rng.uniform(30, 300)
    state = rng.choice(STATES)
    infrastructure = rng.random() < 0.03
    if infrastructure:
        state = RolloutState.FAILED
    all_steps = []
    for i in range(steps):
        completion = rng.randint(8, 64)
        all_steps.append(Step(
            rollout_id=rid, step_index=i, model="policy", backend=f"replica-{rng.randint(0, 3)}",
            policy_version=str(version), prompt_token_ids=list(range(64 + 80 * i)),
            completion_token_ids=list(range(completion)), logprobs=[-0.5] * completion,
            finish_reason="length" if rng.random() < 0.05 else "stop",
            tool_calls=[ToolCall(id=f"c{k}", name="bash") for k in range(rng.randint(0, 2))],
            usage=Usage(prompt_tokens=64 + 80 * i, completion_tokens=completion),
            timings=Timings(queued_ms=1.0, first_token_ms=40.0, total_ms=rng.uniform(200, 2000)),
            started_at=base + 5 + i))
    sandbox = SandboxDone(rollout_id=rid, sandbox_id=rid, provider="docker", outcome=SandboxOutcome.COMPLETED,
                          reason="", started_at=base + 2, finished_at=at - 10)
    verification = None
    if state is RolloutState.COMPLETED or infrastructure:
        reward = None if infrastructure else float(rng.random() < 0.2 + 0.6 * version / 50)
        verification = VerificationResult(
            rollout_id=rid, verifier="tests", reward=reward, passed=reward == 1.0, started_at=at - 9,
            finished_at=at - rng.uniform(1, 8), parser="" if infrastructure else "pytest",
            flags=["infrastructure_error"] if infrastructure else [f for f in FLAGS if rng.random() < 0.02],
            counts=TestCounts(f2p_passed=int(reward == 1.0), f2p_failed=int(reward == 0.0), p2p_passed=5))
    history = [StateTransition(from_state=None, to_state=RolloutState.PENDING, at=base),
               StateTransition(from_state=RolloutState.PENDING, to_state=RolloutState.PROVISIONING, at=base + 1),
               StateTransition(from_state=RolloutState.PROVISIONING, to_state=RolloutState.RUNNING, at=base + 2),
               StateTransition(from_state=RolloutState.RUNNING, to_state=state, at=at)]
    reward = None if infrastructure else (verification.reward if verification is not None else 0.0)
    trajectory = Trajectory(
        rollout_id=rid, task_id=task, group_id=group, group_index=index, group_size=4, final_state=state,
        reward=reward, steps=all_steps, sandbox=sandbox, verification=verification,
        policy_versions=[str(version)], completed_at=at, infrastructure=infrastructure, history=history,
        metadata={"task_set": ["easy", "medium", "hard"][hash(task) % 3]})
    states = [RolloutStateChanged(rollout_id=rid, task_id=task, from_state=h.from_state, to_state=h.to_state,
                                  at=h.at) for h in history]
    return trajectory, sandbox, verification, states


async def store_batch(store, batch) -> None:
    await store.insert_trajectories([b[0] for b in batch])
    await store.insert_sandbox_results([b[1] for b in batch])
    await store.insert_verifications([b[2] for b in batch if b[2] is not None])
    await store.insert_states([s for b in batch for s in b[3]])


def make_rollouts(rng: random.Random, n: int, *, start: float, end: float, steps: int, prefix: str, first: int = 0):
    out = []
    for g in range(first // 4, (first + n + 3) // 4):
        task = rng.choice(TASKS)
        for index in range(4):
            k = g * 4 + index
            if k < first or k >= first + n:
                continue
            at = start + (end - start) * (k - first) / max(n, 1)
            version = int(50 * (at - start) / max(end - start, 1)) if prefix == "r" else 50
            out.append(rollout(rng, f"{prefix}-{k:07d}", task, f"{prefix}-g{g:06d}", index, at, version, steps))
    return out


async def serve(args) -> None:
    """The service under test: fill, then serve while inserting ``--rate`` rollouts/s."""
    import uvicorn

    from arena_trajectory.app import create_app
    from arena_trajectory.clickhouse import ChdbBackend
    from arena_trajectory.store import TrajectoryStore

    store = TrajectoryStore(ChdbBackend(Path(args.serve) / "clickhouse"))
    await store.init()
    rng = random.Random(7)
    now = time.time()
    started = time.monotonic()
    for first in range(0, args.rollouts, 2000):
        n = min(2000, args.rollouts - first)
        span = args.days * 86400
        lo = now - span + span * first / args.rollouts
        hi = now - span + span * (first + n) / args.rollouts
        await store_batch(store, make_rollouts(rng, n, start=lo, end=hi, steps=args.steps, prefix="r", first=first))
    fill_s = time.monotonic() - started

    async def keep_inserting() -> None:
        k = 0
        while True:
            tick = time.time()
            batch = make_rollouts(rng, args.rate // 10, start=tick, end=tick + 0.1, steps=args.steps, prefix="live",
                                  first=k)
            k += len(batch)
            await store_batch(store, batch)
            # a few rollouts left in flight, for the live counts
            await store.insert_states([RolloutStateChanged(rollout_id=f"run-{k}", task_id="t", from_state=None,
                                                           to_state=RolloutState.RUNNING, at=tick)])
            await asyncio.sleep(max(0.0, 0.1 - (time.time() - tick)))

    config = uvicorn.Config(create_app(store), host="127.0.0.1", port=args.port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    inserter = asyncio.create_task(keep_inserting())
    print(json.dumps({"ready": True, "fill_s": fill_s}), flush=True)
    await server.serve()
    inserter.cancel()
    await store.close()


def start(args, directory: str, rollouts: int) -> tuple[subprocess.Popen, int, float]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", directory, "--port", str(port),
                             "--rollouts", str(rollouts), "--steps", str(args.steps), "--rate", str(args.rate),
                             "--days", str(args.days)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"the service on {directory} did not start")
    return proc, port, json.loads(line)["fill_s"]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def measure(args, full: int, empty: int) -> None:
    async with httpx.AsyncClient(timeout=60.0) as http:
        async def get(port: int, path: str, ok: tuple[int, ...] = (200,)) -> float:
            t = time.perf_counter()
            resp = await http.get(f"http://127.0.0.1:{port}{path}")
            elapsed = (time.perf_counter() - t) * 1000
            if resp.status_code not in ok:
                raise SystemExit(f"{path}: {resp.status_code} {resp.text[:300]}")
            return elapsed

        deep_offset = min(5000, args.rollouts // 2)
        page = (await http.get(f"http://127.0.0.1:{full}/v1/trajectories", params={"limit": 50, "offset": deep_offset})
                ).json()["trajectories"]
        deep = f"before_completed_at={page[-1]['completed_at']}&before_rollout={page[-1]['rollout_id']}"
        hour = time.time() - 3600
        paths = [
            "/v1/stats/overview", f"/v1/stats/overview?since={hour:.0f}", "/v1/stats/live",
            "/v1/stats/verification", "/v1/stats/tasks?limit=100&order=attempts",
            "/v1/stats/tasks?limit=100&order=success_rate&min_attempts=5", "/v1/stats/token-usage",
            "/v1/stats/training", "/v1/trajectories?limit=50", f"/v1/trajectories?limit=50&{deep}",
            f"/v1/trajectories?limit=50&offset={deep_offset}", f"/v1/trajectories/{page[0]['rollout_id']}",
        ]
        print(f"{'endpoint':68} {'p50 ms':>8} {'p95 ms':>8} {'empty p50':>10} {'healthz p50':>11} "
              f"{'x healthz':>9} {'x empty':>8}")
        for path in paths:
            single = "/v1/trajectories/" in path and "?" not in path  # 404 on the empty store
            for _ in range(3):  # warm-up
                await get(full, path)
                await get(empty, path, ok=(404,) if single else (200,))
            ours, base_empty, base_health = [], [], []
            for _ in range(args.requests):
                ours.append(await get(full, path))
                base_empty.append(await get(empty, path, ok=(404,) if single else (200,)))
                base_health.append(await get(full, "/healthz"))
            p50, p95 = statistics.median(ours), pct(ours, 0.95)
            e50, h50 = statistics.median(base_empty), statistics.median(base_health)
            print(f"{path[:68]:68} {p50:8.1f} {p95:8.1f} {e50:10.1f} {h50:11.2f} {p50 / h50:9.1f} {p50 / e50:8.1f}",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rate", type=int, default=50, help="rollouts/s inserted while measuring")
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args))
        return
    with tempfile.TemporaryDirectory(prefix="arena-dash-") as tmp:
        procs = []
        try:
            t = time.monotonic()
            empty_proc, empty, _ = start(args, f"{tmp}/empty", 0)
            procs.append(empty_proc)
            full_proc, full, fill_s = start(args, f"{tmp}/full", args.rollouts)
            procs.append(full_proc)
            print(f"filled {args.rollouts} rollouts x {args.steps} steps in {fill_s:.0f} s "
                  f"({args.rollouts / fill_s:.0f} rollouts/s); both services insert {args.rate} rollouts/s; "
                  f"{args.requests} requests per endpoint (setup {time.monotonic() - t:.0f} s)", flush=True)
            asyncio.run(measure(args, full, empty))
        finally:
            for proc in procs:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
