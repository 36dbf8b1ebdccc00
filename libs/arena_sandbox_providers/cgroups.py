"""Per-sandbox cgroups (v1 or v2) for the local provider: pids, memory and CPU limits.

When cgroups are not writable, :func:`available` says why and the local provider falls back to
per-process rlimits only. See docs/sandbox.md (Providers).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from pathlib import Path

from arena_sandbox_providers import priority

ROOT = Path("/sys/fs/cgroup")


@functools.lru_cache(maxsize=1)
def mode() -> str | None:
    """``"v1"``, ``"v2"`` or ``None`` (not usable here)."""
    if (ROOT / "cgroup.controllers").exists():
        probe = ROOT / "arena"
    elif (ROOT / "pids" / "cgroup.procs").exists() and (ROOT / "memory" / "cgroup.procs").exists():
        probe = ROOT / "pids" / "arena"
    else:
        return None
    try:
        probe.mkdir(exist_ok=True)
    except OSError:
        return None
    if (ROOT / "cgroup.controllers").exists():
        try:  # let sandboxes below arena/ use the pids, memory and cpu controllers
            for path in (ROOT, probe):
                (path / "cgroup.subtree_control").write_text("+pids +memory +cpu")
        except OSError:
            return None
        return "v2"
    return "v1"


def available() -> str | None:
    return None if mode() is not None else "cgroups are not writable here (no per-sandbox pids/memory limits)"


def _write(path: Path, value: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.write_text(value)


class SandboxCgroup:
    """The cgroup(s) of one sandbox."""

    def __init__(self, owner: str, name: str):
        m = mode()
        rel = Path("arena") / owner / name
        if m == "v2":
            self.dirs = [ROOT / rel]
            self._memory = ROOT / rel
        else:
            self.dirs = [ROOT / c / rel for c in ("pids", "memory", "cpu") if (ROOT / c).is_dir()]
            self._memory = ROOT / "memory" / rel

    def create(self, *, pids: int, memory_bytes: int, cpus: float, nice: int = 0) -> None:
        """Make the group with its limits; with ``nice``, the group every sandbox shares (``arena/``)
        gets the lower CPU weight of that nice level against the services' own (:mod:`.priority`)."""
        for d in self.dirs:
            for attempt in range(3):  # a sibling's destroy may remove the empty owner group meanwhile
                try:
                    d.mkdir(parents=True, exist_ok=True)
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
        if mode() == "v2":
            d = self.dirs[0]
            if nice > 0:
                _write(ROOT / "arena" / "cpu.weight", str(priority.cgroup_v2_weight(nice)))
            _write(d / "pids.max", str(pids))
            _write(d / "memory.max", str(memory_bytes))
            _write(d / "memory.swap.max", "0")
            _write(d / "cpu.max", f"{int(cpus * 100_000)} 100000")
            return
        for d in self.dirs:
            if d.parts[4] == "pids":
                _write(d / "pids.max", str(pids))
            elif d.parts[4] == "memory":
                _write(d / "memory.limit_in_bytes", str(memory_bytes))
                _write(d / "memory.memsw.limit_in_bytes", str(memory_bytes))  # no swap, if accounted
            elif d.parts[4] == "cpu":
                if nice > 0:
                    _write(ROOT / "cpu" / "arena" / "cpu.shares", str(priority.cpu_shares(nice)))
                _write(d / "cpu.cfs_period_us", "100000")
                _write(d / "cpu.cfs_quota_us", str(int(cpus * 100_000)))

    @property
    def procs_files(self) -> tuple[str, ...]:
        return tuple(str(d / "cgroup.procs") for d in self.dirs)

    def oom_kills(self) -> int:
        name = "memory.events" if mode() == "v2" else "memory.oom_control"
        try:
            for line in (self._memory / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError, ValueError):
                out.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return sorted(out)

    def destroy(self, *, timeout_s: float = 5.0) -> None:
        """Kill what is left in the group, then remove it. Never raises."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        for d in self.dirs:
            with contextlib.suppress(OSError):
                d.rmdir()
            with contextlib.suppress(OSError):
                d.parent.rmdir()  # the owner's group, once its last sandbox is gone


def reap(owner: str) -> int:
    """Remove every sandbox cgroup of ``owner`` (killing what is left in it)."""
    m = mode()
    if m is None:
        return 0
    bases = [ROOT / "arena" / owner] if m == "v2" else [ROOT / c / "arena" / owner for c in ("pids", "memory", "cpu")]
    names: set[str] = set()
    for base in bases:
        if base.is_dir():
            names.update(p.name for p in base.iterdir() if p.is_dir())
    for name in names:
        SandboxCgroup(owner, name).destroy()
    return len(names)
