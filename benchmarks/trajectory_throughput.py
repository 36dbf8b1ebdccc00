"""Sustained throughput of the trajectory plane: steps per second from publish to
queryable in ClickHouse (chDB) and to a trainer's ``TrajectoryStream``, every figure a
ratio to a baseline run beside it in the same run: nats-py's own JetStream publish of the
same messages with the same concurrency and no Arena code.

One run, one machine, real processes: a ``nats-server`` with file storage (fsync setting
``--sync``, default ``always`` as in ``arena up``), ``python -m arena_trajectory`` with
embedded chDB, a trainer (a ``TrajectoryStream`` consumer) in a process of its own, as a
trainer runs, and the planes' publishes from this process.

1. baseline: N step messages to a scratch stream, each ``await js.publish(...)`` with its
   ``Nats-Msg-Id`` in a task of its own, at most ``--in-flight`` awaiting their ``PubAck``
   (nats-py, no Arena code).
2. ``Bus.publish``: the same messages, the same way, through Arena's bus (what every plane
   publishes with: trace headers, retries, bodies over ``max_payload`` to the object store),
   to the scratch stream (one by one) and to Arena's steps stream (where those made together
   go as one pack: ``arena_core.packing``).
3. end to end: publish through ``Bus.publish``, as the other planes would, the state
   transitions, steps, sandbox and verification results of ``--rollouts`` rollouts
   (groups of ``--group-size``, ``--steps`` steps each, the same concurrency); measure from
   the first publish until (a) ``GET /v1/counts?table=steps`` shows every step queryable,
   and (b) the trainer has received (and committed) every group, i.e. every step inside a
   ``GroupCompleted``. As the rollout plane does, a final transition carries the
   rollout's history.

Beside the rates it prints the CPU this process spent per publish in 1 and 2 (the
client's own cost, steadier than a rate on a shared machine), when each path of 3
finished and the CPU seconds each process used: on a small machine the three share the
cores, so that is where the time goes.

It uses only ``Bus.connect`` / ``Bus.publish`` / ``Bus.ensure_topology`` of Arena's bus, so
the same script measures another checkout of Arena (``PYTHONPATH`` pointing at its
packages) against the same baseline.

The headline is ``--sync always`` (as ``arena up``) with ``--in-flight`` 256 publishes awaiting their
acks; the baseline and the end-to-end path are run again with ``--wide-in-flight`` (default 1,024:
the proxy does not bound the steps it is publishing, and a training batch of that many concurrent
rollouts has that many), and with ``--lazy-sync`` (default ``1s``: a power loss can lose the last second of
acknowledged writes) and printed beside it.

Run: ``.venv/bin/python benchmarks/trajectory_throughput.py [--rollouts 1200 --steps 50 --sync always --lazy-sync 1s --in-flight 256]``
Realistic steps (2,560 tokens, ~14.5 KB): ``--rollouts 200 --steps 20 --prompt-tokens 2048 --completion-tokens 512``
Where the publish window goes (each publish timed until its ack, by kind): ``--latencies``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import nats

from arena_core import runtime, subjects
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


async def publish_all(publish, load, in_flight: int) -> tuple[float, float]:
    """``await publish(subject, data, msg_id)`` for every message of ``load``, each in a task
    of its own, at most ``in_flight`` at once; (wall seconds, CPU seconds of this process).

    As a plane's publisher does, it keeps only what is in flight: a finished task and its
    ack are dropped (kept alive, 66,000 tasks and acks made the publisher's garbage
    collector scan them over and over: seconds of CPU that no plane spends)."""
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task] = set()
    room: asyncio.Future | None = None  # set when a slot frees while the loop below waits for one
    acked = duplicates = 0

    def done(task: asyncio.Task) -> None:
        nonlocal acked, duplicates
        pending.discard(task)
        if not task.cancelled() and task.exception() is None:
            acked += 1
            duplicates += bool(task.result().duplicate)
        if room is not None and not room.done():
            room.set_result(None)

    t0, cpu0 = time.perf_counter(), time.process_time()
    for subject, data, msg_id in load:
        while len(pending) >= in_flight:
            room = loop.create_future()
            await room
        task = asyncio.ensure_future(publish(subject, data, msg_id))
        pending.add(task)
        task.add_done_callback(done)
    while pending:
        await asyncio.gather(*pending)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert acked == len(load) and not duplicates, (acked, len(load), duplicates)
    return elapsed, cpu


async def publish_rates(url: str, args, only: tuple[str, ...] = ()) -> dict[str, tuple[float, float]]:
    """(steps per second, CPU us per publish) of the baseline and of ``Bus.publish``, to a
    scratch stream, each run ``--repeat`` times in turn (the best of each is kept); ``only``:
    just these runs."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    bus = await Bus.connect(url, "bench")
    payloads = [encode(step(f"raw{r}", s, args)) for r in range(args.rollouts) for s in range(args.steps)]
    runs = {
        "baseline": lambda subject, data, msg_id: js.publish(subject, data, headers={"Nats-Msg-Id": msg_id}),
        "bus": lambda subject, data, msg_id: bus.publish(subject, data, msg_id=msg_id),
    }
    # the scratch stream takes no atomic batches nor packs: Bus.publish one by one there; to Arena's
    # own steps stream (declared as the services declare it) the same messages go out packed
    await bus.ensure_topology()
    runs["bus-batched"] = lambda subject, data, msg_id: bus.publish(subject.replace("bench.raw.", "arena.step.b"),
                                                                     data, msg_id=msg_id)
    if only:
        runs = {name: run for name, run in runs.items() if name in only}
    best: dict[str, tuple[float, float]] = {}
    for attempt in range(args.repeat):
        for name, publish in runs.items():
            load = [(f"bench.raw.{n % 100}", p, f"{name}:{attempt}:{n}") for n, p in enumerate(payloads)]
            await js.add_stream(name="BENCH_RAW", subjects=["bench.raw.>"])
            elapsed, cpu = await publish_all(publish, load, args.in_flight)
            await js.delete_stream("BENCH_RAW")
            await js.purge_stream("ARENA_STEPS")
            rate, us = len(load) / elapsed, cpu / len(load) * 1e6
            if name not in best or rate > best[name][0]:
                best[name] = (rate, us)
    await bus.close()
    await nc.close()
    return best


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


