"""``arena tasks import swebench FILE``: SWE-bench-format rows (JSONL, JSON or Parquet) as task
files, each repository checked out of a local mirror (pushed as a bundle) or named by an image.
The row handling itself is :mod:`arena.datasets`; docs/tasks.md, "Importing a dataset"."""

from __future__ import annotations

import argparse
from pathlib import Path

SUMMARY = "SWE-bench-format rows (instance_id, repo, base_commit, patch, test_patch, FAIL_TO_PASS, ...)"


def add_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("file", help="JSONL, JSON or Parquet rows (instance_id, repo, base_commit, patch, test_patch, "
                                "FAIL_TO_PASS, PASS_TO_PASS, ...)")
    q.add_argument("--out", required=True, help="directory for <instance_id>.json and gold/<instance_id>.patch")
    q.add_argument("--mirrors", help="directory of local mirrors: owner__name.bundle, owner__name.git or owner__name/")
    q.add_argument("--image", help="tasks run in this image holding the repository (a row's image_name wins)")
    q.add_argument("--image-path", default="/testbed", help="the repository's directory in the image")
    q.add_argument("--command", default="python -m pytest -rA -p no:cacheprovider {test_files}",
                   help="test command; {test_files} = the files the test patch touches (default %(default)r)")
    q.add_argument("--specs", help="JSON of per-repository specs as SWE-bench keeps them (MAP_REPO_VERSION_TO_SPECS: "
                                   "{\"owner/name\": {\"<version>\": {\"test_cmd\": ..., ...}}}, or one spec per "
                                   "repository); test_cmd and eval_commands used, the rest kept in the task's metadata")
    q.add_argument("--agent-command", help="the agent (sh -c) every task runs; default: none yet")
    q.add_argument("--test-timeout", type=float, default=900.0)


def run(args: argparse.Namespace, connect) -> int:
    import tempfile

    import msgspec

    from arena import datasets
    from arena.progress import WaitProgress
    from arena_core.errors import InvalidRequest
    from arena_core.schemas import AgentSpec, BundleSource, encode

    rows = datasets.read_rows(args.file)
    specs = datasets.read_specs(args.specs)
    out = Path(args.out)
    (out / "gold").mkdir(parents=True, exist_ok=True)
    agent = AgentSpec(command=["sh", "-c", args.agent_command]) if args.agent_command else datasets.UNSET_AGENT

    with connect() as client, WaitProgress(len(rows), "import") as progress:
        for i, row in enumerate(rows, 1):
            if args.image or row.image_name:
                source = datasets.image_source(row, args.image or "", args.image_path)
            else:
                if not args.mirrors:
                    raise InvalidRequest(f"{row.instance_id}: give --mirrors (local repositories) or --image")
                mirror = datasets.mirror_of(Path(args.mirrors), row.repo)
                with tempfile.TemporaryDirectory(prefix="arena-import-") as tmp:
                    datasets.checkout(mirror, row.base_commit, Path(tmp) / "repo")
                    source = BundleSource(digest=client.push_bundle(Path(tmp) / "repo"))
            spec = datasets.spec_for(specs, row, args.command)
            task = datasets.to_task(row, source=source, command=spec.test_cmd, agent=agent,
                                    timeout_s=args.test_timeout, extra_test_files=spec.test_files, spec=spec)
            (out / f"{row.instance_id}.json").write_bytes(msgspec.json.format(encode(task)) + b"\n")
            (out / "gold" / f"{row.instance_id}.patch").write_text(row.patch)
            print(f"[{i}/{len(rows)}] {row.instance_id}: {len(task.verifier.fail_to_pass)} FAIL_TO_PASS, "
                  f"{len(task.verifier.pass_to_pass)} PASS_TO_PASS, source {source.__struct_config__.tag}",
                  flush=True)
            progress.finished(row.instance_id, "completed")
    print(f"wrote {len(rows)} task(s) to {out}")
    return 0
