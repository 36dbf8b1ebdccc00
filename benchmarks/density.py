"""Density: N agents x T turns that mostly wait on a slow LLM, through Arena and bare.

The workload (``arena_stack.waiting_agents``): a trivial stdlib agent making one chat call per
turn, graded by an ``exact`` verifier; a vLLM-shaped stand-in backend whose latency is lognormal
(median L, sigma 0.5, the same draw for the same agent and turn in both runs) and which serves at
most K calls at once (more wait inside it, as in vLLM). Baseline, in the same run: the same agent
program as N plain processes pointed straight at the same backend. Arena runs with its defaults;
only the proxy's in-flight bound is set to K when K is not the default (64).

Reported, each beside the bare run's figure and their ratio: completed and other final states;
wall time against the ideal (the slowest agent's own LLM time, and the backend's bound: all LLM
time / K); Arena's CPU beyond the agents' own, per turn and per rollout (the stack's process
trees from /proc, waited-for children included, less what the agents measured of themselves);
the path's time per call (the agent's round trip less the backend's own time and the queue) and
the proxy's own time per call (a step's total less its queue and the backend's time); memory per
live sandbox beyond the agent (PSS of the per-sandbox processes and the services' growth; and the
host's MemAvailable drop); the backend's most calls at once and its idle time while calls queued.

    .venv/bin/python benchmarks/density.py [--agents 256] [--turns 10] [--latency 2] [--backend-limit 64]
                                           [--burn-ms 0] [--skip-bare] [--json]
                                           [--provider docker [--docker-url URL] [--image IMAGE]] [--slots N]

``--provider docker``: the same agents in containers (the image's ``python3``), on the engine at
``--docker-url`` or, without one, Podman's service started for the run by ``deploy/docker-engine.sh``
and stopped after; per container it reports the memory (the container's cgroup, the PSS of its
processes, of its ``conmon`` and the engine's growth) and the start time. Every container of the
run's own sandbox owner is removed at the end, whatever happened (and said if any was left).

Figures and how to read them: docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import msgspec
import psutil

from arena.sdk import ArenaClient
from arena_core import apikeys
from arena_core.schemas import SubmitRolloutRequest
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack
from arena_stack.waiting_agents import AGENT_FILE, StandInBackend, agent_env, latency_s, waiting_task, write_agent
from arena_sandbox_providers.hostdir import SANDBOX_UID

FINAL = ("completed", "failed", "timed_out", "cancelled", "budget_exhausted")
DEFAULT_LIMIT = Settings().backend_max_inflight
TICK = os.sysconf("SC_CLK_TCK")
IDLE_S = 3.0
ENGINE_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "docker-engine.sh"
#: the engine's own processes among the measured services (docker provider, an engine this run started)
ENGINE_SERVICES = ("podman",)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# ------------------------------------------------------------------------------------ sampling


def _proc_table() -> dict[int, tuple[int, float, float, int, str]]:
    """pid -> (parent, own CPU s, CPU s of the children it waited for, start tick, comm)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                head, _, rest = Path(f"/proc/{entry}/stat").read_text().rpartition(")")
                f = rest.split()
                out[int(entry)] = (int(f[1]), (int(f[11]) + int(f[12])) / TICK, (int(f[13]) + int(f[14])) / TICK,
                                   int(f[19]), head.partition("(")[2])
    return out


def services_cpu(roots: dict[str, int]) -> dict[str, tuple[float, float]]:
    """name -> (own CPU s, CPU s of the children it waited for) of each root process."""
    table = _proc_table()
    return {name: table[pid][1:3] for name, pid in roots.items() if pid in table}


def _pss(proc: psutil.Process) -> int:
    try:
        return proc.memory_full_info().pss
    except (psutil.Error, OSError):
        return 0


def _created(proc: psutil.Process, now: float) -> float:
    try:
        return proc.create_time()
    except psutil.Error:
        return now


def mem_available() -> int:
    return psutil.virtual_memory().available


