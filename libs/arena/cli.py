"""The ``arena`` command: run the embedded stack and talk to it.

    arena up [--llm-script FILE]        start nats-server + the four services; Ctrl-C stops them
    arena demo                          up + a group of 4 quickstart rollouts, printed, then down
    arena submit TASK [--n N] [--wait]  submit a rollout (or a group) of a task file
    arena status [ID]                   one rollout, or all of them
    arena trajectory ID                 a stored trajectory as JSON
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path

import msgspec

from arena.errors import ArenaError
from arena.settings import Settings, SettingsError

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = REPO_ROOT / "examples" / "quickstart"


def _client(args):
    from arena.sdk import ArenaClient

    return ArenaClient(args.url, args.trajectory_url)


def _fmt_time(ts: float, t0: float) -> str:
    return f"+{ts - t0:6.2f}s"


# ---------------------------------------------------------------------------- up


async def _up(settings: Settings, llm_script: str | None) -> None:
    from arena.runtime import stop_on_signals
    from arena.stack import Stack

    stop = stop_on_signals()
    stack = Stack(settings, llm_script=llm_script)
    await stack.start()
    print(f"\nArena is up. Rollout API and proxy: {settings.rollout_url}  trajectories: {settings.trajectory_url}")
    print(f"Logs in {stack.data_dir / 'logs'}. Ctrl-C to stop.", flush=True)
    try:
        while not stop.is_set():
            for child in stack.children:
                if not child.alive():
                    print(f"{child.name} exited with code {child.proc.returncode}; stopping. "
                          f"Last log lines:\n{child.tail()}", file=sys.stderr)
                    stop.set()
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    finally:
        print("stopping...", flush=True)
        stack.stop()
        print("stopped.")


def cmd_up(args) -> int:
    settings = Settings.from_env(**({"data_dir": args.data_dir} if args.data_dir else {}))
    asyncio.run(_up(settings, args.llm_script))
    return 0


# ---------------------------------------------------------------------------- demo


def print_rollout(client, view, t0: float) -> None:
    print(f"\nrollout {view.rollout_id}  (group member {view.group_index})")
    for t in view.history:
        frm = t.from_state.value if t.from_state else "-"
        print(f"  {_fmt_time(t.at, t0)}  {frm:>12} -> {t.to_state.value:<12} {t.reason}")
    try:
        traj = client.wait_trajectory(view.rollout_id, timeout=30)
    except ArenaError as exc:
        print(f"  trajectory: not available ({exc})")
        return
    for s in traj.steps:
        lp = s.logprobs or []
        mean_lp = sum(lp) / len(lp) if lp else float("nan")
        print(f"  step {s.step_index}: prompt {len(s.prompt_token_ids or [])} tokens, completion "
              f"{len(s.completion_token_ids or [])} tokens (ids from {s.token_ids_source}), "
              f"mean logprob {mean_lp:.3f}, finish {s.finish_reason}, {s.timings.total_ms:.1f} ms")
    v = traj.verification
    if v is not None:
        print(f"  verification: {v.counts.f2p_passed}/{v.counts.f2p_passed + v.counts.f2p_failed} FAIL_TO_PASS, "
              f"{v.counts.p2p_passed}/{v.counts.p2p_passed + v.counts.p2p_failed} PASS_TO_PASS passed"
              + (f", flags: {', '.join(v.flags)}" if v.flags else ""))
    print(f"  reward: {traj.reward:g}")


async def _demo(settings: Settings, n: int, seed: int) -> int:
    from arena.sdk import ArenaClient
    from arena.stack import Stack
    from arena.tasks import load_task

    task = load_task(QUICKSTART)
    print(f"== starting the embedded stack in {settings.data_dir}")
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", log=lambda m: print("   " + m))
    await stack.start()
    try:
        return await asyncio.to_thread(_demo_run, ArenaClient(settings.rollout_url, settings.trajectory_url),
                                       task, n, seed)
    finally:
        print("\n== stopping the stack")
        stack.stop()
        print("   stopped cleanly")


def _demo_run(client, task, n: int, seed: int) -> int:
    t0 = time.time()
    print(f"\n== submitting a group of {n} rollouts of task {task.id!r} (seeds {seed}..{seed + n - 1})")
    group = client.submit_group(task, n=n, seed=seed)
    print(f"   group {group.group_id}: {', '.join(group.rollout_ids)}")
    views = [client.wait(rid, timeout=300) for rid in group.rollout_ids]
    print(f"\n== all {n} rollouts final after {time.time() - t0:.1f}s")
    for view in views:
        print_rollout(client, view, t0)
    deadline = time.monotonic() + 30
    summary = None
    while time.monotonic() < deadline:
        try:
            summary = client.group(group.group_id)
            break
        except ArenaError:
            time.sleep(0.2)
    if summary is None:
        print("\nFAIL: the trajectory plane did not publish the completed group", file=sys.stderr)
        return 1
    rewards = summary["rewards"]
    print(f"\n== group {group.group_id}: rewards {rewards}")
    print(f"   GRPO advantages: {[round(a, 3) for a in summary['advantages']]}")
    ok = all(v.state.value == "completed" for v in views) and 1.0 in rewards and 0.0 in rewards
    if not ok:
        print("\nFAIL: expected every rollout completed and rewards that differ (at least one 1 and one 0)",
              file=sys.stderr)
        return 1
    print("\nOK: every rollout completed, rewards differ, advantages computed.")
    return 0


def cmd_demo(args) -> int:
    data_dir = Path(args.data_dir or ".arena/demo").resolve()
    if data_dir.exists():
        shutil.rmtree(data_dir)
    settings = Settings.from_env(data_dir=str(data_dir))
    return asyncio.run(_demo(settings, args.n, args.seed))


# ---------------------------------------------------------------------------- client commands


def cmd_submit(args) -> int:
    from arena.tasks import load_task

    task = load_task(args.task)
    with _client(args) as client:
        if args.n > 1:
            group = client.submit_group(task, n=args.n, seed=args.seed)
            print(f"group {group.group_id}")
            ids = group.rollout_ids
        else:
            view = client.submit(task)
            ids = [view.rollout_id]
        for rid in ids:
            print(rid)
        if args.wait:
            failed = 0
            for rid in ids:
                view = client.wait(rid, timeout=args.timeout)
                reward = "-" if view.reward is None else f"{view.reward:g}"
                print(f"{rid}  {view.state.value:<16} reward {reward:<4} {view.reason}")
                failed += view.state.value != "completed"
            return 1 if failed else 0
    return 0


def cmd_status(args) -> int:
    with _client(args) as client:
        if args.id:
            print(msgspec.json.format(msgspec.json.encode(client.get(args.id)), indent=2).decode())
            return 0
        for view in client.list(state=args.state):
            reward = "-" if view.reward is None else f"{view.reward:g}"
            print(f"{view.rollout_id}  {view.task_id:<24} {view.state.value:<16} reward {reward:<4} "
                  f"steps {view.steps:<3} {view.reason}")
    return 0


def cmd_trajectory(args) -> int:
    with _client(args) as client:
        traj = client.trajectory(args.id)
        print(msgspec.json.format(msgspec.json.encode(traj), indent=2).decode())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arena", description="Arena: rollouts, sandboxes, verification, "
                                                               "trajectories for agentic RL.")
    parser.add_argument("--url", default="http://127.0.0.1:9090", help="rollout API (default %(default)s)")
    parser.add_argument("--trajectory-url", default="http://127.0.0.1:9092",
                        help="trajectory API (default %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start the embedded stack until Ctrl-C")
    p.add_argument("--data-dir", help="where NATS, ClickHouse and logs live (default $ARENA_DATA_DIR or .arena)")
    p.add_argument("--llm-script", help="also start the scripted LLM backend with this script file")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("demo", help="start the stack, run a quickstart group, print it, stop")
    p.add_argument("--data-dir", help="default .arena/demo (wiped first)")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("submit", help="submit a task file (a rollout, or a group with --n)")
    p.add_argument("task", help="task.json or a directory holding one")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--wait", action="store_true", help="wait for every rollout to finish")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="show one rollout, or list them")
    p.add_argument("id", nargs="?")
    p.add_argument("--state")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("trajectory", help="print a stored trajectory")
    p.add_argument("id")
    p.set_defaults(func=cmd_trajectory)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ArenaError, SettingsError) as exc:
        code = getattr(exc, "code", "settings")
        print(f"arena: {code}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
