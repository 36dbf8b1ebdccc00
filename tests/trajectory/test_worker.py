"""The trajectory worker against a real nats-server and embedded ClickHouse (chDB)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from arena_core import subjects
from arena_core.bus import run_consumers
from arena_core.sequences import with_sequences
from arena_core.schemas import (
    GroupCompleted,
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxOutcome,
    SandboxStarted,
    Step,
    Trajectory,
    Usage,
    VerificationResult,
)
from arena.stream import TrajectoryStream
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.worker import TRAJECTORIES_STREAM, TrajectoryWorker


@pytest.fixture
async def store(tmp_path):
    s = TrajectoryStore(ChdbBackend(tmp_path / "clickhouse"))
    await s.init()
    try:
        yield s
    finally:
        await s.close()


def step(rid: str, i: int, version: str = "3") -> Step:
    return Step(rollout_id=rid, step_index=i, model="m", backend="b0", policy_version=version,
                prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], logprobs=[-0.1, -0.2],
                completion_text=f"{rid} step {i}", usage=Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
                started_at=1_700_000_000.0 + i)


def state(rid: str, to: RolloutState, *, steps: int, group: str | None = None, index: int = 0, size: int = 1,
          frm: RolloutState = RolloutState.VERIFYING) -> RolloutStateChanged:
    return RolloutStateChanged(rollout_id=rid, task_id="calc/add", from_state=frm, to_state=to, at=1_700_000_100.0,
                               steps=steps, group_id=group, group_index=index, group_size=size)


async def publish_step(bus, s: Step, seq: str | int | None = None) -> None:
    await bus.publish(subjects.step(s.rollout_id), s,
                      msg_id=subjects.msg_id(s.rollout_id, "step", s.step_index if seq is None else seq))


async def publish_outcome(bus, rid: str, reward: float) -> None:
    await bus.publish(subjects.sandbox_started(rid), SandboxStarted(rollout_id=rid, sandbox_id=f"sb-{rid}",
                      provider="local", at=1.0), msg_id=subjects.msg_id(rid, "sandbox-started"))
    await bus.publish(subjects.sandbox_done(rid),
                      SandboxDone(rollout_id=rid, sandbox_id=f"sb-{rid}", provider="local",
                                  outcome=SandboxOutcome.COMPLETED, reason="done", started_at=1.0, finished_at=2.0,
                                  exit_code=0, diff=f"diff of {rid}\n"),
                      msg_id=subjects.msg_id(rid, "sandbox-done"))
    await bus.publish(subjects.verify_done(rid),
                      VerificationResult(rollout_id=rid, verifier="tests", reward=reward, passed=reward == 1.0,
                                         started_at=3.0, finished_at=4.0),
                      msg_id=subjects.msg_id(rid, "verify-done"))


async def publish_state(bus, event: RolloutStateChanged, seq: str = "final") -> None:
    await bus.publish(subjects.rollout_state(event.rollout_id), event,
                      msg_id=subjects.msg_id(event.rollout_id, "state", seq))


async def last(bus, subject: str, type_, timeout: float = 15.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            raw = await bus.js.get_last_msg(TRAJECTORIES_STREAM, subject)
            return msgspec.json.decode(raw.data, type=type_)
        except Exception:  # noqa: BLE001 - not there yet
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"nothing on {subject} after {timeout}s") from None
            await asyncio.sleep(0.1)


async def whole_group(bus, group_id: str) -> GroupCompleted:
    """The group on the stream, which refers to its members, with each member read from
    its trajectory message (as a raw reader would; ``TrajectoryStream`` does it too)."""
    group = await last(bus, subjects.group(group_id), GroupCompleted)
    assert group.trajectories == [] and group.members, group
    members = [await last(bus, ref.subject, Trajectory) for ref in group.members]
    assert [t.rollout_id for t in members] == [ref.rollout_id for ref in group.members]
    return msgspec.structs.replace(group, trajectories=members, members=[])


async def count_on(bus, subject_filter: str) -> int:
    info = await bus.js.stream_info(TRAJECTORIES_STREAM, subjects_filter=subject_filter)
    return sum((info.state.subjects or {}).values())


async def dead_letters(bus) -> int:
    info = await bus.js.stream_info("ARENA_DEAD")
    return info.state.messages


@pytest.fixture
async def running(bus, store):
    """Starts a worker's consumers in-process; yields a function that starts them."""
    stop = asyncio.Event()
    tasks = []

    def start(**options) -> TrajectoryWorker:
        worker = TrajectoryWorker(bus, store, **options)
        tasks.append(asyncio.create_task(run_consumers(worker.consumers(), stop)))
        return worker

    yield start
    stop.set()
    await asyncio.gather(*tasks)


