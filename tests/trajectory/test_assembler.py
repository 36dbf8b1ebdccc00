"""Trajectory assembly and group completion, without a bus or a database."""

from __future__ import annotations

import msgspec
import pytest

from arena_core.schemas import (
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxOutcome,
    Step,
    Usage,
    VerificationResult,
)
from arena_trajectory import assembler


def step(rid: str, i: int, version: str | None = "1", text: str = "") -> Step:
    return Step(rollout_id=rid, step_index=i, model="m", backend="b0", policy_version=version,
                completion_text=text or f"step {i}", usage=Usage(prompt_tokens=10, completion_tokens=i + 1))


def final(rid: str, state=RolloutState.COMPLETED, *, steps: int = 2, group: str | None = None, index: int = 0,
          size: int = 1, at: float = 100.0) -> RolloutStateChanged:
    return RolloutStateChanged(rollout_id=rid, task_id="task-1", from_state=RolloutState.VERIFYING, to_state=state,
                               at=at, reason="done", steps=steps, group_id=group, group_index=index,
                               group_size=size, metadata={"run": "a"})


def sandbox(rid: str) -> SandboxDone:
    return SandboxDone(rollout_id=rid, sandbox_id="s", provider="local", outcome=SandboxOutcome.COMPLETED,
                       reason="", started_at=1.0, finished_at=2.0, exit_code=0, diff="--- a\n+++ b\n")


def verified(rid: str, reward: float) -> VerificationResult:
    return VerificationResult(rollout_id=rid, verifier="tests", reward=reward, passed=reward == 1.0,
                              started_at=3.0, finished_at=4.0)


def test_steps_are_sorted_and_deduplicated():
    steps = [step("r", 2), step("r", 0), step("r", 1), step("r", 0, text="redelivered")]
    out = assembler.dedupe_steps(steps)
    assert [s.step_index for s in out] == [0, 1, 2]
    assert out[0].completion_text == "step 0"


def test_policy_versions_are_distinct_in_order_of_use():
    steps = [step("r", 0, "3"), step("r", 1, None), step("r", 2, "4"), step("r", 3, "3"), step("r", 4, "")]
    assert assembler.policy_versions(steps) == ["3", "4"]


def test_assemble_a_completed_rollout():
    t = assembler.assemble(final("r"), [step("r", 1), step("r", 0), step("r", 1)], sandbox("r"), verified("r", 1.0))
    assert t.rollout_id == "r" and t.task_id == "task-1"
    assert t.final_state is RolloutState.COMPLETED
    assert t.reward == 1.0
    assert [s.step_index for s in t.steps] == [0, 1]
    assert t.policy_versions == ["1"]
    assert t.sandbox.diff.startswith("---")
    assert t.completed_at == 100.0
    assert t.metadata == {"run": "a"}


def test_reward_is_the_verifiers_whatever_the_final_state_and_none_when_never_verified():
    assert assembler.assemble(final("r"), [], sandbox("r"), verified("r", 0.25)).reward == 0.25
    # an agent that failed or timed out but was verified keeps what its verifier gave
    assert assembler.assemble(final("r", RolloutState.FAILED), [], sandbox("r"), verified("r", 1.0)).reward == 1.0
    assert assembler.assemble(final("r", RolloutState.TIMED_OUT), [], sandbox("r"), verified("r", 0.0)).reward == 0.0
    # never verified: no reward (not a 0), and not an infrastructure outcome either
    for state in (RolloutState.FAILED, RolloutState.TIMED_OUT, RolloutState.COMPLETED):
        t = assembler.assemble(final("r", state), [], sandbox("r"), None)
        assert t.reward is None and not t.infrastructure, state
    # an infrastructure outcome has none even with a (late) verification
    infra = msgspec.structs.replace(final("r", RolloutState.FAILED), infrastructure=True)
    assert assembler.assemble(infra, [], sandbox("r"), verified("r", 1.0)).reward is None


