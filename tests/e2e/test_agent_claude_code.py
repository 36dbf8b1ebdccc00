"""Claude Code, unmodified (the native ``claude`` from npm, in ``arena/claude-code``), in a docker
sandbox (Podman) through the real stack: its Anthropic Messages calls go through Arena's proxy,
translated to the scripted backend's OpenAI chat, which plays Read, Edit and Bash tool calls;
Claude Code runs them in the sandbox and ends; Arena captures each call as a step, verifies the
workspace (the quickstart's tests; swebench-mini's hidden tests, run in the same image) and
keeps Claude Code's events and session file as artifacts.

Needs the image (``make images``) and a Docker-API engine (the ``docker_url`` fixture); skipped
without them. ``make test-agents`` builds the images and runs this file.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import docker
import httpx
import msgspec
import pytest

from arena.datasets import checkout, mirror_of, read_rows, to_task
from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core import apikeys
from arena_core.bus import Bus
from arena_core.schemas import (AgentSpec, Budget, GroupSubmitted, PathSource, SamplingParams, ScaffoldSpec,
                                SubmitGroupRequest, Task, Trajectory)
from arena_stack.stack import Stack

from tests.e2e.scaffold_stacks import docker_stack, require_image

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart"
SWEBENCH = ROOT / "examples" / "swebench-mini"
IMAGE = "arena/claude-code:latest"

pytestmark = [pytest.mark.timeout(900)]

MEDIAN = "/sandbox/workspace/textstats/core.py"
FIX = r"sed -i 's/(ordered\[mid\] + ordered\[mid + 1\]) \/ 2/(ordered[mid - 1] + ordered[mid]) \/ 2/' " + MEDIAN
WRONG = r"sed -i 's/(ordered\[mid\] + ordered\[mid + 1\]) \/ 2/(ordered[mid - 1] + ordered[mid]) \/\/ 2/' " + MEDIAN
TESTS = "python3 -m pytest -q -p no:cacheprovider tests"


def tool(name: str, **arguments) -> dict:
    return {"name": name, "arguments": json.dumps(arguments)}


def play(label: str, patch: str) -> dict:
    """Read the file, patch it and run the tests (Bash), then a final answer: three LLM calls."""
    return {"label": label, "match": "textstats", "weight": 0.5, "turns": [
        {"content": "Let me read the median function.", "tool_calls": [tool("Read", file_path=MEDIAN)]},
        {"content": "The middle pair is off by one; fixing it and running the tests.",
         "tool_calls": [tool("Bash", command=f"{patch} && {TESTS}", description="Fix median and run the tests")]},
        {"content": "Fixed `median` for even-length lists."},
    ]}


HUMANIZE = "/sandbox/workspace/inflection/__init__.py"
BUGGY, FIXED = 'word = re.sub(r"_id", "", word)', 'word = re.sub(r"_id$", "", word)'
CHECK = "python3 -c 'import inflection; print(inflection.humanize(\"user_identity\"))'"

#: swebench-mini's jpvanhal__inflection-1 (its problem statement starts "humanize() eats"): Read the
#: module, Edit the regex (Claude Code refuses an Edit of a file it has not Read), Bash to check it,
#: then a final answer: four LLM calls.
INFLECTION = {"label": "inflection", "match": "humanize() eats", "turns": [
    {"content": "Let me look at humanize.", "tool_calls": [tool("Read", file_path=HUMANIZE, offset=180, limit=30)]},
    {"content": "The regex strips `_id` anywhere; anchor it at the end.",
     "tool_calls": [tool("Edit", file_path=HUMANIZE, old_string=BUGGY, new_string=FIXED)]},
    {"content": "Checking the example from the issue.",
     "tool_calls": [tool("Bash", command=CHECK, description="Check humanize")]},
    {"content": "`humanize` now strips only a trailing `_id`."},
]}

# seeds 0 and 1 draw the second and the first quickstart play (weights 0.5/0.5, as in
# tests/e2e/test_stack.py); the inflection play matches only its own task
SCRIPT = {"plays": [play("right", FIX), play("wrong", WRONG), INFLECTION]}
TURNS = 3


@pytest.fixture(scope="module")
def engine(docker_url):
    return require_image(docker_url, IMAGE)


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-claude-code")
    script = data_dir / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with docker_stack(engine, data_dir, script, "cc") as (stack, settings):
        yield stack, settings


def claude_task(task: Task | None = None) -> Task:
    agent = AgentSpec(scaffold=ScaffoldSpec(name="claude-code", model="scripted", config={"max_turns": 10}))
    # Claude Code's requests carry ~13 KB of system prompt and tools: a turn budget, no token budget
    return msgspec.structs.replace(task or load_task(QUICKSTART), agent=agent, image=IMAGE,
                                   budget=Budget(max_turns=10, wall_clock_s=300))


def artifact(stack: Stack, traj: Trajectory, name: str) -> bytes:
    key = traj.sandbox.artifacts[name]

    async def get() -> bytes:
        bus = await Bus.connect(stack.settings.nats_url, "test")
        try:
            return (await (await bus.artifacts()).get(key)).data
        finally:
            await bus.close()

    return asyncio.run(get())


def test_claude_code_solves_the_quickstart_task_and_a_wrong_script_scores_zero(stack):
    stack_, settings = stack
    request = SubmitGroupRequest(task=claude_task(), n=2, sampling=SamplingParams(seed=0), provider="docker")
    started = time.monotonic()
    reply = httpx.post(f"{settings.rollout_url}/v1/rollout-groups", content=msgspec.json.encode(request),
                       headers={"content-type": "application/json", **apikeys.auth_headers(stack_.api_key)}, timeout=30)
    assert reply.status_code < 300, reply.text
    group = msgspec.json.decode(reply.content, type=GroupSubmitted)
    client = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack_.api_key)
    views = [client.wait(rid, timeout=600) for rid in group.rollout_ids]
    elapsed = time.monotonic() - started
    assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
    assert [v.reward for v in views] == [0.0, 1.0]
    assert [v.steps for v in views] == [TURNS, TURNS]
    print(f"\ntwo quickstart rollouts with Claude Code in {IMAGE} (concurrently): {elapsed:.1f} s")

    for view, expected in zip(views, ("(ordered[mid - 1] + ordered[mid]) // 2", "(ordered[mid - 1] + ordered[mid]) / 2"),
                              strict=True):
        traj = client.wait_trajectory(view.rollout_id, timeout=60)
        assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
        assert f"+    return {expected}" in traj.sandbox.diff
        assert [s.api for s in traj.steps] == ["anthropic.messages"] * TURNS
        assert [c.name for s in traj.steps for c in s.tool_calls] == ["Read", "Bash"]
        for step in traj.steps:
            assert step.stream and step.token_ids_source == "backend" and step.policy_version == "0"
            assert len(step.completion_token_ids) == step.usage.completion_tokens
        # the preset's result: Claude Code's own final `result` event
        result = traj.sandbox.result
        assert result["subtype"] == "success" and result["is_error"] is False and result["num_turns"] == TURNS
        # Claude Code really ran the tools in the sandbox: their outputs are in its session file
        session = [json.loads(line) for line in artifact(stack_, traj, "claude-code.session.jsonl").splitlines()]
        outputs = [json.dumps(block.get("content")) for entry in session if entry.get("type") == "user"
                   for block in (entry["message"]["content"] if isinstance(entry["message"]["content"], list) else [])
                   if block.get("type") == "tool_result"]
        assert len(outputs) == 2
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in outputs[0]  # Read, before the fix
        assert ("7 passed" if view.reward == 1.0 else "failed") in outputs[1]  # pytest in the sandbox
        events = artifact(stack_, traj, "claude-code.events.jsonl").decode()
        assert '"type":"result"' in events
        # the second call carried the file's content back to the model (Anthropic tool_result -> OpenAI tool)
        assert "ordered[mid + 1]" in json.dumps(traj.steps[1].request_messages)


def test_claude_code_solves_a_swebench_task(stack, tmp_path):
    """swebench-mini's jpvanhal__inflection-1: the repository checked out from the dataset's mirror
    (a path, bundled by the SDK for the docker sandbox), the hidden tests run by the verifier in
    the same image (Python 3.11 and pytest from ``arena/agent-node``)."""
    stack_, settings = stack
    row = next(r for r in read_rows(SWEBENCH / "dataset.jsonl") if r.instance_id == "jpvanhal__inflection-1")
    checkout(mirror_of(SWEBENCH / "repos", row.repo), row.base_commit, tmp_path / "repo")
    task = claude_task(to_task(row, source=PathSource(path=str(tmp_path / "repo")), timeout_s=120))
    client = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack_.api_key)
    started = time.monotonic()
    view = client.wait(client.submit(task, provider="docker").rollout_id, timeout=600)
    elapsed = time.monotonic() - started
    turns = len(INFLECTION["turns"])
    assert view.state.value == "completed", view.reason
    assert view.reward == 1.0 and view.steps == turns
    print(f"\nswebench-mini inflection-1 with Claude Code in {IMAGE}: {elapsed:.1f} s")
    traj = client.wait_trajectory(view.rollout_id, timeout=60)
    assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
    assert f"+    {FIXED}" in traj.sandbox.diff and f"-    {BUGGY}" in traj.sandbox.diff
    assert traj.verification.counts.f2p_passed == 5 and traj.verification.counts.f2p_failed == 0
    assert traj.verification.counts.p2p_failed == 0
    assert [s.api for s in traj.steps] == ["anthropic.messages"] * turns
    assert [c.name for s in traj.steps for c in s.tool_calls] == ["Read", "Edit", "Bash"]
    assert traj.sandbox.result["num_turns"] == turns and traj.sandbox.result["subtype"] == "success"
    assert "User identity" in json.dumps(traj.steps[3].request_messages)  # the Bash output, back to the model
    # Training sequences: Read's call chains onto the first, but Claude Code replays the Edit call with
    # its input as its schema parsed it, defaults filled in: the model sampled `{"file_path": ...}`,
    # the next request carries `{"replace_all": false, "file_path": ...}`, so the third call's prompt
    # does not extend the second call's completion token for token (at its arguments) and a new
    # sequence starts there. Claude Code's doing, not the proxy's: the Read call (offset, limit
    # given) and the Bash call come back as sampled.
    check_sequences(traj, turns)
    assert [seq.step_indexes for seq in traj.sequences] == [[0, 1], [2, 3]]
    ((brk),) = traj.sequence_breaks
    assert brk.step_index == 2 and brk.kind == "prefix_mismatch"
    assert b"replace_all" not in bytes(t - 3 for t in traj.steps[1].completion_token_ids)  # sampled without it
    (replayed,) = [json.loads(c["function"]["arguments"]) for m in traj.steps[2].request_messages
                   for c in m.get("tool_calls") or () if c["function"]["name"] == "Edit"]
    assert list(replayed)[0] == "replace_all" and replayed["replace_all"] is False  # replayed with it, first


def check_sequences(traj: Trajectory, turns: int) -> None:
    """The steps as training sequences (as tests/e2e/test_agent_mini_swe_agent.py's ``check_steps``)."""
    for step in traj.steps:
        assert step.token_ids_source == "backend" and step.policy_version == "0"
        assert len(step.completion_token_ids) == step.usage.completion_tokens == len(step.logprobs)
    assert sum(len(q.step_indexes) for q in traj.sequences) == turns
    for seq in traj.sequences:
        assert len(seq.token_ids) == len(seq.loss_mask) == len(seq.logprobs)
        assert sum(seq.loss_mask) == sum(len(traj.steps[i].completion_token_ids) for i in seq.step_indexes)


def test_claude_code_with_its_full_default_tool_set(stack):
    """``config.tools: "default"``: Claude Code's own built-in set (24 tools here), the Agent tool among
    them, whose list of sub-agent types Claude Code sends as a ``system`` message inside ``messages``:
    the proxy keeps it in place (an OpenAI system message after the first user message). Beside it,
    the same set less three tools taken off by ``config.disallowed_tools``."""
    stack_, settings = stack
    client = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack_.api_key)
    denied = ["Agent", "WebFetch", "WebSearch"]
    rids = []
    started = time.monotonic()
    for extra in ({}, {"disallowed_tools": denied}):
        agent = AgentSpec(scaffold=ScaffoldSpec(name="claude-code", model="scripted",
                                                config={"max_turns": 10, "tools": "default", **extra}))
        task = msgspec.structs.replace(claude_task(), agent=agent)
        rids.append(client.submit(task, sampling=SamplingParams(seed=1), provider="docker").rollout_id)
    views = [client.wait(rid, timeout=600) for rid in rids]
    elapsed = time.monotonic() - started
    assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
    assert [v.reward for v in views] == [1.0, 1.0] and [v.steps for v in views] == [TURNS, TURNS]  # the right play
    print(f"\ntwo quickstart rollouts with Claude Code's full tool set (concurrently): {elapsed:.1f} s")
    traj, fewer = (client.wait_trajectory(rid, timeout=60) for rid in rids)
    offered = {t["function"]["name"] for t in traj.steps[0].tools}
    assert {"Agent", "Bash", "Edit", "Read", "Write", "WebFetch", "TaskCreate"} <= offered and len(offered) > 20
    roles = [m["role"] for m in traj.steps[0].request_messages]
    assert roles[:2] == ["system", "user"] and "system" in roles[2:]  # the mid-conversation system message
    (agents,) = [m for m in traj.steps[0].request_messages[2:] if m["role"] == "system"]
    assert "Agent tool" in agents["content"]
    for step in traj.steps[1:]:  # kept in place on every call, after it the conversation
        assert [m["role"] for m in step.request_messages][:3] == roles[:3]
    # the calls (Read, Bash: no defaults filled in) chain into one training sequence
    check_sequences(traj, TURNS)
    assert [seq.step_indexes for seq in traj.sequences] == [[0, 1, 2]] and not traj.sequence_breaks
    # disallowed tools are not offered at all; without the Agent tool no sub-agent list is sent (the
    # Skill tool's list of skills still comes as a system message in mid-conversation)
    left = {t["function"]["name"] for t in fewer.steps[0].tools}
    assert left == offered - set(denied)
    assert [m["role"] for m in fewer.steps[0].request_messages] == roles
    assert "Agent tool" not in json.dumps(fewer.steps[0].request_messages)
    assert "skills are available" in fewer.steps[0].request_messages[2]["content"]
