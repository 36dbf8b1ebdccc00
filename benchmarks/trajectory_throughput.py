"""Sustained throughput of the trajectory plane: steps per second from publish to
queryable in ClickHouse (chDB) and to a trainer's ``TrajectoryStream``, beside the raw
JetStream async publish rate of the same messages measured in the same run.

One run, one machine, real processes: a ``nats-server`` with file storage (fsync setting
``--sync``, default ``always`` as in ``arena up``), ``python -m arena_trajectory`` with
embedded chDB, and a ``TrajectoryStream`` consumer in this process.

1. raw: an async publish of N step messages to a scratch stream, then wait for every
   ack: once with Arena's publisher (``arena_core.jetlink.JsPublisher``, what every plane's
   ``Bus.publish`` uses) and once with nats-py's ``js.publish_async``, for reference.
2. end to end: publish, as the other planes would (Arena's publisher), the state
   transitions, steps, sandbox and verification results of ``--rollouts`` rollouts
   (groups of ``--group-size``, ``--steps`` steps each, async publishes with
   ``Nats-Msg-Id``, at most 4,000 awaiting their ack); measure from the first
   publish until (a) ``GET /v1/counts?table=steps`` shows every step queryable, and (b) the trainer
   has received (and committed) every group, i.e. every step inside a ``GroupCompleted``.
   As the rollout plane does, a final transition carries the rollout's history.

Beside the rates it prints when each path finished and the CPU seconds each process
used: on a small machine the three share the cores, so that is where the time goes.

Run: ``.venv/bin/python benchmarks/trajectory_throughput.py [--rollouts 1200 --steps 50 --sync 1s]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import httpx
import nats

from arena_core import subjects
from arena_core.bus import Bus
from arena_stack.natsserver import DEFAULT_SYNC, NatsServer, free_port
from arena_core.schemas import (
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxOutcome,
    StateTransition,
    Step,
    Timings,
    Usage,
    VerificationResult,
    encode,
)
from arena_core.jetlink import JsPublisher
from arena_core.natslink import NatsLink
from arena.stream import TrajectoryStream

LIFECYCLE = [RolloutState.PENDING, RolloutState.PROVISIONING, RolloutState.RUNNING, RolloutState.VERIFYING,
             RolloutState.COMPLETED]


def step(rid: str, i: int, args) -> Step:
    return Step(rollout_id=rid, step_index=i, model="m", backend="b0", policy_version="1",
                request_messages=[{"role": "user", "content": f"step {i} of {rid}"}],
                prompt_token_ids=list(range(args.prompt_tokens)), completion_token_ids=list(range(args.completion_tokens)),
                logprobs=[-0.5] * args.completion_tokens, completion_text="x" * args.completion_tokens,
                usage=Usage(prompt_tokens=args.prompt_tokens, completion_tokens=args.completion_tokens),
                timings=Timings(total_ms=25.0), started_at=time.time())


def messages(args) -> list[tuple[str, bytes, str]]:
    """(subject, payload, msg id) of the whole load, in the order the planes would publish."""
    out = []
    now = time.time()
    for r in range(args.rollouts):
        g, i = divmod(r, args.group_size)
        rid, task = f"r{r}", f"task-{g % 10}"

        def state(k: int) -> RolloutStateChanged:
            # like the rollout plane, a final transition carries the rollout's whole history
            history = [StateTransition(from_state=LIFECYCLE[j - 1] if j else None, to_state=LIFECYCLE[j],
                                       at=now + j * 0.001) for j in range(k + 1)] if LIFECYCLE[k].is_final else []
            return RolloutStateChanged(rollout_id=rid, task_id=task, from_state=LIFECYCLE[k - 1] if k else None,
                                       to_state=LIFECYCLE[k], at=now + k * 0.001, steps=args.steps if k >= 3 else 0,
                                       group_id=f"g{g}", group_index=i, group_size=args.group_size, history=history)
        for k in range(3):
            out.append((subjects.rollout_state(rid), encode(state(k)), subjects.msg_id(rid, "state", k)))
        for s in range(args.steps):
            out.append((subjects.step(rid), encode(step(rid, s, args)), subjects.msg_id(rid, "step", s)))
        out.append((subjects.sandbox_done(rid), encode(SandboxDone(
            rollout_id=rid, sandbox_id="sb", provider="local", outcome=SandboxOutcome.COMPLETED, reason="",
            started_at=now, finished_at=now + 1)), subjects.msg_id(rid, "sandbox-done")))
        out.append((subjects.verify_done(rid), encode(VerificationResult(
            rollout_id=rid, verifier="tests", reward=float(i % 2), passed=i % 2 == 1, started_at=now,
            finished_at=now + 1)), subjects.msg_id(rid, "verify-done")))
        for k in (3, 4):
            out.append((subjects.rollout_state(rid), encode(state(k)), subjects.msg_id(rid, "state", k)))
    return out


MAX_IN_FLIGHT = 4000  # publishes awaiting their PubAck, for both publishers


async def publish_all_nats_py(js, load, *, headers: bool) -> float:
    """nats-py's ``publish_async`` (``publish_async_max_pending`` bounds what is in flight)."""
    t0 = time.perf_counter()
    futures = []
    for subject, data, msg_id in load:
        futures.append(await js.publish_async(subject, data, headers={"Nats-Msg-Id": msg_id} if headers else None))
    results = await asyncio.gather(*futures)
    assert all(not getattr(r, "duplicate", False) for r in results)
    return time.perf_counter() - t0


