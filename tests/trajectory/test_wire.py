"""Publishing steps as the JSON they arrived as: the same message as encoding the structs, without\nthe training sequences, which the trainer stream assembles from the steps."""

from __future__ import annotations

import msgspec

from arena_core.schemas import (
    GroupCompleted,
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
    group = assembler.complete_group([msgspec.structs.replace(t, group_size=3) for t in (a, b, none)])
    wire = encode_group(group, {"r1": {i: encode(s) for i, s in enumerate(a.steps)}})
    assert b"sequence" not in wire
    decoded = decode_group(wire)
    assert decoded.trajectories[0].sequences == a.sequences and len(a.sequences) == 2
    assert decoded.trajectories[1].sequences == [] and decoded.trajectories[1].sequence_breaks == b.sequence_breaks
    assert decoded.trajectories[2].sequences == [] == decoded.trajectories[2].sequence_breaks


def test_a_group_with_raw_steps_decodes_to_the_same_group():
    a, b = trajectory("r1", 0, [step("r1", 0)]), trajectory("r2", 1, [step("r2", 0), step("r2", 1)])
    group = assembler.complete_group([a, b])
    raw = {"r1": {0: encode(a.steps[0])}, "r2": {i: encode(s) for i, s in enumerate(b.steps)}}
    bare = msgspec.structs.replace(group, trajectories=[without_sequences(t) for t in group.trajectories])
    assert encode_group(group, raw) == encode(bare)
    assert decode_group(encode_group(group, raw)) == group
    # JSON as a producer sent it (other key order, spacing, a field we do not know) stays valid
    odd = b'{"step_index": 0, "rollout_id": "r1", "model": "m", "backend": "b", "future_field": 1}'
    decoded = msgspec.json.decode(encode_group(group, {"r1": {0: odd}}), type=GroupCompleted)
    assert decoded.trajectories[0].steps[0] == Step(rollout_id="r1", step_index=0, model="m", backend="b")
    assert decoded.trajectories[1] == without_sequences(b)


def test_step_cache_counts_and_keeps_each_step_with_its_json():
    cache = StepCache(max_steps=3)
    cache.add([StoredStep(step("r1", 0), b"0"), StoredStep(step("r1", 1), b"1"), StoredStep(step("r1", 1), b"1b")])
    assert cache.count("r1") == 2
    cache.add([StoredStep(step("r2", 0), b"x"), StoredStep(step("r2", 1), b"y")])  # over the bound: r1 goes
    assert cache.count("r1") == 0 and cache.count("r2") == 2
    assert [s.raw for s in cache.pop("r2")] == [b"x", b"y"] and cache.count("r2") == 0


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
