"""In-process caches of the trajectory worker: what this process stored, kept until it is
assembled or published so the hot path does not read it back from ClickHouse. All are
bounded and both are only shortcuts: on a miss the worker reads the store.

A step is kept with the JSON it arrived as (``StoredStep.raw``), so it is published
inside its trajectory and group without being encoded again (``arena_trajectory.wire``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
import msgspec

from arena_core.schemas import SandboxDone, Step, Trajectory, VerificationResult

RawSteps = dict[int, msgspec.Raw | bytes]

#: Each cache holds at most this many bytes of steps' JSON (and their decoded steps, several
#: times that in Python objects: a 2,560-token step is ~14.5 KB of JSON, ~130 KB decoded), so
#: a burst of large steps waiting for their rollouts' final states cannot exhaust the memory.
MAX_CACHED_BYTES = 64 * 1024 * 1024


class StoredStep(msgspec.Struct, gc=False):
    """A stored step: the decoded ``Step`` and the JSON it was stored as. (A Struct: made
    for every step, and a NamedTuple costs several times more to make; ``gc=False``: it holds no cycle.)"""

    step: Step
    raw: msgspec.Raw | bytes


def first_per_index(steps: Iterable[StoredStep]) -> list[StoredStep]:
    """One per ``step_index`` (the first: a redelivered step is the same step), by index."""
    by_index: dict[int, StoredStep] = {}
    for s in steps:
        by_index.setdefault(s.step.step_index, s)
    return [by_index[i] for i in sorted(by_index)]


class StepCache:
    """Steps this process stored, by rollout, until its trajectory is assembled: the
    final state usually finds them here instead of reading them back. A rollout's
    cached steps are used only if they are all there (else the store is read). Bounded."""

    def __init__(self, max_steps: int = 50_000, max_bytes: int = MAX_CACHED_BYTES):
        self.max_steps = max_steps
        self.max_bytes = max_bytes
        self._rollouts: dict[str, dict[int, StoredStep]] = {}
        self._count = 0
        self._bytes = 0  # of the steps' JSON

    def add(self, steps: Iterable[StoredStep]) -> None:
        for stored in steps:
            got = self._rollouts.setdefault(stored.step.rollout_id, {})
            old = got.get(stored.step.step_index)
            if old is None:
                self._count += 1
            else:
                self._bytes -= len(old.raw)
            got[stored.step.step_index] = stored
            self._bytes += len(stored.raw)
        while (self._count > self.max_steps or self._bytes > self.max_bytes) and self._rollouts:
            self._drop(self._rollouts.pop(next(iter(self._rollouts))))  # the oldest rollout

    def pop(self, rollout_id: str) -> list[StoredStep]:
        got = self._rollouts.pop(rollout_id, {})
        self._drop(got)
        return [got[i] for i in sorted(got)]

    def _drop(self, steps: dict[int, StoredStep]) -> None:
        self._count -= len(steps)
        self._bytes -= sum(len(s.raw) for s in steps.values())

    def count(self, rollout_id: str) -> int:
        """How many distinct steps of the rollout are cached."""
        return len(self._rollouts.get(rollout_id, ()))


class MemberCache:
    """Trajectories this process assembled (with their steps' JSON), by group, until
    their group is published: the batch that completes a group usually finds its members
    here instead of reading them back from ClickHouse. Bounded; on a miss the store is read."""

    def __init__(self, max_trajectories: int = 20_000, max_bytes: int = MAX_CACHED_BYTES):
        self.max_trajectories = max_trajectories
        self.max_bytes = max_bytes
        self._groups: dict[str, dict[int, Trajectory]] = {}
        self._raw: dict[str, RawSteps] = {}
        self._count = 0
        self._bytes = 0  # of the members' steps' JSON

    def add(self, trajectories: Iterable[Trajectory], raw: Mapping[str, RawSteps] | None = None) -> None:
        for t in trajectories:
            if t.group_id is None:
                continue
            members = self._groups.setdefault(t.group_id, {})
            if t.group_index not in members:
                self._count += 1
            members[t.group_index] = t
            if raw and t.rollout_id in raw:
                self._bytes -= _size(self._raw.get(t.rollout_id))
                self._raw[t.rollout_id] = raw[t.rollout_id]
                self._bytes += _size(raw[t.rollout_id])
        while (self._count > self.max_trajectories or self._bytes > self.max_bytes) and self._groups:
            self.forget(next(iter(self._groups)))  # the oldest group

    def whole(self, group_id: str) -> list[Trajectory] | None:
        members = self._groups.get(group_id)
        if not members:
            return None
        size = next(iter(members.values())).group_size
        return [members[i] for i in sorted(members)] if len(members) >= size else None

    def raw(self, rollout_id: str) -> RawSteps | None:
        """The JSON of the cached trajectory's steps, by step index."""
        return self._raw.get(rollout_id)

    def forget(self, group_id: str) -> None:
        members = self._groups.pop(group_id, {})
        self._count -= len(members)
        for t in members.values():
            self._bytes -= _size(self._raw.pop(t.rollout_id, None))


def _size(raw: RawSteps | None) -> int:
    return sum(len(r) for r in raw.values()) if raw else 0


class ResultCache:
    """Sandbox results and verifications this process stored, by rollout, until the
    rollout's trajectory is assembled (the latest ``finished_at`` of each kind wins, as in
    the store). Bounded; on a miss the store is read."""

    def __init__(self, max_rollouts: int = 20_000):
        self.max_rollouts = max_rollouts
        self.sandboxes: dict[str, SandboxDone] = {}
        self.verifications: dict[str, VerificationResult] = {}

    def add(self, sandboxes: Iterable[SandboxDone], verifications: Iterable[VerificationResult]) -> None:
        for kind, items in ((self.sandboxes, sandboxes), (self.verifications, verifications)):
            for item in items:
                old = kind.get(item.rollout_id)
                if old is None or item.finished_at >= old.finished_at:
                    kind[item.rollout_id] = item
            while len(kind) > self.max_rollouts:
                kind.pop(next(iter(kind)))  # the oldest

    def forget(self, rollout_id: str) -> None:
        self.sandboxes.pop(rollout_id, None)
        self.verifications.pop(rollout_id, None)


class RecentSet:
    """The last ``max_items`` keys added, oldest forgotten first: what this process knows
    happened (a miss only means "look it up")."""

    def __init__(self, max_items: int):
        self.max_items = max_items
        self._keys: dict[str, None] = {}

    def add(self, key: str) -> None:
        self._keys.pop(key, None)
        self._keys[key] = None
        if len(self._keys) > self.max_items:
            del self._keys[next(iter(self._keys))]

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
