"""Added latency and throughput of Arena's LLM proxy (capture on) vs LiteLLM's proxy.

One run, one machine, the same fixed-latency fake backend (``arena_stack.scripted_llm``,
vLLM-shaped) behind both:

- direct: client -> backend (the baseline)
- arena: client -> rollout service proxy (``python -m arena_rollout``, NATS JetStream,
  every call captured as a Step and published) -> backend
- floor-uvicorn, floor-aiohttp: client -> a bare pass-through proxy from the libraries
  Arena's proxy uses (``passthrough_proxy.py``: aiohttp's client behind uvicorn or
  aiohttp.web; no key, budget or capture) -> backend: what the libraries alone cost
- litellm: client -> ``litellm --config`` (``litellm[proxy]`` from PyPI, installed by
  this script into its own venv, ``.arena/bench-litellm``) -> backend

Each proxy is measured on each client API it serves (``--apis``): OpenAI chat (the floors
pass it through), the OpenAI Responses API and the Gemini API (both translated to the
backend's chat completions, by Arena and by LiteLLM alike).

Added latency = proxy p50/p99 minus direct p50/p99, from sequential calls to the proxy
and straight to the backend in turn (interleaved, so a change in machine load hits both
alike); each proxy runs alone (Arena is stopped before LiteLLM starts). Max RPS =
completed calls per second at a fixed concurrency for a fixed time; RPS per core =
calls per CPU-second the proxy's processes used during that run (read from /proc).

Run: ``.venv/bin/python benchmarks/proxy_overhead.py [--latency-ms 20] [--seconds 8] [--apis chat,responses,gemini]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".arena" / "bench-litellm"
LITELLM_KEY = "sk-arena-bench-" + os.urandom(16).hex()
CONTENT = "The middle pair is ordered[mid - 1] and ordered[mid]; fixed."  # ~60 tokens


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_litellm() -> Path:
    exe = VENV / "bin" / "litellm"
    if exe.exists():
        return exe
    print(f"installing litellm[proxy] into {VENV} (one time) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(VENV / "bin" / "pip"), "install", "--quiet", "litellm[proxy]"], check=True)
    return exe


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def cpu_seconds(pid: int) -> float:
    """utime+stime of ``pid`` and all its descendants, seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(times.get(p, 0.0) for p in tree)


#: the client APIs measured, each a route below a proxy's root
APIS = ("chat", "responses", "gemini")


def route(api: str, stream: bool) -> str:
    if api == "responses":
        return "/v1/responses"
    if api == "gemini":
        return "/v1beta/models/scripted:" + ("streamGenerateContent?alt=sse" if stream else "generateContent")
    return "/v1/chat/completions"


def body(stream: bool, api: str = "chat") -> dict:
    """The same request (one user message, at most 128 tokens) in each API's shape."""
    if api == "responses":
        return {"model": "scripted", "input": "fix the median", "max_output_tokens": 128, "stream": stream}
    if api == "gemini":  # whether it streams is the route's
        return {"contents": [{"role": "user", "parts": [{"text": "fix the median"}]}],
                "generationConfig": {"maxOutputTokens": 128}}
    return {"model": "scripted", "messages": [{"role": "user", "content": "fix the median"}], "max_tokens": 128,
            "stream": stream}


async def one(client: httpx.AsyncClient, url: str, headers: dict, stream: bool, api: str = "chat") -> float:
    """One call; ``url`` is the proxy's root for an API other than chat (its route is added)."""
    if api != "chat":
        url += route(api, stream)
    t0 = time.perf_counter()
    if stream:
        async with client.stream("POST", url, json=body(True, api), headers=headers) as resp:
            resp.raise_for_status()
            async for _ in resp.aiter_raw():
                pass
    else:
        resp = await client.post(url, json=body(False, api), headers=headers)
        resp.raise_for_status()
    return (time.perf_counter() - t0) * 1000


