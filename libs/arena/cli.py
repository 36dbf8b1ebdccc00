"""The ``arena`` command: run the embedded stack and talk to it.

``arena --help`` lists the subcommands; docs/deploy.md ("The ``arena`` command") has them at a glance.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from pathlib import Path
from typing import get_args

import msgspec

from arena import endpoints, formats
from arena.endpoints import LOCAL_KEY_FILE
from arena_core.errors import ArenaError, InvalidRequest, Unauthorized
from arena_core.schemas import RolloutState, ScaffoldName
from arena_core.settings import Settings, SettingsError

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = REPO_ROOT / "examples" / "quickstart"


def _endpoints(args: argparse.Namespace) -> endpoints.Endpoints:
    """The APIs and the key for this command (``arena.endpoints.resolve``: ``--url`` /
    ``--trajectory-url``, then ``ARENA_URL`` / ``ARENA_TRAJECTORY_URL`` / ``ARENA_API_KEY``, then the
    local stack and ``$ARENA_DATA_DIR/api-key``); kept on ``args`` for main()'s error hints."""
    found = endpoints.resolve(getattr(args, "url", None), getattr(args, "trajectory_url", None))
    args.endpoints = found
    return found


def _client(args: argparse.Namespace):
    from arena.sdk import ArenaClient

    found = _endpoints(args)
    return ArenaClient(found.url, found.trajectory_url, api_key=found.api_key or "")


def _nats_url(url: str) -> str:
    """``url`` as given when it names a user; else with the ``admin`` credentials that
    ``arena up`` keeps under the data directory (``nats-users.json``), when this user can read them."""
    from urllib.parse import urlsplit

    from arena_stack import natsauth

    kept = Path(os.environ.get("ARENA_DATA_DIR", ".arena")) / natsauth.CREDENTIALS_FILE
    if any(urlsplit(one.strip()).username for one in url.split(",")) or not os.access(kept, os.R_OK):
        return url
    return natsauth.with_user(url, "admin", msgspec.json.decode(kept.read_bytes())["admin"])


#: How long the dashboard's one-time sign-in link stays usable.
SIGN_IN_MINUTES = 10


async def _sign_in_link(nats_url: str, dashboard_url: str, project: str = "default") -> str:
    """``{dashboard}/?token=...``: a one-time, read-only sign-in token (docs/dashboard.md, "Signing in")."""
    from arena_core import apikeys
    from arena_core.bus import Bus

    bus = await Bus.connect(nats_url, "arena-cli")
    try:
        token = await apikeys.issue_sign_in_token(bus, ttl_s=SIGN_IN_MINUTES * 60, project=project)
    finally:
        await bus.close()
    return f"{dashboard_url.rstrip('/')}/?token={token}"


def _reward_text(traj) -> str:
    """A trajectory's reward as the CLI shows it: the verifier's, or why there is none."""
    if traj.reward is not None:
        return format(traj.reward, "g")
    return "- (infrastructure outcome)" if traj.infrastructure else "- (not verified)"


def _fmt_time(ts: float, t0: float) -> str:
    return f"+{ts - t0:6.2f}s"


# ---------------------------------------------------------------------------- up


async def _up(settings: Settings, llm_script: str | None, cluster: int = 0) -> None:
    from arena_core.runtime import stop_on_signals
    from arena_stack import natsauth
    from arena_stack.stack import Stack

    stop = stop_on_signals()
    stack = Stack(settings, llm_script=llm_script, nats_cluster=cluster)
    await stack.start()
    print(f"\nArena is up. Rollout API and proxy: {settings.rollout_url}  trajectories: {settings.trajectory_url}")
    key = stack.api_key
    if key:
        print(f"API key for this machine's CLI (submit, read): {stack.data_dir / LOCAL_KEY_FILE} "
              "(the CLI, ArenaClient() and exports read it from $ARENA_DATA_DIR, default .arena, "
              "unless ARENA_API_KEY is set)")
    else:
        print("\nWARNING: ARENA_AUTH=off: the rollout and trajectory APIs ask for no key. Anyone who reaches "
              f"{settings.host} (every local user, at least) may submit, read and change everything.\n")
    print(f"NATS: one user per service, passwords in {stack.data_dir / natsauth.CREDENTIALS_FILE} (0600; "
          "the `admin` one for `arena keys`, a worker's own for a worker elsewhere)")
    if stack.dashboard_started:  # a one-time, read-only sign-in link (a cookie), never an API key in an address
        link = await _sign_in_link(stack.direct_nats_url(), stack.dashboard_url) if key else stack.dashboard_url
        print(f"Dashboard: {link}" + (f"  (one-time sign-in link, valid {SIGN_IN_MINUTES} minutes; "
                                      "`arena keys sign-in` makes another)" if key else ""))
    if cluster:
        print(f"NATS cluster of {cluster}: ARENA_NATS_URL={stack.nats_cluster.url} (with a user's credentials) "
              f"(replicas {stack.settings.nats_replicas})")
    print(_capacity_line(stack.settings))
    print(f"Logs in {stack.data_dir / 'logs'}. Ctrl-C to stop.", flush=True)
    try:
        await stack.supervise(stop)
    finally:
        print("stopping...", flush=True)
        stack.stop()
        print("stopped.")


def _capacity_line(settings: Settings) -> str:
    """How many agents this host holds at once and why, and what the backend is sent at once
    (docs/performance.md)."""
    held = settings.sandbox_capacity()
    return (f"Agents at once: {held.slots} sandboxes on this host ({held.reason}; "
            f"ARENA_SANDBOX_CONCURRENCY sets it). LLM calls in flight per backend replica: at most "
            f"{settings.backend_max_inflight} (ARENA_BACKEND_MAX_INFLIGHT, vLLM's --max-num-seqs); "
            "more wait in the proxy's queue.")


