"""The reaper: ends the rollouts nothing else would end.

One past its hard lifetime (queue + run + verify, whatever its state), past its queue limit (the
agent never ran: an infrastructure outcome), past its wall-clock budget since its agent started, or
in ``verifying`` past its verification deadline. ``overdue`` (pure) picks them; ``Reaper.run``
moves them by compare-and-set. See docs/rollout.md (State machine, Hard lifetime).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import msgspec

from arena_core.runtime import every
from arena_core.schemas import (
    CompositeVerifier,
    LlmJudgeVerifier,
    RewardFileVerifier,
    RolloutRecord,
    RolloutState,
    TestsVerifier,
)
from arena_rollout.state import agent_started

log = logging.getLogger("arena.rollout.reaper")

S = RolloutState

#: The states a wall-clock budget runs in (the agent's time); ``verifying`` is after it.
REAPED = frozenset({S.PENDING, S.PROVISIONING, S.RUNNING})
#: Seconds a rollout may wait for its sandbox (``ARENA_QUEUE_TIMEOUT_S``) when not given.
DEFAULT_QUEUE_TIMEOUT_S = 900.0
#: The state the verification deadline runs in.
VERIFYING = frozenset({S.VERIFYING})
#: The states a hard lifetime runs in: all but the final ones.
LIVE = REAPED | VERIFYING
#: Time a verification takes besides its verifier's own timeouts (a fresh sandbox, the
#: agent's diff applied, the result published), added to those timeouts.
VERIFY_SETUP_S = 300.0


class Overdue(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: str
    state: RolloutState
    reason: str
    #: ``timed_out`` (wall clock) or ``failed`` (verification deadline)
    target: RolloutState = S.TIMED_OUT
    #: Arena's outcome, not the policy's: no reward, never a 0. The agent never ran (its time
    #: went by in the queue), or no verification came (a verifier that answers after the
    #: deadline is not counted: the rollout, its trajectory and exports all keep no reward).
    infrastructure: bool = False
    #: the states the transition may start from (it is a no-op from any other)
    only_from: frozenset[RolloutState] = REAPED


def deadline(record: RolloutRecord, grace_s: float, queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
             off_clock_s: float = 0.0) -> float:
    """When the reaper ends ``record``: in the queue (``pending``, ``provisioning``) ``queue_timeout_s``
    after it was created; once its agent runs, its wall-clock budget from then, plus the time its LLM
    calls waited in the proxy's queue for a backend slot (``off_clock_s``: not the agent's time);
    plus grace."""
    started = agent_started(record) if record.state == S.RUNNING else None
    if started is None:
        return record.created_at + queue_timeout_s + grace_s
    return started + record.task.budget.wall_clock_s + max(0.0, off_clock_s) + grace_s


def verifier_budget_s(verifier: object) -> float:
    """How long a verifier may run by its own timeouts (composites run their parts in
    turn); 0 for verifiers without one (exact, rubric, python)."""
    if isinstance(verifier, CompositeVerifier):
        return sum(verifier_budget_s(part.verifier) for part in verifier.verifiers)
    if isinstance(verifier, (TestsVerifier, LlmJudgeVerifier)):
        return verifier.timeout_s
    if isinstance(verifier, RewardFileVerifier):  # each step's script in turn
        return sum(s.timeout_s or verifier.timeout_s for s in verifier.steps) or verifier.timeout_s
    return 0.0


def verifying_since(record: RolloutRecord) -> float:
    """When ``record`` entered ``verifying`` (its last such transition; else its last update)."""
    for entry in reversed(record.history):
        if entry.to_state == S.VERIFYING:
            return entry.at
    return record.updated_at


def verify_deadline_s(record: RolloutRecord, deadline_s: float) -> float:
    """How long ``record`` may stay in ``verifying``: ``deadline_s``, or its verifier's own
    timeouts plus ``VERIFY_SETUP_S`` when that is longer."""
    own = record.verify_budget_s or verifier_budget_s(record.task.verifier)
    return max(deadline_s, own + VERIFY_SETUP_S if own else 0.0)


def _none_off_clock(rollout_id: str) -> float:
    return 0.0


def overdue(records: Iterable[RolloutRecord], *, now: float, grace_s: float,
            verify_deadline: float = 0.0, queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
            off_clock: Callable[[str], float] = _none_off_clock) -> list[Overdue]:
    """The rollouts of ``records`` to end now, oldest first: past their hard lifetime (``lifetime_s``
    from ``created_at``, in any live state: ``timed_out``, an infrastructure outcome), past their
    queue limit (never ran: an infrastructure outcome), past their wall clock since their agent started, or, when
    ``verify_deadline`` > 0, in ``verifying`` past their verification deadline."""
    found: list[Overdue] = []
    for r in sorted(records, key=lambda r: r.created_at):
        if r.state in LIVE and r.lifetime_s > 0 and now > r.created_at + r.lifetime_s:
            # Arena's bound, not the policy's budget (that is the wall clock): no reward
            found.append(Overdue(
                rollout_id=r.rollout_id, state=r.state, only_from=LIVE, infrastructure=True,
                reason=(f"infrastructure: hard lifetime exceeded: {now - r.created_at:.1f} s since submission "
                        f"(limit {r.lifetime_s:g} s, queue + run + verify) while {r.state.value}; "
                        "its sandbox and verification are abandoned")))
        elif r.state in REAPED and now > deadline(r, grace_s, queue_timeout_s,
                                                  off_clock(r.rollout_id) if r.state == S.RUNNING else 0.0):
            started = agent_started(r) if r.state == S.RUNNING else None
            if started is None:  # load, not the policy: an infrastructure outcome with no reward
                reason = (f"infrastructure: the agent never ran: {now - r.created_at:.1f} s in the queue "
                          f"(limit {queue_timeout_s:g} s) while {r.state.value}")
            else:
                waited = off_clock(r.rollout_id)
                reason = (f"wall-clock budget exhausted: {now - started - waited:.1f} s of "
                          f"{r.task.budget.wall_clock_s:g} s used since the agent started"
                          + (f" (besides {waited:.1f} s its LLM calls waited for a backend slot)" if waited else ""))
            found.append(Overdue(rollout_id=r.rollout_id, state=r.state, reason=reason,
                                 infrastructure=started is None))
        elif r.state == S.VERIFYING and verify_deadline > 0:
            since, allowed = verifying_since(r), verify_deadline_s(r, verify_deadline)
            if now > since + allowed:
                found.append(Overdue(
                    rollout_id=r.rollout_id, state=r.state, target=S.FAILED, only_from=VERIFYING,
                    reason=(f"verification deadline passed: no verification result after {now - since:.1f} s in "
                            f"verifying (deadline {allowed:g} s): the verify job was never picked up or every "
                            f"verification worker is down"), infrastructure=True))
    return found


class Lifecycle(Protocol):
    async def transition(self, rollout_id: str, target: RolloutState, *, reason: str,
                         only_from: frozenset[RolloutState] | None = None, infrastructure: bool = False) -> Any: ...


class LiveRecords(Protocol):
    watching: bool

    def live(self) -> list[RolloutRecord]: ...


class Reaper:
    def __init__(self, *, lifecycle: Lifecycle, records: LiveRecords, interval_s: float = 1.0,
                 grace_s: float = 5.0, verify_deadline_s: float = 1800.0,
                 queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
                 off_clock: Callable[[str], float] = _none_off_clock):
        """``off_clock``: seconds a rollout's LLM calls waited in the proxy's queue for a backend slot
        (the proxy's ``off_clock_s``, this process's), left out of its wall clock."""
        if interval_s <= 0 or grace_s < 0 or verify_deadline_s < 0 or queue_timeout_s <= 0:
            raise ValueError("reaper: interval_s and queue_timeout_s must be > 0, grace_s and verify_deadline_s >= 0")
        self.queue_timeout_s = queue_timeout_s
        self.off_clock = off_clock
        self.lifecycle = lifecycle
        self.records = records
        self.interval_s = interval_s
        self.grace_s = grace_s
        #: 0 never fails a rollout for staying in ``verifying``
        self.verify_deadline_s = verify_deadline_s

    async def sweep(self, now: float | None = None) -> list[str]:
        """End every overdue rollout; return the ids this call ended."""
        if not self.records.watching:  # the cache answers only once its watch has caught up
            return []
        ended: list[str] = []
        items = overdue(self.records.live(), now=time.time() if now is None else now, grace_s=self.grace_s,
                        verify_deadline=self.verify_deadline_s, queue_timeout_s=self.queue_timeout_s,
                        off_clock=self.off_clock)
        for item in items:
            after = await self.lifecycle.transition(item.rollout_id, item.target, reason=item.reason,
                                                    only_from=item.only_from,
                                                    **({"infrastructure": True} if item.infrastructure else {}))
            if after is not None:
                log.info("rollout reaped: %s", item.reason, extra={"rollout_id": item.rollout_id})
                ended.append(item.rollout_id)
        return ended

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every ``interval_s`` until ``stop``; an error is logged, never fatal. A lifecycle
        with a scheduler (``dispatch``) is asked to start what the free slots take at each sweep
        too: slots another replica gave back, new workers, changed quotas (docs/projects.md)."""
        dispatch = getattr(self.lifecycle, "dispatch", None)

        async def sweep() -> None:
            await self.sweep()
            if dispatch is not None and self.records.watching:
                await dispatch()

        await every(stop, self.interval_s, sweep, what="reaper sweep")
