"""``arena eval``: run an evaluation job (a dataset × an agent × models, k attempts each), resume it,
report it. docs/evaluation.md."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import get_args

from arena_core.errors import InvalidRequest
from arena_core.schemas import ScaffoldName


def add_parser(sub, stack: argparse.ArgumentParser) -> None:
    """``eval run``, ``eval resume``, ``eval report`` under ``arena``'s subcommands."""
    p = sub.add_parser("eval", help="evaluation jobs: a dataset × an agent × models, k attempts each; pass@k, "
                                    "pass^k and paired comparisons with intervals, cost (docs/evaluation.md)")
    ev = p.add_subparsers(dest="eval_command", required=True)
    q = ev.add_parser("run", parents=[stack], help="submit every task × model × attempt and wait; writes the job "
                                                    "under $ARENA_DATA_DIR/evals/JOB")
    q.add_argument("--dataset", required=True, help="an import's output directory, a task file or directory, or a "
                                                    "Harbor dataset.toml")
    q.add_argument("--agent", required=True, choices=["task", *get_args(ScaffoldName)],
                   help="a scaffold preset (docs/agents.md), or `task`: each task's own agent")
    q.add_argument("--model", action="append", required=True, help="a model the backends serve (repeat to compare)")
    q.add_argument("--k", type=int, default=5, help="attempts per task and model (default %(default)s)")
    q.add_argument("--concurrency", type=int, default=8, help="rollouts in flight at once (default %(default)s)")
    q.add_argument("--provider", choices=["local", "docker", "mock"],
                   help="sandbox provider (default: docker for a task with its own image, else local)")
    q.add_argument("--max-infra-retries", type=int, default=2,
                   help="tries again after an infrastructure outcome, per attempt (default %(default)s)")
    q.add_argument("--timeout", type=float, default=1800.0, help="the longest wait for one rollout, seconds")
    q.add_argument("--seed", type=int, default=0, help="the attempts' seeds derive from it (the same for every model)")
    q.add_argument("--threshold", type=float, default=1.0, help="a reward at or above it is a success (default 1)")
    q.add_argument("--prices", help="price table (TOML) for the report printed at the end")
    q.set_defaults(func=cmd_eval_run)
    q = ev.add_parser("resume", parents=[stack], help="go on with a job: wait for its tries in flight, run what is "
                                                       "left; never runs a finished attempt again")
    q.add_argument("job", help="a job id (ev-...) or its directory")
    q.add_argument("--prices", help="price table (TOML) for the report printed at the end")
    q.set_defaults(func=cmd_eval_resume)
    q = ev.add_parser("report", parents=[stack], help="the job's table on stdout; report.md, report.json and "
                                                       "report.html beside it; the report kept on the trajectory "
                                                       "service for the dashboard")
    q.add_argument("job", help="a job id (ev-...) or its directory")
    q.add_argument("--prices", help="price table (TOML): dollars per million tokens per model, per sandbox hour")
    q.add_argument("--out", help="directory for the report files (default: the job's directory)")
    q.add_argument("--version", type=int, default=1,
                   help="the grading version to report (default 1: as the rollouts were verified; "
                        "N > 1: an `arena eval regrade`, written as report.vN.*)")
    q.add_argument("--local", action="store_true", help="write the files only (do not store the report on the "
                                                        "trajectory service)")
    q.set_defaults(func=cmd_eval_report)
    q = ev.add_parser("regrade", parents=[stack],
                      help="verify every graded attempt of a finished job again with another verifier (as "
                           "`arena verify` does one rollout): a new grading version and report.vN.*, earlier "
                           "ones kept")
    q.add_argument("job", help="a job id (ev-...) or its directory")
    how = q.add_mutually_exclusive_group(required=True)
    how.add_argument("--verifier", help="verifier JSON, or a file holding it (or a task.json): for every task")
    how.add_argument("--task-dir", help="tasks (any --dataset form) whose verifiers grade the job's tasks of "
                                        "the same id")
    q.add_argument("--prices", help="price table (TOML) for the new report")
    q.add_argument("--concurrency", type=int, help="verifications at once (default: the job's concurrency)")
    q.add_argument("--timeout", type=float, default=600.0, help="the longest wait for one verification, seconds")
    q.add_argument("--nats-url", default=os.environ.get("ARENA_NATS_URL", "nats://127.0.0.1:4222"),
                   help="NATS (default $ARENA_NATS_URL or %(default)s)")
    q.set_defaults(func=cmd_eval_regrade)
    q = ev.add_parser("export", parents=[stack], help="each attempt's trajectory as Arena's JSON and in Harbor's "
                                                      "trajectory format (ATIF), under JOB/trajectories")
    q.add_argument("job", help="a job id (ev-...) or its directory")
    q.add_argument("--format", choices=["both", "atif", "arena"], default="both",
                   help="ROLLOUT.json (Arena's), ROLLOUT.atif.json (ATIF v1.8), or both (default)")
    q.add_argument("--out", help="directory (default: the job's trajectories/)")
    q.set_defaults(func=cmd_eval_export)
    q = ev.add_parser("versions", help="the job's grading versions (the original and each regrade)")
    q.add_argument("job", help="a job id (ev-...) or its directory")
    q.set_defaults(func=cmd_eval_versions)


