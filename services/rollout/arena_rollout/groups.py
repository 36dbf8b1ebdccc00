"""Group completion policies: all members; the first k of n; a deadline (docs/rollout.md, Group
completion). ``decide`` (pure) says which members to cancel now; ``GroupPolicies`` keeps count of
each policed group's members that ended with a reward and cancels by compare-and-set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import msgspec

from arena_core.schemas import GroupCompletion, RolloutRecord, RolloutState

log = logging.getLogger("arena.rollout.groups")

S = RolloutState
#: The states a policy cancels from: every non-final one (a member in ``verifying`` too: the
#: group does not wait for it).
LIVE = frozenset({S.PENDING, S.PROVISIONING, S.RUNNING, S.VERIFYING})


def completion_problems(completion: GroupCompletion, n: int) -> list[str]:
    """What is wrong with ``completion`` for a group of ``n`` (each a 422's sentence)."""
    k = completion.first_k
    if k is not None and not 1 <= k <= n:
        return [f"completion.first_k must be between 1 and n ({n}), got {k}"]
    return []


def policed(completion: GroupCompletion) -> bool:
    """Whether ``completion`` can end a group before every member has (not the default, all)."""
    return completion.first_k is not None or completion.deadline_s is not None


def counts_toward_k(record: RolloutRecord) -> bool:
    """A member that ended with the verifier's reward (a verified 0 is a real outcome and counts);
    an infrastructure outcome, a never-verified failure or a cancelled member does not."""
    return (record.state.is_final and record.reward is not None and not record.infrastructure
            and not record.group_cancelled)


class Cancel(msgspec.Struct, frozen=True, kw_only=True):
    """Cancel ``rollout_ids`` (the group's members not ended yet) with ``reason``."""

    group_id: str
    rollout_ids: list[str]
    reason: str


def decide(group_id: str, live: Sequence[RolloutRecord], *, scored: int, now: float) -> Cancel | None:
    """Which of a group's ``live`` (non-final) members to cancel now, given ``scored`` members that
    ended with a reward; ``None``: none. The policy and the submission time are the members'."""
    if not live:
        return None
    first = live[0]
    policy, size = first.completion, first.group_size
    k, deadline = policy.first_k, policy.deadline_s
    if k is not None and scored >= k:
        reason = (f"group completion: the first {k} of {size} members ended with a reward "
                  f"(first_k={k}); the rest are cancelled")
    elif deadline is not None and now >= first.group_submitted_at + deadline:
        reason = (f"group completion: deadline of {deadline:g} s after submission passed with "
                  f"{size - len(live)} of {size} members ended (deadline_s={deadline:g})")
    else:
        return None
    return Cancel(group_id=group_id, rollout_ids=sorted(r.rollout_id for r in live), reason=reason)


def decisions(live: Iterable[RolloutRecord], scored: dict[str, set[int]], *, now: float) -> list[Cancel]:
    """``decide`` for every policed group among ``live`` records; ``scored``: group id -> the
    ``group_index`` of members that ended with a reward."""
    groups: dict[str, list[RolloutRecord]] = {}
    for r in live:
        if r.group_id is not None and policed(r.completion) and r.state in LIVE:
            groups.setdefault(r.group_id, []).append(r)
    found = []
    for gid, members in sorted(groups.items()):
        cancel = decide(gid, members, scored=len(scored.get(gid, ())), now=now)
        if cancel is not None:
            found.append(cancel)
    return found


class Lifecycle(Protocol):
    async def transition(self, rollout_id: str, target: RolloutState, *, reason: str,
                         only_from: frozenset[RolloutState] | None = None, group_cancelled: bool = False) -> Any: ...


class LiveRecords(Protocol):
    watching: bool

    def live(self) -> list[RolloutRecord]: ...


class GroupPolicies:
    """Enforces completion policies. ``ended`` is fed every final record the rollout cache learns
    (its own writes and the KV watch, so every replica counts the same, and a restart counts
    again from the bucket); a member scoring for a ``first_k`` group wakes the loop at once, a
    deadline is found by the sweep every ``interval_s``. Replicas cancelling the same member race
    harmlessly: the transition is a compare-and-set."""

    def __init__(self, *, lifecycle: Lifecycle, records: LiveRecords, interval_s: float = 1.0):
        if interval_s <= 0:
            raise ValueError("GroupPolicies: interval_s must be > 0")
        self.lifecycle = lifecycle
        self.records = records
        self.interval_s = interval_s
        #: group id -> ``group_index`` of members that ended with a reward (policed groups only)
        self.scored: dict[str, set[int]] = {}
        self._wake = asyncio.Event()

    def ended(self, record: RolloutRecord) -> None:
        """A member's final record (called by the record cache; cheap, no I/O)."""
        if record.group_id is None or not policed(record.completion):
            return
        if counts_toward_k(record):
            self.scored.setdefault(record.group_id, set()).add(record.group_index)
            if record.completion.first_k is not None:
                self._wake.set()

    async def sweep(self, now: float | None = None) -> list[str]:
        """Cancel what the policies say; the ids this call cancelled."""
        if not self.records.watching:  # the counts are whole only once the watch caught up
            return []
        live = self.records.live()
        cancelled: list[str] = []
        for item in decisions(live, self.scored, now=time.time() if now is None else now):
            for rid in item.rollout_ids:
                after = await self.lifecycle.transition(rid, S.CANCELLED, reason=item.reason, only_from=LIVE,
                                                        group_cancelled=True)
                if after is not None:
                    cancelled.append(rid)
            log.info("%s: cancelled %d members", item.reason, len(item.rollout_ids), extra={"group_id": item.group_id})
        # forget the groups with no live member left (nothing more to decide for them); read
        # again after the awaits above: a group submitted meanwhile may have scored already
        present = {r.group_id for r in self.records.live() if r.group_id is not None}
        for gid in [g for g in self.scored if g not in present]:
            del self.scored[gid]
        return cancelled

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep on every wake-up and every ``interval_s`` until ``stop``; an error is logged."""
        while not stop.is_set():
            waiting = asyncio.ensure_future(self._wake.wait())
            stopping = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({waiting, stopping}, timeout=self.interval_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (waiting, stopping):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if stop.is_set():
                return
            self._wake.clear()
            try:
                await self.sweep()
            except Exception:  # noqa: BLE001 - the next sweep tries again
                log.exception("group completion sweep failed")
