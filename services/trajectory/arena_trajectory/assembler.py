"""Pure trajectory logic: steps + outcome -> ``Trajectory``; trajectories -> ``GroupCompleted``.

No NATS, no storage: the worker fetches what is stored and calls these functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from arena_core import sequences
from arena_core.grpo import group_advantages
from arena_core.schemas import (
    GroupCompleted,
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    StateTransition,
    Step,
    Trajectory,
    VerificationResult,
)


def dedupe_steps(steps: Iterable[Step]) -> list[Step]:
    """Steps sorted by ``step_index``, one per index (a redelivered step is the same step)."""
    by_index: dict[int, Step] = {}
    for step in steps:
        by_index.setdefault(step.step_index, step)
    return [by_index[i] for i in sorted(by_index)]


def policy_versions(steps: Sequence[Step]) -> list[str]:
    """The distinct policy versions that served ``steps`` (every one of a partial rollout's
    spans), in order of first use."""
    seen: dict[str, None] = {}
    for step in steps:
        for version in [span.version for span in step.policy_spans] or [step.policy_version]:
            if version is not None and version != "":
                seen.setdefault(version, None)
    return list(seen)


def trajectory_reward(final_state: RolloutState, verification: VerificationResult | None,
                      infrastructure: bool = False, group_cancelled: bool = False) -> float | None:
    """The verifier's reward, whatever the final state (a failed or timed-out rollout that was
    verified keeps what its verifier gave); ``None`` when it has none: an infrastructure outcome
    (Arena could not run or verify it), a member its group's completion policy cancelled (a
    verification arriving after that is not counted), or a rollout that ended without being
    verified (its agent failed, timed out or was cancelled). Never a made-up 0 (docs/trajectory.md)."""
    del final_state  # one meaning whatever the ending: the verifier's, or none
    if infrastructure or group_cancelled or verification is None:
        return None
    return verification.reward


def missing_parts(
    event: RolloutStateChanged,
    steps: Sequence[Step],
    sandbox: SandboxDone | None,
    verification: VerificationResult | None,
) -> list[str]:
    """What the final ``event`` says exists but is not stored yet (empty: ready to assemble).

    ``steps`` must be de-duplicated. A completed rollout was verified, so its sandbox
    result and verification must exist. A rollout that timed out or failed because of its
    sandbox, or that ended while its sandbox was running (cancelled, budget exhausted),
    has a sandbox result on its way. Other endings (cancelled before a sandbox started, a
    sandbox job given up on) may legitimately lack them.
    """
    return missing_counts(event, len(steps), has_sandbox=sandbox is not None, has_verification=verification is not None)


def missing_counts(event: RolloutStateChanged, steps: int, *, has_sandbox: bool, has_verification: bool) -> list[str]:
    """``missing_parts`` from what is known: how many distinct steps, whether a sandbox
    result and a verification are there."""
    missing = []
    if steps < event.steps:
        missing.append(f"steps {steps}/{event.steps}")
    if not has_sandbox and sandbox_expected(event):
        missing.append("sandbox result")
    if event.to_state is RolloutState.COMPLETED and not has_verification:
        missing.append("verification")
    return missing


def sandbox_expected(event: RolloutStateChanged) -> bool:
    """Whether a final ``event`` implies a ``SandboxDone`` exists or will arrive."""
    if event.infrastructure and event.from_state in (RolloutState.PENDING, RolloutState.PROVISIONING):
        return False  # it expired in the queue: no sandbox ever ran, so it is stored at once
    if event.to_state in (RolloutState.COMPLETED, RolloutState.TIMED_OUT):
        return True
    if event.from_state in (RolloutState.RUNNING, RolloutState.VERIFYING):
        return True
    gave_up = event.reason.startswith(("sandbox gave up", "infrastructure: sandbox gave up"))
    return event.to_state is RolloutState.FAILED and not gave_up


def assemble(
    event: RolloutStateChanged,
    steps: Iterable[Step],
    sandbox: SandboxDone | None,
    verification: VerificationResult | None,
    *,
    incomplete: Sequence[str] = (),
    history: Sequence[StateTransition] = (),
    merge_sequences: bool = True,
) -> Trajectory:
    """Build the trajectory of the rollout that ``event`` (a final state) ended.

    ``incomplete`` names parts given up on (see ``missing_parts``); they are recorded in
    ``Trajectory.incomplete`` (and, for older readers, ``metadata["incomplete"]``) so a
    trainer can filter such trajectories out. ``history`` is the stored transitions; the
    final one is added from ``event`` if it is not among them. The steps are merged into
    training sequences (``arena_core.sequences.assemble``) unless ``merge_sequences`` is
    false: the trajectory service leaves them out (derived data: neither its store nor its
    messages carry them; readers assemble them from the steps).
    """
    if not event.to_state.is_final:
        raise ValueError(f"rollout {event.rollout_id}: {event.to_state.value} is not a final state")
    ordered = dedupe_steps(steps)
    merged, breaks = sequences.assemble(ordered) if merge_sequences else ([], [])
    metadata = dict(event.metadata)
    if incomplete:
        metadata["incomplete"] = "; ".join(incomplete)
    return Trajectory(
        rollout_id=event.rollout_id,
        task_id=event.task_id,
        group_id=event.group_id,
        group_index=event.group_index,
        group_size=event.group_size,
        final_state=event.to_state,
        reason=event.reason,
        reward=trajectory_reward(event.to_state, verification, event.infrastructure, event.group_cancelled),
        infrastructure=event.infrastructure,
        group_cancelled=event.group_cancelled,
        steps=ordered,
        sandbox=sandbox,
        verification=verification,
        policy_versions=policy_versions(ordered),
        completed_at=event.at,
        metadata=metadata,
        history=full_history(event, history),
        incomplete=list(incomplete),
        sequences=merged,
        sequence_breaks=breaks,
        project=event.project,
    )


def full_history(event: RolloutStateChanged, stored: Sequence[StateTransition]) -> list[StateTransition]:
    """The rollout's transitions. A final event carries the full history from the
    rollout's record, which is authoritative (stored state rows can still be on their
    way after a crash). Without it (an older producer): the ``stored`` non-final
    transitions by time, then the final one from ``event`` (a rollout has exactly one
    final state; stored rows carry millisecond times)."""
    if event.history:
        return list(event.history)
    final = StateTransition(from_state=event.from_state, to_state=event.to_state, at=event.at, reason=event.reason)
    return [*sorted((t for t in stored if not t.to_state.is_final), key=lambda t: t.at), final]


def group_members(trajectories: Iterable[Trajectory]) -> list[Trajectory]:
    """One trajectory per ``group_index``, in ``group_index`` order."""
    by_index: dict[int, Trajectory] = {}
    for t in trajectories:
        by_index.setdefault(t.group_index, t)
    return [by_index[i] for i in sorted(by_index)]


def complete_group(trajectories: Iterable[Trajectory], *, allow_partial: bool = False) -> GroupCompleted | None:
    """The ``GroupCompleted`` message once every member ``0..group_size-1`` has a
    trajectory, else ``None``. With ``allow_partial`` (the group timed out), the members
    present form a ``partial`` group. Members cancelled by the group's completion policy
    (``group_cancelled``) are left out, listed in ``cancelled_indexes``: the group goes out with
    the others, its rewards and advantages over them. Deterministic: the same members give the
    same message."""
    stored = group_members(trajectories)
    if not stored:
        return None
    first = stored[0]
    if first.group_id is None:
        return None
    size = first.group_size
    for t in stored:
        if t.group_id != first.group_id or t.group_size != size:
            raise ValueError(f"group {first.group_id}: members disagree on group id or size")
    present = {t.group_index for t in stored}
    missing = [i for i in range(size) if i not in present]
    if missing and not allow_partial:
        return None
    members = [t for t in stored if not t.group_cancelled]
    rewards = [t.reward for t in members]
    scored = [r for r in rewards if r is not None]
    scored_advantages = iter(group_advantages(scored))
    advantages = [0.0 if r is None else next(scored_advantages) for r in rewards]
    return GroupCompleted(
        group_id=first.group_id,
        task_id=first.task_id,
        size=size,
        trajectories=members,
        rewards=rewards,
        advantages=advantages,
        excluded_indexes=[t.group_index for t in members if t.reward is None],
        completed_at=max(t.completed_at for t in stored),
        partial=bool(missing),
        missing_indexes=missing,
        cancelled_indexes=[t.group_index for t in stored if t.group_cancelled],
        project=first.project,
    )
