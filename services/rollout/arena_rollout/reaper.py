"""The wall-clock reaper: a rollout past its wall-clock budget ends even when nothing
else would end it.

The proxy refuses a late LLM call and the sandbox times out the run it started, but a
rollout whose agent makes no LLM calls while its sandbox job is never picked up (no
worker for its provider, every worker down), or whose sandbox service died with it,
would otherwise wait forever. ``overdue`` (pure) picks the rollouts still ``pending``,
``provisioning`` or ``running`` more than ``wall_clock_s + grace_s`` after they were
created; ``Reaper.run`` checks the record cache's live rollouts every ``interval_s`` and
moves each one to ``timed_out`` with the reason. ``verifying`` is not reaped: the agent
finished within its budget and the verifier bounds its own run.

Several rollout-service replicas may reap at once: the transition is compare-and-set,
only from the states above, and its event is de-duplicated by ``Nats-Msg-Id``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

import msgspec

from arena.schemas import RolloutRecord, RolloutState

log = logging.getLogger("arena.rollout.reaper")

S = RolloutState

#: The states a wall-clock budget runs in (the agent's time); ``verifying`` is after it.
REAPED = frozenset({S.PENDING, S.PROVISIONING, S.RUNNING})


class Overdue(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: str
    state: RolloutState
    reason: str


def deadline(record: RolloutRecord, grace_s: float) -> float:
    """When the reaper ends ``record``: its wall-clock budget since creation, plus grace."""
    return record.created_at + record.task.budget.wall_clock_s + grace_s


def overdue(records: Iterable[RolloutRecord], *, now: float, grace_s: float) -> list[Overdue]:
    """The rollouts of ``records`` to end now, oldest first."""
    return [
        Overdue(rollout_id=r.rollout_id, state=r.state,
                reason=(f"wall-clock budget exhausted: {now - r.created_at:.1f} s of "
                        f"{r.task.budget.wall_clock_s:g} s used while {r.state.value}"))
        for r in sorted(records, key=lambda r: r.created_at)
        if r.state in REAPED and now > deadline(r, grace_s)
    ]


class Lifecycle(Protocol):
    async def transition(self, rollout_id: str, target: RolloutState, *, reason: str,
                         only_from: frozenset[RolloutState] | None = None) -> Any: ...


class LiveRecords(Protocol):
    watching: bool

    def live(self) -> list[RolloutRecord]: ...


class Reaper:
    def __init__(self, *, lifecycle: Lifecycle, records: LiveRecords, interval_s: float = 1.0,
                 grace_s: float = 5.0):
        if interval_s <= 0 or grace_s < 0:
            raise ValueError("reaper: interval_s must be > 0 and grace_s >= 0")
        self.lifecycle = lifecycle
        self.records = records
        self.interval_s = interval_s
        self.grace_s = grace_s

    async def sweep(self, now: float | None = None) -> list[str]:
        """End every overdue rollout; return the ids this call moved to ``timed_out``."""
        if not self.records.watching:  # the cache answers only once its watch has caught up
            return []
        ended: list[str] = []
        for item in overdue(self.records.live(), now=time.time() if now is None else now, grace_s=self.grace_s):
            after = await self.lifecycle.transition(item.rollout_id, S.TIMED_OUT, reason=item.reason,
                                                    only_from=REAPED)
            if after is not None:
                log.info("rollout reaped: %s", item.reason, extra={"rollout_id": item.rollout_id})
                ended.append(item.rollout_id)
        return ended

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every ``interval_s`` until ``stop``; an error is logged, never fatal."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self.sweep()
            except Exception:  # noqa: BLE001 - a NATS hiccup must not stop the reaper for good
                log.exception("reaper sweep failed; retrying in %.1f s", self.interval_s)
