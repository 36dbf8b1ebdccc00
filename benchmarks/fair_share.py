"""Fair share: a light project's rollouts while a heavy project saturates the sandbox slots,
against the same rollouts on the idle stack, through the real stack (nats-server, the services
as processes, bubblewrap sandboxes, keys on).

The workload (``arena_stack.waiting_agents``): the stdlib agent making ``--turns`` chat calls to a
stand-in backend of fixed latency (``--latency``, sigma 0), graded ``exact``. Two projects, each
with its own key and default settings (normal priority, weight 1: the scheduler's fair share
alone decides; ``--light-priority high`` puts light in a higher class):

1. idle: project ``light`` runs ``--light`` rollouts one after another on the idle stack;
2. loaded: project ``heavy`` submits ``--heavy`` rollouts (in groups, honouring 429s), which
   fill the ``--slots`` slots and leave a backlog; once it waits, ``light`` runs the same
   rollouts one after another again; then heavy's remainder is cancelled (the run is bounded).

A rollout's time is its submission to its final state (its own history). Reported: light's p50
and p99 in each phase and their ratios (loaded / idle; the goal of issue 40: p99 within 10%);
its wait for a slot (submission to ``provisioning``: the scheduler's part; the rest is the
sandbox, the agent and verification on a host that is also running heavy's sandboxes); the
slots heavy held and its backlog while light ran.

    .venv/bin/python benchmarks/fair_share.py [--slots 16] [--heavy 400] [--light 20] [--turns 2]
                                              [--latency 1.0] [--light-priority normal] [--json]

Figures: docs/projects.md and docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec

from arena.sdk import ArenaClient
from arena_core import apikeys
from arena_core.bus import Bus
from arena_core.errors import Overloaded
from arena_core.schemas import RolloutState
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack
from arena_stack.waiting_agents import StandInBackend, agent_env, waiting_task, write_agent

S = RolloutState


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


def took(view) -> float:
    """Submission to final state, seconds, from the rollout's own history."""
    return view.history[-1].at - view.history[0].at


def waited(view) -> float:
    """Submission to its slot (``provisioning``): the scheduler's part of its time."""
    return next(t.at for t in view.history if t.to_state == S.PROVISIONING) - view.history[0].at


def light_run(client: ArenaClient, task, n: int, waits: list[float] | None = None) -> list[float]:
    times = []
    for i in range(n):
        view = client.wait(client.submit(task).rollout_id, timeout=600)
        if view.state != S.COMPLETED:
            raise SystemExit(f"a light rollout ended {view.state.value}: {view.reason}")
        times.append(took(view))
        if waits is not None:
            waits.append(waited(view))
    return times


def heavy_submitter(client: ArenaClient, task, n: int, stop: threading.Event, ids: list[str]) -> None:
    """``n`` rollouts in groups of 32, waiting out each 429's Retry-After."""
    left = n
    while left and not stop.is_set():
        size = min(32, left)
        try:
            ids.extend(client.submit_group(task, n=size).rollout_ids)
            left -= size
        except Overloaded as exc:
            stop.wait(max(exc.retry_after, 0.5))


async def main(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="arena-fair-share-"))
    agent_dir = write_agent(tmp / "agent")
    repo = tmp / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("a task whose agent mostly waits\n")
    with StandInBackend(free_port(), median_s=args.latency, sigma=0.0, limit=0, log=tmp / "backend.log") as backend:
        rp = free_port()
        settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp / "arena"),
                            rollout_port=rp, trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                            backend_url=backend.url, backend_policy_version="0", allow_host_paths=True,
                            sandbox_concurrency=args.slots, backend_max_inflight=max(64, 4 * args.slots))
        stack = Stack(settings, log=lambda m: None)
        await stack.start()
        try:
            bus = await Bus.connect(stack.direct_nats_url(), "fair-share-bench")
            try:
                heavy_key, _ = await apikeys.issue(bus, "heavy", ["submit", "read"], "heavy")
                light_key, _ = await apikeys.issue(bus, "light", ["submit", "read"], "light")
                admin_key, _ = await apikeys.issue(bus, "bench-admin", ["admin"])
            finally:
                await bus.close()
            await asyncio.sleep(1.0)  # the services' key watches see them
            return await asyncio.to_thread(run, args, settings, heavy_key, light_key, admin_key, repo, agent_dir)
        finally:
            stack.stop()