def _threads_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def start_service(url: str, data_dir: Path, port: int, log, profile_to: str | None = None) -> subprocess.Popen:
    # ARENA_AUTH=off: the store's throughput is measured, not the API keys (the counts polled on loopback)
    env = dict(os.environ, ARENA_NATS_URL=url, ARENA_DATA_DIR=str(data_dir), ARENA_HOST="127.0.0.1", ARENA_AUTH="off",
               ARENA_TRAJECTORY_PORT=str(port), ARENA_LOG_LEVEL=os.environ.get("BENCH_LOG_LEVEL", "WARNING"))
    profile = ["-m", "cProfile", "-o", profile_to] if profile_to else []
    return subprocess.Popen([sys.executable, *profile, "-m", "arena_trajectory"], env=env, stdout=log, stderr=log)


async def wait_healthy(client: httpx.AsyncClient, port: int) -> None:
    for _ in range(600):
        try:
            if (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit("the trajectory service did not become healthy")


class Trainer:
    """A ``TrajectoryStream`` reading (and committing) every group, noting when it has them all."""

    def __init__(self, url: str, groups_expected: int):
        self.url = url
        self.groups_expected = groups_expected
        self.groups = self.steps = 0
        self.done = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self.run())

    async def run(self) -> None:
        async with TrajectoryStream(self.url, name="bench", max_ack_pending=4096) as stream:
            print("ready", flush=True)
            async for batch in stream.groups(batch_size=16, max_wait=0.05):
                self.groups += len(batch)
                self.steps += sum(len(t.steps) for g in batch for t in g.trajectories)
                await batch.commit()
                if self.groups >= self.groups_expected:
                    self.done.set_result(time.time())
                    return