async def test_group_of_two_with_a_state_that_overtakes_its_last_step(nats_server, bus, store, running):
    # r0: 2 steps, reward 1; r1: 3 steps, reward 0; r2: a single rollout, no group
    for i in range(2):
        await publish_step(bus, step("r0", i))
    await publish_step(bus, step("r0", 0), seq="redelivered")  # the same step twice on the stream
    for i in range(2):  # r1's last step is held back
        await publish_step(bus, step("r1", i))
    await publish_outcome(bus, "r0", 1.0)
    await publish_outcome(bus, "r1", 0.0)
    await publish_state(bus, state("r0", RolloutState.RUNNING, steps=1, group="g1", size=2,
                                   frm=RolloutState.PROVISIONING), seq="running")
    await publish_state(bus, state("r0", RolloutState.COMPLETED, steps=2, group="g1", index=0, size=2))
    await publish_state(bus, state("r1", RolloutState.COMPLETED, steps=3, group="g1", index=1, size=2))
    await publish_step(bus, step("r2", 0))
    await publish_state(bus, state("r2", RolloutState.FAILED, steps=1))

    running(give_up_after=8)  # r2 failed while verifying but never sends its sandbox result: ~5 s of waiting
    t0 = await last(bus, subjects.trajectory("calc/add", "r0"), Trajectory)
    await asyncio.sleep(0.6)  # r1's state is being retried meanwhile
    assert await store.trajectory("r1") is None
    assert await count_on(bus, "arena.group.*") == 0
    await publish_step(bus, step("r1", 2))

    group = await whole_group(bus, "g1")
    t1 = with_sequences(await last(bus, subjects.trajectory("calc/add", "r1"), Trajectory))  # derived: not on the wire
    t2 = await last(bus, subjects.trajectory("calc/add", "r2"), Trajectory)

    assert [s.step_index for s in t0.steps] == [0, 1]
    assert [s.step_index for s in t1.steps] == [0, 1, 2]
    assert "incomplete" not in t1.metadata
    assert (t0.reward, t1.reward) == (1.0, 0.0)
    assert t0.verification.reward == 1.0 and t0.sandbox.diff == "diff of r0\n"
    assert t0.policy_versions == ["3"]
    # never verified: no reward (docs/trajectory.md, One meaning of reward)
    assert t2.final_state is RolloutState.FAILED and t2.reward is None and t2.group_id is None

    assert group.group_id == "g1" and group.task_id == "calc/add" and group.size == 2
    assert [t.rollout_id for t in group.trajectories] == ["r0", "r1"]
    assert group.rewards == [1.0, 0.0]
    assert group.advantages == pytest.approx([1.0, -1.0], abs=1e-5)
    assert with_sequences(group.trajectories[1]) == t1

    # stored, once each, and the same as what was published
    assert await store.trajectory("r1") == t1
    assert await store.count_rows("trajectories") == 3
    assert await store.count_rows("steps", rollout_id="r0") == 2
    assert await store.count_rows("steps") == 6
    assert await store.count_rows("sandbox_results") == 3 - 1  # r2 never ran a sandbox
    assert await store.count_rows("verifications") == 2
    assert [t.rollout_id for t in await store.group("g1")] == ["r0", "r1"]

    # a redelivered final state publishes nothing new
    await publish_state(bus, state("r1", RolloutState.COMPLETED, steps=3, group="g1", index=1, size=2), seq="again")
    await asyncio.sleep(0.5)
    assert await count_on(bus, "arena.group.*") == 1
    assert await count_on(bus, "arena.trajectory.*.*") == 3
    assert await dead_letters(bus) == 0

    # the trainer's end of the pipe sees the group
    async with TrajectoryStream(nats_server.url, name="t") as stream:
        async for batch in stream.groups(batch_size=1):
            assert [g.group_id for g in batch] == ["g1"]
            # as published, with the members' training sequences assembled from their steps
            assert batch.groups[0] == msgspec.structs.replace(
                group, trajectories=[with_sequences(t) for t in group.trajectories])
            await batch.commit()
            break


