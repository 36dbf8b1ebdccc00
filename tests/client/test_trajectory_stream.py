"""TrajectoryStream against a real nats-server: commit semantics, redelivery, staleness, groups
that refer to their members."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from arena_core import subjects
from arena_core.schemas import GroupCompleted, RolloutState, Step, Trajectory
from arena_core.sequences import with_sequences
from arena.stream import TrajectoryStream, group_policy_version, is_stale, training_sequences
from arena_trajectory.wire import encode_group


def group(gid: str, *versions: str) -> GroupCompleted:
    members = [Trajectory(rollout_id=f"{gid}-{i}", task_id="t", group_id=gid, group_index=i, group_size=2,
                          final_state=RolloutState.COMPLETED, reward=float(i), policy_versions=[v])
               for i, v in enumerate(versions or ("1", "1"))]
    return GroupCompleted(group_id=gid, task_id="t", size=len(members), trajectories=members,
                          rewards=[t.reward for t in members], advantages=[-1.0, 1.0], completed_at=1.0)


async def publish(bus, g: GroupCompleted) -> None:
    await bus.publish(subjects.group(g.group_id), g, msg_id=f"{g.group_id}:group:0")


async def take(stream: TrajectoryStream, batch_size: int = 1, **kw):
    async def first():
        async for batch in stream.groups(batch_size=batch_size, **kw):
            return batch
    return await asyncio.wait_for(first(), timeout=10)


async def nothing_within(stream: TrajectoryStream, seconds: float) -> bool:
    try:
        await asyncio.wait_for(take(stream), timeout=seconds)
    except asyncio.TimeoutError:
        return True
    return False


async def test_uncommitted_groups_come_back_committed_ones_do_not(nats_server, bus):
    for gid in ("g1", "g2", "g3"):
        await publish(bus, group(gid))
    async with TrajectoryStream(nats_server.url, name="trainer-a") as stream:
        batch = await take(stream, batch_size=2)
        assert [g.group_id for g in batch] == ["g1", "g2"]
        assert batch.groups[0].advantages == [-1.0, 1.0]
        await batch.commit()
        await batch.commit()  # idempotent
        held = await take(stream)
        assert [g.group_id for g in held] == ["g3"]
        assert stream.stats.committed == 2 and stream.stats.yielded == 3
        # never committed: g3 goes back when the stream closes

    async with TrajectoryStream(nats_server.url, name="trainer-a") as stream:
        batch = await take(stream)
        assert [g.group_id for g in batch] == ["g3"]  # redelivered; g1, g2 are not
        await batch.commit()
        assert await nothing_within(stream, 1.5)

    async with TrajectoryStream(nats_server.url, name="trainer-a") as stream:
        assert await nothing_within(stream, 1.5)
        await publish(bus, group("g4"))
        assert [g.group_id for g in await take(stream)] == ["g4"]

    # another trainer has its own cursor and sees everything
    async with TrajectoryStream(nats_server.url, name="trainer-b") as stream:
        batch = await take(stream, batch_size=4)
        assert [g.group_id for g in batch] == ["g1", "g2", "g3", "g4"]


async def test_heartbeats_keep_a_held_batch_from_being_redelivered(nats_server, bus):
    await publish(bus, group("g1"))
    async with TrajectoryStream(nats_server.url, name="slow", ack_wait=1.0) as stream:
        batch = await take(stream)
        await asyncio.sleep(2.5)  # a long training step: 2.5 x ack_wait
        info = await stream._bus.js.consumer_info("ARENA_TRAJECTORIES", "trainer-slow")  # noqa: SLF001
        assert info.num_redelivered == 0 and info.num_ack_pending == 1
        await batch.commit()
        info = await stream._bus.js.consumer_info("ARENA_TRAJECTORIES", "trainer-slow")  # noqa: SLF001
        assert info.num_ack_pending == 0


async def test_partial_batch_after_max_wait(nats_server, bus):
    await publish(bus, group("g1"))
    async with TrajectoryStream(nats_server.url, name="partial") as stream:
        batch = await take(stream, batch_size=8, max_wait=0.3)
        assert [g.group_id for g in batch] == ["g1"]


async def test_duplicate_group_message_is_not_yielded_twice(nats_server, bus):
    await publish(bus, group("g1"))
    await bus.publish(subjects.group("g1"), group("g1"), msg_id="g1:group:republished")  # after the dedup window
    await publish(bus, group("g2"))
    async with TrajectoryStream(nats_server.url, name="dups") as stream:
        a = await take(stream)
        b = await take(stream)
        assert [a.groups[0].group_id, b.groups[0].group_id] == ["g1", "g2"]
        assert stream.stats.duplicates == 1


async def test_stale_groups_are_dropped(nats_server, bus):
    await publish(bus, group("old", "1", "4"))  # oldest step from policy 1
    await publish(bus, group("fresh", "4", "5"))
    await publish(bus, group("unversioned", "main", "main"))
    policy = {"version": 6}
    async with TrajectoryStream(nats_server.url, name="offpolicy", max_staleness=2,
                                current_policy_version=lambda: policy["version"]) as stream:
        batch = await take(stream, batch_size=2)
        assert [g.group_id for g in batch] == ["fresh", "unversioned"]
        assert stream.stats.dropped_stale == 1
        await batch.commit()
    async with TrajectoryStream(nats_server.url, name="offpolicy", max_staleness=2,
                                current_policy_version=lambda: 6) as stream:
        assert await nothing_within(stream, 1.2)  # the dropped group was acked, not handed back


def test_staleness_rules():
    assert group_policy_version(group("g", "7", "x", "5")) == 5
    assert group_policy_version(group("g", "x", "y")) is None
    assert is_stale(group("g", "3"), 6, 2)
    assert not is_stale(group("g", "4"), "6", 2)
    assert not is_stale(group("g", "3"), "v6", 2)
    assert not is_stale(group("g", "3"), 6, None)


def test_a_group_from_the_stream_hands_each_members_sequences_with_its_advantage():
    def member(i: int, reward: float | None) -> Trajectory:
        steps = [Step(rollout_id=f"g-{i}", step_index=0, model="m", backend="b", prompt_token_ids=[1, 2],
                      completion_token_ids=[3 + i], logprobs=[-0.5]),
                 Step(rollout_id=f"g-{i}", step_index=1, model="m", backend="b", prompt_token_ids=[1, 2, 3 + i, 7],
                      completion_token_ids=[8, 2], logprobs=[-0.25, -0.125])]
        return with_sequences(Trajectory(rollout_id=f"g-{i}", task_id="t", group_id="g", group_index=i, group_size=3,
                                         final_state=RolloutState.COMPLETED, reward=reward, steps=steps,
                                         infrastructure=reward is None))
    members = [member(0, 1.0), member(1, 0.0), member(2, None)]
    g = GroupCompleted(group_id="g", task_id="t", size=3, trajectories=members, rewards=[1.0, 0.0, None],
                       advantages=[1.0, -1.0, 0.0], excluded_indexes=[2], completed_at=1.0)
    back = msgspec.json.decode(msgspec.json.encode(g), type=GroupCompleted)  # off the wire
    got = training_sequences(back)
    assert [(s.rollout_id, s.advantage) for s in got] == [("g-0", 1.0), ("g-1", -1.0)]
    assert got[1].sequence.token_ids == [1, 2, 4, 7, 8, 2] and got[1].sequence.loss_mask == [0, 0, 1, 0, 1, 1]
    assert got[1].sequence.logprobs == [0.0, 0.0, -0.5, 0.0, -0.25, -0.125]
    assert got[1].sequence.step_indexes == [0, 1]


async def test_bad_names_and_missing_stream(nats_server):
    with pytest.raises(ValueError):
        TrajectoryStream(nats_server.url, name="a.b")
    with pytest.raises(ValueError):
        TrajectoryStream(nats_server.url, name="x", max_staleness=1)
    from arena_core.errors import Unavailable

    with pytest.raises(Unavailable):
        async with TrajectoryStream(nats_server.url, name="early"):
            pass


async def publish_by_reference(bus, g: GroupCompleted, *, members: bool = True) -> None:
    """As the trajectory service publishes: each member's trajectory, then the group referring to them."""
    if members:
        for t in g.trajectories:
            await bus.publish(subjects.trajectory(t.task_id, t.rollout_id), t,
                              msg_id=subjects.msg_id(t.rollout_id, "trajectory", 0))
    await bus.publish(subjects.group(g.group_id), encode_group(g), msg_id=f"{g.group_id}:group:0")


