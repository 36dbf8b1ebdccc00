"""The rollout state machine: which transitions are allowed, and applying one.

Pure: no I/O. The store applies a transition with compare-and-set, so two replicas
racing on one rollout cannot both win.
"""

from __future__ import annotations

import msgspec

from arena_core.errors import Conflict
from arena_core.schemas import RolloutRecord, RolloutState, StateTransition

S = RolloutState

_ABORTS = frozenset({S.FAILED, S.TIMED_OUT, S.CANCELLED, S.BUDGET_EXHAUSTED})

#: Allowed next states. Every non-final state may also abort to any of ``_ABORTS``.
ALLOWED: dict[RolloutState, frozenset[RolloutState]] = {
    S.PENDING: frozenset({S.PROVISIONING}) | _ABORTS,
    S.PROVISIONING: frozenset({S.RUNNING}) | _ABORTS,
    S.RUNNING: frozenset({S.VERIFYING}) | _ABORTS,
    S.VERIFYING: frozenset({S.COMPLETED}) | _ABORTS,
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.TIMED_OUT: frozenset(),
    S.CANCELLED: frozenset(),
    S.BUDGET_EXHAUSTED: frozenset(),
}


def can_transition(current: RolloutState, target: RolloutState) -> bool:
    return target in ALLOWED[current]


def transition(
    record: RolloutRecord, target: RolloutState, *, reason: str, at: float, reward: float | None = None,
    infrastructure: bool = False, group_cancelled: bool = False,
) -> RolloutRecord:
    """Return ``record`` moved to ``target``; raise ``Conflict`` if not allowed."""
    if not can_transition(record.state, target):
        raise Conflict(f"rollout {record.rollout_id} cannot go from {record.state.value} to {target.value}")
    entry = StateTransition(from_state=record.state, to_state=target, at=at, reason=reason)
    changes: dict = {"state": target, "reason": reason, "updated_at": at, "history": [*record.history, entry]}
    if reward is not None:
        changes["reward"] = reward
    if infrastructure:
        changes["infrastructure"] = True
    if group_cancelled:
        changes["group_cancelled"] = True
    return msgspec.structs.replace(record, **changes)


def agent_started(record: RolloutRecord) -> float | None:
    """When the rollout's sandbox started its agent (its ``running`` transition), if it has:
    the wall-clock budget counts from then; the time before is queueing."""
    for entry in record.history:
        if entry.to_state == S.RUNNING:
            return entry.at
    return None