def kernel_memory() -> int:
    """Bytes the kernel holds for objects (slab: namespaces, mounts, sockets, cgroups; kernel
    stacks; page tables): what a sandbox costs outside any process's PSS."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[k].split()[0]) * 1024 for k in ("Slab", "KernelStack", "PageTables") if k in fields)


def _is_agent(comm: str) -> bool:
    return comm.startswith("python")  # below the sandbox service: only the agents run Python


#: unix time = this + a process's start time in /proc (seconds since boot, CLOCK_BOOTTIME)
_BOOT_OFFSET = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def _started_at(ticks: int) -> float:
    return _BOOT_OFFSET + ticks / TICK


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
    except OSError:
        return []


def _environ(pid: int, name: str) -> str | None:
    try:
        for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if entry.startswith(name.encode() + b"="):
                return entry.partition(b"=")[2].decode(errors="replace")
    except OSError:
        pass
    return None


class HostSampler:
    """Below ``parent`` (the sandbox service, or this benchmark for the bare run), every
    ``interval`` s: each process's CPU as last seen (a process's last moments before it exits are
    missed), by kind: ``agent`` (Python), ``sandbox`` (bwrap and its gate, git: the rest), the
    parent's direct children apart (``direct``: the parent waits for them, their CPU is in its
    children's figure). Every ``memory_every`` samples: the live agents, their PSS, the PSS of the
    other processes below ``parent`` and of each of ``services``, and the host's MemAvailable;
    the sample with the most live agents is kept."""

    def __init__(self, parent: int, services: dict[str, int], interval: float = 0.5, memory_every: int = 2,
                 skip: tuple[int, ...] = ()):
        self.parent, self.services, self.interval, self.memory_every = parent, services, interval, memory_every
        self.skip = set(skip)
        self.peak: dict | None = None
        self.max_live = 0
        self.cpu: dict[tuple[int, int], tuple[str, float]] = {}  # (pid, start) -> (kind, CPU s)
        self._base: dict[tuple[int, int], float] = {}
        self.cpu_wait: dict[tuple[int, int], float] = {}
        #: agent index (its DENSITY_AGENT) -> unix time its process started
        self.agent_started: dict[str, float] = {}
        self._agents_seen: set[tuple[int, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _below(self, table) -> dict[int, str]:
        kids = collections.defaultdict(list)
        for pid, row in table.items():
            kids[row[0]].append(pid)
        out, frontier = {}, [(c, True) for c in kids[self.parent] if c not in self.skip]
        while frontier:
            pid, direct = frontier.pop()
            out[pid] = "agent" if _is_agent(table[pid][4]) else "direct" if direct else "sandbox"
            frontier += [(c, False) for c in kids[pid]]
        return out

    def scan_cpu(self, *, baseline: bool = False) -> None:
        table = _proc_table()
        for pid, kind in self._below(table).items():
            key = (pid, table[pid][3])
            if baseline:
                self._base[key] = table[pid][1]
            self.cpu[key] = (kind, table[pid][1])
            if kind == "agent":  # schedstat: ns on a CPU, ns runnable but waiting for one
                with contextlib.suppress(OSError, ValueError, IndexError):
                    self.cpu_wait[key] = int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
                if key not in self._agents_seen:
                    self._agents_seen.add(key)
                    if (index := _environ(pid, "DENSITY_AGENT")) is not None:
                        self.agent_started.setdefault(index, _started_at(table[pid][3]))

    def agents_cpu_wait(self) -> float:
        """Seconds the agents were runnable but waiting for a CPU (as last seen), in all."""
        return sum(self.cpu_wait.values())

    def cpu_by_kind(self) -> dict[str, float]:
        out = collections.Counter()
        for key, (kind, cpu) in self.cpu.items():
            out[kind] += cpu - self._base.get(key, 0.0)
        return dict(out)

    def sample_memory(self) -> dict:
        agents, others = [], []
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.parent).children(recursive=True):
                if p.pid in self.skip:
                    continue
                with contextlib.suppress(psutil.Error):
                    (agents if _is_agent(p.name()) else others).append(p)
        now = time.time()
        settled = [_pss(p) for p in agents if now - _created(p, now) > 1.0]  # past its start-up
        nice = None
        for p in agents[:1]:
            with contextlib.suppress(psutil.Error):
                nice = p.nice()
        return {"live": len(agents), "agents_pss": sum(_pss(p) for p in agents), "agent_nice": nice,
                "agent_pss_median": statistics.median(settled) if settled else 0,
                "others_pss": sum(_pss(p) for p in others), "others": len(others),
                "services_pss": {n: _pss(psutil.Process(pid)) for n, pid in self.services.items()
                                 if psutil.pid_exists(pid)},
                "available": mem_available(), "kernel": kernel_memory()}

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.scan_cpu()
            if i % self.memory_every == 0:
                s = self.sample_memory()
                self.max_live = max(self.max_live, s["live"])
                if s["live"] and (self.peak is None or s["live"] >= self.peak["live"]):
                    self.peak = s
            i += 1
            self._stop.wait(max(self.interval, 2 * (time.monotonic() - t0)))

    def __enter__(self) -> HostSampler:
        self.scan_cpu(baseline=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.scan_cpu()


class ContainerSampler(HostSampler):
    """The docker provider's sandboxes through Podman: the containers of sandbox owner ``owner``,
    found by their ``conmon`` (Podman's monitor process beside each container, named
    ``arena-<owner>-<sandbox id>`` on its command line; the container's init is its child). Kinds:
    ``agent`` (the agent program), ``sandbox`` (in the container but the agent: the command
    server, the init; the LLM relay's shim), ``engine`` (conmon and what it runs beside the
    container: the OCI runtime at start, ``podman container cleanup`` at exit). Memory samples add
    each live container's memory cgroup (``memory.usage_in_bytes`` on cgroup v1, ``memory.current``
    on v2) and the PSS of the ``engine`` processes; per container it records when its conmon, its
    init and its agent started (for the start time against the job's start)."""

    def __init__(self, owner: str, services: dict[str, int], **kw):
        super().__init__(0, services, **kw)
        self.prefix = f"arena-{owner}-"
        self._conmons: dict[tuple[int, int], str] = {}  # (pid, start) -> container id ("" = not ours)
        self._roles: dict[tuple[int, int], str] = {}  # (pid, start) -> agent / sandbox
        self._cgroups: dict[str, Path | None] = {}
        #: container id -> {"conmon", "init", "agent": unix times, "index": the agent's DENSITY_AGENT}
        self.containers: dict[str, dict] = {}

    def _ours(self, pid: int) -> str:
        args = _cmdline(pid)
        opts = dict(zip(args, args[1:]))
        return opts.get("-c", "") if opts.get("-n", "").startswith(self.prefix) else ""

    def _role(self, pid: int) -> str:
        args = _cmdline(pid)
        shim = any(a.endswith("/shim.py") for a in args)
        return "agent" if not shim and args and args[-1].endswith(f"/{AGENT_FILE}") else "sandbox"

    def _below(self, table) -> dict[int, str]:
        kids = collections.defaultdict(list)
        for pid, row in table.items():
            kids[row[0]].append(pid)
        out: dict[int, str] = {}
        for pid, row in table.items():
            if row[4] != "conmon":
                continue
            key = (pid, row[3])
            if key not in self._conmons:
                self._conmons[key] = self._ours(pid)
            cid = self._conmons[key]
            if not cid:
                continue
            out[pid] = "engine"
            record = self.containers.setdefault(cid, {"conmon": _started_at(row[3])})
            frontier = [(c, True) for c in kids[pid]]
            while frontier:
                child, direct = frontier.pop()
                crow = table[child]
                if direct and not _is_agent(crow[4]):
                    kind = "engine"  # the OCI runtime creating it, podman's clean-up at its exit
                elif direct:
                    kind = "sandbox"  # the container's init: the command server
                    record.setdefault("init", _started_at(crow[3]))
                    record.setdefault("init_pid", child)
                else:
                    ckey = (child, crow[3])
                    if ckey not in self._roles:
                        self._roles[ckey] = self._role(child)
                    kind = self._roles[ckey]
                    if kind == "agent" and "agent" not in record:
                        record["agent"] = _started_at(crow[3])
                        if (index := _environ(child, "DENSITY_AGENT")) is not None:
                            record["index"] = index
                out[child] = kind
                frontier += [(g, False) for g in kids[child]]
        return out

    def _cgroup_memory(self, cid: str, init_pid: int) -> tuple[int, int, int]:
        """The container's memory cgroup: (usage, anonymous, file-backed incl. tmpfs) bytes."""
        if cid not in self._cgroups:
            self._cgroups[cid] = None
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{init_pid}/cgroup").read_text().splitlines():
                    _, controllers, path = line.split(":", 2)
                    if "memory" in controllers.split(","):
                        self._cgroups[cid] = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
                        break
                    if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
                        self._cgroups[cid] = Path("/sys/fs/cgroup") / path.lstrip("/")
        path = self._cgroups[cid]
        if path is None:
            return 0, 0, 0
        try:
            if (path / "memory.current").exists():  # v2
                usage = int((path / "memory.current").read_text())
                stat = dict(line.split() for line in (path / "memory.stat").read_text().splitlines())
                return usage, int(stat.get("anon", 0)), int(stat.get("file", 0))
            usage = int((path / "memory.usage_in_bytes").read_text())
            stat = dict(line.split() for line in (path / "memory.stat").read_text().splitlines())
            return usage, int(stat.get("total_rss", 0)), int(stat.get("total_cache", 0))
        except (OSError, ValueError):
            return 0, 0, 0

    def sample_memory(self) -> dict:
        table = _proc_table()
        below = self._below(table)
        now = time.time()
        by_kind: dict[str, list[int]] = collections.defaultdict(list)
        settled, nice = [], None
        for pid, kind in below.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                pss = _pss(proc)
                by_kind[kind].append(pss)
                if kind == "agent":
                    if now - _created(proc, now) > 1.0:
                        settled.append(pss)
                    if nice is None:
                        nice = proc.nice()
        usage = anon = file = containers = 0
        for cid, record in self.containers.items():
            if record.get("init_pid") in below:  # the container runs
                u, a, f = self._cgroup_memory(cid, record["init_pid"])
                containers += 1
                usage, anon, file = usage + u, anon + a, file + f
        return {"live": len(by_kind["agent"]), "agents_pss": sum(by_kind["agent"]), "agent_nice": nice,
                "agent_pss_median": statistics.median(settled) if settled else 0,
                "others_pss": sum(by_kind["sandbox"]), "others": len(by_kind["sandbox"]),
                "engine_pss": sum(by_kind["engine"]), "engine_procs": len(by_kind["engine"]),
                "containers": containers, "cgroup_usage": usage, "cgroup_anon": anon, "cgroup_file": file,
                "services_pss": {n: _pss(psutil.Process(pid)) for n, pid in self.services.items()
                                 if psutil.pid_exists(pid)},
                "available": mem_available(), "kernel": kernel_memory(), "shmem": shmem(),
                "sandbox_uid_tasks": tasks_of_uid(SANDBOX_UID)}


def shmem() -> int:
    """Bytes in tmpfs and shared memory (``Shmem`` of /proc/meminfo): an engine's store in /dev/shm,
    containers' /tmp."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


def tasks_of_uid(uid: int) -> int:
    """Threads of this host whose real uid is ``uid``: what RLIMIT_NPROC counts (per uid, host-wide
    for processes in the host's user namespace, as containers without a user namespace are)."""
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                status = Path(f"/proc/{entry}/status").read_text()
                fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    n += int(fields["Threads"])
    return n


def memory_figures(idle: dict, peak: dict | None) -> dict:
    """Per live agent at the peak: the agent's PSS, what else is its own (per-sandbox processes
    and the services' growth since idle), and the host's MemAvailable drop beyond the agent."""
    if not peak or not peak["live"]:
        return {}
    live = peak["live"]
    growth = sum(peak["services_pss"].get(n, 0) - v for n, v in idle["services_pss"].items())
    agent = peak["agent_pss_median"] or peak["agents_pss"] / live
    engine = peak.get("engine_pss", 0)  # docker: conmon and the engine's helpers beside each container
    out = {"live": live, "agent_nice": peak.get("agent_nice"), "agent_mb": agent / 2**20,
           "beyond_agent_mb": (peak["others_pss"] + engine + growth) / live / 2**20,
           "per_sandbox_procs_mb": peak["others_pss"] / live / 2**20, "services_growth_mb": growth / live / 2**20,
           "host_beyond_agent_mb": ((idle["available"] - peak["available"]) / live - agent) / 2**20,
           "host_per_agent_mb": (idle["available"] - peak["available"]) / live / 2**20,
           "kernel_mb": (peak["kernel"] - idle["kernel"]) / live / 2**20}
    if "containers" in peak:
        n = max(1, peak["containers"])
        engine_growth = sum(peak["services_pss"].get(k, 0) - idle["services_pss"].get(k, 0) for k in ENGINE_SERVICES
                            if k in idle["services_pss"])
        out.update({"containers": peak["containers"], "engine_procs_mb": engine / live / 2**20,
                    "engine_procs": peak["engine_procs"], "engine_service_growth_mb": engine_growth / live / 2**20,
                    "cgroup_mb": peak["cgroup_usage"] / n / 2**20, "cgroup_anon_mb": peak["cgroup_anon"] / n / 2**20,
                    "cgroup_file_mb": peak["cgroup_file"] / n / 2**20,
                    "shmem_mb": (peak["shmem"] - idle.get("shmem", peak["shmem"])) / live / 2**20,
                    "sandbox_uid_tasks": peak["sandbox_uid_tasks"],
                    "sandbox_uid_tasks_idle": idle.get("sandbox_uid_tasks", 0)})
    return out


# ------------------------------------------------------------------------------------ the two runs


def ideal(n: int, turns: int, args) -> dict:
    draws = [[latency_s(args.latency, args.sigma, args.seed, str(i), t) for t in range(turns)] for i in range(n)]
    total = sum(map(sum, draws))
    return {"slowest_agent_s": max(map(sum, draws)), "backend_bound_s": total / args.backend_limit
            if args.backend_limit else 0.0, "llm_s": total}


def path_times(calls: dict[tuple[str, int], object], agents: dict[str, list[float]],
               queued: dict[tuple[str, int], float]) -> list[float]:
    """Per call, ms: the agent's round trip less the backend's own time (with any wait inside
    it) and the proxy's queue: the path's time (transport, relay, proxy)."""
    out = []
    for agent, rtts in agents.items():
        for turn, rtt in enumerate(rtts):
            c = calls.get((agent, turn))
            if c is not None:
                out.append(rtt - (c.ended - c.arrived) * 1000 - queued.get((agent, turn), 0.0))
    return out


def run_processes(argv: list[str], envs: list[dict[str, str]]) -> tuple[list[int], float]:
    """Start ``argv`` once per environment, all at once; their exit codes and CPU seconds in all
    (``wait4``: each whole process, its exit included)."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for env in envs]
    codes, cpu = [], 0.0
    for p in procs:
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        codes.append(p.returncode)
        cpu += usage.ru_utime + usage.ru_stime
    return codes, cpu


async def run_bare(args, backend: StandInBackend, agent_dir: Path, tmp: Path) -> dict:
    env_base = {"PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1", "OPENAI_BASE_URL": backend.url, "OPENAI_API_KEY": "bare"}
    outs = [tmp / "bare" / str(i) for i in range(args.agents)]
    for o in outs:
        o.mkdir(parents=True)
    sampler = HostSampler(os.getpid(), {}, skip=(backend.proc.pid,))
    idle = sampler.sample_memory()
    envs = [{**env_base, **agent_env(i, args.turns, args.burn_ms), "DENSITY_OUT": str(outs[i])}
            for i in range(args.agents)]
    with sampler:
        t0 = time.time()
        codes, cpu_s = await asyncio.to_thread(run_processes, ["python3", str(agent_dir / AGENT_FILE)], envs)
        wall = time.time() - t0
    results = {}
    for i, o in enumerate(outs):
        with contextlib.suppress(OSError, ValueError):
            results[str(i)] = json.loads((o / "result.json").read_text())
    stats = backend.stats()
    calls = {(c.agent, c.turn): c for c in stats.calls}
    self_ms = sum(r["cpu_ms"] for r in results.values())
    return {"completed": sum(1 for i, c in enumerate(codes) if c == 0 and results.get(str(i), {}).get("answer") == "42"),
            "exit_codes": dict(collections.Counter(codes)), "wall_s": wall,
            "agents_cpu_ms": cpu_s * 1000, "agents_self_cpu_ms": self_ms,
            "agents_polled_cpu_ms": sampler.cpu_by_kind().get("agent", 0.0) * 1000,
            "agents_cpu_wait_s": sampler.agents_cpu_wait(),
            "exit_cpu_ms": (cpu_s * 1000 - self_ms) / max(1, len(results)),
            "path_ms": path_times(calls, {a: r["calls_ms"] for a, r in results.items()}, {}),
            "backend": backend_figures(stats, []), "memory": memory_figures(idle, sampler.peak),
            "phases_s": {"start -> first call": [r["sent"][0] - t0 for r in results.values() if r["sent"]],
                         "last answer -> all exited": [t0 + wall - r["sent"][-1] - r["calls_ms"][-1] / 1000
                                                       for r in results.values() if r["sent"]]}}


def backend_figures(stats, queued: list[tuple[float, float]]) -> dict:
    """The backend's most calls at once, and the seconds it served fewer than its limit while
    calls waited in the proxy's queue (``queued``: (from, to) unix seconds of each wait)."""
    events = [(c.arrived, 1, 0) for c in stats.calls] + [(c.ended, -1, 0) for c in stats.calls]
    events += [(a, 0, 1) for a, _ in queued] + [(b, 0, -1) for _, b in queued]
    events.sort()
    held = waiting = 0
    idle_waiting = at_limit = any_waiting = 0.0
    last = events[0][0] if events else 0.0
    gaps, gap = [], 0.0
    for t, d_held, d_wait in events:
        span = t - last
        if waiting > 0 and stats.limit and held < stats.limit:
            idle_waiting += span
            gap += span
        elif gap:
            gaps.append(gap)
            gap = 0.0
        if stats.limit and held >= stats.limit:
            at_limit += span
        if waiting > 0:
            any_waiting += span
        held += d_held
        waiting += d_wait
        last = t
    span = (events[-1][0] - events[0][0]) if events else 0.0
    return {"calls": len(stats.calls), "max_seen": stats.max_seen, "limit": stats.limit,
            "idle_while_queued_s": idle_waiting, "longest_idle_while_queued_ms": max(gaps + [gap], default=0) * 1000,
            "at_limit_s": at_limit, "span_s": span, "queued_s": any_waiting}


class Engine:
    """The docker provider's engine: ``url``, or (none given) Podman's Docker-API service started
    for this run by ``deploy/docker-engine.sh`` (its usual store) and stopped by its PID at the end."""

    def __init__(self, url: str, work: Path):
        self.url, self.work, self.pid = url, work, 0
        self.pidfile = work / "podman.pid"

    def __enter__(self) -> Engine:
        if not self.url:
            self.work.mkdir(parents=True, exist_ok=True)
            sock = self.work / "podman.sock"
            proc = subprocess.run(["bash", str(ENGINE_SCRIPT), "start", str(sock), str(self.pidfile)],
                                  capture_output=True, text=True, timeout=900, check=False)
            if proc.returncode != 0:
                self.__exit__()
                raise SystemExit(f"density: no Docker-API engine here: {proc.stderr.strip()[-800:]}")
            self.url, self.pid = f"unix://{sock}", int(self.pidfile.read_text())
        return self

    def __exit__(self, *exc) -> None:
        if self.pidfile.exists():
            subprocess.run(["bash", str(ENGINE_SCRIPT), "stop", str(self.pidfile)], check=False, timeout=60)

    def leftovers(self, owner: str) -> int | None:
        """Containers of ``owner`` in the engine's store, asked of ``podman`` on the store itself
        (None: not this run's engine, so its store is not known here)."""
        if not self.pid:
            return None
        proc = subprocess.run(["bash", str(ENGINE_SCRIPT), "podman", "ps", "-a", "-q", "--filter",
                               f"label=arena.owner={owner}"], capture_output=True, text=True, timeout=120, check=False)
        return len(proc.stdout.split()) if proc.returncode == 0 else None


def remove_containers(url: str, owner: str, data_dir: Path) -> int:
    """Remove every container (and network, and directory) of sandbox owner ``owner``; how many
    containers there were. Synchronous: it runs in ``finally`` however the run ends."""
    from arena_sandbox_providers import docker_provider

    client = docker_provider.connect(url)
    try:
        found = client.api.containers(all=True, filters={"label": f"arena.owner={owner}"})
        for info in found:
            sandbox_id = (info.get("Labels") or {}).get("arena.sandbox_id", "-")
            docker_provider._remove(client, info["Id"], data_dir / "docker" / owner / sandbox_id)
        for net in client.api.networks(filters={"label": f"arena.owner={owner}"}):
            with contextlib.suppress(Exception):
                client.api.remove_network(net["Id"])
        return len(found)
    finally:
        client.close()


async def run_arena(args, backend: StandInBackend, agent_dir: Path, repo: Path, tmp: Path,
                    engine: Engine | None = None) -> dict:
    rp = free_port()
    changed = {} if args.backend_limit == DEFAULT_LIMIT else {"backend_max_inflight": args.backend_limit or 100_000}
    if args.slots:
        changed["sandbox_concurrency"] = args.slots
    docker = args.provider == "docker"
    owner = f"density-{uuid.uuid4().hex[:8]}"
    provider = {"sandbox_provider": args.provider, "sandbox_owner": owner}
    if docker:
        provider["docker_url"] = engine.url
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp / "arena"), rollout_port=rp,
                        trajectory_port=free_port(), dashboard_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                        backend_url=backend.url, backend_policy_version="0", allow_host_paths=True, **provider,
                        **changed)
    wall_clock = 60 + 4 * args.turns * args.latency * max(1, args.agents / (args.backend_limit or args.agents))
    stack = Stack(settings, log=lambda m: None)
    cleanup: dict = {}
    try:
        return await _run_arena(args, backend, agent_dir, repo, settings, stack, changed, wall_clock, engine, cleanup)
    finally:
        stack.stop()
        if docker:  # whatever happened: nothing of this run's is left in the engine
            cleanup["left_after_stack_stop"] = remove_containers(engine.url, owner, Path(settings.data_dir))
            cleanup["left_after_removal"] = remove_containers(engine.url, owner, Path(settings.data_dir))
            cleanup["owner"] = owner
            if (listed := engine.leftovers(owner)) is not None:  # podman itself, on the engine's store
                cleanup["podman_ps"] = f"{listed} container(s) of the owner"


