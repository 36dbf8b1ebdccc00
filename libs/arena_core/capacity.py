"""How many sandboxes a host holds, and why (docs/performance.md).

An agent spends most of its life waiting on its LLM: a waiting sandbox costs memory, not CPU.
So the sandbox plane's concurrency is sized from memory, not cores: the memory this process may
use (the host's available memory, or its memory cgroup's limit when lower) less a reserve kept
free, divided by a per-sandbox budget (``ARENA_SANDBOX_MEMORY_MB``), bounded by the file
descriptors the service may open (each live sandbox holds a few). At run time a sandbox starts
only while the host still has the reserve free (:func:`memory_free_for_sandboxes`), so agents
heavier than the budget are held back by memory, not by a count sized for the lightest.

``ARENA_SANDBOX_CONCURRENCY`` set (non-zero) overrides the sizing. No I/O besides ``/proc`` and
``/sys/fs/cgroup`` reads.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import msgspec

MIB = 1024 * 1024
#: File descriptors one live sandbox holds in its service (the gate's pipes and pidfd, the relay's
#: listening socket and connections, the log, a cgroup file or two), with room to spare.
FDS_PER_SANDBOX = 16
#: File descriptors the service keeps for itself (the bus, HTTP clients, logs, the store).
FDS_RESERVED = 512
#: The most slots sizing gives, whatever the memory (a setting can go past it).
MAX_SLOTS = 4096
#: The fewest: a small machine still runs a few agents at once.
MIN_SLOTS = 4


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """The sandboxes a worker runs at once, and the figures that decided it."""

    slots: int
    #: Why: one line for ``arena up``'s banner and the service's start-up log.
    reason: str
    memory_bytes: int = 0  # memory this process may use, at sizing time
    budget_bytes: int = 0
    reserve_bytes: int = 0
    fd_limit: int = 0


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == field:
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_memory_room() -> int | None:
    """What this process's memory cgroup still allows (its limit less its usage), if limited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            limit_file, usage_file = base / "memory.max", base / "memory.current"
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit_file, usage_file = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
        else:
            continue
        try:
            raw = limit_file.read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                continue
            return max(0, int(raw) - int(usage_file.read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def memory_available() -> int:
    """Bytes this process could still use: ``MemAvailable``, or its memory cgroup's room if lower."""
    host = _meminfo("MemAvailable")
    if host is None:
        try:
            host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            host = 0
    room = _cgroup_memory_room()
    return min(host, room) if room is not None else host


def fd_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE``."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (each live sandbox holds descriptors); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return fd_limit()
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass
    return fd_limit()


def size(*, budget_mb: int, reserve_mb: int, memory_bytes: int | None = None, fds: int | None = None) -> Capacity:
    """The slots for a per-sandbox ``budget_mb``, keeping ``reserve_mb`` free (pure given its inputs)."""
    memory = memory_available() if memory_bytes is None else memory_bytes
    fds = fd_limit() if fds is None else fds
    budget, reserve = budget_mb * MIB, reserve_mb * MIB
    by_memory = max(0, memory - reserve) // max(1, budget)
    by_fds = max(0, fds - FDS_RESERVED) // FDS_PER_SANDBOX
    slots = max(MIN_SLOTS, min(by_memory, by_fds, MAX_SLOTS))
    gib = memory / 1024**3
    if slots == MIN_SLOTS and min(by_memory, by_fds) < MIN_SLOTS:
        why = f"the fewest sizing gives ({gib:.1f} GiB free, {fds} file descriptors)"
    elif slots == by_memory:
        why = f"{gib:.1f} GiB free less a {reserve_mb} MiB reserve, {budget_mb} MiB per waiting sandbox"
    elif slots == by_fds:
        why = (f"{fds} file descriptors, {FDS_PER_SANDBOX} per sandbox "
               f"(memory would hold {by_memory}; raise `ulimit -n`)")
    else:
        why = f"the cap of {MAX_SLOTS} (memory would hold {by_memory}; ARENA_SANDBOX_CONCURRENCY goes past it)"
    return Capacity(slots=slots, reason=why, memory_bytes=memory, budget_bytes=budget, reserve_bytes=reserve,
                    fd_limit=fds)


def memory_free_for_sandboxes(reserve_mb: int) -> bool:
    """Whether another sandbox may start now: the host still has more than the reserve free."""
    return memory_available() > reserve_mb * MIB