def _check_llm_script(path: str) -> None:
    """A script the scripted LLM will load, or an ``InvalidRequest`` naming what is wrong with it
    (before anything starts: the backend runs as a child process, its error only in its log)."""
    from arena_stack import scripted_llm

    try:
        scripted_llm.load_script(path)
    except OSError as exc:
        raise InvalidRequest(f"--llm-script {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # msgspec's DecodeError and ValidationError are ValueErrors
        raise InvalidRequest(f"--llm-script {path} is not a script: {exc}") from None


def cmd_up(args) -> int:
    settings = Settings.from_env(**({"data_dir": args.data_dir} if args.data_dir else {}))
    if args.cluster is not None and args.cluster < 1:
        raise ArenaError("--cluster takes the number of nats-servers, e.g. --cluster 3")
    if args.llm_script:
        _check_llm_script(args.llm_script)
    from arena_stack.stack import StackError

    try:
        asyncio.run(_up(settings, args.llm_script, args.cluster or 0))
    except StackError as exc:  # a port or the data directory another holds, or a child that keeps dying
        print(f"arena up: {exc}", file=sys.stderr)
        return 1
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
    print(f"  reward: {_reward_text(traj)}")


async def _demo(settings: Settings, n: int, seed: int) -> int:
    from arena.sdk import ArenaClient
    from arena_stack.stack import Stack
    from arena.tasks import load_task

    task = load_task(QUICKSTART)
    print(f"== starting the embedded stack in {settings.data_dir}")
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", log=lambda m: print("   " + m))
    await stack.start()
    try:
        key = stack.api_key
        print(f"   API keys on: this client's key in {stack.data_dir / LOCAL_KEY_FILE}" if key else
              "   WARNING: ARENA_AUTH=off: the APIs ask for no key; anyone who reaches them may use them")
        return await asyncio.to_thread(_demo_run, ArenaClient(settings.rollout_url, settings.trajectory_url,
                                                              api_key=key), task, n, seed)
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

    from arena.authoring import with_agent

    task = with_agent(load_task(args.task), scaffold=args.scaffold, model=args.model)
    model = args.model or "default"
    if (args.first_k is not None or args.deadline is not None) and args.n < 2:
        raise InvalidRequest("--first-k and --deadline are a group's completion policy: give --n N (N >= 2)")
    with _client(args) as client:
        if args.n > 1:
            group = client.submit_group(task, n=args.n, seed=args.seed, model=model, first_k=args.first_k,
                                        deadline_s=args.deadline, provider=args.provider)
            print(f"group {group.group_id}")
            ids = group.rollout_ids
        else:
            view = client.submit(task, model=model, provider=args.provider)
            ids = [view.rollout_id]
        for rid in ids:
            print(rid)
        if args.wait:
            return _wait_rollouts(client, ids, args.timeout)
    return 0


def _wait_rollouts(client, ids: list[str], timeout: float) -> int:
    """Wait for every rollout (concurrently), a progress bar on stderr and, on stdout, a line per
    rollout as it finishes; 1 when any did not complete."""
    from arena.progress import WaitProgress, as_finished, outcome_of

    failed = 0
    with WaitProgress(len(ids), "rollouts") as progress:
        for rid, view in as_finished(ids, lambda rid: client.wait(rid, timeout=timeout)):
            reward = "-" if view.reward is None else f"{view.reward:g}"
            if not view.state.is_final:
                progress.finished(rid, "failed")
                print(f"{rid}  {view.state.value:<16} reward {reward:<4} (still running after {timeout:g}s)",
                      flush=True)
            else:
                progress.finished(rid, outcome_of(view))
                print(f"{rid}  {view.state.value:<16} reward {reward:<4} {view.reason}", flush=True)
            # a member its group's completion policy cancelled did what was asked
            failed += view.state.value != "completed" and not view.group_cancelled
    return 1 if failed else 0


def cmd_duel(args) -> int:
    """A duel per task (``--task``, or each task of ``--dataset``): two policies, the same seeds;
    with ``--wait``, the rounds as they are decided, each duel's result and the leaderboard."""
    from arena import datasets
    from arena.tasks import load_task

    if len(args.policy) != 2:
        raise ArenaError("a duel takes two policies: --policy A --policy B")
    paths = [Path(args.task)] if args.task else list(datasets.iter_task_files(Path(args.dataset)))
    if not paths:
        raise ArenaError(f"no task files in {args.dataset}")
    with _client(args) as client:
        submitted = []
        for path in paths:
            duel = client.submit_duel(load_task(path), policies=args.policy, n=args.seeds, seed=args.seed,
                                      provider=args.provider)
            print(f"duel {duel.duel_id}  task {duel.task_id}  {duel.policies[0]} (a) vs {duel.policies[1]} (b), "
                  f"{args.seeds} seeds from {args.seed}", flush=True)
            submitted.append(duel)
        if not args.wait:
            return 0
        undecided = 0
        for duel in submitted:
            policies = duel.policies

            def show(r: dict, duel_id: str = duel.duel_id) -> None:
                rewards = "  ".join("-" if x is None else f"{x:g}" for x in r["rewards"])
                who = {"a": policies[0], "b": policies[1]}.get(r["winner"], r["winner"])
                print(f"  {duel_id} seed {r['seed']:<4} rewards {rewards:<10} -> {who}", flush=True)

            result = client.wait_duel(duel.duel_id, timeout=args.timeout, on_round=show)
            wins, draws, void = result["wins"], result["draws"], result["void"]
            outcome = result["winner"] or ("a tie" if result["complete"] else "undecided (timed out)")
            print(f"duel {duel.duel_id}: {policies[0]} {wins[0]} - {wins[1]} {policies[1]}, {draws} draw(s), "
                  f"{void} void; winner: {outcome}", flush=True)
            undecided += not result["complete"]
        board = client.leaderboard()
        print(f"\nleaderboard ({board['method']}, {board['games']} games; 95% interval)")
        print(f"{'#':>3}  {'policy':<32} {'rating':>7}  {'interval':>15}  {'games':>5} {'W':>4} {'L':>4} {'D':>4}")
        for i, r in enumerate(board["ratings"], 1):
            interval = f"{r['ci_low']:.0f}..{r['ci_high']:.0f}"
            print(f"{i:>3}  {r['policy']:<32} {r['rating']:>7.1f}  {interval:>15}  {r['games']:>5} {r['wins']:>4} "
                  f"{r['losses']:>4} {r['draws']:>4}")
        return 1 if undecided else 0


#: What ``arena status`` asks of the API when it filters client-side (the API's most).
LIST_MAX = 100_000


def cmd_status(args) -> int:
    """One rollout as JSON, or a table of rollouts (oldest first, the newest ``--limit``). The API
    filters by state and group; the task is filtered here, as is the limit once anything is."""
    if not 1 <= args.limit <= LIST_MAX:
        raise InvalidRequest(f"--limit takes 1 to {LIST_MAX}, not {args.limit}")
    with _client(args) as client:
        if args.id:
            print(msgspec.json.format(msgspec.json.encode(client.get(args.id)), indent=2).decode())
            return 0
        # the API cuts to its limit before it picks the group: ask for all it has when a filter follows
        server_limit = args.limit if args.group is None and args.task is None else LIST_MAX
        views = client.list(state=args.state, group_id=args.group, limit=server_limit)
    if args.task is not None:
        views = [v for v in views if v.task_id == args.task]
    views = views[-args.limit:]
    if not views:
        given = ", ".join(f"--{k} {v}" for k, v in (("state", args.state), ("group", args.group),
                                                    ("task", args.task)) if v is not None)
        print("no rollouts" + (f" match {given}" if given else " yet"), file=sys.stderr)
        return 0
    print("\n".join(status_table(views, now=time.time())))
    return 0


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def status_table(views, *, now: float, width: int | None = None) -> list[str]:
    """Rollouts as a table: id, task, state, reward, steps, group (member/size), age, reason."""
    from arena.table import format_table

    rows = [(v.rollout_id, v.task_id, v.state.value + (" (infra)" if v.infrastructure else ""),
             "-" if v.reward is None else f"{v.reward:g}", v.steps,
             f"{v.group_id} {v.group_index + 1}/{v.group_size}" if v.group_id else "-",
             _age(now - v.created_at), v.reason or "-") for v in views]
    return format_table(["ROLLOUT", "TASK", "STATE", "REWARD", "STEPS", "GROUP", "CREATED", "REASON"], rows,
                        width=width, right=["REWARD", "STEPS"], drop=["CREATED", "STEPS", "GROUP"])


def trajectory_summary(traj) -> list[str]:
    """A stored trajectory in a few lines: state, reward, turns, tokens, verification, flags."""
    prompt = sum(s.usage.prompt_tokens or len(s.prompt_token_ids or []) for s in traj.steps)
    completion = sum(s.usage.completion_tokens or len(s.completion_token_ids or []) for s in traj.steps)
    group = f"  group {traj.group_id} member {traj.group_index + 1}/{traj.group_size}" if traj.group_id else ""
    reward = _reward_text(traj)
    lines = [f"rollout      {traj.rollout_id}  task {traj.task_id}{group}",
             f"state        {traj.final_state.value}" + (f": {traj.reason}" if traj.reason else ""),
             f"reward       {reward}",
             f"turns        {len(traj.steps)} LLM call(s), {len(traj.sequences)} training sequence(s)",
             f"tokens       {prompt} prompt, {completion} completion"]
    v = traj.verification
    if v is None:
        lines.append("verification none")
    else:
        c = v.counts
        tests = (f"{c.f2p_passed}/{c.f2p_passed + c.f2p_failed} FAIL_TO_PASS, "
                 f"{c.p2p_passed}/{c.p2p_passed + c.p2p_failed} PASS_TO_PASS passed")
        verdict = "passed" if v.passed else "not passed"
        lines.append(f"verification {v.verifier}: {verdict}; {tests}" + (f"; {v.reason}" if v.reason else "")
                     + (f"; error: {v.error}" if v.error else ""))
    lines.append(f"flags        {', '.join(v.flags) if v is not None and v.flags else 'none'}")
    if traj.incomplete:
        lines.append(f"incomplete   {', '.join(traj.incomplete)}")
    if traj.policy_versions:
        lines.append(f"policy       {', '.join(traj.policy_versions)}")
    return lines


def cmd_trajectory(args) -> int:
    with _client(args) as client:
        traj = client.trajectory(args.id)
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(traj), indent=2).decode())
        return 0
    print("\n".join(trajectory_summary(traj)))
    print(f"(the whole trajectory, steps with token ids and logprobs: arena trajectory {traj.rollout_id} --json)")
    return 0