async def publish_all_arena(publisher: JsPublisher, load, *, headers: bool) -> float:
    """Arena's publisher (``arena_core.jetlink.JsPublisher``, what ``Bus.publish`` and so every
    plane uses), at most ``MAX_IN_FLIGHT`` awaiting their PubAck."""
    t0 = time.perf_counter()
    window: deque[asyncio.Future] = deque()
    results = []
    for subject, data, msg_id in load:
        if len(window) >= MAX_IN_FLIGHT:
            results.append(await window.popleft())
        window.append(publisher.publish(subject, data, msg_id=msg_id if headers else None))
    results += await asyncio.gather(*window)
    assert not any(r.duplicate for r in results)
    return time.perf_counter() - t0


async def raw_rates(url: str, args) -> dict[str, float]:
    """Steps per second of a bare async publish to a scratch stream, by each publisher."""
    nc = await nats.connect(url)
    js = nc.jetstream(publish_async_max_pending=MAX_IN_FLIGHT)
    link = await NatsLink.open(url, name="bench-raw")
    payloads = [encode(step(f"raw{r}", s, args)) for r in range(args.rollouts) for s in range(args.steps)]
    load = [(f"bench.raw.{n % 100}", p, "") for n, p in enumerate(payloads)]
    rates = {}
    for name in ("nats-py", "arena"):
        await js.add_stream(name="BENCH_RAW", subjects=["bench.raw.>"])
        if name == "nats-py":
            elapsed = await publish_all_nats_py(js, load, headers=False)
        else:
            elapsed = await publish_all_arena(JsPublisher(link), load, headers=False)
        rates[name] = len(load) / elapsed
        await js.delete_stream("BENCH_RAW")
    await link.close()
    await nc.close()
    return rates


def _stat_seconds(stat: str) -> float:
    """User + system CPU seconds of a ``/proc/.../stat`` line (Linux)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds consumed so far by each process."""
    return {name: _stat_seconds(Path(f"/proc/{pid}/stat").read_text()) for name, pid in pids.items()}


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of the threads of ``pid``, summed by thread name (a thread that
    ended is no longer counted)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (task / "stat").read_text()
        except OSError:
            continue
        name = "event loop" if task.name == str(pid) else raw[raw.index("(") + 1:raw.rindex(")")]
        out[name] = out.get(name, 0.0) + _stat_seconds(raw)
    return out


