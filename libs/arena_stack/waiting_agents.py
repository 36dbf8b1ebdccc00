"""A workload of agents that mostly wait on their LLM, for density benchmarks and tests.

``AGENT_PROGRAM``: a stdlib agent making one chat call per turn, then writing the answer an
``exact`` verifier grades. ``StandInBackend``: a vLLM-shaped backend (``ScriptedLLM``'s answers)
whose latency is lognormal, serving at most ``limit`` calls at once (more wait inside it, as in
vLLM) and recording every call. Run alone: ``python -m arena_stack.waiting_agents --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
from aiohttp import web

from arena_core.schemas import AgentSpec, Budget, ExactVerifier, PathSource, Task
from arena_stack.scripted_llm import Script, ScriptedLLM, ScriptedResponse

ANSWER = "42"

#: The agent: DENSITY_TURNS chat calls (its history growing), the last answer in result.json
#: with its calls' send times and round trips and its own CPU time (``getrusage`` just before it ends).
AGENT_PROGRAM = r'''
import json, os, resource, time, urllib.request
url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
headers = {"content-type": "application/json", "authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", "")}
who, turns = os.environ["DENSITY_AGENT"], int(os.environ["DENSITY_TURNS"])
burn = float(os.environ.get("DENSITY_BURN_MS", "0")) / 1000
out = os.environ.get("DENSITY_OUT", "/sandbox/.arena")
messages, calls, sent, answer = [], [], [], ""
for turn in range(turns):
    if burn:  # the agent's own work between calls (a tool run), on the CPU
        until = time.process_time() + burn
        while time.process_time() < until:
            pass
    messages.append({"role": "user", "content": f"agent={who} turn={turn}"})
    body = json.dumps({"model": "default", "max_tokens": 16, "messages": messages}).encode()
    sent.append(time.time())
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=3600) as resp:
        answer = json.load(resp)["choices"][0]["message"].get("content") or ""
    calls.append((time.perf_counter() - t0) * 1000)
    messages.append({"role": "assistant", "content": answer})
r = resource.getrusage(resource.RUSAGE_SELF)
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump({"answer": answer.strip(), "calls_ms": calls, "sent": sent, "cpu_ms": (r.ru_utime + r.ru_stime) * 1000}, f)
open(os.path.join(out, "done"), "w").close()
'''

AGENT_FILE = "agent.py"
_TAG = re.compile(r"agent=(\S+) turn=(\d+)")


def write_agent(directory: Path) -> Path:
    """``directory`` holding the agent program as ``agent.py`` (and a task's workspace README)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / AGENT_FILE).write_text(AGENT_PROGRAM)
    return directory


def agent_env(index: int, turns: int, burn_ms: float = 0.0) -> dict[str, str]:
    return {"DENSITY_AGENT": str(index), "DENSITY_TURNS": str(turns), "DENSITY_BURN_MS": f"{burn_ms:g}"}


def waiting_task(repo: Path, agent_dir: Path, *, index: int, turns: int, burn_ms: float = 0.0,
                 wall_clock_s: float = 600.0, image: str | None = None) -> Task:
    """Agent ``index``'s task (its index and turns in its environment), graded ``exact`` on 42.
    The same program on every provider: ``python3`` from ``PATH`` (the host's on ``local``; on
    ``docker`` the image's, ``image`` or the provider's default, which must have a Python 3 with
    its stdlib, as Arena's images do)."""
    return Task(id="waiting-agent", source=PathSource(path=str(repo)), instructions="Answer after a few turns.",
                agent=AgentSpec(command=["python3", f"/sandbox/agent/{AGENT_FILE}"], path=str(agent_dir),
                                env=agent_env(index, turns, burn_ms)),
                verifier=ExactVerifier(answers=[ANSWER]), budget=Budget(wall_clock_s=wall_clock_s), image=image or None)


def latency_s(median_s: float, sigma: float, seed: int, agent: str, turn: int) -> float:
    """The backend's latency for ``agent``'s ``turn``: lognormal (median ``median_s``), the same
    for the same agent and turn in every run."""
    return median_s * math.exp(sigma * random.Random(f"{seed}:{agent}:{turn}").gauss(0.0, 1.0))


class Call(msgspec.Struct, array_like=True):
    """One call as the backend saw it; times are unix seconds."""

    agent: str
    turn: int
    arrived: float  # the request read
    started: float  # a slot of ``limit`` taken (after any wait inside the backend)
    ended: float  # the answer ready, before it is written
    latency: float  # the drawn latency, seconds


class Stats(msgspec.Struct):
    calls: list[Call]
    max_seen: int  # the most calls the backend held at once (served and waiting inside it)
    limit: int


class _Server:
    def __init__(self, *, median_s: float, sigma: float, seed: int, limit: int):
        self.median_s, self.sigma, self.seed, self.limit = median_s, sigma, seed, limit
        self.llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="answer", content=ANSWER)]))
        self.slots = asyncio.Semaphore(limit) if limit else None
        self.calls: list[Call] = []
        self.seen = self.max_seen = 0
        self.untagged = 0

    async def chat(self, request: web.Request) -> web.Response:
        arrived = time.time()
        self.seen += 1
        self.max_seen = max(self.max_seen, self.seen)
        try:
            body = msgspec.json.decode(await request.read())
            last = next((m.get("content") or "" for m in reversed(body.get("messages") or [])
                         if m.get("role") == "user"), "")
            if tag := _TAG.search(str(last)):
                agent, turn = tag.group(1), int(tag.group(2))
            else:
                self.untagged += 1
                agent, turn = "untagged", self.untagged
            delay = latency_s(self.median_s, self.sigma, self.seed, agent, turn)
            if self.slots is not None:
                await self.slots.acquire()
            try:
                started = time.time()
                await asyncio.sleep(delay)
                answer = msgspec.json.encode(self.llm.complete(body))
            finally:
                if self.slots is not None:
                    self.slots.release()
            ended = time.time()
        finally:
            self.seen -= 1
        self.calls.append(Call(agent, turn, arrived, started, ended, delay))
        return web.Response(body=answer, content_type="application/json")

    def app(self) -> web.Application:
        async def models(_):
            return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

        async def no_tokenize(_):  # like Ollama: the proxy counts without it
            return web.json_response({"detail": "Not Found"}, status=404)

        async def stats(_):
            return web.Response(body=msgspec.json.encode(Stats(self.calls, self.max_seen, self.limit)),
                                content_type="application/json")

        async def reset(_):
            self.calls, self.max_seen = [], self.seen
            return web.json_response({"reset": True})

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([web.get("/v1/models", models), web.get("/health", models),
                        web.post("/v1/chat/completions", self.chat), web.post("/tokenize", no_tokenize),
                        web.get("/stats", stats), web.post("/stats/reset", reset)])
        return app