async def latency(targets: list[tuple[str, dict]], stream: bool, n: int, api: str = "chat") -> list[list[float]]:
    """``n`` sequential calls to each target, interleaved (direct, arena, litellm, direct, ...),
    so that every target sees the same machine: a drift in load between separate runs
    would otherwise show up as added latency."""
    def api_of(i: int) -> str:  # the first target is the backend itself: chat
        return "chat" if i == 0 else api

    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(10):
            for i, (url, headers) in enumerate(targets):
                await one(client, url, headers, stream, api_of(i))
        out: list[list[float]] = [[] for _ in targets]
        for _ in range(n):
            for i, (url, headers) in enumerate(targets):
                out[i].append(await one(client, url, headers, stream, api_of(i)))
        return out


async def throughput(url: str, headers: dict, stream: bool, seconds: float, concurrency: int,
                     pids: list[int], api: str = "chat") -> tuple[float, float | None, int]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        done = errors = 0
        first_error: list[str] = []
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < stop_at:
                try:
                    await one(client, url, headers, stream, api)
                    done += 1
                except httpx.HTTPError as exc:
                    errors += 1
                    if not first_error:
                        first_error.append(f"{type(exc).__name__}: {exc}")

        cpu0 = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        cpu = (sum(cpu_seconds(p) for p in pids) - cpu0) if pids else None
    if first_error:
        print(f"  first error against {url}: {first_error[0][:300]}", flush=True)
    return done / elapsed, (done / cpu if cpu else None), errors


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def start_arena(tmp: Path, backend_url: str) -> tuple[list, str, dict]:
    from arena_stack.natsserver import NatsServer

    from arena_stack import topology

    nats = NatsServer(tmp / "nats").start()
    asyncio.run(topology.create(nats.url))  # the streams and buckets, as `arena up` makes them first
    port = free_port()
    env = {**os.environ, "ARENA_NATS_URL": nats.url, "ARENA_ROLLOUT_PORT": str(port), "ARENA_BACKEND_URL": backend_url,
           "ARENA_PUBLIC_URL": f"http://127.0.0.1:{port}", "ARENA_DATA_DIR": str(tmp / "data"),
           "ARENA_LOG_LEVEL": "WARNING", "ARENA_BACKEND_MAX_INFLIGHT": "1024",
           "ARENA_ALLOW_HOST_PATHS": "1",  # the benchmark's task names a local directory
           "ARENA_AUTH": "off"}  # the proxy's overhead is measured (it takes the rollout's key), not the API's
    proc = subprocess.Popen([sys.executable, "-m", "arena_rollout"], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "arena.log", "wb"))
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/healthz", proc, 60)
    repo = tmp / "repo"
    repo.mkdir()
    task = {"id": "bench", "repo": str(repo), "instructions": "bench", "agent": {"command": ["true"]},
            "verifier": {"type": "tests", "fail_to_pass": ["t::x"]}, "budget": {"wall_clock_s": 3600}}
    asyncio.run(_announce_worker(nats.url))
    answer = httpx.post(base + "/v1/rollouts", json={"task": task}, timeout=10)
    if answer.status_code != 201:
        raise RuntimeError(f"cannot submit the benchmark rollout: {answer.status_code} {answer.text}")
    rid = answer.json()["rollout_id"]
    key = asyncio.run(_rollout_key(nats.url, rid))
    return [proc, nats], f"{base}/proxy/{rid}", {"authorization": f"Bearer {key}"}


async def _announce_worker(nats_url: str) -> None:
    """A stand-in sandbox worker's entry, so the benchmark rollout is accepted (no sandbox
    runs: the benchmark is the rollout's agent)."""
    from arena_core.bus import Bus
    from arena_core.workers import Advertiser

    bus = await Bus.connect(nats_url, "bench")
    try:
        await Advertiser(bus, ["local"], owner="bench", slots=1).announce()
    finally:
        await bus.close()


async def _rollout_key(nats_url: str, rid: str) -> str:
    """The benchmark rollout marked running (as its sandbox's start would) and its key."""
    from arena_core import subjects
    from arena_core.bus import Bus
    from arena_core.schemas import RolloutState
    from arena_rollout.store import RolloutStore
    import msgspec

    bus = await Bus.connect(nats_url, "bench")
    try:
        store = RolloutStore(await bus.kv(subjects.KV_ROLLOUTS))
        record, _ = await store.update(rid, lambda r: msgspec.structs.replace(r, state=RolloutState.RUNNING))
        return record.api_key
    finally:
        await bus.close()