async def trainer_process(url: str, groups: int) -> None:
    """``--as-trainer``: the trainer in a process of its own, as a trainer runs (beside the
    service and the planes, not in the publisher's event loop); prints ``ready`` once
    subscribed, then ``{"done_at": unix time, "steps": n}`` once it has every group."""
    trainer = Trainer(url, groups)
    done_at = await trainer.done
    print(json.dumps({"done_at": done_at, "steps": trainer.steps}), flush=True)


class TrainerProcess:
    """``python trajectory_throughput.py --as-trainer URL GROUPS`` started and read."""

    def __init__(self, url: str, groups: int, log):
        self.proc = subprocess.Popen([sys.executable, __file__, "--as-trainer", url, str(groups)],
                                     stdout=subprocess.PIPE, stderr=log, text=True)
        self.result: dict | None = None
        self._lines: asyncio.Queue[str] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(loop,), daemon=True).start()

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        for line in self.proc.stdout:
            loop.call_soon_threadsafe(self._lines.put_nowait, line.strip())
        loop.call_soon_threadsafe(self._lines.put_nowait, "")

    async def ready(self) -> None:
        if await asyncio.wait_for(self._lines.get(), 60) != "ready":
            raise SystemExit("the trainer process did not start")

    def poll(self) -> dict | None:
        """Its result once it has every group, else None."""
        while self.result is None and not self._lines.empty():
            line = self._lines.get_nowait()
            if not line:
                raise SystemExit(f"the trainer process exited ({self.proc.poll()})")
            self.result = json.loads(line)
        return self.result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(30)


async def until_queryable_and_trained(client, port: int, total_steps: int, trainer: TrainerProcess, t0: float,
                                      args) -> tuple[float, float]:
    """(seconds from ``t0`` until every step is queryable, until the trainer has every group);
    ``t0`` from ``time.time()`` (the trainer is another process)."""
    t_query = None
    stored: dict = {}
    while t_query is None or trainer.poll() is None:
        if t_query is None:  # rows stored (cheap) until they are all there, then as queries see them
            stored = (await client.get(f"http://127.0.0.1:{port}/v1/counts",
                                       params={"table": "steps", "final": "false"})).json()
            if stored["steps"] >= total_steps:
                counts = (await client.get(f"http://127.0.0.1:{port}/v1/counts", params={"table": "steps"})).json()
                if counts["steps"] >= total_steps:
                    t_query = time.time()
        if time.time() - t0 > args.timeout:
            raise SystemExit(f"timed out: steps stored {stored}, the trainer not done")
        await asyncio.sleep(0.05)
    result = trainer.poll()
    assert result["steps"] == total_steps, (result, total_steps)
    return t_query - t0, result["done_at"] - t0