def _need_numpy() -> None:
    """The statistics need numpy (the ``eval`` extra; the ``server`` extra has it too)."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise InvalidRequest("arena eval needs numpy: pip install 'arena[eval]'") from None


def _go(args, directory: Path) -> int:
    from arena.cli import _client
    from arena.evaluation.records import read_spec
    from arena.evaluation.runner import run_job

    spec = read_spec(directory)
    with _client(args) as client:
        result = run_job(client, directory)
        _go_summary(spec, result)
        _print_report(directory, args.prices, client)
    return 1 if result.still_running else 0


def _go_summary(spec, result) -> None:
    s = result.settled
    print(f"job {spec.job_id}: {s['completed']} completed, {s['failed']} failed, {s['infrastructure']} "
          f"infrastructure (after retries) this run; {result.already_done} settled before, {result.retried} "
          f"tries again after an infrastructure outcome, {result.adopted} tries taken over from an earlier run",
          flush=True)
    if result.still_running:
        print(f"job {spec.job_id}: {result.still_running} attempt(s) still running after {spec.timeout_s:g}s: "
              f"`arena eval resume {spec.job_id}` waits for them", flush=True)


def _print_report(directory: Path, prices: str | None, client=None) -> None:
    from arena.evaluation import report

    built = report.build(directory, prices)
    print("\n".join(report.text_lines(built)))
    if client is not None:
        _store(client, built)


def _store(client, built) -> None:
    """The report kept on the trajectory service for the dashboard's Evaluations page; a failure
    is said on stderr (the files are the report; the dashboard copy is a view of them)."""
    import sys

    import msgspec

    from arena_core.errors import ArenaError

    try:
        client.store_eval_report(msgspec.json.encode(built))
    except ArenaError as exc:
        print(f"the report was not stored on the trajectory service (the dashboard will not show it; "
              f"`arena eval report {built.spec.job_id}` stores it again): {exc}", file=sys.stderr)


def cmd_eval_run(args) -> int:
    from arena.evaluation.records import evals_dir
    from arena.evaluation.runner import create_job

    _need_numpy()
    directory = create_job(args.dataset, agent=args.agent, models=args.model, k=args.k,
                           concurrency=args.concurrency, provider=args.provider,
                           max_infra_retries=args.max_infra_retries, timeout_s=args.timeout, seed=args.seed,
                           success_threshold=args.threshold, root=evals_dir())
    print(f"job {directory.name} ({directory})", flush=True)
    return _go(args, directory)


def cmd_eval_resume(args) -> int:
    from arena.evaluation.records import job_dir

    _need_numpy()
    return _go(args, job_dir(args.job))


def cmd_eval_report(args) -> int:
    from arena.evaluation import report
    from arena.evaluation.records import job_dir

    _need_numpy()
    directory = job_dir(args.job)
    built = report.build(directory, args.prices, args.version)
    print("\n".join(report.text_lines(built)))
    written = report.write_files(built, Path(args.out) if args.out else directory)
    print("wrote " + ", ".join(str(p) for p in written))
    if not args.local:
        import sys

        from arena.cli import _client
        from arena_core.errors import ArenaError

        try:
            with _client(args) as client:
                _store(client, built)
        except ArenaError as exc:  # no stack to reach: the files stand; say so
            print(f"the report was not stored on the trajectory service (--local: files only): {exc}",
                  file=sys.stderr)
    return 0


def cmd_eval_regrade(args) -> int:
    import asyncio

    from arena import replay
    from arena.cli import _client, _nats_url
    from arena.evaluation import report
    from arena.evaluation.records import job_dir, read_spec
    from arena.evaluation.regrade import bus_reverify, regrade, verifiers_from_task_dir
    from arena_core.bus import Bus

    _need_numpy()
    directory = job_dir(args.job)
    spec = read_spec(directory)
    task_ids = [t.task_id for t in spec.tasks]
    if args.verifier:
        one = replay.parse_verifier(args.verifier)
        verifiers, source = {t: one for t in task_ids}, f"--verifier {args.verifier}"
    else:
        verifiers, source = verifiers_from_task_dir(args.task_dir, task_ids), f"--task-dir {args.task_dir}"

    async def run(client):
        bus = await Bus.connect(_nats_url(args.nats_url), "cli")
        try:
            return await regrade(directory, verifiers=verifiers, source=source, concurrency=args.concurrency,
                                 reverify=bus_reverify(bus, client.trajectory, timeout=args.timeout))
        finally:
            await bus.close()

    with _client(args) as client:
        version = asyncio.run(run(client))
        built = report.build(directory, args.prices, version.version)
        _store(client, built)
    print("\n".join(report.text_lines(built)))
    written = report.write_files(built, directory)
    print(f"grading version {version.version}: {version.regraded} attempt(s) verified again "
          f"({version.infrastructure} without a verdict); wrote " + ", ".join(str(p) for p in written))
    return 0


def cmd_eval_versions(args) -> int:
    import time

    from arena.evaluation.records import job_dir
    from arena.evaluation.versions import read_versions, report_stem
    from arena.table import format_table

    rows = [[str(v.version), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v.created_at)) if v.created_at
             else "-", v.source, v.verifier, str(v.regraded) if v.version > 1 else "-", report_stem(v.version) + ".*"]
            for v in read_versions(job_dir(args.job))]
    print("\n".join(format_table(["VERSION", "CREATED", "GRADED BY", "STORED AS", "REGRADED", "REPORT"], rows)))
    return 0


def cmd_eval_export(args) -> int:
    from arena.cli import _client
    from arena.evaluation.interchange import export_job
    from arena.evaluation.records import job_dir

    directory = job_dir(args.job)
    out = Path(args.out) if args.out else directory / "trajectories"
    with _client(args) as client:
        rows = export_job(directory, client, fmt=args.format, out=out)
    missing = sum(r.missing for r in rows)
    print(f"{len(rows) - missing} attempt(s) exported to {out} ({args.format}; index.jsonl)"
          + (f"; {missing} without a trajectory" if missing else ""))
    return 0
