"""Sandboxes run at a lower CPU priority than Arena's own services (docs/performance.md).

A host full of agents saturates its cores; the proxy, the bus and the state machine must still
answer in milliseconds. One setting, ``ARENA_SANDBOX_NICE`` (0-19, default 10), sets it for each
provider in the terms the kernel uses there:

- local: every process of a sandbox runs at that nice level (its first process gets it, the rest
  inherit it), and the cgroup all sandboxes share (``arena/``) gets the matching lower CPU weight
  (v2 ``cpu.weight``, v1 ``cpu.shares``), which is what the scheduler weighs against the services'
  own cgroups. Without writable cgroups, the sandbox's session (``bwrap --new-session``: with
  ``kernel.sched_autogroup_enabled`` the scheduler weighs sessions against each other first) gets
  the nice level too, set from inside; the kernel takes such changes from an unprivileged writer
  once per 100 ms, so in a burst of starts some sandboxes keep their session at the services'
  weight: give the service writable cgroups (run it as root, or delegate a cgroup v2 subtree);
- docker: the container's CPU shares (``--cpu-shares``), the matching weight;
- kubernetes: the pod's CPU request sets its weight (docs/kubernetes.md).

The weight of nice level ``n`` is the kernel's own: about 1.25 times less per level (nice 10 is
about a tenth of nice 0). The scheduler stays work-conserving: idle cores go to sandboxes.
"""

from __future__ import annotations

import contextlib
import os


def _factor(nice: int) -> float:
    return 1.25 ** max(0, min(19, nice))


def cgroup_v2_weight(nice: int) -> int:
    """``cpu.weight`` (1-10000, default 100) for nice level ``nice``."""
    return max(1, round(100 / _factor(nice)))


def cpu_shares(nice: int) -> int:
    """cgroup v1 ``cpu.shares`` and docker's ``--cpu-shares`` (default 1024) for ``nice``."""
    return max(2, round(1024 / _factor(nice)))


def lower(pid: int, nice: int) -> None:
    """Set process ``pid`` (a sandbox's first process, before it runs anything) to ``nice``; what it
    starts inherits it. A process gone already is left alone. (Its session's autogroup is set from
    inside the sandbox, which is a session of its own: :data:`.local._AUTOGROUP_NICE`.)"""
    if nice <= 0:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.setpriority(os.PRIO_PROCESS, pid, nice)