async def end_to_end(url: str, data_dir: Path, args, nats_pid: int) -> dict[str, float]:
    """Publish through ``Bus.publish`` while the service and the trainer consume."""
    port = free_port()
    bus = await Bus.connect(url, "bench")
    await bus.ensure_topology()
    log = open(os.environ.get("BENCH_SERVICE_LOG", data_dir.parent / "service.log"), "ab")  # noqa: SIM115 - closed below
    service = start_service(url, data_dir, port, log, args.profile)
    total_steps = args.rollouts * args.steps
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            await wait_healthy(client, port)
            load = messages(args)
            trainer = TrainerProcess(url, args.rollouts // args.group_size, log)
            await trainer.ready()
            pids = {"nats-server": nats_pid, "trajectory service": service.pid, "trainer": trainer.proc.pid,
                    "bench (the planes' publisher)": os.getpid()}
            cpu0 = cpu_seconds(pids)
            threads0 = thread_seconds(service.pid)
            t0 = time.time()
            publish_s, _ = await publish_all(lambda subject, data, msg_id: bus.publish(subject, data, msg_id=msg_id),
                                             load, args.in_flight)
            query_s, stream_s = await until_queryable_and_trained(client, port, total_steps, trainer, t0, args)
            cpu1 = cpu_seconds(pids)
            threads1 = thread_seconds(service.pid)
            return {"publish_s": publish_s, "messages": len(load), "query_s": query_s, "stream_s": stream_s,
                    "cpu": {k: cpu1[k] - cpu0[k] for k in pids},
                    "threads": _threads_since(threads0, threads1),
                    "wall_s": time.time() - t0}
    finally:
        if "trainer" in locals():
            trainer.stop()
        service.terminate()
        service.wait(30)
        log.close()
        await bus.close()


async def backlog(url: str, data_dir: Path, args, nats_pid: int) -> dict[str, float]:
    """The service's own pace: the whole load is in the streams before it starts (published
    by ``Bus.publish``, not timed); from its first delivery until every step is queryable
    and the trainer has every group. No publisher competes for the cores."""
    from nats.js.errors import NotFoundError

    port = free_port()
    bus = await Bus.connect(url, "bench")
    await bus.ensure_topology()
    load = messages(args)
    await publish_all(lambda subject, data, msg_id: bus.publish(subject, data, msg_id=msg_id), load, args.in_flight)
    log = open(os.environ.get("BENCH_SERVICE_LOG", data_dir.parent / "service.log"), "ab")  # noqa: SIM115 - closed below
    trainer = TrainerProcess(url, args.rollouts // args.group_size, log)
    await trainer.ready()
    service = start_service(url, data_dir, port, log)
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            while True:  # the first step handed to the service: its durable consumer delivered something
                try:
                    info = await bus.js.consumer_info("ARENA_STEPS", subjects.CONSUMER_TRAJ_STEPS)
                    if info.delivered.stream_seq > 0:
                        break
                except NotFoundError:
                    pass
                if service.poll() is not None:
                    raise SystemExit("the trajectory service exited")
                await asyncio.sleep(0.01)
            t0 = time.time()
            cpu0 = cpu_seconds({"trajectory service": service.pid, "nats-server": nats_pid})
            threads0 = thread_seconds(service.pid)
            query_s, stream_s = await until_queryable_and_trained(client, port, args.rollouts * args.steps, trainer,
                                                                  t0, args)
            cpu1 = cpu_seconds({"trajectory service": service.pid, "nats-server": nats_pid})
            return {"query_s": query_s, "stream_s": stream_s, "cpu": {k: cpu1[k] - cpu0[k] for k in cpu0},
                    "threads": _threads_since(threads0, thread_seconds(service.pid))}
    finally:
        trainer.stop()
        service.terminate()
        service.wait(30)
        log.close()
        await bus.close()


def beside(tmp: Path, args, sync: str) -> tuple[float, dict]:
    """The baseline's rate and the end-to-end run with ``args`` on a fresh server with
    ``sync``: a figure printed beside the headline."""
    server = NatsServer(tmp / "nats", sync=sync).start()
    try:
        base = run_as_a_plane(publish_rates(server.url, args, only=("baseline",)))["baseline"][0]
        data = tmp / "data"
        data.mkdir(parents=True)
        return base, run_as_a_plane(end_to_end(server.url, data, args, server.proc.pid))
    finally:
        server.stop()


async def publish_latencies(url: str, args) -> None:
    """``--latencies``: the end-to-end load published through ``Bus.publish`` (no service, no
    trainer), each publish timed until its ack; per kind of message, how long it waited and
    what share of the in-flight window it held (Little's law: rate x wait)."""
    bus = await Bus.connect(url, "bench")
    await bus.ensure_topology()
    waits: dict[str, list[float]] = {}

    async def timed(subject: str, data: bytes, msg_id: str):
        t0 = time.perf_counter()
        ack = await bus.publish(subject, data, msg_id=msg_id)
        kind = "step" if subject.startswith("arena.step.") else ".".join(subject.split(".")[1:3])
        waits.setdefault(kind, []).append(time.perf_counter() - t0)
        return ack

    load = messages(args)
    elapsed, _ = await publish_all(timed, load, args.in_flight)
    await bus.close()
    held = sum(sum(w) for w in waits.values())
    print(f"\n{len(load)} messages in {elapsed:.2f} s ({len(load) / elapsed:,.0f} msgs/s), {args.in_flight} in flight")
    print(f"{'kind':<18} {'count':>7} {'mean ms':>8} {'p50 ms':>7} {'p90 ms':>7} {'window':>7}")
    for kind, w in sorted(waits.items(), key=lambda kv: -sum(kv[1])):
        w.sort()
        print(f"{kind:<18} {len(w):>7} {sum(w) / len(w) * 1e3:>8.2f} {w[len(w) // 2] * 1e3:>7.2f} "
              f"{w[int(len(w) * 0.9)] * 1e3:>7.2f} {sum(w) / held:>7.0%}")


def run_as_a_plane(main):
    """Run ``main`` (the planes' publishes) on the loop the planes run on: uvloop, as
    ``arena_core.runtime.run`` does (the baseline's nats-py publishes too, so the ratio
    compares like with like). The trainer runs on asyncio's own loop, as a user's does."""
    return runtime.run(main)


def print_cpu(run: dict, steps: int) -> None:
    """Each process's CPU seconds in ``run``, per step, the service's by thread."""
    for name, seconds in run["cpu"].items():
        print(f"  {name:<30} {seconds:6.2f} s  ({seconds / steps * 1e6:5.1f} us/step)")
        if name == "trajectory service":
            for thread, used in sorted(run["threads"].items(), key=lambda kv: -kv[1]):
                print(f"    {thread:<28} {used:6.2f} s  ({used / steps * 1e6:5.1f} us/step)")


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
    parser.add_argument("--lazy-sync", default="1s",
                        help="also run the baseline and the end-to-end path with this sync_interval, printed beside "
                             "the headline ('none': skip; default %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--in-flight", type=int, default=256,
                        help="publishes awaiting their PubAck at once, in every run (default %(default)s)")
    parser.add_argument("--wide-in-flight", type=int, default=1024,
                        help="also run the baseline and the end-to-end path (fsync as --sync) with this many "
                             "publishes in flight, printed beside the headline (0: skip; default %(default)s)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs of the baseline and of Bus.publish, in turn; the best of each (default %(default)s)")
    parser.add_argument("--profile", help="write a cProfile of the trajectory service (end-to-end run) to this file")
    parser.add_argument("--latencies", action="store_true",
                        help="only time each publish of the load until its ack, by kind of message, and exit")
    parser.add_argument("--as-trainer", nargs=2, metavar=("URL", "GROUPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_trainer:
        asyncio.run(trainer_process(args.as_trainer[0], int(args.as_trainer[1])))
        return
    if args.latencies:
        with tempfile.TemporaryDirectory(prefix="arena-bench-") as tmp:
            server = NatsServer(Path(tmp) / "nats", sync=args.sync).start()
            try:
                run_as_a_plane(publish_latencies(server.url, args))
            finally:
                server.stop()
        return
    reference = cpu_reference()
    with tempfile.TemporaryDirectory(prefix="arena-bench-") as tmp:
        nats_server = NatsServer(Path(tmp) / "nats", sync=args.sync).start()
        try:
            rates = run_as_a_plane(publish_rates(nats_server.url, args))
            data = Path(tmp) / "data"
            data.mkdir()
            e2e = run_as_a_plane(end_to_end(nats_server.url, data, args, nats_server.proc.pid))
        finally:
            nats_server.stop()
        drain_server = NatsServer(Path(tmp) / "nats-backlog", sync=args.sync).start()
        try:
            data = Path(tmp) / "data-backlog"
            data.mkdir()
            drained = run_as_a_plane(backlog(drain_server.url, data, args, drain_server.proc.pid))
        finally:
            drain_server.stop()
        wide = None
        if args.wide_in_flight and args.wide_in_flight != args.in_flight:
            wide = beside(Path(tmp) / "wide", argparse.Namespace(**{**vars(args), "in_flight": args.wide_in_flight}),
                          args.sync)
        lazy = None
        if args.lazy_sync != "none" and args.lazy_sync != args.sync:
            lazy = beside(Path(tmp) / "lazy", args, args.lazy_sync)
    steps = args.rollouts * args.steps
    step_bytes = len(encode(step("r0", 0, args)))
    print(f"\ntrajectory throughput: {args.rollouts} rollouts x {args.steps} steps = {steps} steps "
          f"(~{step_bytes} B each), groups of {args.group_size}, JetStream sync_interval={args.sync}, "
          f"{os.cpu_count()} cores; CPU reference {reference:.3f} s (sum(range(3e7)), lower is faster)\n")
    (base, base_us), (bus_rate, bus_us) = rates["baseline"], rates["bus"]
    rows = [
        ("baseline: nats-py js.publish (steps)", base, "steps/s", f"{base_us:.0f}"),
        ("Bus.publish, one by one (steps)", bus_rate, "steps/s", f"{bus_us:.0f}"),
        ("Bus.publish to ARENA_STEPS: packs (steps)", rates["bus-batched"][0], "steps/s", f"{rates['bus-batched'][1]:.0f}"),
        ("e2e load published by Bus.publish (all msgs)", e2e["messages"] / e2e["publish_s"], "msgs/s", ""),
        ("publish -> queryable in ClickHouse (chDB)", steps / e2e["query_s"], "steps/s", ""),
        ("publish -> trainer TrajectoryStream", steps / e2e["stream_s"], "steps/s", ""),
        ("backlog -> queryable (service alone)", steps / drained["query_s"], "steps/s", ""),
        ("backlog -> trainer (service alone)", steps / drained["stream_s"], "steps/s", ""),
    ]
    print(f"{args.in_flight} publishes in flight, best of {args.repeat} runs for the first three rows\n")
    print(f"{'path':<46} {'rate':>12} {'unit':<8} {'x baseline':>10} {'CPU us/publish':>15}")
    for name, rate, unit, us in rows:
        print(f"{name:<46} {rate:>12,.0f} {unit:<8} {rate / base:>10.2f} {us:>15}")
    print(f"\ntimeline from the first publish: all published {e2e['publish_s']:.2f} s, all steps queryable "
          f"{e2e['query_s']:.2f} s, trainer has every group {e2e['stream_s']:.2f} s")
    print(f"\nCPU seconds during the end-to-end run ({e2e['wall_s']:.2f} s wall, {os.cpu_count()} cores):")
    print_cpu(e2e, steps)
    print(f"\nCPU seconds while the service worked through the backlog alone ({drained['stream_s']:.2f} s):")
    print_cpu(drained, steps)
    slowest = steps / max(e2e['query_s'], e2e['stream_s'])
    alone = steps / max(drained['query_s'], drained['stream_s'])
    print(f"\nend to end (slowest path): {slowest:,.0f} steps/s = {slowest / base:.2f} x baseline; goal 20,000")
    print(f"the service alone on a backlog (slowest path): {alone:,.0f} steps/s = {alone / base:.2f} x baseline")
    if wide is not None:
        wide_base, wide_e2e = wide
        wide_slowest = steps / max(wide_e2e['query_s'], wide_e2e['stream_s'])
        print(f"\nbeside it, {args.wide_in_flight} publishes in flight (sync_interval={args.sync}; the proxy does not "
              f"bound its step publishes, a training batch of that many rollouts has that many): baseline "
              f"{wide_base:,.0f} steps/s; end to end {wide_slowest:,.0f} steps/s = {wide_slowest / wide_base:.2f} x that "
              f"baseline; CPU us/step " + " / ".join(f"{name.split(' (')[0]} {sec / steps * 1e6:.1f}"
                                                     for name, sec in wide_e2e["cpu"].items()))
    if lazy is not None:
        lazy_base, lazy_e2e = lazy
        lazy_slowest = steps / max(lazy_e2e['query_s'], lazy_e2e['stream_s'])
        print(f"\nbeside it, sync_interval={args.lazy_sync} (acknowledged writes can be lost on power loss): "
              f"baseline {lazy_base:,.0f} steps/s; end to end {lazy_slowest:,.0f} steps/s = "
              f"{lazy_slowest / lazy_base:.2f} x that baseline, {lazy_slowest / slowest:.2f} x the {args.sync} figure")


if __name__ == "__main__":
    main()