def cmd_verify(args) -> int:
    from arena import replay

    spec = replay.parse_verifier(args.verifier)
    name = args.name or replay.replay_name(spec)
    with _client(args) as client:
        trajectory = client.trajectory(args.id)

    async def run():
        from arena_core.bus import Bus

        bus = await Bus.connect(_nats_url(args.nats_url), "cli")
        try:
            task = await replay.rollout_task(bus, args.id)
            return await replay.replay(bus, replay.build_job(trajectory, task, spec, name), timeout=args.timeout)
        finally:
            await bus.close()

    result = asyncio.run(run())
    print(msgspec.json.format(msgspec.json.encode(result), indent=2).decode())
    return 0


def cmd_export(args) -> int:
    from arena.export import ExportOptions
    from arena.export_io import ExportFilter, HttpSource, Progress, StoreSource, export

    f = ExportFilter(task_id=args.task_id, since=args.since, until=args.until, policy_version=args.policy_version)
    if args.store:
        source: StoreSource | HttpSource = StoreSource(args.store, f)
    else:
        found = _endpoints(args)
        source = HttpSource(found.trajectory_url, f, api_key=found.api_key or "")
    options = ExportOptions(include_incomplete=args.include_incomplete, include_partial_groups=args.include_partial,
                            sft_threshold=args.sft_threshold, dpo_margin=args.dpo_margin, dpo_pairs=args.dpo_pairs,
                            normalize_std=not args.no_std)
    progress = Progress(None, enabled=False if args.quiet else None)
    stats, files = export(source, view=args.view, fmt=args.format, out=Path(args.out), options=options,
                          progress=progress)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(stats.skipped.items())) or "nothing"
    print(f"{stats.rows} {args.view} rows from {stats.trajectories} trajectories in {stats.groups} groups "
          f"-> {len(files)} file(s) under {args.out}; skipped: {skipped}")
    if stats.trajectories:
        return 0
    print(_nothing_matched(source, f), file=sys.stderr)
    return 1


