"""A large diff is kept once, in the object store: the ClickHouse rows hold its reference, and
the trainer stream, the API, exports and groups give the diff as the sandbox sent it."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from arena_core import subjects
from arena_core.bus import run_consumers
from arena_core.schemas import (RolloutState, RolloutStateChanged, SandboxDone, SandboxOutcome, Trajectory,
                                VerificationResult)
from arena_trajectory import diffs
from arena_trajectory.app import create_app
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.store import DATABASE, TrajectoryStore
from arena_trajectory.worker import TRAJECTORIES_STREAM, TrajectoryWorker

#: ~1.2 MiB over several lines, non-ASCII included: over the inline limit and over a message
LARGE = "".join(f"+line {i} é€ {'x' * 60}\n" for i in range(16_000))


@pytest.fixture
async def store(tmp_path):
    s = TrajectoryStore(ChdbBackend(tmp_path / "clickhouse"))
    await s.init()
    try:
        yield s
    finally:
        await s.close()


def done(rid: str, diff: str, artifacts: dict[str, str] | None = None) -> SandboxDone:
    return SandboxDone(rollout_id=rid, sandbox_id=f"sb-{rid}", provider="local", outcome=SandboxOutcome.COMPLETED,
                       reason="done", started_at=1.0, finished_at=2.0, exit_code=0, diff=diff,
                       artifacts=artifacts or {})


async def finish(bus, rid: str, diff: str, *, group: str | None = None, index: int = 0, size: int = 1) -> None:
    await bus.publish(subjects.sandbox_done(rid), done(rid, diff, {"agent.log": f"{rid}/agent.log"}),
                      msg_id=subjects.msg_id(rid, "sandbox-done"))
    await bus.publish(subjects.verify_done(rid), VerificationResult(rollout_id=rid, verifier="exact", reward=1.0,
                                                                    passed=True, started_at=3.0, finished_at=4.0),
                      msg_id=subjects.msg_id(rid, "verify-done"))
    event = RolloutStateChanged(rollout_id=rid, task_id="t", from_state=RolloutState.VERIFYING,
                                to_state=RolloutState.COMPLETED, at=5.0, steps=0, group_id=group,
                                group_index=index, group_size=size)
    await bus.publish(subjects.rollout_state(rid), event, msg_id=subjects.msg_id(rid, "state", "final"))


async def on_stream(bus, rid: str, timeout: float = 20.0) -> Trajectory:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            msg = await bus.js.get_last_msg(TRAJECTORIES_STREAM, subjects.trajectory("t", rid))
            return msgspec.json.decode(await bus.body(msg), type=Trajectory)
        except Exception:  # noqa: BLE001 - not there yet
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"no trajectory of {rid} after {timeout}s") from None
            await asyncio.sleep(0.1)


async def test_a_large_diff_is_stored_once_and_given_back_whole(bus, store):
    stop = asyncio.Event()
    worker = TrajectoryWorker(bus, store)
    task = asyncio.create_task(run_consumers(worker.consumers(), stop))
    try:
        await finish(bus, "big", LARGE, group="g", index=0, size=2)
        await finish(bus, "small", "+a small diff\n", group="g", index=1, size=2)
        big, small = await on_stream(bus, "big"), await on_stream(bus, "small")
    finally:
        stop.set()
        await task
    # the trainer stream: the messages the sandbox sent, unchanged
    assert big.sandbox.diff == LARGE and big.sandbox.artifacts == {"agent.log": "big/agent.log"}
    assert small.sandbox.diff == "+a small diff\n"
    # ClickHouse: the large diff's reference only, in both rows; the small one inline
    stored = await store.sandbox_result("big")
    assert stored.diff == "" and stored.artifacts == {"agent.log": "big/agent.log", "diff": "big/diff.json"}
    assert (await store.sandbox_result("small")).diff == "+a small diff\n"
    for table in ("sandbox_results", "trajectories"):
        rows = await store.select(f"SELECT length(body) AS n FROM {DATABASE}.{table} FINAL "
                                  "WHERE rollout_id = {rid:String}", {"rid": "big"})
        assert int(msgspec.json.decode(rows[0])["n"]) < 4096, table
    objects = await bus.artifacts()
    assert (await objects.get("big/diff.json")).data == msgspec.json.encode(LARGE)  # the bytes it arrived as
    # the API gives the diff back where a whole trajectory leaves the service
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(store, bus)), base_url="http://t") as api:
        got = msgspec.json.decode((await api.get("/v1/trajectories/big")).content, type=Trajectory)
        assert got.sandbox.diff == LARGE and "diff" not in got.sandbox.artifacts
        page = (await api.get("/v1/export/trajectories")).json()
        assert {t["rollout_id"]: t["sandbox"]["diff"] for t in page["trajectories"]} == {
            "big": LARGE, "small": "+a small diff\n"}
        group = (await api.get("/v1/groups/g")).json()
        assert [t["sandbox"]["diff"] for t in group["trajectories"]] == [LARGE, "+a small diff\n"]


async def test_an_artifact_named_diff_is_kept_and_a_missing_object_stays_a_reference(bus):
    theirs = done("r1", LARGE, {"diff": "r1/diff-of-the-scaffold"})
    assert await diffs.decode_sandbox_done(bus, msgspec.json.encode(theirs)) == theirs  # the name is taken: inline
    small = done("r0", "+a line\n")
    assert await diffs.decode_sandbox_done(bus, msgspec.json.encode(small)) == small
    spilled = await diffs.decode_sandbox_done(bus, msgspec.json.encode(done("r2", LARGE)))
    assert diffs.spilled(spilled) and spilled.diff == "" and spilled.artifacts == {"diff": "r2/diff.json"}
    assert await diffs.restore(bus, spilled) == done("r2", LARGE)
    wire = await diffs.raw_sandbox(bus, spilled)  # for a message: encodes as the sandbox sent it
    assert msgspec.json.encode(wire) == msgspec.json.encode(done("r2", LARGE))
    await (await bus.artifacts()).delete("r2/diff.json")
    assert await diffs.restore(bus, spilled) == spilled  # logged; the reference is what is left
    assert await diffs.raw_sandbox(bus, spilled) == spilled
