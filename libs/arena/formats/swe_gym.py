"""``arena tasks import swe-gym FILE``: SWE-Gym rows (SWE-bench's columns, FAIL_TO_PASS and
PASS_TO_PASS as real lists) as Arena tasks, graded by SWE-bench's rule: every FAIL_TO_PASS and
PASS_TO_PASS test passes after the hidden ``test_patch``. The row handling is SWE-bench's
(:mod:`arena.datasets`, which reads lists and JSON strings alike); docs/tasks.md, "SWE-Gym"."""

from __future__ import annotations

import argparse
from pathlib import Path

SUMMARY = "SWE-Gym rows (SWE-bench's columns with FAIL_TO_PASS/PASS_TO_PASS as lists)"


def add_arguments(q: argparse.ArgumentParser) -> None:
    from arena.formats import swebench

    swebench.add_arguments(q)


def run(args: argparse.Namespace, connect) -> int:
    import tempfile

    import msgspec

    from arena import datasets
    from arena.formats.rows import write_task
    from arena.progress import WaitProgress
    from arena_core.errors import InvalidRequest
    from arena_core.schemas import AgentSpec, BundleSource

    rows = datasets.read_rows(args.file)
    specs = datasets.read_specs(args.specs)
    out = Path(args.out)
    agent = AgentSpec(command=["sh", "-c", args.agent_command]) if args.agent_command else datasets.UNSET_AGENT
    with connect() as client, WaitProgress(len(rows), "import") as progress:
        for i, row in enumerate(rows, 1):
            if args.image or row.image_name:
                source = datasets.image_source(row, args.image or "", args.image_path)
            else:
                if not args.mirrors:
                    raise InvalidRequest(f"{row.instance_id}: give --mirrors (local repositories) or --image")
                with tempfile.TemporaryDirectory(prefix="arena-import-") as tmp:
                    datasets.checkout(datasets.mirror_of(Path(args.mirrors), row.repo), row.base_commit,
                                      Path(tmp) / "repo")
                    source = BundleSource(digest=client.push_bundle(Path(tmp) / "repo"))
            spec = datasets.spec_for(specs, row, args.command)
            task = datasets.to_task(row, source=source, command=spec.test_cmd, agent=agent,
                                    timeout_s=args.test_timeout, extra_test_files=spec.test_files, spec=spec)
            task = msgspec.structs.replace(task, metadata={**task.metadata, "dataset": "swe-gym"})
            write_task(out, task, row.patch)
            print(f"[{i}/{len(rows)}] {task.id}: {len(task.verifier.fail_to_pass)} FAIL_TO_PASS, "
                  f"{len(task.verifier.pass_to_pass)} PASS_TO_PASS", flush=True)
            progress.finished(task.id, "completed")
    print(f"wrote {len(rows)} task(s) to {out}")
    return 0