def _nothing_matched(source, f) -> str:
    """The warning for an export that read no trajectory: the filters, and the task ids a
    ``--task-id`` may have meant (from the trajectory API; a ``--store`` export names none)."""
    from arena.export import near_matches
    from arena.export_io import HttpSource

    given = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in msgspec.structs.asdict(f).items() if v is not None)
    where = "the store" if not isinstance(source, HttpSource) else source.url
    if not given:
        return f"arena: warning: no trajectory stored in {where} yet: nothing exported"
    message = f"arena: warning: no trajectory in {where} matches {given}: nothing exported"
    if f.task_id and isinstance(source, HttpSource):
        try:
            known = asyncio.run(source.task_ids())
        except ArenaError as exc:  # the warning stands without its suggestions
            return f"{message} (no task ids to suggest: {exc})"
        near = near_matches(f.task_id, known)
        if f.task_id in known:
            message += f"; task {f.task_id!r} is stored: the other filters leave none of its trajectories"
        elif near:
            message += f"; task ids near {f.task_id!r}: {', '.join(near)}"
        elif known:
            message += f"; no task id is near {f.task_id!r} ({len(known)} task(s) stored)"
    return message


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (``arena: ...``, exit 2) rather than the usage text."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"arena: {message} (`{self.prog} --help` lists the options)\n")


