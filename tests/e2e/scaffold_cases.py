"""What the end-to-end tests of the scaffolds in their images share (Qwen Code, Codex, Gemini CLI,
and the newest releases): the two tasks (the quickstart, swebench-mini's jpvanhal__inflection-1),
the shell commands their plays run, submitting and waiting, reading an artifact, and the checks of
the captured steps as training sequences."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import msgspec

from arena.datasets import checkout, mirror_of, read_rows, to_task
from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core import apikeys
from arena_core.bus import Bus
from arena_core.schemas import (AgentSpec, Budget, GroupSubmitted, PathSource, RolloutView, SamplingParams,
                                ScaffoldSpec, SubmitGroupRequest, Task, Trajectory)
from arena_core.settings import Settings
from arena_stack.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart"
SWEBENCH = ROOT / "examples" / "swebench-mini"

MEDIAN = "/sandbox/workspace/textstats/core.py"
FIX = r"sed -i 's/(ordered\[mid\] + ordered\[mid + 1\]) \/ 2/(ordered[mid - 1] + ordered[mid]) \/ 2/' " + MEDIAN
WRONG = r"sed -i 's/(ordered\[mid\] + ordered\[mid + 1\]) \/ 2/(ordered[mid - 1] + ordered[mid]) \/\/ 2/' " + MEDIAN
TESTS = "python3 -m pytest -q -p no:cacheprovider tests"
#: What each quickstart play leaves in core.py: the wrong one (seed 0 draws it), the right one (seed 1).
PATCHED = ("(ordered[mid - 1] + ordered[mid]) // 2", "(ordered[mid - 1] + ordered[mid]) / 2")

HUMANIZE = "/sandbox/workspace/inflection/__init__.py"
BUGGY, FIXED = 'word = re.sub(r"_id", "", word)', 'word = re.sub(r"_id$", "", word)'
CHECK = "python3 -c 'import inflection; print(inflection.humanize(\"user_identity\"))'"


def tool(name: str, **arguments) -> dict:
    """A scripted tool call, its arguments written as Python's ``json.dumps`` writes them."""
    return {"name": name, "arguments": json.dumps(arguments)}


def compact(name: str, **arguments) -> dict:
    """A scripted tool call, its arguments written compact (as ``JSON.stringify`` writes them)."""
    return {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}


def scaffold_task(name: str, image: str, task: Task | None = None, config: dict | None = None) -> Task:
    agent = AgentSpec(scaffold=ScaffoldSpec(name=name, model="scripted", config=config or {}))
    # the scaffolds' requests carry 20-80 KB of system prompt and tools: a turn budget, no token budget
    return msgspec.structs.replace(task or load_task(QUICKSTART), agent=agent, image=image,
                                   budget=Budget(max_turns=10, wall_clock_s=300))


def inflection_task(name: str, image: str, repo: Path, config: dict | None = None) -> Task:
    """swebench-mini's jpvanhal__inflection-1: the repository checked out from the dataset's mirror
    into ``repo`` (a path, bundled by the SDK for the docker sandbox)."""
    row = next(r for r in read_rows(SWEBENCH / "dataset.jsonl") if r.instance_id == "jpvanhal__inflection-1")
    checkout(mirror_of(SWEBENCH / "repos", row.repo), row.base_commit, repo)
    return scaffold_task(name, image, to_task(row, source=PathSource(path=str(repo)), timeout_s=120), config)


def client_of(stack: Stack, settings: Settings) -> ArenaClient:
    return ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)


def run_group(stack: Stack, settings: Settings, task: Task, n: int = 2, seed: int = 0) -> tuple[list[RolloutView], float]:
    """A group of ``n`` rollouts (seeds ``seed``, ``seed + 1``, ...) on the docker provider, waited for."""
    request = SubmitGroupRequest(task=task, n=n, sampling=SamplingParams(seed=seed), provider="docker")
    started = time.monotonic()
    reply = httpx.post(f"{settings.rollout_url}/v1/rollout-groups", content=msgspec.json.encode(request),
                       headers={"content-type": "application/json", **apikeys.auth_headers(stack.api_key)}, timeout=30)
    assert reply.status_code < 300, reply.text
    group = msgspec.json.decode(reply.content, type=GroupSubmitted)
    client = client_of(stack, settings)
    views = [client.wait(rid, timeout=600) for rid in group.rollout_ids]
    return views, time.monotonic() - started


def run_one(stack: Stack, settings: Settings, task: Task) -> tuple[RolloutView, float]:
    client = client_of(stack, settings)
    started = time.monotonic()
    view = client.wait(client.submit(task, provider="docker").rollout_id, timeout=600)
    return view, time.monotonic() - started


def artifact(stack: Stack, traj: Trajectory, name: str) -> bytes:
    key = traj.sandbox.artifacts[name]

    async def get() -> bytes:
        bus = await Bus.connect(stack.settings.nats_url, "test")
        try:
            return (await (await bus.artifacts()).get(key)).data
        finally:
            await bus.close()

    return asyncio.run(get())


def check_sequences(traj: Trajectory, turns: int) -> None:
    """The steps as training sequences: backend token ids, loss mask = the completions."""
    for step in traj.steps:
        assert step.token_ids_source == "backend" and step.policy_version == "0"
        assert len(step.completion_token_ids) == step.usage.completion_tokens == len(step.logprobs)
    assert sum(len(q.step_indexes) for q in traj.sequences) == turns
    for seq in traj.sequences:
        assert len(seq.token_ids) == len(seq.loss_mask) == len(seq.logprobs)
        assert sum(seq.loss_mask) == sum(len(traj.steps[i].completion_token_ids) for i in seq.step_indexes)


def check_inflection(traj: Trajectory) -> None:
    """The inflection task verified: the regex anchored, all FAIL_TO_PASS passing, nothing broken."""
    assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
    assert f"+    {FIXED}" in traj.sandbox.diff and f"-    {BUGGY}" in traj.sandbox.diff
    assert traj.verification.counts.f2p_passed == 5 and traj.verification.counts.f2p_failed == 0
    assert traj.verification.counts.p2p_failed == 0
