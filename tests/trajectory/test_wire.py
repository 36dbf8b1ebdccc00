"""Publishing steps as the JSON they arrived as: the same message as encoding the structs, without\nthe training sequences, which the trainer stream assembles from the steps."""

from __future__ import annotations

import msgspec

from arena_core.schemas import (
    GroupCompleted,
    MemberRef,
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxOutcome,
    Step,
    Trajectory,
    Usage,
    VerificationResult,
    encode,
)
from arena.stream import _decode as decode_group
from arena.stream import _decode_trajectory as decode_trajectory
from arena_trajectory import assembler
from arena_trajectory.caches import MemberCache, ResultCache, StepCache, StoredStep, first_per_index
from arena_trajectory.wire import encode_group, encode_trajectory


def step(rid: str, i: int, **kw) -> Step:
    return Step(rollout_id=rid, step_index=i, model="m", backend="b", policy_version="2",
                prompt_token_ids=[1, 2, i], completion_token_ids=[7, 8], logprobs=[-0.5, -0.125],
                usage=Usage(prompt_tokens=3, completion_tokens=2), **kw)


def trajectory(rid: str, index: int, steps: list[Step]):
    event = RolloutStateChanged(rollout_id=rid, task_id="t", from_state=RolloutState.VERIFYING,
                                to_state=RolloutState.COMPLETED, at=5.0, steps=len(steps), group_id="g",
                                group_index=index, group_size=2)
    sandbox = SandboxDone(rollout_id=rid, sandbox_id="s", provider="local", outcome=SandboxOutcome.COMPLETED,
                          reason="", started_at=1.0, finished_at=2.0)
    verification = VerificationResult(rollout_id=rid, verifier="tests", reward=float(index), passed=bool(index),
                                      started_at=2.0, finished_at=3.0)
    return assembler.assemble(event, steps, sandbox, verification)


def without_sequences(t: Trajectory) -> Trajectory:
    return msgspec.structs.replace(t, sequences=[], sequence_breaks=[])


def test_raw_steps_encode_to_the_same_bytes_as_the_structs_without_the_sequences():
    steps = [step("r1", i) for i in range(3)]
    t = trajectory("r1", 0, steps)
    assert t.sequences  # the assembler made them; the wire leaves them out
    raw = {s.step_index: encode(s) for s in steps}
    wire = encode(without_sequences(t))
    assert encode_trajectory(t, raw) == wire and b"sequences" not in wire
    assert encode_trajectory(t) == wire
    assert encode_trajectory(t, {1: raw[1]}) == wire  # a step without JSON at hand is encoded


def test_the_trainer_stream_assembles_the_sequences_the_wire_left_out():
    a = trajectory("r1", 0, [step("r1", 0), step("r1", 1)])
    b = trajectory("r2", 1, [step("r2", 0, abandoned=True)])  # no sequence, one break
    none = trajectory("r3", 2, [])
    assert len(a.sequences) == 2 and b.sequences == [] and len(b.sequence_breaks) == 1
    for t in (a, b, none):
        wire = encode_trajectory(t, {s.step_index: encode(s) for s in t.steps})
        assert b"sequence" not in wire
        assert decode_trajectory(wire) == t
    # a group that carries its members (as published before they were referred to)
    group = assembler.complete_group([msgspec.structs.replace(t, group_size=3) for t in (a, b, none)])
    embedded = encode(msgspec.structs.replace(group, trajectories=[without_sequences(t) for t in group.trajectories]))
    assert decode_group(embedded) == group


def test_a_group_refers_to_its_members_trajectory_messages():
    a, b = trajectory("r1", 0, [step("r1", 0)]), trajectory("r2", 1, [step("r2", 0), step("r2", 1)])
    group = assembler.complete_group([a, b])
    wire = msgspec.json.decode(encode_group(group), type=GroupCompleted)
    assert wire.trajectories == [] and wire == msgspec.structs.replace(group, trajectories=[], members=[
        MemberRef(rollout_id="r1", group_index=0, subject="arena.trajectory.t.r1"),
        MemberRef(rollout_id="r2", group_index=1, subject="arena.trajectory.t.r2")])
    assert b"token_ids" not in encode_group(group)