def _stack_options() -> argparse.ArgumentParser:
    """``--url`` and ``--trajectory-url``: a parent of the parser and of each subcommand that talks
    to the APIs, so they go before or after the subcommand (``SUPPRESS``: a subcommand that is not
    given them keeps what came before it); unset, ``arena.endpoints.resolve`` finds them."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help=f"rollout API (default $ARENA_URL or {endpoints.DEFAULT_URL})")
    common.add_argument("--trajectory-url", default=argparse.SUPPRESS,
                        help=f"trajectory API (default $ARENA_TRAJECTORY_URL or {endpoints.DEFAULT_TRAJECTORY_URL})")
    return common


def build_parser() -> argparse.ArgumentParser:
    stack = _stack_options()
    parser = _Parser(prog="arena", parents=[stack],
                     description="Arena: rollouts, sandboxes, verification, trajectories for agentic RL. The key "
                                 "sent to the APIs: $ARENA_API_KEY, else the one `arena up` wrote to "
                                 "$ARENA_DATA_DIR/api-key (default .arena/api-key).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start the embedded stack until Ctrl-C")
    p.add_argument("--data-dir", help="where NATS, ClickHouse and logs live (default $ARENA_DATA_DIR or .arena)")
    p.add_argument("--llm-script", help="also start the scripted LLM backend with this script file")
    p.add_argument("--cluster", type=int, metavar="N",
                   help="run NATS as a JetStream cluster of N nats-servers (streams and buckets at N "
                        "replicas, at most 5) instead of one: node 0 on the port of $ARENA_NATS_URL")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("demo", help="start the stack, run a quickstart group, print it, stop")
    p.add_argument("--data-dir", help="default .arena/demo (wiped first)")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("submit", parents=[stack], help="submit a task file (a rollout, or a group with --n)")
    p.add_argument("task", help="task.json or a directory holding one")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--first-k", type=int, default=None, metavar="K",
                   help="a group is done once K members ended with a reward; the rest are cancelled")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="cancel a group's members not ended S seconds after submission")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--wait", action="store_true", help="wait for every rollout to finish")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--scaffold", choices=list(get_args(ScaffoldName)),
                   help="run this agent scaffold (its preset, docs/agents.md) instead of the task's agent")
    p.add_argument("--model", help="the rollout's model (the proxy sends it to the backend); also the model "
                                   "of the task's scaffold or of --scaffold")
    p.add_argument("--provider", choices=["local", "docker", "mock"], default="local",
                   help="sandbox provider (default %(default)s; docker: the task's own image, e.g. an imported "
                        "Harbor or Terminal-Bench task)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("duel", parents=[stack],
                       help="one task (or each task of a dataset) for two policies on the same seeds")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--task", help="task.json or a directory holding one")
    which.add_argument("--dataset", help="an import's output directory (`arena tasks import`): a duel per task")
    p.add_argument("--policy", action="append", default=[], required=True,
                   help="a model name the backends serve (twice: side a, then side b)")
    p.add_argument("--seeds", type=int, default=8, help="rounds, one per seed (1-64, default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the first seed (default %(default)s)")
    p.add_argument("--provider", choices=["local", "docker", "mock"], default="local")
    p.add_argument("--wait", action="store_true", help="print the rounds as they are decided, the result and "
                                                       "the leaderboard")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each duel")
    p.set_defaults(func=cmd_duel)

    p = sub.add_parser("tasks", help="tasks: init, check, shell (writing one); push, import, validate "
                                     "(bundles and datasets)")
    tasks = p.add_subparsers(dest="tasks_command", required=True)
    q = tasks.add_parser("push", parents=[stack],
                         help="upload a directory as a content-addressed bundle; prints its digest")
    q.add_argument("dir")
    q.set_defaults(func=cmd_tasks_push)
    q = tasks.add_parser("import", parents=[stack], help="turn a dataset into task files: "
                                                         + ", ".join(formats.names()))
    importers = q.add_subparsers(dest="format", required=True, metavar="FORMAT",
                                 parser_class=_Parser)
    for name in formats.names():
        module = formats.load(name)
        r = importers.add_parser(name, parents=[stack], help=module.SUMMARY, description=module.SUMMARY)
        module.add_arguments(r)
        r.set_defaults(func=cmd_tasks_import)
    q = tasks.add_parser("validate", parents=[stack],
                         help="each task's oracle (gold patch, solve.sh) must score 1 and a do-nothing agent 0 "
                              "(through the running stack)")
    q.add_argument("path", help="an import's output directory, or one task file")
    q.add_argument("--timeout", type=float, default=900.0)
    q.add_argument("--runs", type=int, default=1, help="run each agent this many times: a task whose rewards "
                                                       "differ is flaky (default %(default)s; 3 finds most)")
    q.add_argument("--provider", choices=["local", "docker", "mock"],
                   help="sandbox provider (default: docker for a task with its own image, else local)")
    q.add_argument("--build", action="store_true", help="build each task's image first (arena images build); "
                                                        "a failed build is the task's verdict")
    q.add_argument("--base-map", default=os.environ.get("ARENA_IMAGE_BASE_MAP", ""),
                   help="with --build: base images as local ones (as arena images build --base-map)")
    q.add_argument("-v", "--verbose", action="store_true")
    q.set_defaults(func=cmd_tasks_validate)
    q = tasks.add_parser("audit", parents=[stack],
                         help="the hack suite against each task (through the running stack): the share of hacks "
                              "that scored above a do-nothing agent, per task and in total (arena.audit)")
    q.add_argument("path", help="an import's output directory, or one task file")
    q.add_argument("--hack", action="append", help="only this hack (repeatable; default: all of arena.hacks)")
    q.add_argument("--provider", choices=["local", "docker"],
                   help="sandbox provider (default: docker for a task with its own image, else local)")
    q.add_argument("--timeout", type=float, default=900.0)
    q.add_argument("-v", "--verbose", action="store_true")
    q.set_defaults(func=cmd_tasks_audit)
    q = tasks.add_parser("export", help="write Arena tasks as tasks of another format (harbor: task "
                                        "directories and a dataset.toml Harbor's loader accepts)")
    q.add_argument("format", choices=["harbor"])
    q.add_argument("path", help="an import's output directory, or one task file (reward_file tasks)")
    q.add_argument("--out", required=True, help="directory for <name>/ per task and dataset.toml")
    q.add_argument("--dataset-name", default="arena/exported", help="dataset.toml's [dataset] name (org/name)")
    q.set_defaults(func=cmd_tasks_export)
    q = tasks.add_parser("init", help="write a skeleton task (instructions, repository, tests verifier, "
                                      "oracle solution) to a new directory NAME")
    q.add_argument("name", help="the directory, named after the task id")
    q.set_defaults(func=cmd_tasks_init)
    q = tasks.add_parser("check", parents=[stack],
                         help="through the running stack: the task's oracle (gold/<id>.patch) scores 1, "
                              "doing nothing 0")
    q.add_argument("task", help="task.json or a directory holding one")
    q.add_argument("--timeout", type=float, default=600.0)
    q.add_argument("-v", "--verbose", action="store_true")
    q.set_defaults(func=cmd_tasks_check)
    q = tasks.add_parser("shell", parents=[stack],
                         help="an interactive shell in the task's sandbox, as its agent has it (bubblewrap, the "
                              "task's source in /sandbox/workspace: a directory, a bundle of the stack, a git "
                              "commit; an image source: a container of its image, as the docker provider makes "
                              "it, on the engine at ARENA_DOCKER_URL)")
    q.add_argument("task", help="task.json or a directory holding one")
    q.add_argument("command", nargs=argparse.REMAINDER, help="a command instead of the shell (after --)")
    q.set_defaults(func=cmd_tasks_shell)

    from arena import eval_cli

    eval_cli.add_parser(sub, stack)

    p = sub.add_parser("status", parents=[stack], help="show one rollout, or list them")
    p.add_argument("id", nargs="?")
    p.add_argument("--state", choices=[state.value for state in RolloutState], help="only rollouts in this state")
    p.add_argument("--group", help="only the members of this group")
    p.add_argument("--task", help="only rollouts of this task id")
    p.add_argument("--limit", type=int, default=50, help="the newest that many (default %(default)s)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("trajectory", parents=[stack], help="a stored trajectory: a summary, or --json")
    p.add_argument("id")
    p.add_argument("--json", action="store_true", help="the whole trajectory as JSON (steps, token ids, logprobs)")
    p.set_defaults(func=cmd_trajectory)

    p = sub.add_parser("export", parents=[stack], help="export stored trajectories as training data (Parquet or JSONL)")
    p.add_argument("--view", choices=["grpo", "dpo", "sft", "tokens"], required=True)
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    p.add_argument("--out", required=True, help="a directory for parquet (date=/task= partitions), a file for jsonl")
    p.add_argument("--store", help="read a chDB directory (service stopped) or ClickHouse URL instead of the "
                                   "trajectory API (--trajectory-url)")
    p.add_argument("--task-id")
    p.add_argument("--policy-version")
    p.add_argument("--since", type=float, help="completed at or after (unix seconds)")
    p.add_argument("--until", type=float, help="completed before (unix seconds)")
    p.add_argument("--sft-threshold", type=float, default=1.0, help="sft: minimum reward (default %(default)s)")
    p.add_argument("--dpo-margin", type=float, default=0.0, help="dpo: minimum reward gap, exclusive")
    p.add_argument("--dpo-pairs", choices=["best-worst", "all"], default="best-worst")
    p.add_argument("--no-std", action="store_true", help="advantages r - mean, not divided by std (Dr. GRPO)")
    p.add_argument("--include-incomplete", action="store_true", help="keep trajectories marked incomplete")
    p.add_argument("--include-partial", action="store_true", help="use groups that are missing members")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("verify", parents=[stack], help="re-verify a stored rollout with a new or changed verifier")
    p.add_argument("id")
    p.add_argument("--verifier", required=True, help="verifier JSON, or a file holding it (or a task.json)")
    p.add_argument("--name", help="name the result is stored under (default replay-<type>-<hash>)")
    p.add_argument("--nats-url", default=os.environ.get("ARENA_NATS_URL", "nats://127.0.0.1:4222"),
                   help="NATS (default $ARENA_NATS_URL or %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("images", help="sandbox images, built locally with Podman (docs/agents.md, Images)")
    images = p.add_subparsers(dest="images_command", required=True)
    q = images.add_parser("build", help="build images (and those they are built from); kept when current. "
                                        "Given an import's output directory or task files: each task's own image")
    q.add_argument("names", nargs="*", help="agent-base, quickstart, agent-node, claude-code, opencode, "
                                            "mini-swe-agent (default: all); or imported tasks (a directory, "
                                            "task files): their Dockerfiles, built offline with Podman")
    q.add_argument("--rebuild", action="store_true", help="rebuild even the images that are current")
    q.add_argument("--base-map", default=os.environ.get("ARENA_IMAGE_BASE_MAP", ""),
                   help="task images: base images as local ones, IMAGE=LOCAL[,...] (default "
                        "$ARENA_IMAGE_BASE_MAP), e.g. ubuntu:24.04=localhost/arena/quickstart:latest")
    q.set_defaults(func=cmd_images_build)

    p = sub.add_parser("backend", help="register, list or remove LLM backend replicas (arena_backends)")
    p.add_argument("action", choices=["register", "list", "remove"])
    p.add_argument("--id", help="replica id")
    p.add_argument("--url", dest="replica_url", help="OpenAI-compatible base URL, ending in /v1")
    p.add_argument("--model", action="append", help="a model it serves (repeatable; none = any)")
    p.add_argument("--policy-version", default="", help="policy version it serves (after a weight sync)")
    p.add_argument("--max-inflight", type=int, default=64,
                   help="requests the replica serves at once: the proxy sends it no more, the rest wait in "
                        "its queue; give vLLM's --max-num-seqs (default %(default)s)")
    p.add_argument("--nats-url", default=os.environ.get("ARENA_NATS_URL", "nats://127.0.0.1:4222"),
                   help="NATS (default $ARENA_NATS_URL or %(default)s)")
    p.set_defaults(func=cmd_backend)

    p = sub.add_parser("keys", help="API keys of the rollout and trajectory APIs (create, list, revoke), "
                                    "and a one-time dashboard sign-in link (sign-in)")
    p.add_argument("action", choices=["create", "list", "revoke", "sign-in"])
    p.add_argument("--dashboard-url", default=os.environ.get("ARENA_DASHBOARD_URL") or
                   f"http://127.0.0.1:{os.environ.get('ARENA_DASHBOARD_PORT', '9091')}",
                   help="sign-in: the dashboard (default $ARENA_DASHBOARD_URL or %(default)s)")
    p.add_argument("--name", default="", help="create: who or what the key is for")
    p.add_argument("--scope", action="append", choices=["submit", "read", "admin"],
                   help="create: a scope (repeatable): submit (POST), read (GET), admin (both)")
    p.add_argument("--project", default="default",
                   help="create, sign-in: the project the key sees and makes objects in (default %(default)s); "
                        "an admin key sees every project (docs/projects.md)")
    p.add_argument("--id", help="revoke: the key's id (`arena keys list`)")
    p.add_argument("--nats-url", default=os.environ.get("ARENA_NATS_URL", "nats://127.0.0.1:4222"),
                   help="NATS (default $ARENA_NATS_URL or %(default)s)")
    p.set_defaults(func=cmd_keys)
    p = sub.add_parser("projects", parents=[stack],
                       help="projects' quotas and priorities of the sandbox slots (set: an admin key; list)")
    p.add_argument("action", choices=["set", "list"])
    p.add_argument("name", nargs="?", help="set: the project")
    p.add_argument("--max-sandboxes", type=int, help="set: sandboxes it holds at once at most (0: no limit of its own)")
    p.add_argument("--max-queued", type=int, help="set: rollouts it may have waiting; beyond, 429 (0: no limit of its own)")
    p.add_argument("--priority", choices=["high", "normal", "low"], help="set: its class, served before the lower ones")
    p.add_argument("--weight", type=float, help="set: its fair share of the slots within its class (> 0)")
    p.set_defaults(func=cmd_projects)
    p = sub.add_parser("track", help="follow the trainer stream and log each completed group's rewards, pass rate, "
                                     "tokens and infrastructure outcomes to W&B, MLflow or TensorBoard")
    p.add_argument("--to", choices=["wandb", "mlflow", "tensorboard"], required=True)
    p.add_argument("--group-by", choices=["task"], help="the figures under {task_id}/, one series per task")
    p.add_argument("--dir", help="wandb: the runs' directory; mlflow: the tracking URI or a local directory; "
                                 "tensorboard: the event files' directory (default runs)")
    p.add_argument("--project", default="arena", help="the W&B project or MLflow experiment (default %(default)s)")
    p.add_argument("--arena-project", help="only this Arena project's groups (default: every project's; "
                                           "docs/projects.md)")
    p.add_argument("--run-name")
    p.add_argument("--name", default="tracker",
                   help="the durable consumer is trainer-NAME: a restart goes on where it stopped "
                        "(default %(default)s)")
    p.add_argument("--nats-url", help="default $ARENA_NATS_URL or nats://127.0.0.1:4222; without a user, the "
                                      "local stack's trainer user from $ARENA_DATA_DIR/nats-users.json")
    p.add_argument("--data-dir", help="the local stack's data directory (default $ARENA_DATA_DIR or .arena)")
    p.add_argument("--limit", type=int, help="stop after this many groups")
    p.add_argument("--idle", type=float, help="stop after this many seconds without a group")
    p.add_argument("--wandb-offline", action="store_true", help="a W&B run on disk only (no login; wandb sync)")
    p.set_defaults(func=cmd_track)

    return parser


# ---------------------------------------------------------------------------- images


def cmd_images_build(args) -> int:
    """``deploy/images/build.sh`` of this checkout: as root into the docker engine's store (through
    ``deploy/docker-engine.sh``, as ``make images``), else into the user's own Podman store."""
    import subprocess

    paths = [name for name in args.names if os.sep in name or name.endswith(".json") or Path(name).exists()]
    if paths:
        if len(paths) != len(args.names):
            raise ArenaError("give either image names or imported tasks (directories, task files), not both")
        return _build_task_images(args, [Path(p) for p in paths])
    deploy = REPO_ROOT / "deploy"
    if not (deploy / "images" / "build.sh").is_file():
        raise ArenaError(f"no deploy/images/build.sh under {REPO_ROOT}: images are built from a checkout of Arena")
    names = args.names or ["all"]
    env = dict(os.environ, ARENA_IMAGES=" ".join(names))
    if args.rebuild:
        env["ARENA_REBUILD_IMAGES"] = "1"
    if os.geteuid() == 0:
        command = ["bash", str(deploy / "docker-engine.sh"), "images"]
    else:
        command = ["bash", str(deploy / "images" / "build.sh"), *names]
    return subprocess.run(command, env=env, check=False).returncode


