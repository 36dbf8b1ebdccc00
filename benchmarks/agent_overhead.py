"""Agent overhead: what Arena adds around each scaffold, with the scripted backend answering at once.

Every scaffold solves the quickstart task in three turns (read, fix and test, submit) through
the real embedded stack (NATS, rollout / sandbox / verification / trajectory services, the
scripted LLM with no latency). Beside them, the baseline: the thinnest tool-calling loop a
raw ``command`` agent can be (stdlib Python, the same three tool calls). From each rollout's
trajectory (its state history and its steps' timestamps):

- submit -> first call: from submission to the scaffold's first LLM call reaching the proxy
- start -> first call: from the agent's start in its sandbox to that call (the scaffold's own start-up)
- proxy / turn: the proxy's time per call (capture on; the backend answers at once)
- scaffold / turn: the scaffold's time between an answer and its next call (running the tool, rendering)
- end: from the last answer to the sandbox's end (the scaffold's exit, the diff taken)
- verify: from the sandbox's end to the reward

Run: ``.venv/bin/python benchmarks/agent_overhead.py [--rollouts 3] [--docker-url unix:///…sock]``.
Scaffolds whose virtualenv (``make scaffolds-venv``) or image (``make images``, and a Docker API
via --docker-url) is missing are listed as skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.scaffolds import install
from arena_core.schemas import AgentSpec, Budget, RolloutState, ScaffoldSpec, Task, Trajectory
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart"
SCAFFOLDS_DIR = ROOT / ".arena" / "scaffolds"
MEDIAN = "textstats/core.py"
FIX = r"sed -i 's/(ordered\[mid\] + ordered\[mid + 1\]) \/ 2/(ordered[mid - 1] + ordered[mid]) \/ 2/' "
TESTS = "python3 -m pytest -q -p no:cacheprovider tests"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def bash(thought: str, command: str) -> dict:
    return {"content": f"THOUGHT: {thought}",
            "tool_calls": [{"name": "bash", "arguments": json.dumps({"command": command})}]}


def read_tool(name: str, **arguments) -> dict:
    return {"name": name, "arguments": json.dumps(arguments)}


# one play per scaffold family, told apart by a marker in the task's instructions
PLAYS = [
    {"label": "bash", "match": "[tools: bash]", "turns": [
        bash("Read the median function.", f"grep -n ordered {MEDIAN}"),
        bash("Fix the middle pair and run the tests.", f"{FIX}{MEDIAN} && {TESTS}"),
        bash("Submit.", SUBMIT)]},
    {"label": "claude-code", "match": "[tools: claude]", "turns": [
        {"content": "Reading.", "tool_calls": [read_tool("Read", file_path=f"/sandbox/workspace/{MEDIAN}")]},
        {"content": "Fixing.", "tool_calls": [read_tool("Bash", command=f"{FIX}/sandbox/workspace/{MEDIAN} && {TESTS}",
                                                        description="fix and test")]},
        {"content": "Fixed."}]},
    {"label": "opencode", "match": "[tools: opencode]", "turns": [
        {"content": "Reading.", "tool_calls": [read_tool("read", filePath=f"/sandbox/workspace/{MEDIAN}")]},
        {"content": "Fixing.", "tool_calls": [read_tool("bash", command=f"{FIX}{MEDIAN} && {TESTS}",
                                                        description="fix and test")]},
        {"content": "Fixed."}]},
]

def right_play(path: Path, marker: str) -> dict:
    """The right play of a scaffold's end-to-end test, matched on the benchmark's marker."""
    play = next(p for p in json.loads(path.read_text())["plays"] if p["label"] == "right")
    return {**play, "match": marker, "weight": 1.0}


PLAYS += [right_play(ROOT / "tests" / "e2e" / "openhands_plays.json", "[tools: openhands]"),
          right_play(ROOT / "tests" / "e2e" / "plays" / "terminus2_quickstart.json", "[tools: terminus]")]

# The baseline: a raw `command` agent, the thinnest loop over the same bash tool calls.
BASELINE_AGENT = r'''
import json, os, subprocess, urllib.request
task = json.load(open("/sandbox/.arena/task.json"))["task"]
url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object",
         "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
messages = [{"role": "user", "content": task["instructions"]}]
for _ in range(10):
    body = json.dumps({"model": "scripted", "messages": messages, "tools": tools}).encode()
    req = urllib.request.Request(url, body, {"content-type": "application/json",
                                             "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    message = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]
    messages.append(message)
    calls = message.get("tool_calls") or []
    if not calls:
        break
    command = json.loads(calls[0]["function"]["arguments"])["command"]
    if "COMPLETE_TASK_AND_SUBMIT" in command:
        break
    out = subprocess.run(command, shell=True, capture_output=True, text=True, cwd="/sandbox/workspace")
    messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": out.stdout + out.stderr})
open("/sandbox/.arena/done", "w").close()
'''

SCAFFOLDS = {  # name -> (play marker, provider, what it needs)
    "baseline": ("[tools: bash]", "local", None),
    "mini-swe-agent": ("[tools: bash]", "local", "venv"),
    "claude-code": ("[tools: claude]", "docker", "arena/claude-code:latest"),
    "opencode": ("[tools: opencode]", "docker", "arena/opencode:latest"),
    "openhands": ("[tools: openhands]", "local", "venv"),
    "terminus-2": ("[tools: terminus]", "local", "venv"),
}


def task_for(name: str, marker: str, agent_dir: Path, image: str | None = None) -> Task:
    task = load_task(QUICKSTART)
    if image is not None:  # the docker provider runs the agent in the scaffold's image
        task = msgspec.structs.replace(task, image=image)
    if name == "baseline":
        agent = AgentSpec(command=["python3", "/sandbox/agent/agent.py"], path=str(agent_dir))
    else:
        agent = AgentSpec(scaffold=ScaffoldSpec(name=name, model="scripted"))
    return msgspec.structs.replace(task, instructions=f"{task.instructions}\n{marker}", agent=agent,
                                   budget=Budget(max_turns=10, wall_clock_s=300))


def phases(traj: Trajectory) -> dict[str, float]:
    """The rollout's phases in ms, from its state history and its steps' timestamps."""
    at = {t.to_state: t.at for t in traj.history}
    created = traj.history[0].at
    steps = sorted(traj.steps, key=lambda s: s.step_index)
    ends = [s.started_at + s.timings.total_ms / 1000 for s in steps]
    gaps = [(b.started_at - e) * 1000 for e, b in zip(ends, steps[1:])]
    return {
        "submit_first": (steps[0].started_at - created) * 1000,
        "start_first": (steps[0].started_at - at[RolloutState.RUNNING]) * 1000,
        "proxy_turn": statistics.median(s.timings.total_ms for s in steps),
        "scaffold_turn": statistics.median(gaps) if gaps else 0.0,
        "end": (at[RolloutState.VERIFYING] - ends[-1]) * 1000,
        "verify": (at[RolloutState.COMPLETED] - at[RolloutState.VERIFYING]) * 1000,
        "turns": float(len(steps)),
    }


def available(name: str, need: str | None, docker_url: str | None) -> str | None:
    """Why ``name`` cannot run here, or None."""
    if need is None:
        return None
    if need == "venv":
        return None if (SCAFFOLDS_DIR / name).is_dir() else f"no virtualenv: make scaffolds-venv"
    if not docker_url:
        return "no --docker-url"
    import docker

    client = docker.DockerClient(base_url=docker_url)
    try:
        client.images.get(need)
        return None
    except docker.errors.ImageNotFound:
        return f"no image {need}: make images"
    finally:
        client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=3, help="sequential rollouts per scaffold")
    ap.add_argument("--docker-url", default=os.environ.get("ARENA_DOCKER_URL") or os.environ.get("DOCKER_HOST"))
    ap.add_argument("--only", nargs="*", help="scaffolds to run (default: every available one)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="arena-agent-bench-"))
    agent_dir = tmp / "agent"
    agent_dir.mkdir()
    (agent_dir / "agent.py").write_text(BASELINE_AGENT)
    (tmp / "script.json").write_text(json.dumps({"plays": PLAYS}))
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp / "data"),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{free_port()}/v1",
                        backend_policy_version="0", allow_host_paths=True,
                        docker_url=args.docker_url or "",
                        sandbox_provider="local,docker" if args.docker_url else "local")  # a consumer each
    os.environ["ARENA_SCAFFOLDS_DIR"] = str(SCAFFOLDS_DIR)
    stack = Stack(settings, llm_script=tmp / "script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    client = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)
    results: dict[str, dict[str, float]] = {}
    skipped: dict[str, str] = {}
    try:
        for name, (marker, provider, need) in SCAFFOLDS.items():
            if args.only and name not in args.only and name != "baseline":
                continue
            why = available(name, need, args.docker_url)
            if why is not None:
                skipped[name] = why
                continue
            runs = []
            for _ in range(args.rollouts):
                image = need if provider == "docker" else None
                rid = client.submit(task_for(name, marker, agent_dir, image), provider=provider).rollout_id
                view = client.wait(rid, timeout=600)
                if view.state is not RolloutState.COMPLETED or view.reward != 1.0:
                    skipped[name] = f"rollout {rid} ended {view.state.value} (reward {view.reward}): {view.reason}"
                    break
                runs.append(phases(client.wait_trajectory(rid, timeout=60)))
            else:
                results[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"  measured {name}", flush=True)
    finally:
        client.close()
        stack.stop()
    print(f"\n{args.rollouts} sequential quickstart rollouts per scaffold, 3 turns each, scripted backend with no "
          f"latency; medians in ms; {os.cpu_count()} cores (shared), load average {os.getloadavg()[0]:.2f}")
    cols = ["submit_first", "start_first", "proxy_turn", "scaffold_turn", "end", "verify"]
    print(f"{'scaffold':16s}" + "".join(f"{c:>15s}" for c in cols))
    base = results.get("baseline")
    for name, r in results.items():
        print(f"{name:16s}" + "".join(f"{r[c]:15.1f}" for c in cols))
        if base is not None and name != "baseline":
            print(f"{'  x baseline':16s}" + "".join(
                f"{(r[c] / base[c] if base[c] > 0 else float('nan')):15.2f}" for c in cols))
    for name, why in skipped.items():
        print(f"{name:16s} skipped: {why}")


if __name__ == "__main__":
    sys.exit(main())