def with_steps(g: GroupCompleted) -> GroupCompleted:
    """``g`` whose members have a step each with token ids (so each has a training sequence)."""
    members = [msgspec.structs.replace(t, steps=[Step(
        rollout_id=t.rollout_id, step_index=0, model="m", backend="b", prompt_token_ids=[1, 2], completion_token_ids=[3],
        logprobs=[-0.5])]) for t in g.trajectories]
    return msgspec.structs.replace(g, trajectories=members)


async def test_a_group_that_refers_to_its_members_is_handed_out_whole(nats_server, bus):
    g = with_steps(group("ref1"))
    await publish_by_reference(bus, g)
    raw = await bus.js.get_last_msg("ARENA_TRAJECTORIES", subjects.group("ref1"))
    assert b"token_ids" not in raw.data  # the group carries references, not copies
    async with TrajectoryStream(nats_server.url, name="by-ref") as stream:
        batch = await take(stream)
        (got,) = batch.groups
        assert got == msgspec.structs.replace(g, trajectories=[with_sequences(t) for t in g.trajectories])
        assert got.members == [] and [len(t.sequences) for t in got.trajectories] == [1, 1]
        await batch.commit()


async def test_a_member_not_on_the_stream_yet_holds_its_group_back_until_it_is(nats_server, bus):
    g = with_steps(group("late"))
    first, second = g.trajectories
    await bus.publish(subjects.trajectory("t", first.rollout_id), first, msg_id="late-0")
    await publish_by_reference(bus, g, members=False)  # the second member is not there yet
    async with TrajectoryStream(nats_server.url, name="late-member") as stream:
        assert await nothing_within(stream, 1.5)
        await bus.publish(subjects.trajectory("t", second.rollout_id), second, msg_id="late-1")
        batch = await take(stream)
        assert [t.rollout_id for t in batch.groups[0].trajectories] == [first.rollout_id, second.rollout_id]
        await batch.commit()