def _build_task_images(args, paths: list[Path]) -> int:
    """Each imported task's image (:mod:`arena.images`), then a table; exit 1 if one failed."""
    from arena import images
    from arena.table import format_table

    base_map = images.parse_base_map(args.base_map)
    builds = [b for path in paths for b in images.task_builds(path)]
    if not builds:
        raise ArenaError(f"no imported task with a build context (metadata.environment) in {', '.join(map(str, paths))}")
    results = []
    done: dict[str, images.BuildResult] = {}
    for i, (task_file, task) in enumerate(builds, 1):
        result = done.get(task.image or "") or images.build_task(task_file, task, base_map=base_map,
                                                                 rebuild=args.rebuild)
        if result.status != "failed":
            done[result.tag] = result  # tasks sharing a Dockerfile share its image
        result = images.BuildResult(task.id, result.tag, result.status, result.seconds, result.log, result.reason)
        print(f"[{i}/{len(builds)}] {task.id}: {result.status} {result.tag} ({result.seconds:.1f}s)"
              + (f": {result.reason}" if result.reason else ""), flush=True)
        results.append(result)
    rows = [(r.task_id, r.status, r.tag, f"{r.seconds:.1f}", str(r.log or "-")) for r in results]
    print("\n".join(format_table(["TASK", "BUILD", "IMAGE", "SECONDS", "LOG"], rows, right=["SECONDS"])))
    failed = [r for r in results if r.status == "failed"]
    for r in failed:
        print(f"build failed: {r.task_id}: {r.reason}" + (f" (log: {r.log})" if r.log else ""))
    print(f"{len(results) - len(failed)}/{len(results)} task image(s) ready")
    return 1 if failed else 0