def start_litellm(tmp: Path, backend_url: str) -> tuple[subprocess.Popen, str]:
    exe = ensure_litellm()
    port = free_port()
    config = tmp / "litellm.yaml"
    config.write_text(json.dumps({
        "model_list": [{"model_name": "scripted", "litellm_params": {
            # custom_openai: an OpenAI-compatible server reached through LiteLLM's chat completions
            # for every client API (its openai/ and hosted_vllm/ providers send a Responses call
            # on to the backend's own /responses, which vLLM serves and the stand-in does not)
            "model": "custom_openai/scripted", "api_base": backend_url, "api_key": "none"}}],
        "litellm_settings": {"telemetry": False, "drop_params": True},
    }))
    env = {**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "HOME": str(tmp),
           "LITELLM_MASTER_KEY": LITELLM_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = subprocess.Popen([str(VENV / "bin" / "python"), str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                             "--num_workers", "1"], env=env, stdout=open(tmp / "litellm.log", "wb"),
                            stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, 180)
    return proc, f"http://127.0.0.1:{port}"


#: the floors measured: a bare pass-through on each server (``passthrough_proxy.py``)
FLOORS = ("uvicorn", "aiohttp")


def start_floor(server: str, backend_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "passthrough_proxy.py"), server, str(port),
                             backend_url], stdout=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, 30)
    return proc, f"http://127.0.0.1:{port}/v1/chat/completions"