async def test_members_are_read_from_the_leader_on_a_stream_without_direct_gets(nats_server, bus):
    info = await bus.js.stream_info("ARENA_TRAJECTORIES")
    info.config.allow_direct = False
    await bus.js.update_stream(info.config)
    try:
        g = with_steps(group("nodirect"))
        await publish_by_reference(bus, g)
        async with TrajectoryStream(nats_server.url, name="no-direct") as stream:
            batch = await take(stream)
            assert [len(t.steps) for t in batch.groups[0].trajectories] == [1, 1]
            await batch.commit()
    finally:
        info.config.allow_direct = True
        await bus.js.update_stream(info.config)


def test_a_batch_decoded_with_the_gc_paused_is_not_scanned_after_and_a_freeze_is_kept():
    import gc

    from arena.stream import _gc_paused

    assert gc.isenabled()
    with _gc_paused():
        assert not gc.isenabled()
        made = [[i, i + 1] for i in range(50_000)]  # a batch's token-id lists
    # back on, and what was made inside is already in the oldest generation: no collection
    # scans it (alive) on its way there
    assert gc.isenabled() and gc.get_count()[0] < 1_000
    assert any(made is o for o in gc.get_objects(generation=2))
    gc.freeze()  # a trainer that froze its own objects keeps them frozen
    try:
        frozen = gc.get_freeze_count()
        with _gc_paused():
            more = [[i] for i in range(1_000)]
        # neither unfrozen nor frozen more: the pause left the generations alone
        assert gc.get_freeze_count() == frozen and gc.isenabled() and len(more) == 1_000
    finally:
        gc.unfreeze()