def test_assemble_refuses_a_non_final_state():
    with pytest.raises(ValueError):
        assembler.assemble(final("r", RolloutState.RUNNING), [], None, None)


def test_missing_parts():
    event = final("r", steps=3)
    assert assembler.missing_parts(event, [step("r", 0)], None, None) == ["steps 1/3", "sandbox result", "verification"]
    steps = [step("r", i) for i in range(3)]
    assert assembler.missing_parts(event, steps, sandbox("r"), verified("r", 0.0)) == []
    # cancelled before a sandbox ran: nothing to wait for beyond its steps
    queued = msgspec.structs.replace(final("r", RolloutState.CANCELLED, steps=0), from_state=RolloutState.PROVISIONING)
    assert assembler.missing_parts(queued, [], None, None) == []
    # cancelled, timed out or failed while its sandbox ran: the sandbox result is on its way
    running = msgspec.structs.replace(queued, from_state=RolloutState.RUNNING)
    assert assembler.missing_parts(running, [], None, None) == ["sandbox result"]
    for state in (RolloutState.TIMED_OUT, RolloutState.FAILED):
        assert assembler.missing_parts(msgspec.structs.replace(queued, to_state=state), [], None, None) == [
            "sandbox result"]
    # a sandbox job that was given up on never produces one
    gave_up = msgspec.structs.replace(queued, to_state=RolloutState.FAILED,
                                      reason="sandbox gave up after 5 deliveries: boom")
    assert assembler.missing_parts(gave_up, [], None, None) == []


def test_incomplete_parts_are_recorded_in_metadata():
    t = assembler.assemble(final("r", steps=3), [step("r", 0)], sandbox("r"), None,
                           incomplete=["steps 1/3", "verification"])
    assert t.metadata == {"run": "a", "incomplete": "steps 1/3; verification"}


def test_group_completes_only_with_every_member():
    a = assembler.assemble(final("a", group="g", index=0, size=2, at=5.0), [], sandbox("a"), verified("a", 1.0))
    b = assembler.assemble(final("b", group="g", index=1, size=2, at=7.0), [], sandbox("b"), verified("b", 0.0))
    assert assembler.complete_group([a]) is None
    assert assembler.complete_group([b]) is None
    group = assembler.complete_group([b, a, b])
    assert group is not None
    assert group.group_id == "g" and group.task_id == "task-1" and group.size == 2
    assert [t.rollout_id for t in group.trajectories] == ["a", "b"]
    assert group.rewards == [1.0, 0.0]
    assert group.advantages == pytest.approx([1.0, -1.0], abs=1e-5)
    assert group.completed_at == 7.0
    assert assembler.complete_group([a, b]) == group  # deterministic: a re-publish is identical


def test_a_single_rollout_makes_no_group():
    t = assembler.assemble(final("r"), [], sandbox("r"), verified("r", 1.0))
    assert assembler.complete_group([t]) is None
    assert assembler.complete_group([]) is None


def test_the_final_events_history_wins_over_stored_rows():
    from arena_core.schemas import StateTransition

    S = RolloutState
    chain = [StateTransition(from_state=None, to_state=S.PENDING, at=1.0),
             StateTransition(from_state=S.PENDING, to_state=S.PROVISIONING, at=2.0),
             StateTransition(from_state=S.PROVISIONING, to_state=S.RUNNING, at=3.0),
             StateTransition(from_state=S.RUNNING, to_state=S.VERIFYING, at=4.0),
             StateTransition(from_state=S.VERIFYING, to_state=S.COMPLETED, at=5.0, reason="done")]
    event = msgspec.structs.replace(final("r"), history=chain)
    # after a crash only the late rows may be stored yet: the event's history is still whole
    assert assembler.full_history(event, chain[3:4]) == chain
    # an older producer without history: stored rows plus the final transition
    older = final("r")
    assert [t.to_state for t in assembler.full_history(older, chain[:4])] == [
        S.PENDING, S.PROVISIONING, S.RUNNING, S.VERIFYING, S.COMPLETED]