def stop(proc) -> None:
    if hasattr(proc, "stop"):
        proc.stop()
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency-ms", type=float, default=20.0, help="fixed backend latency")
    ap.add_argument("--requests", type=int, default=300, help="sequential calls per latency run")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each throughput run")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--apis", default=",".join(APIS),
                    help=f"client APIs to measure the proxies on, comma-separated ({', '.join(APIS)})")
    ap.add_argument("--no-litellm", action="store_true", help="measure Arena and the floors only")
    args = ap.parse_args()
    apis = [a for a in args.apis.split(",") if a]
    if not apis or any(a not in APIS for a in apis):
        raise SystemExit(f"--apis: choose among {', '.join(APIS)}")
    tmp = Path(tempfile.mkdtemp(prefix="arena-bench-"))
    script = tmp / "script.json"
    script.write_text(json.dumps({"responses": [{"label": "a", "content": CONTENT}]}))
    bport = free_port()
    backend = subprocess.Popen([sys.executable, "-m", "arena_stack.scripted_llm", "--script", str(script), "--port",
                                str(bport), "--latency-ms", str(args.latency_ms), "--chunk-tokens", "4"],
                               stdout=subprocess.DEVNULL, stderr=open(tmp / "backend.log", "wb"))
    procs: list = [backend]
    backend_url = f"http://127.0.0.1:{bport}/v1"
    results: dict[str, dict] = {}
    litellm_error = None
    direct_url = backend_url + "/chat/completions"

    def measure(name: str, root: str, headers: dict, pids: list[int], only: tuple[str, ...] = APIS) -> None:
        """``name`` on each API asked for that it serves; ``root``: the proxy's root (below
        which each API's route is)."""
        for api in (a for a in apis if a in only):
            url = root + route("chat", False) if api == "chat" else root
            label = name if api == "chat" else f"{name}:{api}"
            measure_one(label, url, headers, pids, api)

    def measure_one(name: str, url: str, headers: dict, pids: list[int], api: str) -> None:
        for stream in (False, True):
            mode = "stream" if stream else "whole"
            base, lat = asyncio.run(latency([(direct_url, {}), (url, headers)], stream, args.requests, api))
            rps, per_core, errors = asyncio.run(throughput(url, headers, stream, args.seconds,
                                                           args.concurrency, pids, api))
            results[f"{name}/{mode}"] = {"p50": statistics.median(lat), "p99": pct(lat, 0.99),
                                         "base_p50": statistics.median(base), "base_p99": pct(base, 0.99),
                                         "rps": rps, "per_core": per_core, "errors": errors}
            print(f"  measured {name:16s} {mode:6s} p50 {statistics.median(lat):7.2f} ms (direct "
                  f"{statistics.median(base):.2f} ms in the same run)  rps {rps:7.1f}", flush=True)

    try:
        wait_http(backend_url + "/models", backend, 30)
        for stream in (False, True):
            rps, _, _ = asyncio.run(throughput(direct_url, {}, stream, args.seconds, args.concurrency, []))
            results["direct/" + ("stream" if stream else "whole")] = {"rps": rps}
        # the floor: a bare pass-through from the same libraries (no key, budget or capture)
        for server in FLOORS:
            floor_proc, floor_url = start_floor(server, backend_url)
            procs.append(floor_proc)
            measure(f"floor-{server}", floor_url.removesuffix(route("chat", False)), {}, [floor_proc.pid],
                    only=("chat",))
            stop(floor_proc)
            procs.remove(floor_proc)
        # one proxy at a time, so neither's background work (LiteLLM's logging and spend
        # tracking, Arena's step recording) lands on the other's measurement
        arena_procs, arena_url, arena_headers = start_arena(tmp, backend_url)
        procs += arena_procs
        # Arena's CPU includes its nats-server: capture is part of the cost
        measure("arena", arena_url, arena_headers, [arena_procs[0].pid, arena_procs[1].proc.pid])
        for proc in reversed(arena_procs):
            stop(proc)
            procs.remove(proc)
        if not args.no_litellm:
            try:
                litellm_proc, litellm_url = start_litellm(tmp, backend_url)
                procs.append(litellm_proc)
            except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
                litellm_error = str(exc)
            else:
                headers = {"authorization": f"Bearer {LITELLM_KEY}", "x-goog-api-key": LITELLM_KEY}
                measure("litellm", litellm_url, headers, [litellm_proc.pid])
    finally:
        for p in reversed(procs):
            stop(p)
    print()
    print(f"backend fixed latency {args.latency_ms:g} ms; {args.requests} sequential calls for latency; "
          f"{args.seconds:g} s at concurrency {args.concurrency} for throughput; {os.cpu_count()} cores (shared); "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    print(f"{'mode':7s} {'proxy':21s} {'added p50 ms':>13s} {'added p99 ms':>13s} {'max rps':>9s} "
          f"{'rps/core':>9s} {'errors':>7s}")
    suffixes = ["" if a == "chat" else f":{a}" for a in apis]
    for mode in ("whole", "stream"):
        print(f"{mode:7s} {'direct':21s} {'':>13s} {'':>13s} {results[f'direct/{mode}']['rps']:9.1f}")
        for name in ("arena", *(f"floor-{f}" for f in FLOORS), "litellm"):
            for suffix in suffixes:
                r = results.get(f"{name}{suffix}/{mode}")
                if r is None:
                    continue
                per_core = f"{r['per_core']:9.1f}" if r["per_core"] else f"{'n/a':>9s}"
                print(f"{mode:7s} {name + suffix:21s} {r['p50'] - r['base_p50']:13.2f} "
                      f"{r['p99'] - r['base_p99']:13.2f} {r['rps']:9.1f} {per_core} {r['errors']:7d}")
        for suffix in suffixes:
            a, l = results.get(f"arena{suffix}/{mode}"), results.get(f"litellm{suffix}/{mode}")
            if a and l:
                added_a, added_l = a["p50"] - a["base_p50"], l["p50"] - l["base_p50"]
                print(f"{mode:7s} ratio {'(' + (suffix[1:] or 'chat') + ')':11s} arena/litellm added p50 "
                      f"{added_a / added_l if added_l > 0 else float('nan'):.2f}; rps x{a['rps'] / l['rps']:.2f}"
                      + (f"; rps/core x{a['per_core'] / l['per_core']:.2f}" if a["per_core"] and l["per_core"]
                         else ""))
    for mode in ("whole", "stream"):
        a, f = results.get(f"arena/{mode}"), results.get(f"floor-uvicorn/{mode}")
        if a and f:
            print(f"{mode:7s} arena over its libraries' bare pass-through (uvicorn + aiohttp): "
                  f"{(a['p50'] - a['base_p50']) - (f['p50'] - f['base_p50']):+.2f} ms p50")
    if litellm_error:
        print(f"litellm could not be run: {litellm_error} (log: {tmp / 'litellm.log'})")
    shutil.rmtree(tmp, ignore_errors=True) if not litellm_error else None


if __name__ == "__main__":
    main()