async def end_to_end(url: str, data_dir: Path, args, nats_pid: int) -> dict[str, float]:
    port = free_port()
    env = dict(os.environ, ARENA_NATS_URL=url, ARENA_DATA_DIR=str(data_dir), ARENA_HOST="127.0.0.1",
               ARENA_TRAJECTORY_PORT=str(port), ARENA_LOG_LEVEL=os.environ.get("BENCH_LOG_LEVEL", "WARNING"))
    bus = await Bus.connect(url, "bench")
    await bus.ensure_topology()
    log = open(os.environ.get("BENCH_SERVICE_LOG", data_dir.parent / "service.log"), "ab")  # noqa: SIM115 - closed below
    profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    service = subprocess.Popen([sys.executable, *profile, "-m", "arena_trajectory"], env=env, stdout=log, stderr=log)
    total_steps = args.rollouts * args.steps
    groups_expected = args.rollouts // args.group_size
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            for _ in range(300):
                try:
                    if (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
            load = messages(args)
            received = {"groups": 0, "steps": 0}
            t_stream = asyncio.get_running_loop().create_future()

            async def trainer():
                async with TrajectoryStream(url, name="bench", max_ack_pending=4096) as stream:
                    async for batch in stream.groups(batch_size=16, max_wait=0.05):
                        received["groups"] += len(batch)
                        received["steps"] += sum(len(t.steps) for g in batch for t in g.trajectories)
                        await batch.commit()
                        if received["groups"] >= groups_expected:
                            t_stream.set_result(time.perf_counter())
                            return

            trainer_task = asyncio.create_task(trainer())
            publisher = await bus.publisher()
            pids = {"nats-server": nats_pid, "trajectory service": service.pid, "bench (publisher + trainer)": os.getpid()}
            cpu0 = cpu_seconds(pids)
            threads0 = thread_seconds(service.pid)
            t0 = time.perf_counter()
            publish_s = await publish_all_arena(publisher, load, headers=True)
            t_query = None
            while t_query is None or not t_stream.done():
                if t_query is None:  # rows stored (cheap) until they are all there, then as queries see them
                    stored = (await client.get(f"http://127.0.0.1:{port}/v1/counts",
                                               params={"table": "steps", "final": "false"})).json()
                    if stored["steps"] >= total_steps:
                        counts = (await client.get(f"http://127.0.0.1:{port}/v1/counts",
                                                   params={"table": "steps"})).json()
                        if counts["steps"] >= total_steps:
                            t_query = time.perf_counter()
                if time.perf_counter() - t0 > args.timeout:
                    raise SystemExit(f"timed out: steps stored {stored}, trainer {received}")
                await asyncio.sleep(0.1)
            await trainer_task
            cpu1 = cpu_seconds(pids)
            threads1 = thread_seconds(service.pid)
            assert received["steps"] == total_steps, received
            return {"publish_s": publish_s, "messages": len(load), "query_s": t_query - t0,
                    "stream_s": t_stream.result() - t0, "cpu": {k: cpu1[k] - cpu0[k] for k in pids},
                    "threads": {k: v - threads0.get(k, 0.0) for k, v in threads1.items() if v - threads0.get(k, 0.0) > 0},
                    "wall_s": time.perf_counter() - t0}
    finally:
        service.terminate()
        service.wait(30)
        log.close()
        await bus.close()


def cpu_reference() -> float:
    """Seconds for a fixed piece of pure-Python work: this machine's speed at the moment of
    the run (shared machines vary by tens of percent), to compare runs by."""
    t0 = time.perf_counter()
    sum(range(30_000_000))
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=1200, help="default %(default)s: 60,000 steps, a few seconds sustained")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=32)
    parser.add_argument("--sync", default=DEFAULT_SYNC, help="JetStream sync_interval (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--profile", help="write a cProfile of the trajectory service to this file")
    args = parser.parse_args()
    reference = cpu_reference()
    with tempfile.TemporaryDirectory(prefix="arena-bench-") as tmp:
        nats_server = NatsServer(Path(tmp) / "nats", sync=args.sync).start()
        try:
            raws = asyncio.run(raw_rates(nats_server.url, args))
            data = Path(tmp) / "data"
            data.mkdir()
            e2e = asyncio.run(end_to_end(nats_server.url, data, args, nats_server.proc.pid))
        finally:
            nats_server.stop()
    steps = args.rollouts * args.steps
    step_bytes = len(encode(step("r0", 0, args)))
    print(f"\ntrajectory throughput: {args.rollouts} rollouts x {args.steps} steps = {steps} steps "
          f"(~{step_bytes} B each), groups of {args.group_size}, JetStream sync_interval={args.sync}, "
          f"{os.cpu_count()} cores; CPU reference {reference:.3f} s (sum(range(3e7)), lower is faster)\n")
    raw, raw_nats_py = raws["arena"], raws["nats-py"]
    rows = [
        ("raw async publish, Arena's publisher (steps)", raw, None),
        ("raw async publish, nats-py publish_async", raw_nats_py, None),
        ("e2e load published (all messages, msg ids)", e2e["messages"] / e2e["publish_s"], "msgs/s"),
        ("publish -> queryable in ClickHouse (chDB)", steps / e2e["query_s"], None),
        ("publish -> trainer TrajectoryStream", steps / e2e["stream_s"], None),
    ]
    print(f"{'path':<46} {'rate':>12} {'unit':<8} {'vs raw':>7} {'vs nats-py raw':>15}")
    for name, rate, unit in rows:
        print(f"{name:<46} {rate:>12,.0f} {unit or 'steps/s':<8} {rate / raw:>6.0%} {rate / raw_nats_py:>15.0%}")
    print(f"\ntimeline from the first publish: all published {e2e['publish_s']:.2f} s, all steps queryable "
          f"{e2e['query_s']:.2f} s, trainer has every group {e2e['stream_s']:.2f} s")
    print(f"\nCPU seconds during the end-to-end run ({e2e['wall_s']:.2f} s wall, {os.cpu_count()} cores):")
    for name, seconds in e2e["cpu"].items():
        print(f"  {name:<30} {seconds:6.2f} s  ({seconds / steps * 1e6:5.1f} us/step)")
        if name == "trajectory service":
            for thread, used in sorted(e2e["threads"].items(), key=lambda kv: -kv[1]):
                print(f"    {thread:<28} {used:6.2f} s  ({used / steps * 1e6:5.1f} us/step)")
    print(f"\nend to end (slowest path): {steps / max(e2e['query_s'], e2e['stream_s']):,.0f} steps/s; goal 20,000")


if __name__ == "__main__":
    main()