async def _run_arena(args, backend: StandInBackend, agent_dir: Path, repo: Path, settings: Settings, stack: Stack,
                     changed: dict, wall_clock: float, engine: Engine | None, cleanup: dict) -> dict:
    docker = args.provider == "docker"
    await stack.start(timeout=120)
    roots = {"nats-server": stack.nats.proc.pid, **{c.name: c.pid for c in stack.children if c.pid}}
    if docker and engine.pid:
        roots["podman"] = engine.pid
    with ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key) as client:
        task = client.prepare(waiting_task(repo, agent_dir, index=0, turns=args.turns, burn_ms=args.burn_ms,
                                           wall_clock_s=wall_clock, image=args.image if docker else None))
    bodies = [msgspec.json.encode(SubmitRolloutRequest(task=msgspec.structs.replace(
        task, agent=msgspec.structs.replace(task.agent, env=agent_env(i, args.turns, args.burn_ms))),
        provider=args.provider)) for i in range(args.agents)]
    headers = apikeys.auth_headers(stack.api_key or "")
    refused = collections.Counter()
    sampler = (ContainerSampler(settings.sandbox_owner, roots) if docker
               else HostSampler(roots["sandbox"], roots))
    idle = sampler.sample_memory()
    idle_cpu = services_cpu(roots)
    await asyncio.sleep(IDLE_S)  # the services' background use, before any load
    cpu0 = services_cpu(roots)
    idle_by = {k: (sum(cpu0[k]) - sum(v)) * 1000 / IDLE_S for k, v in idle_cpu.items() if k in cpu0}
    idle_ms_per_s = sum(idle_by.values())
    async with contextlib.AsyncExitStack() as pools_:
        # pools of 32 connections: one httpx pool of hundreds scans them all for every request
        pools = [await pools_.enter_async_context(httpx.AsyncClient(
            base_url=settings.rollout_url, timeout=600, limits=httpx.Limits(max_connections=32), headers=headers))
            for _ in range(max(1, -(-args.agents // 32)))]

        async def one(i: int) -> dict:
            http = pools[i % len(pools)]
            while True:
                got = await http.post("/v1/rollouts", content=bodies[i], headers={"content-type": "application/json"})
                if got.status_code != 429:
                    break
                refused[got.text[:80]] += 1
                await asyncio.sleep(min(float(got.headers.get("retry-after", 1)), 1.0))
            got.raise_for_status()
            rid = got.json()["rollout_id"]
            while True:
                view = (await http.get(f"/v1/rollouts/{rid}/wait", params={"timeout": 60})).json()
                if view["state"] in FINAL:
                    return view

        with sampler:
            t0 = time.time()
            views = await asyncio.gather(*(one(i) for i in range(args.agents)))
            wall = time.time() - t0
        cpu1 = services_cpu(roots)
        trajs = await fetch_trajectories(settings.trajectory_url, headers, [v["rollout_id"] for v in views])
    stats = backend.stats()
    calls = {(c.agent, c.turn): c for c in stats.calls}
    results, queued, proxy_own, ingress, egress = {}, {}, [], [], []
    running_at = {v["rollout_id"]: {h["to_state"]: h["at"] for h in v.get("history", [])} for v in views}
    starts, ends = [], []
    job_started: dict[str, float] = {}  # agent index -> unix time its sandbox job started (the worker's clock)
    for traj in trajs:
        result, key = (traj.get("sandbox") or {}).get("result") or {}, None
        for step in traj.get("steps", []):
            users = [m for m in step.get("request_messages", []) if m.get("role") == "user"]
            tag = str(users[-1].get("content", "")).split() if users else []
            key = (tag[0].removeprefix("agent="), int(tag[1].removeprefix("turn="))) if len(tag) == 2 else None
            t = step["timings"]
            if key in calls:
                c = calls[key]
                queued[key] = t["queued_ms"]
                proxy_own.append(t["total_ms"] - t["queued_ms"] - (c.ended - c.arrived) * 1000)
        if "calls_ms" in result:
            results[key[0] if key else traj["rollout_id"]] = result
            if key and (traj.get("sandbox") or {}).get("started_at"):
                job_started[key[0]] = traj["sandbox"]["started_at"]
            at = running_at.get(traj["rollout_id"], {})
            if result["sent"] and "running" in at and "verifying" in at:
                starts.append(result["sent"][0] - at["running"])  # sandbox made, agent started, its first call
                ends.append(at["verifying"] - result["sent"][-1] - result["calls_ms"][-1] / 1000)  # exit, diff
            for step in traj.get("steps", []):  # the agent's send -> the proxy's call; its end -> the agent's answer
                i = step.get("step_index", 0)
                if i < len(result["sent"]):
                    ingress.append((step["started_at"] - result["sent"][i]) * 1000)
                    egress.append(result["sent"][i] * 1000 + result["calls_ms"][i]
                                  - (step["started_at"] * 1000 + step["timings"]["total_ms"]))
    waits = [(s["started_at"], s["started_at"] + s["timings"]["queued_ms"] / 1000)
             for traj in trajs for s in traj.get("steps", []) if s["timings"]["queued_ms"] > 0]
    # a sandbox's start: its job's start (the worker took it) -> each of its processes started
    start_s: dict[str, list[float]] = collections.defaultdict(list)
    for index, at in sampler.agent_started.items():
        if index in job_started:
            start_s["job -> agent process"].append(at - job_started[index])
    for record in getattr(sampler, "containers", {}).values():
        if record.get("index") in job_started:
            for what in ("conmon", "init"):
                if what in record:
                    start_s[f"job -> {'container init' if what == 'init' else what}"].append(
                        record[what] - job_started[record["index"]])
    cpu = {name: (cpu1[name][0] - cpu0[name][0], cpu1[name][1] - cpu0[name][1]) for name in cpu1 if name in cpu0}
    states = collections.Counter(v["state"] for v in views)
    reasons = collections.Counter(f'{v["state"]}: {v.get("reason", "")[:100]}' for v in views if v["state"] != "completed")
    return {"completed": sum(1 for v in views if v["state"] == "completed" and v.get("reward") == 1.0),
            "states": dict(states), "reasons": dict(reasons.most_common(5)), "refused_429": dict(refused),
            "memory_refusals": sum(n for r, n in reasons.items() if "memory" in r.lower()), "wall_s": wall,
            "cpu_s": {k: {"own": v[0], "children": v[1]} for k, v in cpu.items()},
            "polled_cpu_s": sampler.cpu_by_kind(), "agents_cpu_wait_s": sampler.agents_cpu_wait(), "idle_cpu_ms_per_s": idle_ms_per_s, "idle_cpu_ms_per_s_by": idle_by,
            "agents_self_cpu_ms": sum(r["cpu_ms"] for r in results.values()), "agents_reported": len(results),
            "path_ms": path_times(calls, {a: r["calls_ms"] for a, r in results.items()}, queued),
            "proxy_own_ms": proxy_own, "queued_ms": list(queued.values()), "ingress_ms": ingress,
            "egress_ms": egress, "phases_s": {**phases(views), "running -> first call": starts,
                                              "last answer -> verifying": ends},
            "backend": backend_figures(stats, waits), "memory": memory_figures(idle, sampler.peak),
            "max_live": sampler.max_live, "settings_changed": changed, "sandbox_slots": settings.sandbox_slots,
            "wall_clock_s": wall_clock, "start_s": dict(start_s), "provider": args.provider,
            "image": (args.image or settings.sandbox_image) if docker else "",
            "containers_seen": len(getattr(sampler, "containers", {})), "cleanup": cleanup}


def phases(views: list[dict]) -> dict[str, list[float]]:
    """Seconds of each rollout in the queue (pending -> running), in its sandbox (running ->
    verifying) and in verification (verifying -> completed)."""
    out = collections.defaultdict(list)
    for v in views:
        at = {h["to_state"]: h["at"] for h in v.get("history", [])}
        for name, a, b in (("queue", "pending", "running"), ("sandbox", "running", "verifying"),
                           ("verify", "verifying", "completed")):
            if a in at and b in at:
                out[name].append(at[b] - at[a])
    return dict(out)


async def fetch_trajectories(url: str, headers: dict, rids: list[str]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers,
                                 limits=httpx.Limits(max_connections=16)) as http:
        gate = asyncio.Semaphore(16)

        async def one(rid: str) -> dict:
            async with gate:
                for _ in range(300):
                    got = await http.get(f"/v1/trajectories/{rid}")
                    if got.status_code == 200:
                        return got.json()
                    await asyncio.sleep(0.2)
                return {"rollout_id": rid}

        return await asyncio.gather(*(one(r) for r in rids))


# ------------------------------------------------------------------------------------ the report


def ratio(a: float, b: float | None) -> str:
    return f"x{a / b:.2f}" if b else "x -"


def report(args, arena: dict, bare: dict | None, ideal_: dict) -> list[str]:
    n, turns = args.agents, args.turns
    b = bare or {}
    lines = [f"density: {n} agents x {turns} turns, backend latency lognormal median {args.latency:g} s sigma "
             f"{args.sigma:g}, backend limit {args.backend_limit or 'none'}; {os.cpu_count()} cores, "
             f"{psutil.virtual_memory().total / 2**30:.0f} GiB; Arena settings changed: {arena['settings_changed'] or 'none'} "
             f"(sandbox slots {arena['sandbox_slots']}; task wall clock {arena['wall_clock_s']:.0f} s); provider "
             f"{arena['provider']}" + (f" (image {arena['image']})" if arena["image"] else "")]
    lines.append(f"{'':34}{'arena':>12}{'bare':>12}{'ratio':>9}")

    def row(label: str, a: float, bv: float | None, unit: str = "", fmt: str = ".1f") -> None:
        bs = f"{bv:{fmt}}" if bv is not None else "-"
        lines.append(f"{label:34}{a:>12{fmt}}{bs:>12}{ratio(a, bv):>9}  {unit}")

    row("completed (reward 1)", arena["completed"], b.get("completed"), f"of {n}", "d")
    if arena["states"].get("completed", 0) != n:
        lines.append(f"{'':34}other states: {arena['states']}; {arena['reasons']}")
    lines.append(f"{'':34}refused for memory: {arena['memory_refusals']}; submissions refused (429, retried): "
                 f"{sum(arena['refused_429'].values())} {dict(arena['refused_429']) or ''}")
    row("wall", arena["wall_s"], b.get("wall_s"), "s")
    ph = arena["phases_s"]
    lines.append(f"{'':34}per rollout, p50 / max s: " + ", ".join(
        f"{k} {pct(v, 50):.2f} / {max(v):.2f}" for k, v in ph.items() if v))
    if bare:
        lines.append(f"{'':34}bare, p50 / max s: " + ", ".join(
            f"{k} {pct(v, 50):.2f} / {max(v):.2f}" for k, v in b["phases_s"].items() if v))
    lines.append(f"{'':34}ideal: the slowest agent's LLM time {ideal_['slowest_agent_s']:.1f} s (arena "
                 f"{ratio(arena['wall_s'], ideal_['slowest_agent_s'])}, bare "
                 f"{ratio(b['wall_s'], ideal_['slowest_agent_s']) if bare else '-'}); the backend's bound "
                 f"(all LLM time / limit) {ideal_['backend_bound_s']:.1f} s")
    # CPU. Arena's: each service's own and its waited-for children's (the sandbox service's:
    # the sandboxes' outer bwrap, git), plus what the sampler saw of the processes deeper in each
    # sandbox but the agent (bwrap's inner init). The agents': what each measured of itself, plus
    # its exit as the bare run measured it (getrusage of the waited processes less the same report).
    cpu, polled = arena["cpu_s"], arena["polled_cpu_s"]
    services_ms = sum(v["own"] + v["children"] for v in cpu.values()) * 1000
    inner_ms = polled.get("sandbox", 0.0) * 1000
    engine_ms = polled.get("engine", 0.0) * 1000  # docker: conmon, the OCI runtime, podman's clean-up
    platform = services_ms + inner_ms + engine_ms
    exit_ms = b.get("exit_cpu_ms", 0.0)
    agents_ms = arena["agents_self_cpu_ms"] + exit_ms * arena["agents_reported"]
    bare_agents = b.get("agents_cpu_ms")
    row("Arena CPU beyond agents / turn", platform / (n * turns), bare_agents / (n * turns) if bare else None,
        "ms (bare column: the bare agent's own CPU per turn)")
    row("Arena CPU beyond agents / rollout", platform / n, bare_agents / n if bare else None,
        "ms (bare column: the bare agent's own CPU)")
    row("agents' own CPU / rollout", agents_ms / max(1, arena["agents_reported"]),
        bare_agents / n if bare else None, f"ms (self-reported + {exit_ms:.1f} ms exit from the bare run; "
        f"sampled {polled.get('agent', 0) * 1000 / n:.1f})")
    row("agents' wait for a CPU / rollout", arena["agents_cpu_wait_s"] / n, b["agents_cpu_wait_s"] / n if bare else None,
        "s (runnable, not running: /proc/<pid>/schedstat as last sampled)", ".2f")
    parts = ", ".join(f"{k} {(v['own']) * 1000 / n:.1f}" + (f" (+children {v['children'] * 1000 / n:.1f})"
                                                             if v["children"] * 1000 / n >= 0.05 else "")
                      for k, v in sorted(cpu.items(), key=lambda kv: -(kv[1]["own"] + kv[1]["children"])))
    beside = (f"(sampled: the command server and the relay's shim); conmon and the engine's helpers beside each "
              f"container {engine_ms / n:.1f} (sampled)" if arena["provider"] == "docker" else
              f"(sampled; the outer bwrap sampled {polled.get('direct', 0) * 1000 / n:.1f}, in the sandbox "
              f"service's children)")
    lines.append(f"{'':34}per rollout, ms: {parts}; inside the sandboxes but the agent {inner_ms / n:.1f} "
                 f"{beside}; the services idle use {arena['idle_cpu_ms_per_s']:.0f} ms/s ("
                 + ", ".join(f"{k} {v:.0f}" for k, v in sorted(arena["idle_cpu_ms_per_s_by"].items(), key=lambda kv: -kv[1])
                             if v >= 1) + "), "
                 f"{arena['idle_cpu_ms_per_s'] * arena['wall_s'] / n:.1f} ms per rollout over this wall time")
    pa, pb = arena["path_ms"], b.get("path_ms")
    for q in (50, 99):
        row(f"path time per call p{q}", pct(pa, q), pct(pb, q) if pb else None,
            "ms (agent's round trip - backend's own - queue)")
    for q in (50, 99):
        row(f"proxy's own time per call p{q}", pct(arena["proxy_own_ms"], q), None,
            "ms (step total - queued - backend's own)")
    lines.append(f"{'':34}the agent's send -> the proxy's call p50 {pct(arena['ingress_ms'], 50):.1f} ms, p99 "
                 f"{pct(arena['ingress_ms'], 99):.1f} ms; the proxy's end -> the agent's answer p50 "
                 f"{pct(arena['egress_ms'], 50):.1f} ms, p99 {pct(arena['egress_ms'], 99):.1f} ms (relay and proxy I/O)")
    lines.append(f"{'':34}proxy queue per call p50 {pct(arena['queued_ms'], 50):.0f} ms, p99 "
                 f"{pct(arena['queued_ms'], 99):.0f} ms, max {max(arena['queued_ms'], default=0):.0f} ms")
    ba, bb = arena["backend"], b.get("backend", {})
    row("backend: most calls at once", ba["max_seen"], bb.get("max_seen"), f"(limit {ba['limit'] or 'none'}; "
        "bare: waiting inside the backend included)", "d")
    lines.append(f"{'':34}backend below its limit while calls queued in the proxy: {ba['idle_while_queued_s']:.2f} s "
                 f"of the {ba['queued_s']:.1f} s with calls queued (longest {ba['longest_idle_while_queued_ms']:.0f} ms); at its limit {ba['at_limit_s']:.1f} s of "
                 f"{ba['span_s']:.1f} s (bare {bb.get('at_limit_s', 0):.1f} s of {bb.get('span_s', 0):.1f} s)")
    ma, mb = arena["memory"], b.get("memory", {})
    starts = arena.get("start_s", {})
    for what, values in starts.items():
        if values:
            lines.append(f"{'':34}sandbox start, {what}: p50 {pct(values, 50):.2f} s, p99 {pct(values, 99):.2f} s, "
                         f"max {max(values):.2f} s ({len(values)} sandboxes)")
    if ma and "containers" in ma:
        row("memory per container, whole", ma["agent_mb"] + ma["beyond_agent_mb"] + ma["kernel_mb"],
            (mb["agent_mb"] + mb["kernel_mb"]) if mb else None,
            f"MB at {ma['live']} live: the agent's PSS {ma['agent_mb']:.2f} + in the container but the agent "
            f"{ma['per_sandbox_procs_mb']:.2f} + conmon {ma['engine_procs_mb']:.2f} + services' growth "
            f"{ma['services_growth_mb']:.2f} (podman's {ma['engine_service_growth_mb']:.2f}) + kernel {ma['kernel_mb']:.2f} "
            f"(bare column: the bare agent's PSS + the kernel's per bare agent)", ".2f")
        row("container's memory cgroup", ma["cgroup_mb"], mb.get("agent_mb"),
            f"MB per container at {ma['containers']} running (usage: anon {ma['cgroup_anon_mb']:.2f}, file and tmpfs "
            f"{ma['cgroup_file_mb']:.2f}; bare column: the bare agent's PSS)", ".2f")
        row("host MemAvailable drop / container", ma["host_per_agent_mb"], mb.get("host_per_agent_mb"),
            f"MB (bare: per bare agent; noisy on a shared host; tmpfs growth {ma['shmem_mb']:.2f} MB per container)", ".2f")
        lines.append(f"{'':34}sandbox uid {SANDBOX_UID}'s threads on the host at the peak: {ma['sandbox_uid_tasks']} "
                     f"({ma['sandbox_uid_tasks_idle']} before; RLIMIT_NPROC counts them all against each container's "
                     f"nproc ulimit); {ma['engine_procs']} engine processes beside {ma['containers']} containers")
    if ma:
        row("memory per live sandbox beyond agent", ma["beyond_agent_mb"] + ma["kernel_mb"],
            mb.get("kernel_mb"), f"MB at {ma['live']} live: PSS of the per-sandbox processes "
            f"{ma['per_sandbox_procs_mb']:.2f}" + (f" + conmon {ma['engine_procs_mb']:.2f}" if "containers" in ma else "")
            + f" + services' growth {ma['services_growth_mb']:.2f} + kernel "
            f"{ma['kernel_mb']:.2f} (bare column: the kernel's per bare agent)", ".2f")
        row("agent's own PSS", ma["agent_mb"], mb.get("agent_mb"), f"MB (bare at {mb.get('live', 0)} live)", ".2f")
        row("kernel memory per live agent", ma["kernel_mb"], mb.get("kernel_mb"),
            "MB (slab, kernel stacks, page tables; the host's, so others' work shows too)", ".2f")
        row("host MemAvailable drop beyond agent", ma["host_beyond_agent_mb"], mb.get("host_beyond_agent_mb"),
            "MB per live agent (kernel objects included; noisy on a shared host)", ".2f")
    lines.append(f"{'':34}most live sandboxes seen: {arena['max_live']}; the agents' nice level: arena "
                 f"{ma.get('agent_nice')}, bare {mb.get('agent_nice')}")
    if arena.get("cleanup"):
        c = arena["cleanup"]
        lines.append(f"{'':34}containers: {arena['containers_seen']} seen; of owner {c.get('owner')}, "
                     f"{c.get('left_after_stack_stop')} left when the stack had stopped (removed), "
                     f"{c.get('left_after_removal')} after; podman ps -a on the engine's store: "
                     f"{c.get('podman_ps', 'not asked (an engine of its own)')}")
    return lines


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=256)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--latency", type=float, default=2.0, help="the backend's median latency, seconds")
    ap.add_argument("--sigma", type=float, default=0.5, help="the lognormal's sigma")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend-limit", type=int, default=DEFAULT_LIMIT,
                    help="calls the backend serves at once, and the proxy's bound (0: none)")
    ap.add_argument("--burn-ms", type=float, default=0.0, help="CPU ms each agent spends per turn (saturate the cores)")
    ap.add_argument("--provider", default="local", choices=("local", "docker"))
    ap.add_argument("--docker-url", default=os.environ.get("ARENA_TEST_DOCKER_URL", ""),
                    help="docker provider: the Docker-API engine ('': start Podman's for the run, stopped after)")
    ap.add_argument("--image", default="", help="docker provider: the sandbox image ('': the provider's default, "
                    "arena/agent-base); it needs python3 with its stdlib")
    ap.add_argument("--slots", type=int, default=0, help="ARENA_SANDBOX_CONCURRENCY (0: Arena's default)")
    ap.add_argument("--skip-bare", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the raw figures as JSON too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="arena-density-") as tmp_:
        tmp = Path(tmp_)
        agent_dir = write_agent(tmp / "agent")
        repo = tmp / "repo"
        repo.mkdir()
        (repo / "README.md").write_text("a task whose agent mostly waits\n")
        with StandInBackend(free_port(), median_s=args.latency, sigma=args.sigma, seed=args.seed,
                            limit=args.backend_limit, log=tmp / "backend.log") as backend:
            bare = None
            if not args.skip_bare:
                bare = await run_bare(args, backend, agent_dir, tmp)
                backend.reset()
            if args.provider == "docker":
                with Engine(args.docker_url, tmp / "engine") as engine:
                    arena = await run_arena(args, backend, agent_dir, repo, tmp, engine)
            else:
                arena = await run_arena(args, backend, agent_dir, repo, tmp)
    print("\n".join(report(args, arena, bare, ideal(args.agents, args.turns, args))))
    if args.json:
        print(json.dumps({"args": vars(args), "arena": arena, "bare": bare}, default=str))


if __name__ == "__main__":
    # stopped with SIGTERM as with ^C: the stack, the run's containers and its engine are cleaned up alike
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    asyncio.run(main())