def run(args, settings: Settings, heavy_key: str, light_key: str, admin_key: str, repo, agent_dir) -> dict:
    heavy = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=heavy_key,
                        overload_wait=0)
    light = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=light_key)
    admin = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=admin_key)
    try:
        if args.light_priority != "normal":
            admin.set_project("light", priority=args.light_priority)
        base = waiting_task(repo, agent_dir, index=0, turns=args.turns, wall_clock_s=600)
        light_task = light.prepare(msgspec.structs.replace(base, agent=msgspec.structs.replace(
            base.agent, env=agent_env(1, args.turns))))
        heavy_task = heavy.prepare(msgspec.structs.replace(base, agent=msgspec.structs.replace(
            base.agent, env=agent_env(2, args.turns))))
        light_run(light, light_task, 2)  # warm: the sources' cache, the first sandbox
        print(f"idle: {args.light} light rollouts one after another", file=sys.stderr)
        idle_waits, loaded_waits = [], []
        idle = light_run(light, light_task, args.light, idle_waits)
        stop, ids = threading.Event(), []
        submitter = threading.Thread(target=heavy_submitter, args=(heavy, heavy_task, args.heavy, stop, ids))
        submitter.start()
        for _ in range(1200):  # until heavy holds every slot and has a backlog
            mine = {q["project"]: q for q in admin.projects()["projects"]}.get("heavy")
            if mine and mine["sandboxes"] >= args.slots and mine["waiting"] > 0:
                break
            time.sleep(0.1)
        else:
            raise SystemExit("heavy never filled the slots")
        print(f"loaded: heavy holds {args.slots} slots with a backlog; light again", file=sys.stderr)
        samples, loaded = [], []
        probe = threading.Event()

        def watch() -> None:
            while not probe.is_set():
                q = {q["project"]: q for q in admin.projects()["projects"]}
                samples.append((q.get("heavy", {}).get("sandboxes", 0), q.get("heavy", {}).get("waiting", 0)))
                probe.wait(1.0)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            loaded = light_run(light, light_task, args.light, loaded_waits)
        finally:
            probe.set()
            watcher.join()
            stop.set()
            submitter.join()
        for rid in ids:  # bounded: heavy's remainder goes
            try:
                if not heavy.get(rid).state.is_final:
                    heavy.cancel(rid)
            except Exception:  # noqa: BLE001 - ended meanwhile
                pass
    finally:
        heavy.close()
        light.close()
        admin.close()
    held = [s for s, _ in samples]
    backlog = [w for _, w in samples]
    return {
        "slots": args.slots, "heavy_submitted": len(ids), "light_rollouts": args.light, "turns": args.turns,
        "latency_s": args.latency, "light_priority": args.light_priority,
        "idle_p50_s": pct(idle, 50), "idle_p99_s": pct(idle, 99),
        "loaded_p50_s": pct(loaded, 50), "loaded_p99_s": pct(loaded, 99),
        "p50_ratio": pct(loaded, 50) / pct(idle, 50), "p99_ratio": pct(loaded, 99) / pct(idle, 99),
        "idle_wait_p50_s": pct(idle_waits, 50), "idle_wait_p99_s": pct(idle_waits, 99),
        "loaded_wait_p50_s": pct(loaded_waits, 50), "loaded_wait_p99_s": pct(loaded_waits, 99),
        "heavy_sandboxes_mean": statistics.fmean(held) if held else 0.0,
        "heavy_backlog_min": min(backlog) if backlog else 0,
        "idle_s": idle, "loaded_s": loaded,
    }


def report(r: dict) -> str:
    return "\n".join([
        f"fair share: {r['slots']} slots; heavy submitted {r['heavy_submitted']} rollouts, held "
        f"{r['heavy_sandboxes_mean']:.1f} sandboxes on average with at least {r['heavy_backlog_min']} waiting "
        f"while light ran; light: {r['light_rollouts']} rollouts of {r['turns']} x {r['latency_s']:g} s "
        f"(priority {r['light_priority']}), one after another",
        f"{'':22s} {'idle':>8s} {'loaded':>8s} {'ratio':>7s}",
        f"{'light p50 (s)':22s} {r['idle_p50_s']:8.2f} {r['loaded_p50_s']:8.2f} {r['p50_ratio']:7.2f}",
        f"{'light p99 (s)':22s} {r['idle_p99_s']:8.2f} {r['loaded_p99_s']:8.2f} {r['p99_ratio']:7.2f}",
        f"{'light slot wait p50 (s)':22s} {r['idle_wait_p50_s']:8.2f} {r['loaded_wait_p50_s']:8.2f}",
        f"{'light slot wait p99 (s)':22s} {r['idle_wait_p99_s']:8.2f} {r['loaded_wait_p99_s']:8.2f}",
        f"goal (issue 40): p99 ratio <= 1.10: {'met' if r['p99_ratio'] <= 1.10 else 'not met'}",
    ])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--heavy", type=int, default=400)
    parser.add_argument("--light", type=int, default=20)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--latency", type=float, default=1.0)
    parser.add_argument("--light-priority", choices=["high", "normal", "low"], default="normal")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    print(json.dumps(result, indent=1) if args.json else report(result))