class StandInBackend:
    """The stand-in backend as a process of its own (its CPU apart from Arena's and the caller's)."""

    def __init__(self, port: int, *, median_s: float, sigma: float = 0.5, seed: int = 0, limit: int = 0,
                 log: Path | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}/v1"
        self._argv = [sys.executable, "-m", "arena_stack.waiting_agents", "--port", str(port), "--latency",
                      str(median_s), "--sigma", str(sigma), "--seed", str(seed), "--limit", str(limit)]
        self._log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> StandInBackend:
        out = open(self._log, "ab") if self._log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self._argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/models", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the stand-in backend did not start on port {self.port}")
            time.sleep(0.1)

    def stats(self) -> Stats:
        return msgspec.json.decode(httpx.get(f"http://127.0.0.1:{self.port}/stats", timeout=60).content, type=Stats)

    def reset(self) -> None:
        httpx.post(f"http://127.0.0.1:{self.port}/stats/reset", timeout=10).raise_for_status()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> StandInBackend:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m arena_stack.waiting_agents", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--latency", type=float, default=2.0, help="median latency, seconds")
    ap.add_argument("--sigma", type=float, default=0.5, help="the lognormal's sigma (its tail)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="calls served at once (0: no limit)")
    args = ap.parse_args(argv)
    server = _Server(median_s=args.latency, sigma=args.sigma, seed=args.seed, limit=args.limit)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