async def test_a_multi_turn_rollout_is_published_and_stored_with_its_training_sequences(bus, store, running):
    def call(i: int, prompt: list[int], completion: list[int], logprobs: list[float], **kw) -> Step:
        return Step(rollout_id="mt", step_index=i, model="m", backend="b0", policy_version=str(3 + i // 2),
                    prompt_token_ids=prompt, completion_token_ids=completion, logprobs=logprobs, **kw)

    calls = [
        call(0, [1, 2, 3], [4, 5], [-0.5, -0.25]),
        call(1, [1, 2, 3, 4, 5, 6, 6], [9, 9], [-1.0, -1.0], abandoned=True),  # the agent gave up on it
        call(2, [1, 2, 3, 4, 5, 6, 6], [7], [-0.125]),  # its retry: tool output 6, 6 in between
        call(3, [1, 2, 8], [10, 11], [-2.0, -0.75]),  # the scaffold rewrote its history
    ]
    for c in reversed(calls):
        await publish_step(bus, c)
    await publish_outcome(bus, "mt", 1.0)
    await publish_state(bus, state("mt", RolloutState.COMPLETED, steps=4))
    running()
    published = await last(bus, subjects.trajectory("calc/add", "mt"), Trajectory)
    # published without them (they are the steps' tokens again): readers assemble them
    assert published.sequences == [] == published.sequence_breaks
    t = with_sequences(published)

    first, second = t.sequences
    assert first.token_ids == [1, 2, 3, 4, 5, 6, 6, 7] and first.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert first.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -0.125]
    assert first.step_indexes == [0, 2] and first.policy_versions == ["3", "4"]
    assert second.token_ids == [1, 2, 8, 10, 11] and second.loss_mask == [0, 0, 0, 1, 1]
    assert second.step_indexes == [3] and sum(first.loss_mask) + sum(second.loss_mask) == 5
    assert [(b.step_index, b.kind, b.position) for b in t.sequence_breaks] == [
        (1, "abandoned", None), (3, "prefix_mismatch", 2)]
    assert t.sequence_breaks[1].reason == "prefix mismatch at token 2"
    # stored without them (they are the steps' tokens again) and read back the same
    [row] = await store.select("SELECT body FROM arena.trajectories FINAL WHERE rollout_id = 'mt'")
    assert b"sequence" not in row and b"token_ids" not in row
    assert await store.trajectory("mt") == t


async def test_gives_up_waiting_and_marks_the_trajectory_incomplete(bus, store, running):
    await publish_step(bus, step("r9", 0))
    await bus.publish(subjects.sandbox_done("r9"),
                      SandboxDone(rollout_id="r9", sandbox_id="sb", provider="local",
                                  outcome=SandboxOutcome.COMPLETED, reason="", started_at=1.0, finished_at=2.0),
                      msg_id=subjects.msg_id("r9", "sandbox-done"))
    # says 3 steps and completed, but only one step and no verification will ever arrive
    await publish_state(bus, state("r9", RolloutState.COMPLETED, steps=3))
    running(retry_delay=0.05, give_up_after=3)
    t = await last(bus, subjects.trajectory("calc/add", "r9"), Trajectory)
    assert t.metadata["incomplete"] == "steps 1/3; verification"
    assert [s.step_index for s in t.steps] == [0]
    assert t.reward is None and not t.infrastructure  # its verification never came: no reward
    assert await store.count_rows("trajectories") == 1
    assert await dead_letters(bus) == 0


async def test_messages_over_max_payload_travel_through_the_object_store(small_bus, store, tmp_path):
    """A step bigger than a NATS message (as the proxy publishes it), and a trajectory and a
    group bigger than one, are stored, published and streamed whole: the bodies go to
    ``arena_artifacts`` and the messages name them."""
    server, bus = small_bus
    big = "x" * (300 * 1024)  # over max_payload by itself
    half = "y" * (150 * 1024)  # fits, but the trajectory of two does not
    for rid, texts in (("big0", [big, "small"]), ("big1", [half, half])):
        for i, text in enumerate(texts):
            await publish_step(bus, msgspec.structs.replace(step(rid, i), completion_text=text))
        await publish_outcome(bus, rid, 1.0 if rid == "big0" else 0.0)
        await publish_state(bus, state(rid, RolloutState.COMPLETED, steps=2, group="gbig", index=int(rid[-1]),
                                       size=2))
    stop = asyncio.Event()
    task = asyncio.create_task(run_consumers(TrajectoryWorker(bus, store).consumers(), stop))
    try:
        async with TrajectoryStream(server.url, name="big-trainer") as stream:
            batch = await asyncio.wait_for(anext(stream.groups(batch_size=1)), 30)
            [group] = batch.groups
            await batch.commit()
    finally:
        stop.set()
        await task
    assert [t.rollout_id for t in group.trajectories] == ["big0", "big1"]
    assert group.advantages == pytest.approx([1.0, -1.0], abs=1e-5)
    assert [s.completion_text for s in group.trajectories[0].steps] == [big, "small"]
    assert [s.completion_text for s in group.trajectories[1].steps] == [half, half]
    assert (await store.trajectory("big1")).steps == group.trajectories[1].steps
    raw = await bus.js.get_last_msg(TRAJECTORIES_STREAM, subjects.trajectory("calc/add", "big1"))
    assert raw.data in (b"", None) and raw.headers["Arena-Body-Object"] == "bodies/big1:trajectory:0"
    assert with_sequences(msgspec.json.decode(await bus.body(raw), type=Trajectory)) == group.trajectories[1]
    assert await dead_letters(bus) == 0