def test_steps_json_as_a_producer_sent_it_stays_valid_in_a_trajectory():
    t = trajectory("r1", 0, [step("r1", 0)])
    # other key order, spacing, a field we do not know
    odd = b'{"step_index": 0, "rollout_id": "r1", "model": "m", "backend": "b", "future_field": 1}'
    decoded = msgspec.json.decode(encode_trajectory(t, {0: odd}), type=Trajectory)
    assert decoded.steps[0] == Step(rollout_id="r1", step_index=0, model="m", backend="b")


def test_step_cache_counts_and_keeps_each_step_with_its_json():
    cache = StepCache(max_steps=3)
    cache.add([StoredStep(step("r1", 0), b"0"), StoredStep(step("r1", 1), b"1"), StoredStep(step("r1", 1), b"1b")])
    assert cache.count("r1") == 2
    cache.add([StoredStep(step("r2", 0), b"x"), StoredStep(step("r2", 1), b"y")])  # over the bound: r1 goes
    assert cache.count("r1") == 0 and cache.count("r2") == 2
    assert [s.raw for s in cache.pop("r2")] == [b"x", b"y"] and cache.count("r2") == 0


def test_the_caches_are_bounded_by_the_bytes_of_the_steps_json_too():
    steps = StepCache(max_steps=1000, max_bytes=3000)
    steps.add([StoredStep(step("r1", i), b"x" * 1000) for i in range(2)])
    steps.add([StoredStep(step("r1", 1), b"x" * 1000)])  # the same step again: counted once
    assert steps.count("r1") == 2
    steps.add([StoredStep(step("r2", 0), b"y" * 1500)])  # over 3,000 bytes: the oldest rollout goes
    assert steps.count("r1") == 0 and steps.count("r2") == 1
    assert [s.raw for s in steps.pop("r2")] == [b"y" * 1500]
    steps.add([StoredStep(step("r3", 0), b"z" * 2900)])  # what was popped no longer counts
    assert steps.count("r3") == 1

    members = MemberCache(max_bytes=3000)
    a, b = trajectory("r1", 0, [step("r1", 0)]), trajectory("r2", 0, [step("r2", 0)])
    members.add([a], {"r1": {0: b"a" * 2000}})
    members.add([msgspec.structs.replace(b, group_id="g2")], {"r2": {0: b"b" * 2000}})  # over: group g goes
    assert members.raw("r1") is None and members.raw("r2") == {0: b"b" * 2000}


def test_first_per_index_keeps_the_first_copy_of_a_step():
    got = first_per_index([StoredStep(step("r", 1), b"a"), StoredStep(step("r", 0), b"b"),
                           StoredStep(step("r", 1), b"c")])
    assert [(s.step.step_index, s.raw) for s in got] == [(0, b"b"), (1, b"a")]


def test_result_cache_keeps_the_latest_result_and_forgets():
    cache = ResultCache()
    early = VerificationResult(rollout_id="r", verifier="v", reward=0.0, passed=False, started_at=0, finished_at=1)
    late = msgspec.structs.replace(early, reward=1.0, finished_at=2)
    cache.add([], [late])
    cache.add([], [early])  # a redelivery of an older result does not win
    assert cache.verifications["r"].reward == 1.0
    cache.forget("r")
    assert "r" not in cache.verifications


def test_member_cache_drops_the_steps_json_with_the_group():
    cache = MemberCache()
    a = trajectory("r1", 0, [step("r1", 0)])
    cache.add([a], {"r1": {0: b"{}"}})
    assert cache.whole("g") is None and cache.raw("r1") == {0: b"{}"}
    cache.forget("g")
    assert cache.raw("r1") is None


def test_missing_counts_agrees_with_missing_parts():
    event = RolloutStateChanged(rollout_id="r", task_id="t", from_state=RolloutState.VERIFYING,
                                to_state=RolloutState.COMPLETED, at=1.0, steps=2)
    assert assembler.missing_counts(event, 1, has_sandbox=False, has_verification=False) == \
        assembler.missing_parts(event, [step("r", 0)], None, None) == ["steps 1/2", "sandbox result", "verification"]
    assert assembler.missing_counts(event, 2, has_sandbox=True, has_verification=True) == []