# ---------------------------------------------------------------------------- tasks


def cmd_tasks_push(args) -> int:
    with _client(args) as client:
        print(client.push_bundle(args.dir))
    return 0


def cmd_tasks_import(args) -> int:
    """``arena tasks import FORMAT ...``: the format's module (:mod:`arena.formats`) does the import."""
    return formats.load(args.format).run(args, lambda: _client(args))


def cmd_tasks_validate(args) -> int:
    """Each task's oracle (gold patch, solve.sh) must score 1 and doing nothing 0, through the running stack."""
    from arena import datasets

    return _check_tasks(args, list(datasets.iter_task_files(Path(args.path))), oracle_required=False)


def cmd_tasks_audit(args) -> int:
    """``arena tasks audit PATH``: every hack agent and a do-nothing agent on each task (:mod:`arena.audit`)."""
    from arena import audit, datasets

    paths = list(datasets.iter_task_files(Path(args.path)))
    if not paths:
        raise InvalidRequest(f"no task files in {args.path}")
    with _client(args) as client:
        return audit.audit(client, paths, hacks=args.hack, provider=args.provider, timeout=args.timeout,
                           verbose=args.verbose)


def cmd_tasks_export(args) -> int:
    """``arena tasks export harbor PATH --out DIR``: each task as a Harbor task, and a dataset.toml."""
    from arena import datasets
    from arena.formats import harbor
    from arena.tasks import load_task

    tasks = [(p, load_task(p)) for p in datasets.iter_task_files(Path(args.path))]
    if not tasks:
        raise InvalidRequest(f"no task files in {args.path}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        exported = harbor.export_dataset(tasks, out, args.dataset_name)
    except harbor.HarborError as exc:
        raise InvalidRequest(str(exc)) from None
    for directory in exported:
        print(f"{directory}  {harbor.task_digest(directory)}")
    print(f"wrote {len(exported)} Harbor task(s) and {out / 'dataset.toml'}")
    return 0


def cmd_tasks_check(args) -> int:
    """One task (``arena tasks init``'s layout): its oracle solution (``gold/<id>.patch``) must score
    1 and doing nothing 0, through the running stack."""
    path = Path(args.task)
    return _check_tasks(args, [path / "task.json" if path.is_dir() else path], oracle_required=True)


def _check_tasks(args, paths: list[Path], *, oracle_required: bool) -> int:
    """Each task's oracle must score 1 and doing nothing 0 (:mod:`arena.validate`)."""
    from arena import validate

    runs = getattr(args, "runs", 1)
    if not 1 <= runs <= 20:
        raise InvalidRequest(f"--runs takes 1 to 20, not {runs}")
    with _client(args) as client:
        return validate.validate(client, paths, oracle_required=oracle_required, runs=runs,
                                 provider=getattr(args, "provider", None), timeout=args.timeout,
                                 verbose=args.verbose, build=getattr(args, "build", False),
                                 base_map=getattr(args, "base_map", ""))


def cmd_tasks_init(args) -> int:
    from arena.authoring import init_task

    directory = Path(args.name)
    task = init_task(directory)
    print(f"wrote task {task.id} to {directory}/: task.json, repo/, gold/{task.id}.patch (the oracle), README.md")
    print(f"next: arena tasks shell {directory}   arena tasks check {directory}   arena submit {directory} --wait")
    return 0


def cmd_tasks_shell(args) -> int:
    from arena import authoring
    from arena.tasks import load_task

    task = load_task(args.task)
    interactive = sys.stdin.isatty()
    if interactive:
        where = f"a container of {task.image_of()}" if task.workspace_mount() else "bubblewrap"
        print(f"arena: a shell in task {task.id}'s sandbox ({where}), as its agent has it: no network; the "
              "workspace is thrown away on exit (`exit` or Ctrl-D)", file=sys.stderr)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command

    def fetch_bundle(digest: str) -> bytes:  # a bundle source (or agent): from the running stack, with its key
        with _client(args) as client:
            return client.fetch_bundle(digest)

    return authoring.shell(task, command or None, interactive=interactive, fetch_bundle=fetch_bundle)


def cmd_backend(args) -> int:
    """Register, list or remove backend replicas; the proxy picks changes up at once."""
    from arena_core import subjects
    from arena_core.bus import Bus
    from arena_core.schemas import BackendReplica

    async def run() -> int:
        bus = await Bus.connect(_nats_url(args.nats_url), "arena-cli")
        try:
            kv = await bus.kv(subjects.KV_BACKENDS)
            if args.action == "register":
                if not args.id or not args.replica_url:
                    raise ArenaError("backend register needs --id and --url")
                if args.max_inflight < 1:
                    raise ArenaError(f"--max-inflight must be at least 1, got {args.max_inflight}")
                replica = BackendReplica(replica_id=args.id, url=args.replica_url, models=args.model or [],
                                         policy_version=args.policy_version, max_inflight=args.max_inflight,
                                         registered_at=time.time())
                await kv.put(replica.replica_id, msgspec.json.encode(replica))
                print(f"registered {replica.replica_id} -> {replica.url} (policy {replica.policy_version or '-'})")
            elif args.action == "remove":
                if not args.id:
                    raise ArenaError("backend remove needs --id")
                await kv.delete(args.id)
                print(f"removed {args.id}")
            else:
                try:
                    keys = await kv.keys()
                except Exception:  # noqa: BLE001 - nats raises NoKeysError on an empty bucket
                    keys = []
                for key in sorted(keys):
                    entry = await kv.get(key)
                    r = msgspec.json.decode(entry.value, type=BackendReplica)
                    print(f"{r.replica_id:20s} {r.url:40s} policy={r.policy_version or '-'} "
                          f"models={','.join(r.models) or '*'} max_inflight={r.max_inflight}")
            return 0
        finally:
            await bus.close()

    return asyncio.run(run())


def cmd_keys(args) -> int:
    """Create, list or revoke API keys (stored hashed in NATS; the services pick changes up at once), or
    make a one-time dashboard sign-in link."""
    from arena_core import apikeys
    from arena_core.bus import Bus

    if args.action == "sign-in":
        try:
            apikeys.check_project(args.project)
        except ValueError as exc:
            raise ArenaError(str(exc)) from None
        print(asyncio.run(_sign_in_link(_nats_url(args.nats_url), args.dashboard_url, args.project)))
        print(f"one use, within {SIGN_IN_MINUTES} minutes; it signs a browser in read-only", file=sys.stderr)
        return 0

    async def run() -> int:
        bus = await Bus.connect(_nats_url(args.nats_url), "arena-cli")
        try:
            if args.action == "create":
                if not args.name or not args.scope:
                    raise ArenaError("keys create needs --name and at least one --scope")
                try:
                    key, record = await apikeys.issue(bus, args.name, args.scope, args.project)
                except ValueError as exc:
                    raise ArenaError(str(exc)) from None
                sees = "every project" if "admin" in record.scopes else f"project {record.project}"
                print(f"created key {record.key_id} ({record.name}; {', '.join(record.scopes)}; {sees}); "
                      "it is shown once:", file=sys.stderr)
                print(key)
            elif args.action == "revoke":
                if not args.id:
                    raise ArenaError("keys revoke needs --id")
                record = await apikeys.revoke(bus, args.id)
                print(f"revoked {record.key_id} ({record.name})")
            else:
                for r in await apikeys.listing(bus):
                    print(f"{r.key_id:14s} {r.name:24s} {','.join(r.scopes):20s} {r.project:16s} "
                          f"{'revoked' if r.revoked else 'active'}  created {time.strftime('%Y-%m-%d %H:%M', time.gmtime(r.created_at))}")
            return 0
        finally:
            await bus.close()

    return asyncio.run(run())


def cmd_projects(args) -> int:
    """``arena projects set NAME ...`` / ``arena projects list`` through the rollout API (docs/projects.md)."""
    with _client(args) as client:
        if args.action == "set":
            if not args.name:
                raise ArenaError("projects set needs the project's name: arena projects set NAME --max-sandboxes N ...")
            q = client.set_project(args.name, max_sandboxes=args.max_sandboxes, max_queued=args.max_queued,
                                   priority=args.priority, weight=args.weight)
            print(f"project {q['project']}: max sandboxes {q['max_sandboxes'] or 'unlimited'}, max queued "
                  f"{q['max_queued'] or 'unlimited'}, priority {q['priority']}, weight {q['weight']:g}")
            return 0
        rows = client.projects()["projects"]
        print(f"{'project':20s} {'priority':8s} {'weight':>7s} {'max sandboxes':>13s} {'max queued':>10s} "
              f"{'sandboxes':>9s} {'waiting':>7s}")
        for q in rows:
            print(f"{q['project']:20s} {q['priority']:8s} {q['weight']:7g} {q['max_sandboxes'] or '-':>13} "
                  f"{q['max_queued'] or '-':>10} {q['sandboxes']:9d} {q['waiting']:7d}"
                  + ("" if q["stored"] else "  (defaults)"))
        return 0


def cmd_track(args) -> int:
    """``arena track``: the trainer stream's groups into a tracker (docs/rl.md, Trackers)."""
    from urllib.parse import urlparse

    from arena.trackers import TrackerUnavailable, open_tracker, track_groups
    from arena_stack import natsauth

    url = args.nats_url or os.environ.get("ARENA_NATS_URL") or "nats://127.0.0.1:4222"
    credentials = Path(args.data_dir or os.environ.get("ARENA_DATA_DIR") or ".arena") / natsauth.CREDENTIALS_FILE
    if not urlparse(url.split(",")[0]).username and credentials.is_file():
        url = natsauth.with_user(url, "trainer", msgspec.json.decode(credentials.read_bytes())["trainer"])
    if args.arena_project is not None:
        from arena_core.apikeys import check_project

        try:
            check_project(args.arena_project)
        except ValueError as exc:
            raise ArenaError(f"--arena-project: {exc}") from None
    try:
        tracker = open_tracker(args.to, dir=args.dir, project=args.project, run_name=args.run_name,
                               wandb_mode="offline" if args.wandb_offline else None)
    except TrackerUnavailable as exc:
        print(f"arena: {exc}", file=sys.stderr)
        return 2
    try:
        logged = asyncio.run(track_groups(url, tracker, name=args.name, group_by=args.group_by, limit=args.limit,
                                          idle_s=args.idle, project=args.arena_project))
    finally:
        tracker.close()
    print(f"{logged} group(s) logged to {args.to}")
    return 0


def _key_hint(args: argparse.Namespace) -> str:
    """Which key was sent, for a 401: where it came from, or where one is looked for."""
    found: endpoints.Endpoints | None = getattr(args, "endpoints", None)
    if found is None:
        return ""
    if found.key_from:
        return f" (the key sent came from {found.key_from})"
    return (f" (no key sent: set ARENA_API_KEY, or run where `arena up` left {endpoints.local_key_file()}, "
            "or set ARENA_DATA_DIR to its data directory)")


def _quiet_stdout() -> None:
    """stdout's reader has gone (``arena trajectory ID | head``): point stdout at /dev/null so that
    the interpreter's last flush at exit does not complain again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user error (a bad argument, a missing or malformed file, a stack that is
    not running, a refused key) ends in one line on stderr, ``arena: ...``, and exit status 2; any
    other exception keeps its traceback: it is a bug."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except Unauthorized as exc:
        print(f"arena: {exc.code}: {exc}{_key_hint(args)}", file=sys.stderr)
        return 2
    except (ArenaError, SettingsError) as exc:
        code = getattr(exc, "code", "settings")
        print(f"arena: {code}: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        print(f"arena: cannot read {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except msgspec.DecodeError as exc:  # a file or argument that is not the JSON expected (ValidationError too)
        print(f"arena: invalid_request: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _quiet_stdout()
        return 141  # as a process ended by SIGPIPE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
