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

Then the same through the dashboard: its app (``create_app_without_bus``: no NATS, auth off)
served by uvicorn in its own process as the service serves it (``runtime.serve`` on uvloop),
reading ``full``. For each page of ``PAGES``, ``--requests`` page loads: ``GET /`` (index.html),
then the page's ``/api`` calls at once, as its JavaScript makes them; p50/p95 of the whole load.
For each ``/api`` route those pages call, ``--requests`` requests, each followed by the same
trajectory API call(s) made directly (``rollout/<id>`` is three: the trajectory, then its
trainer logprobs and its group together, as ``app.api_rollout`` does); p50/p95 of both and
their ratio: what the dashboard hop adds.

Run: ``.venv/bin/python benchmarks/dashboard_load.py [--rollouts 100000 --steps 4 --rate 50 --requests 40]``
(``--quick``: 10,000 rollouts and 20 requests, a check that it all works, not figures).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
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


def serve_dashboard(args) -> None:
    """The dashboard under test, as ``python -m arena_dashboard`` serves it, minus the bus."""
    from arena_core import runtime
    from arena_dashboard.app import create_app_without_bus

    async def main() -> int:
        stop = runtime.stop_on_signals()
        app = create_app_without_bus(args.dashboard)
        return await runtime.serve(stop, app=app, host="127.0.0.1", port=args.port)

    sys.exit(runtime.run(main()))


def start_dashboard(trajectory_port: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--dashboard", f"http://127.0.0.1:{trajectory_port}",
                             "--port", str(port)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the dashboard did not start")


#: What each page asks ``/api`` for when it loads with no parameters in its address, from its
#: ``render`` in services/dashboard/arena_dashboard/static/js/page-<page>.js (``api(...)``; an
#: empty parameter is not sent; the window defaults to the last hour), plus ``stats/live``,
#: which static/js/live.js asks once a tab connects (every page). Keep in step with the JS.
#: ``{hour}``: now - 3600, ``{rid}``: a stored rollout.
LIVE = "stats/live"
PAGES: dict[str, list[str]] = {
    "overview": [LIVE, "stats/overview?since={hour}"],             # page-overview.js
    "rollouts": [LIVE, "trajectories?limit=50"],                   # page-rollouts.js
    "rollout/<id>": [LIVE, "rollout/{rid}"],                       # page-rollout.js
    "verify": [LIVE, "stats/verification?since={hour}"],           # page-verify.js
    "tokens": [LIVE, "stats/token-usage?since={hour}"],            # page-tokens.js
    "training": [LIVE, "stats/training"],                          # page-training.js
    "tasks": [LIVE, "stats/tasks?order=attempts&limit=100&offset=0"],  # page-tasks.js
    "leaderboard": [LIVE, "leaderboard", "duels?limit=20", "stats/training"],  # page-leaderboard.js
}


def direct_calls(route: str, group_id: str | None) -> list[list[str]]:
    """The trajectory API calls the dashboard makes for ``/api/<route>``: stages, each made at once."""
    from arena_dashboard import params

    name, _, query = route.partition("?")
    suffix = f"?{query}" if query else ""
    if name.startswith("rollout/"):
        path = params.item_path(params.ITEM_ROUTES["trajectories"], name.split("/", 1)[1])
        second = [f"{path}/trainer-logprobs"]
        if group_id:
            second.append(params.item_path(params.ITEM_ROUTES["groups"], group_id))
        return [[path], second]
    if name in params.ROUTES:
        return [[params.ROUTES[name].upstream + suffix]]
    kind, _, item = name.partition("/")
    return [[params.item_path(params.ITEM_ROUTES[kind], item) + suffix]]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def timed_get(http: httpx.AsyncClient, port: int, path: str, ok: tuple[int, ...] = (200,)) -> float:
    """Milliseconds of one GET on 127.0.0.1:``port``; any other status than ``ok`` ends the run."""
    t = time.perf_counter()
    resp = await http.get(f"http://127.0.0.1:{port}{path}")
    elapsed = (time.perf_counter() - t) * 1000
    if resp.status_code not in ok:
        raise SystemExit(f"{path}: {resp.status_code} {resp.text[:300]}")
    return elapsed


async def measure(args, full: int, empty: int) -> None:
    async with httpx.AsyncClient(timeout=60.0) as http:
        get = functools.partial(timed_get, http)

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


async def measure_dashboard(args, full: int, dash: int) -> None:
    limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)  # a browser: 6 per host
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as http:
        get = functools.partial(timed_get, http)

        newest = (await http.get(f"http://127.0.0.1:{full}/v1/trajectories", params={"limit": 1})
                  ).json()["trajectories"][0]
        rid, group_id = newest["rollout_id"], newest.get("group_id")
        fill = {"hour": f"{time.time() - 3600:.0f}", "rid": rid}
        pages = {page: [r.format(**fill) for r in routes] for page, routes in PAGES.items()}

        async def page_load(routes: list[str]) -> float:
            t = time.perf_counter()
            await get(dash, "/")
            await asyncio.gather(*(get(dash, f"/api/{r}") for r in routes))
            return (time.perf_counter() - t) * 1000

        async def direct(stages: list[list[str]]) -> float:
            t = time.perf_counter()
            for stage in stages:
                await asyncio.gather(*(get(full, p, ok=(200, 404)) for p in stage))
            return (time.perf_counter() - t) * 1000

        print(f"\n{'page load (index.html + its /api calls at once)':60} {'p50 ms':>8} {'p95 ms':>8}", flush=True)
        for page, routes in pages.items():
            for _ in range(3):
                await page_load(routes)
            loads = [await page_load(routes) for _ in range(args.requests)]
            print(f"{page + ': ' + ', '.join(PAGES[page][1:]):60} {statistics.median(loads):8.1f} "
                  f"{pct(loads, 0.95):8.1f}", flush=True)

        index = []
        for _ in range(args.requests):
            index.append(await get(dash, "/"))
        print(f"{'GET / (index.html alone)':60} {statistics.median(index):8.1f} {pct(index, 0.95):8.1f}")

        routes = list(dict.fromkeys(r for rs in pages.values() for r in rs))
        print(f"\n{'dashboard /api route':52} {'p50 ms':>8} {'p95 ms':>8} {'direct p50':>10} {'direct p95':>10} "
              f"{'hop ms':>7} {'x direct':>8}", flush=True)
        for route in routes:
            stages = direct_calls(route, group_id)
            for _ in range(3):
                await get(dash, f"/api/{route}")
                await direct(stages)
            ours, theirs = [], []
            for _ in range(args.requests):
                ours.append(await get(dash, f"/api/{route}"))
                theirs.append(await direct(stages))
            p50, d50 = statistics.median(ours), statistics.median(theirs)
            label = route.replace(rid, "<id>").replace(fill["hour"], "<hour ago>")
            print(f"{'/api/' + label:52} {p50:8.1f} {pct(ours, 0.95):8.1f} {d50:10.1f} {pct(theirs, 0.95):10.1f} "
                  f"{p50 - d50:7.1f} {p50 / d50:8.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rate", type=int, default=50, help="rollouts/s inserted while measuring")
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="10,000 rollouts, 20 requests: a fast check")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--dashboard", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args))
        return
    if args.dashboard:
        serve_dashboard(args)
        return
    if args.quick:
        args.rollouts, args.requests = 10_000, 20
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
            dash_proc, dash = start_dashboard(full)
            procs.append(dash_proc)
            asyncio.run(measure_dashboard(args, full, dash))
        finally:
            for proc in procs:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
