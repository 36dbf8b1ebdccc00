"""OpenCode, unmodified (the native ``opencode`` from npm, in ``arena/opencode``), in a docker
sandbox (Podman) through the real stack: its OpenAI chat calls (an ``@ai-sdk/openai-compatible``
provider) go through Arena's proxy to the scripted backend, which plays read, edit and bash tool
calls; OpenCode runs them in the sandbox and ends; Arena captures each call as a step, verifies the
workspace (the quickstart's tests; swebench-mini's hidden tests, run in the same image) and keeps
OpenCode's events and exported session as artifacts.

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
IMAGE = "arena/opencode:latest"

pytestmark = [pytest.mark.timeout(900)]

MEDIAN = "/sandbox/workspace/textstats/core.py"
FIX = r"sed -i 's/(ordered\[mid\] + ordered\[mid + 1\]) \/ 2/(ordered[mid - 1] + ordered[mid]) \/ 2/' " + MEDIAN
WRONG = r"sed -i 's/(ordered\[mid\] + ordered\[mid + 1\]) \/ 2/(ordered[mid - 1] + ordered[mid]) \/\/ 2/' " + MEDIAN
TESTS = "python3 -m pytest -q -p no:cacheprovider tests"


def tool(name: str, **arguments) -> dict:
    return {"name": name, "arguments": json.dumps(arguments)}


def compact(name: str, **arguments) -> dict:
    """A tool call whose arguments are written as OpenCode writes them back (``JSON.stringify``)."""
    return {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}


def play(label: str, patch: str) -> dict:
    """Read the file, patch it and run the tests (Bash), then a final answer: three LLM calls."""
    return {"label": label, "match": "textstats", "weight": 0.5, "turns": [
        {"content": "Let me read the median function.", "tool_calls": [tool("read", filePath=MEDIAN)]},
        {"content": "The middle pair is off by one; fixing it and running the tests.",
         "tool_calls": [tool("bash", command=f"{patch} && {TESTS}", description="Fix median and run the tests")]},
        {"content": "Fixed `median` for even-length lists."},
    ]}


HUMANIZE = "/sandbox/workspace/inflection/__init__.py"
BUGGY, FIXED = 'word = re.sub(r"_id", "", word)', 'word = re.sub(r"_id$", "", word)'
CHECK = "python3 -c 'import inflection; print(inflection.humanize(\"user_identity\"))'"

#: swebench-mini's jpvanhal__inflection-1 (its problem statement starts "humanize() eats"): read the
#: module, edit the regex (OpenCode refuses an edit of a file it has not read), bash to check it,
#: then a final answer: four LLM calls. Its arguments are compact JSON (see the sequences below).
INFLECTION = {"label": "inflection", "match": "humanize() eats", "turns": [
    {"content": "Let me look at humanize.", "tool_calls": [compact("read", filePath=HUMANIZE, offset=180, limit=30)]},
    {"content": "The regex strips `_id` anywhere; anchor it at the end.",
     "tool_calls": [compact("edit", filePath=HUMANIZE, oldString=BUGGY, newString=FIXED)]},
    {"content": "Checking the example from the issue.",
     "tool_calls": [compact("bash", command=CHECK, description="Check humanize")]},
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
    data_dir = tmp_path_factory.mktemp("arena-opencode")
    script = data_dir / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with docker_stack(engine, data_dir, script, "oc") as (stack, settings):
        yield stack, settings


def opencode_task(task: Task | None = None) -> Task:
    agent = AgentSpec(scaffold=ScaffoldSpec(name="opencode", model="scripted"))
    # OpenCode's requests carry ~30 KB of system prompt and tools: a turn budget, no token budget
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


def test_opencode_solves_the_quickstart_task_and_a_wrong_script_scores_zero(stack):
    stack_, settings = stack
    request = SubmitGroupRequest(task=opencode_task(), n=2, sampling=SamplingParams(seed=0), provider="docker")
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
    print(f"\ntwo quickstart rollouts with OpenCode in {IMAGE} (concurrently): {elapsed:.1f} s")

    for view, expected in zip(views, ("(ordered[mid - 1] + ordered[mid]) // 2", "(ordered[mid - 1] + ordered[mid]) / 2"),
                              strict=True):
        traj = client.wait_trajectory(view.rollout_id, timeout=60)
        assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
        assert f"+    return {expected}" in traj.sandbox.diff
        assert [s.api for s in traj.steps] == ["openai.chat"] * TURNS
        assert [c.name for s in traj.steps for c in s.tool_calls] == ["read", "bash"]
        for step in traj.steps:
            assert step.stream and step.token_ids_source == "backend" and step.policy_version == "0"
            assert len(step.completion_token_ids) == step.usage.completion_tokens
        # the preset's result: from OpenCode's JSON events (one step_finish per LLM call)
        result = traj.sandbox.result
        assert result["exit_code"] == 0 and result["errors"] == [] and result["steps"] == TURNS
        assert result["finish_reason"] == "stop"
        # OpenCode really ran the tools in the sandbox: their outputs are in its events and session
        events = [json.loads(line) for line in artifact(stack_, traj, "opencode.events.jsonl").splitlines()]
        outputs = [e["part"]["state"]["output"] for e in events
                   if e.get("type") == "tool_use" and e["part"]["state"].get("status") == "completed"]
        assert len(outputs) == 2
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in outputs[0]  # read, before the fix
        assert ("7 passed" if view.reward == 1.0 else "failed") in outputs[1]  # pytest in the sandbox
        session = json.loads(artifact(stack_, traj, "opencode.session.json"))
        assert session["info"]["id"] == result["session_id"]
        assert ("7 passed" in json.dumps(session)) == (view.reward == 1.0)
        # the second call carried the file's content back to the model as a tool message
        assert "ordered[mid + 1]" in json.dumps(traj.steps[1].request_messages)
        # These plays write arguments as Python's json.dumps does (`", "`, `": "`); OpenCode sends them
        # back compact (JSON.stringify), and the proxy restores the sampled text (the same JSON) before
        # the backend sees it: the three calls stay one training sequence.
        check_sequences(traj, TURNS)
        assert [seq.step_indexes for seq in traj.sequences] == [[0, 1, 2]] and not traj.sequence_breaks
        (replayed,) = [c["function"]["arguments"] for m in traj.steps[1].request_messages
                       for c in m.get("tool_calls") or ()]
        assert replayed == json.dumps({"filePath": MEDIAN})  # as sampled, not as OpenCode re-wrote it


def test_opencode_solves_a_swebench_task(stack, tmp_path):
    """swebench-mini's jpvanhal__inflection-1: the repository checked out from the dataset's mirror
    (a path, bundled by the SDK for the docker sandbox), the hidden tests run by the verifier in
    the same image (Python 3.11 and pytest from ``arena/agent-node``)."""
    stack_, settings = stack
    row = next(r for r in read_rows(SWEBENCH / "dataset.jsonl") if r.instance_id == "jpvanhal__inflection-1")
    checkout(mirror_of(SWEBENCH / "repos", row.repo), row.base_commit, tmp_path / "repo")
    task = opencode_task(to_task(row, source=PathSource(path=str(tmp_path / "repo")), timeout_s=120))
    client = ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack_.api_key)
    started = time.monotonic()
    view = client.wait(client.submit(task, provider="docker").rollout_id, timeout=600)
    elapsed = time.monotonic() - started
    turns = len(INFLECTION["turns"])
    assert view.state.value == "completed", view.reason
    assert view.reward == 1.0 and view.steps == turns
    print(f"\nswebench-mini inflection-1 with OpenCode in {IMAGE}: {elapsed:.1f} s")
    traj = client.wait_trajectory(view.rollout_id, timeout=60)
    assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
    assert f"+    {FIXED}" in traj.sandbox.diff and f"-    {BUGGY}" in traj.sandbox.diff
    assert traj.verification.counts.f2p_passed == 5 and traj.verification.counts.f2p_failed == 0
    assert traj.verification.counts.p2p_failed == 0
    assert [s.api for s in traj.steps] == ["openai.chat"] * turns
    assert [c.name for s in traj.steps for c in s.tool_calls] == ["read", "edit", "bash"]
    assert traj.sandbox.result["steps"] == turns and traj.sandbox.result["errors"] == []
    assert "User identity" in json.dumps(traj.steps[3].request_messages)  # the bash output, back to the model
    # One training sequence: OpenCode replays each tool call with its arguments parsed and written
    # again by JSON.stringify (compact, keys in the order given); this play's arguments are already
    # in that form, so every call's prompt extends the one before token for token.
    check_sequences(traj, turns)
    assert len(traj.sequences) == 1, traj.sequence_breaks
    (seq,) = traj.sequences
    assert seq.step_indexes == list(range(turns))
    assert len(seq.token_ids) == len(traj.steps[-1].prompt_token_ids) + len(traj.steps[-1].completion_token_ids)


def check_sequences(traj: Trajectory, turns: int) -> None:
    """The steps as training sequences (as tests/e2e/test_agent_mini_swe_agent.py's ``check_steps``)."""
    for step in traj.steps:
        assert step.token_ids_source == "backend" and step.policy_version == "0"
        assert len(step.completion_token_ids) == step.usage.completion_tokens == len(step.logprobs)
    assert sum(len(q.step_indexes) for q in traj.sequences) == turns
    for seq in traj.sequences:
        assert len(seq.token_ids) == len(seq.loss_mask) == len(seq.logprobs)
        assert sum(seq.loss_mask) == sum(len(traj.steps[i].completion_token_ids) for i in seq.step_indexes)