def test_an_infrastructure_outcome_has_no_reward_and_stays_out_of_the_advantages():
    infra = msgspec.structs.replace(final("c", RolloutState.FAILED, group="g", index=2, size=3),
                                    reason="infrastructure: could not verify: image missing", infrastructure=True)
    c = assembler.assemble(infra, [], sandbox("c"), None)
    assert (c.reward, c.infrastructure) == (None, True)
    a = assembler.assemble(final("a", group="g", index=0, size=3), [], sandbox("a"), verified("a", 1.0))
    b = assembler.assemble(final("b", group="g", index=1, size=3), [], sandbox("b"), verified("b", 0.0))
    group = assembler.complete_group([a, b, c])
    assert group.rewards == [1.0, 0.0, None]
    # the advantages are those of the two members with a reward; the third gets none (0.0)
    assert group.advantages == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)
    assert group.excluded_indexes == [2]
    # an agent that failed before it was verified has no reward either (not a made-up 0), but is
    # the policy's failure, not an infrastructure outcome; it stays out of the advantages too
    failed = assembler.assemble(final("d", RolloutState.FAILED, group="g", index=2, size=3), [], sandbox("d"), None)
    assert (failed.reward, failed.infrastructure) == (None, False)
    assert assembler.complete_group([a, b, failed]).excluded_indexes == [2]


def test_a_rollout_that_expired_in_the_queue_waits_for_nothing():
    event = RolloutStateChanged(rollout_id="q", task_id="task-1", from_state=RolloutState.PROVISIONING,
                                to_state=RolloutState.TIMED_OUT, at=9.0, steps=0, infrastructure=True,
                                reason="infrastructure: the agent never ran: wall-clock budget exhausted")
    assert assembler.missing_parts(event, [], None, None) == []
    assert assembler.assemble(event, [], None, None).reward is None
    ran = msgspec.structs.replace(event, from_state=RolloutState.RUNNING, infrastructure=False)
    assert assembler.missing_parts(ran, [], None, None) == ["sandbox result"]


def test_members_cancelled_by_the_groups_policy_are_marked_and_left_out_of_the_group():
    """First k of n (or a deadline): the members the policy cancelled carry no reward, even if a
    verification arrived after the cancel, and the group goes out with the others."""
    def cancelled(rid: str, index: int, verification=None):
        event = msgspec.structs.replace(final(rid, RolloutState.CANCELLED, group="g", index=index, size=4, at=200.0),
                                        reason="group completion: the first 2 of 4 ...", group_cancelled=True)
        return assembler.assemble(event, [], sandbox(rid), verification)

    a = assembler.assemble(final("a", group="g", index=0, size=4), [], sandbox("a"), verified("a", 1.0))
    b = assembler.assemble(final("b", group="g", index=2, size=4), [], sandbox("b"), verified("b", 0.0))
    c = cancelled("c", 1, verification=verified("c", 1.0))  # verified too late: not counted
    d = cancelled("d", 3)
    assert (c.reward, c.group_cancelled, c.infrastructure) == (None, True, False)
    assert assembler.complete_group([a, b, c]) is None  # d not stored yet
    group = assembler.complete_group([d, b, c, a])
    assert [t.rollout_id for t in group.trajectories] == ["a", "b"]
    assert group.rewards == [1.0, 0.0] and group.advantages == pytest.approx([1.0, -1.0], abs=1e-5)
    assert group.cancelled_indexes == [1, 3] and group.excluded_indexes == [] and not group.partial
    assert group.completed_at == 200.0  # when the last member (a cancelled one) ended
    # every member cancelled (a deadline before any finished): an empty group, still published
    empty = assembler.complete_group([cancelled(f"x{i}", i) for i in range(4)])
    assert empty.trajectories == [] and empty.rewards == [] and empty.cancelled_indexes == [0, 1, 2, 3]
