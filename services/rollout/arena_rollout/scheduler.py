"""Which waiting rollout gets the next free sandbox slot. docs/projects.md ("The scheduler").

The rollout service keeps a rollout ``pending`` until a slot is free for it and only then moves
it to ``provisioning`` (a compare-and-set: one replica wins) and publishes its sandbox job, so
the sandbox plane's queue holds no more than the slots it can take. The choice, among projects
with a rollout waiting that are under their own ``max_sandboxes``:

1. the highest priority class (``high``, ``normal``, ``low``);
2. within it, the project least served relative to its weight: the sandbox-seconds it is using
   (its sandboxes held now, each counted at least the mean hold, so one start moves it at once)
   plus what it used recently (decayed with a half-life of ``HALF_LIFE_S``), over its weight;
3. ties: the oldest waiting rollout. Within a project, its rollouts start oldest first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from arena_core.quotas import RANK, ProjectQuota, defaults
from arena_core.schemas import RolloutRecord, RolloutState

S = RolloutState
#: the states of a rollout holding a sandbox slot (from the worker's take to the sandbox's end)
HOLDING = frozenset({S.PROVISIONING, S.RUNNING})
HALF_LIFE_S = 60.0


def slot_since(record: RolloutRecord) -> float | None:
    """When ``record`` took its sandbox slot (its ``provisioning``), or ``None``."""
    return next((t.at for t in reversed(record.history) if t.to_state == S.PROVISIONING), None)


class Usage:
    """Sandbox-seconds each project used in slots already given back, decayed (half-life
    ``HALF_LIFE_S``): the memory that keeps shares fair over time, not only at an instant."""

    def __init__(self, half_life_s: float = HALF_LIFE_S):
        self.rate = math.log(2) / half_life_s
        self._spent: dict[str, tuple[float, float]] = {}  # project -> (value, at)

    def add(self, project: str, seconds: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._spent[project] = (self.of(project, now) + max(seconds, 0.0), now)

    def of(self, project: str, now: float | None = None) -> float:
        value, at = self._spent.get(project, (0.0, 0.0))
        if not value:
            return 0.0
        now = time.time() if now is None else now
        return value * math.exp(-self.rate * max(now - at, 0.0))


@dataclass
class _Project:
    quota: ProjectQuota
    waiting: list[RolloutRecord] = field(default_factory=list)
    held: int = 0
    used: float = 0.0


def plan(live: Iterable[RolloutRecord], *, quotas: Callable[[str], ProjectQuota], slots: int | None,
         provider_slots: Callable[[str], int | None], usage: Usage, mean_hold_s: float,
         now: float | None = None) -> list[RolloutRecord]:
    """The pending rollouts to start now, in order: as many as the free slots take (``slots``
    ``None``: unknown, every pending one), by the rule above."""
    now = time.time() if now is None else now
    projects: dict[str, _Project] = {}
    held_by_provider: dict[str, int] = {}
    held = 0

    def project(name: str) -> _Project:
        p = projects.get(name)
        if p is None:
            p = projects[name] = _Project(quota=quotas(name), used=usage.of(name, now))
        return p

    for r in live:
        if r.state == S.PENDING:
            project(r.project).waiting.append(r)
        elif r.state in HOLDING:
            p = project(r.project)
            p.held += 1
            since = slot_since(r)
            p.used += max(now - since if since is not None else 0.0, mean_hold_s)
            held += 1
            held_by_provider[r.provider] = held_by_provider.get(r.provider, 0) + 1
    for p in projects.values():
        p.waiting.sort(key=lambda r: (r.created_at, r.group_index))
    chosen: list[RolloutRecord] = []
    while slots is None or held < slots:
        best, best_key, best_i = None, None, -1
        for p in projects.values():
            if not p.waiting or (p.quota.max_sandboxes and p.held >= p.quota.max_sandboxes):
                continue
            # its oldest rollout whose provider has a free slot
            i = next((i for i, r in enumerate(p.waiting)
                      if (cap := provider_slots(r.provider)) is None or held_by_provider.get(r.provider, 0) < cap),
                     None)
            if i is None:
                continue
            key = (RANK.get(p.quota.priority, 1), p.used / p.quota.weight, p.waiting[i].created_at)
            if best_key is None or key < best_key:
                best, best_key, best_i = p, key, i
        if best is None:
            break
        record = best.waiting.pop(best_i)
        chosen.append(record)
        best.held += 1
        best.used += mean_hold_s
        held += 1
        held_by_provider[record.provider] = held_by_provider.get(record.provider, 0) + 1
    return chosen


__all__ = ["HOLDING", "Usage", "plan", "slot_since", "defaults"]
