"""Per-project quotas and priorities of the sandbox slots: each project's maximum concurrent
sandboxes, maximum queued rollouts, priority class and fair-share weight. docs/projects.md
("Quotas, priorities and fair sharing").

Stored in the ``arena_api_keys`` bucket beside the keys, under ``projects.<name>`` (a key's id
is hex, never dotted), so every rollout replica reads and writes them with the permissions it
already has; the key ring and key listings skip that prefix. A project with no entry gets
:data:`DEFAULTS`: no limit of its own (the host's slots and the server's queue bound it),
``normal`` priority, weight 1.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from arena_core import subjects

#: the prefix of a project's settings in ``arena_api_keys``
PREFIX = "projects."
Priority = Literal["high", "normal", "low"]
#: priority classes, the one served first first
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")
RANK = {name: i for i, name in enumerate(PRIORITIES)}


class ProjectQuota(msgspec.Struct, frozen=True, kw_only=True):
    """A project's share of the sandbox plane. 0 for a maximum: none of the project's own."""

    project: str
    #: sandboxes (provisioning or running) the project holds at once at most; beyond, its rollouts wait
    max_sandboxes: int = 0
    #: rollouts the project may have waiting for a sandbox; a submission beyond gets 429
    max_queued: int = 0
    #: a class served before the lower ones whenever it has a rollout waiting
    priority: Priority = "normal"
    #: its fair share of the slots within its class, relative to the other projects' weights
    weight: float = 1.0
    updated_at: float = 0.0


def defaults(project: str) -> ProjectQuota:
    return ProjectQuota(project=project)


def check(quota: ProjectQuota) -> ProjectQuota:
    """``quota`` when valid, else ``ValueError`` saying what is wrong."""
    from arena_core.apikeys import check_project

    check_project(quota.project)
    problems = []
    if quota.max_sandboxes < 0 or quota.max_queued < 0:
        problems.append("max_sandboxes and max_queued must be >= 0 (0: no limit of the project's own)")
    if quota.priority not in PRIORITIES:
        problems.append(f"priority must be one of {', '.join(PRIORITIES)} (got {quota.priority!r})")
    if not 0 < quota.weight <= 1e6:
        problems.append(f"weight must be > 0 and <= 1e6 (got {quota.weight!r})")
    if problems:
        raise ValueError("; ".join(problems))
    return quota


_decoder = msgspec.json.Decoder(ProjectQuota)


def decode(value: bytes) -> ProjectQuota:
    return _decoder.decode(value)


async def put(bus, quota: ProjectQuota) -> ProjectQuota:
    quota = msgspec.structs.replace(check(quota), updated_at=time.time())
    kv = await bus.kv(subjects.KV_API_KEYS)
    await kv.put(PREFIX + quota.project, msgspec.json.encode(quota))
    return quota


async def get(bus, project: str) -> ProjectQuota:
    kv = await bus.kv(subjects.KV_API_KEYS)
    try:
        entry = await kv.get(PREFIX + project)
    except Exception:  # noqa: BLE001 - KeyNotFoundError and friends: no settings, the defaults
        return defaults(project)
    if entry.value is None:
        return defaults(project)
    return decode(entry.value)


async def listing(bus) -> list[ProjectQuota]:
    """Every project with settings stored, by name."""
    kv = await bus.kv(subjects.KV_API_KEYS)
    try:
        names = await kv.keys()
    except Exception:  # noqa: BLE001 - nats raises NoKeysError on an empty bucket
        return []
    found = []
    for name in names:
        if name.startswith(PREFIX):
            entry = await kv.get(name)
            if entry.value:
                found.append(decode(entry.value))
    return sorted(found, key=lambda q: q.project)


class Quotas:
    """The projects' settings as a rollout replica uses them: read from the bucket, kept for
    ``ttl_s`` (a change reaches every replica within that), the defaults for a project with none."""

    def __init__(self, bus, ttl_s: float = 2.0):
        self.bus, self.ttl_s = bus, ttl_s
        self._known: dict[str, tuple[float, ProjectQuota]] = {}

    def cached(self, project: str) -> ProjectQuota:
        """What is known now, no bus call (the defaults until first read)."""
        hit = self._known.get(project)
        return hit[1] if hit is not None else defaults(project)

    async def of(self, project: str) -> ProjectQuota:
        hit = self._known.get(project)
        now = time.monotonic()
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        try:
            quota = await get(self.bus, project)
        except Exception:  # noqa: BLE001 - the bus is away: what we knew, else the defaults
            return hit[1] if hit is not None else defaults(project)
        self._known[project] = (now, quota)
        return quota

    def remember(self, quota: ProjectQuota) -> None:
        self._known[quota.project] = (time.monotonic(), quota)
