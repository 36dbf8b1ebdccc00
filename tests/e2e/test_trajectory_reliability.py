"""The trajectory plane under crashes, as real processes: a nats-server with file storage,
``python -m arena_trajectory`` and a ``TrajectoryStream`` trainer process.

The test publishes what the rollout, sandbox and verification planes would (state
transitions, 5,000 steps, sandbox and verification results for 200 rollouts in 50 groups
of 4) while the trajectory service is killed with SIGKILL three times, the NATS server is
stopped and restarted once on the same port and store, and the trainer is killed with
SIGKILL once mid-stream. Afterwards: every rollout has its whole trajectory, ClickHouse
holds exactly the expected rows (no loss, no visible duplicate), the training stream
holds each trajectory and group once, and the trainer committed every group exactly once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from arena_core import apikeys, subjects
from arena_core.bus import Bus
from arena_stack.natsserver import DEFAULT_SYNC, NatsServer, free_port
from arena_core.schemas import (
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxOutcome,
    Step,
    Timings,
    Usage,
    VerificationResult,
)

GROUPS, SIZE, STEPS = 50, 4, 25
ROLLOUTS = GROUPS * SIZE
CONSUMER = Path(__file__).with_name("trajectory_stream_consumer.py")
LIFECYCLE = [RolloutState.PENDING, RolloutState.PROVISIONING, RolloutState.RUNNING, RolloutState.VERIFYING,
             RolloutState.COMPLETED]


def rid(g: int, i: int) -> str:
    return f"r-{g:03d}-{i}"


def spawn(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=out)


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


async def publish_rollout(bus: Bus, g: int, i: int) -> None:
    r, task = rid(g, i), f"task-{g % 5}"
    now = time.time()

    def state(k: int) -> RolloutStateChanged:
        return RolloutStateChanged(rollout_id=r, task_id=task, from_state=LIFECYCLE[k - 1] if k else None,
                                   to_state=LIFECYCLE[k], at=now + k * 0.001, steps=STEPS if k >= 3 else 0,
                                   group_id=f"g-{g:03d}", group_index=i, group_size=SIZE)

    async def pub(subject, message, kind, seq=0):
        await bus.publish(subject, message, msg_id=subjects.msg_id(r, kind, seq))

    for k in range(3):
        await pub(subjects.rollout_state(r), state(k), "state", k)
    await asyncio.gather(*(pub(subjects.step(r), Step(
        rollout_id=r, step_index=s, model="m", backend="b0", policy_version=str(g % 3),
        prompt_token_ids=list(range(40 + s)), completion_token_ids=list(range(16)), logprobs=[-0.25] * 16,
        completion_text=f"{r} step {s}", usage=Usage(prompt_tokens=40 + s, completion_tokens=16),
        timings=Timings(total_ms=20.0 + s), started_at=now + s * 0.001), "step", s) for s in range(STEPS)))
    await pub(subjects.sandbox_done(r), SandboxDone(rollout_id=r, sandbox_id=f"sb-{r}", provider="local",
                                                    outcome=SandboxOutcome.COMPLETED, reason="done",
                                                    started_at=now, finished_at=now + 0.5), "sandbox-done")
    await pub(subjects.verify_done(r), VerificationResult(rollout_id=r, verifier="tests", reward=float(i % 2),
                                                          passed=i % 2 == 1, started_at=now + 0.6,
                                                          finished_at=now + 0.7), "verify-done")
    for k in (3, 4):
        await pub(subjects.rollout_state(r), state(k), "state", k)


async def http_json(url: str, key: str, timeout: float = 5.0):
    async with httpx.AsyncClient(timeout=timeout, headers=apikeys.auth_headers(key)) as client:
        r = await client.get(url)
        r.raise_for_status()
        return r.json()


async def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = await predicate()
            if last is True:
                return
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        await asyncio.sleep(0.5)
    raise AssertionError(f"{what} not reached in {timeout}s (last: {last})")


def handed_again(entries: list[tuple[str, list[str]]], group_id: str) -> bool:
    """Whether ``group_id`` was yielded more than once (its first batch never committed)."""
    return sum(group_id in ids for tag, ids in entries if tag == "Y") > 1


def consumer_log(path: Path) -> list[tuple[str, list[str]]]:
    if not path.exists():
        return []
    return [(line[0], line[2:].split()) for line in path.read_text().splitlines() if line]


async def test_no_loss_no_duplicate_under_kill9_and_a_nats_restart(tmp_path):
    nats = NatsServer(tmp_path / "nats", sync=DEFAULT_SYNC).start()
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    env = dict(os.environ, ARENA_NATS_URL=nats.url, ARENA_DATA_DIR=str(tmp_path / "data"), ARENA_HOST="127.0.0.1",
               ARENA_TRAJECTORY_PORT=str(port), ARENA_TRAJECTORY_GROUP_TIMEOUT_S="0", ARENA_LOG_LEVEL="WARNING")
    service_cmd = [sys.executable, "-m", "arena_trajectory"]
    trainer_log = tmp_path / "trainer.log"
    trainer_cmd = [sys.executable, str(CONSUMER), nats.url, "reliability", str(trainer_log)]
    procs: dict[str, subprocess.Popen] = {}
    bus = await Bus.connect(nats.url, "test-load")
    try:
        await bus.ensure_topology()
        key, _ = await apikeys.issue(bus, "test", ["read"])  # the service asks for keys by default
        procs["service"] = spawn(service_cmd, env, tmp_path / "service.log")
        procs["trainer"] = spawn(trainer_cmd, env, tmp_path / "trainer.out")
        kills = 0

        def committed() -> set[str]:
            return {gid for tag, ids in consumer_log(trainer_log) if tag == "C" for gid in ids}

        async def some_committed():
            return len(committed()) > 0

        def interrupted() -> set[str]:
            """Batches yielded right before a restart marker, whose commit never logged: the
            trainer was killed between handing them out and recording the commit, so the
            server may or may not have their acks (if it does, they never come back)."""
            entries = consumer_log(trainer_log)
            out = set()
            for n, (tag, ids) in enumerate(entries):
                if tag == "Y" and (n + 1 == len(entries) or entries[n + 1][0] == "S"):
                    out |= set(ids)
            return out

        async def all_committed():
            """Every group committed, as the trainer logged it or (for a batch whose commit
            the kill cut short after the acks landed) as the server's consumer says: nothing
            pending, nothing unacknowledged."""
            done = committed()
            if done | interrupted() != {f"g-{g:03d}" for g in range(GROUPS)}:
                return len(done)
            info = await bus.js.consumer_info("ARENA_TRAJECTORIES", "trainer-reliability")
            return (info.num_pending == 0 and info.num_ack_pending == 0) or len(done)

        # ten waves of 5 groups; crashes between and during them
        for wave in range(10):
            load = asyncio.gather(*(publish_rollout(bus, g, i) for g in range(wave * 5, wave * 5 + 5)
                                    for i in range(SIZE)))
            if wave in (2, 5, 8):  # SIGKILL the service mid-wave, start it again at once
                await asyncio.sleep(0.3)
                kill9(procs["service"])
                kills += 1
                procs["service"] = spawn(service_cmd, env, tmp_path / "service.log")
            if wave == 6:  # stop the NATS server (by PID) mid-wave; restart on the same port and store
                await asyncio.sleep(0.2)
                nats.stop()
                await asyncio.sleep(1.0)
                nats.start()
            await load
            if wave == 4:  # SIGKILL the trainer once it has committed something
                await until(some_committed, 60, "a first trainer commit")
                kill9(procs["trainer"])
                procs["trainer"] = spawn(trainer_cmd, env, tmp_path / "trainer.out")
        assert kills == 3

        # Every table, not just trajectories and groups: a batch fetched by a killed service
        # is redelivered only after the consumer's ack_wait, so the rows of that batch (say
        # the first states of a wave's rollouts) can land after every trajectory is stored.
        expected = {"steps": ROLLOUTS * STEPS, "sandbox_results": ROLLOUTS, "verifications": ROLLOUTS,
                    "trajectories": ROLLOUTS, "rollout_states": ROLLOUTS * len(LIFECYCLE), "groups": GROUPS}

        async def all_stored():
            counts = await http_json(f"{api}/v1/counts", key)
            return counts == expected or counts

        await until(all_stored, 120, "every row of every table stored")
        await until(all_committed, 60, "every group committed by the trainer")

        # ClickHouse, through the restarted service: exactly the expected rows
        counts = await http_json(f"{api}/v1/counts", key)
        assert counts == expected
        listed = (await http_json(f"{api}/v1/trajectories?limit=1000", key))["trajectories"]
        assert sorted(t["rollout_id"] for t in listed) == sorted(rid(g, i) for g in range(GROUPS) for i in range(SIZE))
        assert all(t["final_state"] == "completed" and t["num_steps"] == STEPS for t in listed)
        one = await http_json(f"{api}/v1/trajectories/{rid(7, 1)}", key)
        assert [s["step_index"] for s in one["steps"]] == list(range(STEPS)) and one["reward"] == 1.0
        assert "incomplete" not in one and [h["to_state"] for h in one["history"]] == [s.value for s in LIFECYCLE]

        # the training log: each trajectory and each group exactly once, nothing dead-lettered
        info = await bus.js.stream_info("ARENA_TRAJECTORIES", subjects_filter=">")
        per_subject = info.state.subjects or {}
        assert len(per_subject) == ROLLOUTS + GROUPS and set(per_subject.values()) == {1}
        assert (await bus.js.stream_info("ARENA_DEAD")).state.messages == 0

        # the trainer: every group committed once; a group came back only if its batch was
        # handed out but not committed when the trainer was killed
        entries = consumer_log(trainer_log)
        commits = [gid for tag, ids in entries if tag == "C" for gid in ids]
        cut_short = interrupted()
        assert len(commits) == len(set(commits)), "each group committed at most once"
        # a group without a logged commit is one whose commit the kill cut short after its ack
        # landed (the server's consumer has nothing pending: checked by all_committed)
        assert set(commits) | cut_short == {f"g-{g:03d}" for g in range(GROUPS)}
        assert not (set(commits) & cut_short) or all(handed_again(entries, g) for g in set(commits) & cut_short)
        handed: dict[str, int] = {}
        for tag, ids in entries:
            for gid in ids if tag == "Y" else ():
                handed[gid] = handed.get(gid, 0) + 1
        again = {gid for gid, n in handed.items() if n > 1}
        assert again <= cut_short, f"re-delivered although committed: {again - cut_short}"
        assert sum(1 for tag, _ in entries if tag == "S") == 2
    finally:
        await bus.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        nats.stop()
