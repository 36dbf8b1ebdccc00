"""Verification throughput: verifications per minute and latency, and parser speed.

1. The quickstart task's gold diff, verified end to end by ``python -m arena_verification``
   worker processes (concurrency 1 each) on one work queue of a real nats-server: N jobs
   published at once; verifications/minute = N / (time to the last result), latency =
   publish -> result received, per job. Each verification is two bubblewrap sandboxes
   (``git apply``, then pytest) on a fresh copy of the repository.
2. Parser throughput in MB/s on a large log built from each runner's real fixture
   (``tests/fixtures/<runner>/``), repeated with unique test names to ``--log-mb``.

Run: ``.venv/bin/python benchmarks/verify_throughput.py [--jobs 8] [--log-mb 32]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from arena_core import subjects
from arena_core.bus import Bus
from arena_stack.natsserver import NatsServer
from arena_core.schemas import VerificationResult, VerifyJob
from arena.tasks import load_task
from arena_verification.parsers import PARSERS

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart"
FIXTURES = ROOT / "tests" / "fixtures"


def gold_diff() -> str:
    script = json.loads((QUICKSTART / "llm_script.json").read_text())
    content = next(r["content"] for r in script["responses"] if r["label"] == "correct")
    return content.split("```diff\n", 1)[1].split("```", 1)[0]


async def run_workers(n_workers: int, n_jobs: int, tmp: Path) -> dict:
    server = NatsServer(tmp / f"nats-{n_workers}").start()
    procs: list[subprocess.Popen] = []
    try:
        bus = await Bus.connect(server.url, "bench")
        await bus.ensure_topology()
        env = {**os.environ, "ARENA_NATS_URL": server.url, "ARENA_VERIFY_CONCURRENCY": "1", "ARENA_LOG_LEVEL": "WARNING"}
        for i in range(n_workers):
            procs.append(subprocess.Popen([sys.executable, "-m", "arena_verification"],
                                          env={**env, "ARENA_DATA_DIR": str(tmp / f"w{n_workers}-{i}")},
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        # Warm-up: one job, so process start-up is not measured.
        await verify_batch(bus, load_task(QUICKSTART), gold_diff(), 1, f"warm{n_workers}")
        latencies, wall = await verify_batch(bus, load_task(QUICKSTART), gold_diff(), n_jobs, f"b{n_workers}")
        await bus.close()
        return {"workers": n_workers, "jobs": n_jobs, "per_min": n_jobs / wall * 60,
                "p50": statistics.median(latencies), "max": max(latencies), "wall": wall}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        server.stop()


async def verify_batch(bus: Bus, task, diff: str, n: int, prefix: str) -> tuple[list[float], float]:
    received: dict[str, float] = {}
    done = asyncio.Event()

    async def on_result(msg) -> None:
        result = msgspec.json.decode(msg.data, type=VerificationResult)
        if result.rollout_id.startswith(prefix) and result.rollout_id not in received:
            assert result.reward == 1.0, result.reason
            received[result.rollout_id] = time.perf_counter()
            if len(received) == n:
                done.set()

    sub = await bus.nc.subscribe("arena.verify.done.*", cb=on_result)
    sent: dict[str, float] = {}
    t0 = time.perf_counter()
    for i in range(n):
        rid = f"{prefix}-{i}"
        sent[rid] = time.perf_counter()
        await bus.publish(subjects.VERIFY_RUN, VerifyJob(rollout_id=rid, task=task, diff=diff),
                          msg_id=subjects.msg_id(rid, "verify-job"))
    await asyncio.wait_for(done.wait(), 60 * n)
    wall = time.perf_counter() - t0
    await sub.unsubscribe()
    return [received[r] - sent[r] for r in sent], wall


# ------------------------------------------------------------------------------ parsers

def big_pytest_log(target_bytes: int) -> str:
    """One long ``pytest -rA -v`` session: progress lines, then the summary naming every test."""
    n = target_bytes // 120
    ids = [f"tests/test_mod{i // 500}.py::TestGroup::test_case_{i}[param-{i % 7}]" for i in range(n)]
    progress = "\n".join(f"{t} {'FAILED' if i % 50 == 0 else 'PASSED'} [{i * 100 // n:3d}%]"
                          for i, t in enumerate(ids))
    summary = "\n".join(f"FAILED {t} - assert 1 == 2" if i % 50 == 0 else f"PASSED {t}" for i, t in enumerate(ids))
    return ("=" * 20 + " test session starts " + "=" * 20 + "\n" + progress + "\n\n"
            + "=" * 20 + " short test summary info " + "=" * 20 + "\n" + summary + "\n"
            + "=" * 10 + f" {n // 50} failed, {n - n // 50} passed in 100.00s " + "=" * 10 + "\n")


def big_log(parser: str, fixture: str, target_bytes: int) -> str:
    """The fixture repeated with a counter appended to every test name, to ``target_bytes``."""
    if parser == "pytest":
        return big_pytest_log(target_bytes)
    text = (FIXTURES / fixture).read_text()
    if parser in ("junit", "pytest_junit"):
        head, _, rest = text.partition("<testcase")
        body, _, tail = ("<testcase" + rest).rpartition("</testsuite>")
        parts = [head]
        size, i = len(head), 0
        while size < target_bytes:
            chunk = re.sub(r'name="([^"]+)"', lambda m: f'name="{m.group(1)}_{i}"', body)
            parts.append(chunk)
            size += len(chunk)
            i += 1
        # keep the declared count consistent: drop it
        return re.sub(r' tests="\d+"', "", "".join(parts)) + "</testsuite>" + tail
    parts, size, i = [], 0, 0
    while size < target_bytes:
        chunk = re.sub(r"(test_\w+|Test\w+|tests::\w+)", lambda m: f"{m.group(1)}{i}", text)
        parts.append(chunk)
        size += len(chunk)
        i += 1
    return "".join(parts)


def parser_speed(target_mb: int) -> list[tuple[str, float, int, float]]:
    cases = [("pytest", "pytest/mixed_rA_v.txt"), ("unittest", "unittest/mixed_v.txt"),
             ("go_test", "go/mixed_v.txt"), ("go_test_json", "go/mixed_json.txt"), ("cargo", "cargo/mixed.txt"),
             ("node_tap", "node/mixed_tap.txt"), ("node_spec", "node/mixed_spec.txt"),
             ("jest", "js/jest_verbose.txt"), ("vitest", "js/vitest_verbose.txt"), ("mocha", "js/mocha_spec.txt"),
             ("junit", "junit/surefire_TEST-calc.CalcTest.xml")]
    rows = []
    for name, fixture in cases:
        text = big_log(name, fixture, target_mb * 1024 * 1024)
        t0 = time.perf_counter()
        out = PARSERS[name](text)
        dt = time.perf_counter() - t0
        mb = len(text.encode()) / 1024 / 1024
        rows.append((name, mb, len(out.results), mb / dt))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--log-mb", type=int, default=32)
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    if not args.skip_e2e:
        with tempfile.TemporaryDirectory() as tmp:
            rows = [asyncio.run(run_workers(n, args.jobs, Path(tmp))) for n in (1, 2)]
        print("\nquickstart task, gold diff, end to end through NATS")
        print(f"{'workers':>7} {'jobs':>5} {'verif/min':>10} {'p50 s':>7} {'max s':>7} {'wall s':>7}")
        for r in rows:
            print(f"{r['workers']:>7} {r['jobs']:>5} {r['per_min']:>10.1f} {r['p50']:>7.2f} {r['max']:>7.2f} "
                  f"{r['wall']:>7.2f}")
    print(f"\nparser throughput on ~{args.log_mb} MB logs")
    print(f"{'parser':<14} {'MB':>6} {'tests':>9} {'MB/s':>8}")
    for name, mb, n, speed in parser_speed(args.log_mb):
        print(f"{name:<14} {mb:>6.1f} {n:>9} {speed:>8.1f}")


if __name__ == "__main__":
    main()