async def test_a_step_the_table_cannot_hold_is_dead_lettered_and_its_batch_stored(bus, store, running):
    await publish_step(bus, step("odd", 0))
    await publish_step(bus, msgspec.structs.replace(step("odd", 1), step_index=-1), seq="negative")
    running()
    dead = await bus.js.pull_subscribe("arena.dead.*", durable="dead-reader", stream="ARENA_DEAD")
    [m] = await dead.fetch(batch=1, timeout=10)
    letter = msgspec.json.decode(m.data)
    assert letter["subject"] == subjects.step("odd") and "does not fit the steps table" in letter["error"]
    assert [s.step_index for s in await store.steps_for("odd")] == [0]


async def test_a_group_that_times_out_is_published_partial_once(nats_server, bus, store, running):
    for index in (0, 1):  # member 2 of 3 is late
        rid = f"p{index}"
        await publish_step(bus, step(rid, 0))
        await publish_outcome(bus, rid, float(index))
        await publish_state(bus, state(rid, RolloutState.COMPLETED, steps=1, group="gp", index=index, size=3))
    running(group_timeout=0.5)
    group = await whole_group(bus, "gp")
    assert group.partial and group.missing_indexes == [2] and group.size == 3
    assert [t.rollout_id for t in group.trajectories] == ["p0", "p1"]
    assert group.advantages == pytest.approx([-1.0, 1.0], abs=1e-5)

    await publish_step(bus, step("p2", 0))  # the late member: stored and streamed alone, no second group
    await publish_outcome(bus, "p2", 1.0)
    await publish_state(bus, state("p2", RolloutState.COMPLETED, steps=1, group="gp", index=2, size=3))
    await last(bus, subjects.trajectory("calc/add", "p2"), Trajectory)
    await asyncio.sleep(1.0)  # two more sweeps
    assert await count_on(bus, "arena.group.*") == 1

    async with TrajectoryStream(nats_server.url, name="strict") as stream:  # default: partial groups dropped
        async def first():
            async for batch in stream.groups(batch_size=1):
                return batch
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(first(), 1.5)
        assert stream.stats.dropped_partial == 1
    async with TrajectoryStream(nats_server.url, name="lenient", partial_groups="yield") as stream:
        async for batch in stream.groups(batch_size=1):
            assert batch.groups[0].partial and batch.groups[0].missing_indexes == [2]
            await batch.commit()
            break


async def test_final_states_handled_in_concurrent_batches_publish_each_group_once_and_whole(bus, store, running):
    # 12 groups of 3; their members' final states come in batches of 2, two batches handled at
    # once, so a group's members are assembled by different batches at the same time
    groups, size = 12, 3
    for g in range(groups):
        for index in range(size):
            rid = f"c{g}-{index}"
            await publish_step(bus, step(rid, 0))
            await publish_outcome(bus, rid, float(index % 2))
    for index in range(size):  # interleaved: each batch holds members of different groups
        for g in range(groups):
            await publish_state(bus, state(f"c{g}-{index}", RolloutState.COMPLETED, steps=1, group=f"gc{g}",
                                           index=index, size=size))
    worker = running(state_batch_size=2, state_concurrency=2, linger=0.0)
    assert worker.state_concurrency == 2
    for g in range(groups):
        group = await whole_group(bus, f"gc{g}")
        assert [t.rollout_id for t in group.trajectories] == [f"c{g}-{i}" for i in range(size)]
        assert group.rewards == [0.0, 1.0, 0.0] and not group.partial
    await asyncio.sleep(0.5)  # anything published twice would be on the stream by now
    assert await count_on(bus, "arena.group.*") == groups
    assert await count_on(bus, "arena.trajectory.*.*") == groups * size
    assert await store.count_rows("trajectories") == groups * size
    assert await dead_letters(bus) == 0
