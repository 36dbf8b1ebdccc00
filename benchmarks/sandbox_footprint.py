"""What one waiting sandbox costs beyond its agent: memory, file descriptors and CPU while it waits.

N local sandboxes (bubblewrap, each with its proxy relay listening in its own network namespace,
as the sandbox service runs them) each run the same agent: a Python program that has imported
what an agent imports (``json``, ``urllib.request``) and waits, as an agent waits on its LLM.
Beside it, in the same run, the same agent as N bare processes. Printed, per sandbox:

- the processes Arena adds around the agent (the two ``bwrap`` processes), proportional set size;
- the agent's own process, in the sandbox and bare (the ratio shows what the sandbox adds to it);
- what the service (this process: the provider, the relays, the per-sandbox bookkeeping) grows by,
  in resident memory and open file descriptors;
- the service's CPU while every agent waits (nothing per sandbox should poll), beside the bare run's.

``.venv/bin/python benchmarks/sandbox_footprint.py --sandboxes 64 --wait 10``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from arena_sandbox_providers import local
from arena_sandbox_providers.local import ProxyForward
from arena_sandbox_providers.local_provider import LocalProvider
from arena_sandbox_providers.provider import CreateSpec

AGENT = "import json, urllib.request, time, sys; print('ready', flush=True); time.sleep(float(sys.argv[1]))"


def _children(root: int) -> list[int]:
    """Every descendant of ``root``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _until_ready(outputs: list[bytearray], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while sum(b"ready" in o for o in outputs) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {sum(b'ready' in o for o in outputs)} of {n} agents started in {timeout:.0f} s")
        await asyncio.sleep(0.2)


def _measure(kind: str, agents: list[int], platform: list[int]) -> dict:
    return {"kind": kind, "agent_pss_kib": statistics.mean(_pss_kib(p) for p in agents) if agents else 0,
            "platform_pss_kib": sum(_pss_kib(p) for p in platform)}


async def arena_run(n: int, wait_s: float, data_dir: Path) -> dict:
    provider = LocalProvider(data_dir=data_dir, owner="footprint")
    # a proxy address nothing answers on: the agents never call it, the relays still listen
    proxy = ProxyForward(host="127.0.0.1", port=9, sandbox_port=18080, routes="/proxy/r-footprint")
    rss0, fds0 = _rss_kib(), _fds()
    sandboxes = [await provider.create(CreateSpec()) for _ in range(n)]
    outputs = [bytearray() for _ in range(n)]
    hold = wait_s + 120
    runs = [asyncio.create_task(s.exec(["python3", "-c", AGENT, str(hold)], env={}, timeout_s=hold + 60, proxy=proxy,
                                       on_output=outputs[i].extend))
            for i, s in enumerate(sandboxes)]
    await _until_ready(outputs, n, timeout=120 + n)
    await asyncio.sleep(1.0)
    rss1, fds1 = _rss_kib(), _fds()
    procs = _children(os.getpid())
    agents = [p for p in procs if _comm(p).startswith("python")]
    platform = [p for p in procs if p not in agents]
    figures = _measure("arena", agents, platform)
    cpu0, t0 = _cpu_s(), time.monotonic()
    await asyncio.sleep(wait_s)
    cpu = _cpu_s() - cpu0
    figures.update(service_rss_kib=(rss1 - rss0) / n, service_fds=(fds1 - fds0) / n,
                   service_cpu_ms_per_s=cpu * 1000 / (time.monotonic() - t0), platform_procs=len(platform) / n,
                   agents=len(agents))
    for r in runs:
        r.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
    for s in sandboxes:
        await s.destroy()
    return figures


async def bare_run(n: int, wait_s: float) -> dict:
    hold = wait_s + 120
    procs = [await asyncio.create_subprocess_exec(sys.executable, "-c", AGENT, str(hold),
                                                  stdout=asyncio.subprocess.PIPE) for _ in range(n)]
    for p in procs:
        await p.stdout.readline()
    await asyncio.sleep(1.0)
    figures = _measure("bare", [p.pid for p in procs], [])
    cpu0, t0 = _cpu_s(), time.monotonic()
    await asyncio.sleep(wait_s)
    figures.update(service_rss_kib=0, service_fds=0, platform_procs=0, agents=n,
                   service_cpu_ms_per_s=(_cpu_s() - cpu0) * 1000 / (time.monotonic() - t0))
    for p in procs:
        p.kill()
        await p.wait()
    return figures


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=64)
    ap.add_argument("--wait", type=float, default=10.0, help="seconds the agents wait while the CPU is measured")
    args = ap.parse_args()
    if local.available() is not None:
        raise SystemExit(f"no bubblewrap here: {local.available()}")
    n = args.sandboxes
    bare = await bare_run(n, args.wait)
    with tempfile.TemporaryDirectory(prefix="arena-footprint-") as tmp:
        arena = await arena_run(n, args.wait, Path(tmp))
    mib = 1024
    beyond = arena["platform_pss_kib"] / n + arena["service_rss_kib"]
    print(f"{n} waiting agents, {args.wait:.0f} s measured")
    print(f"  agent process (PSS):          bare {bare['agent_pss_kib'] / mib:6.2f} MiB   "
          f"in a sandbox {arena['agent_pss_kib'] / mib:6.2f} MiB   ratio {arena['agent_pss_kib'] / bare['agent_pss_kib']:.2f}")
    print(f"  sandbox processes (bwrap):    {arena['platform_pss_kib'] / n / mib:6.2f} MiB per sandbox "
          f"({arena['platform_procs']:.1f} processes)")
    print(f"  service growth:               {arena['service_rss_kib'] / mib:6.2f} MiB RSS, "
          f"{arena['service_fds']:.1f} file descriptors per sandbox")
    print(f"  beyond the agent's own:       {beyond / mib:6.2f} MiB per sandbox "
          f"(ratio to the bare agent's PSS {beyond / bare['agent_pss_kib']:.2f})")
    print(f"  service CPU while they wait:  {arena['service_cpu_ms_per_s']:6.2f} ms/s "
          f"(bare harness {bare['service_cpu_ms_per_s']:.2f} ms/s; "
          f"{arena['service_cpu_ms_per_s'] / n * 1000:.1f} us/s per sandbox)")


if __name__ == "__main__":
    asyncio.run(main())
