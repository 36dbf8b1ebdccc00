"""Codex CLI, unmodified (npm ``@openai/codex``, its native binary, in ``arena/codex``), in a docker
sandbox (Podman) through the real stack: ``codex exec`` talks only the OpenAI Responses API, to
Arena's proxy (a custom provider in ``$CODEX_HOME/config.toml``, ``wire_api = "responses"``), which
translates each call to the scripted backend's chat completions and the answer back into Responses
events; the backend plays Codex's own tool, ``exec_command``; Codex runs the commands in the sandbox
and ends its turn; Arena captures each call as a step (``openai.responses``), verifies the workspace
and keeps Codex's JSON events, its session record and last message as artifacts.

Needs the image (``make images``) and a Docker-API engine (the ``docker_url`` fixture); skipped
without them. ``make test-agents`` builds the images and runs this file.
"""

from __future__ import annotations

import json

import pytest

from arena_core import proxy_routes

from tests.e2e.scaffold_cases import (BUGGY, CHECK, FIX, FIXED, HUMANIZE, MEDIAN, PATCHED, TESTS, WRONG, artifact,
                                      check_inflection, check_sequences, client_of, inflection_task, run_group, run_one,
                                      scaffold_task, tool)
from tests.e2e.scaffold_stacks import docker_stack, require_image

IMAGE = "arena/codex:latest"
NAME = "codex"

pytestmark = [pytest.mark.timeout(900)]

if (b"POST", "/v1/responses") not in proxy_routes.ROUTES:
    pytest.skip("the proxy has no OpenAI Responses route", allow_module_level=True)


def run(command: str) -> dict:
    """Codex's shell tool, as its models call it."""
    return tool("exec_command", cmd=command)


# Codex's first user message is its <environment_context>; the task is a later one (match_any_user)
def play(label: str, patch: str) -> dict:
    """Print the file, patch it and run the tests, then a final answer: three calls."""
    return {"label": label, "match": "textstats", "match_any_user": True, "weight": 0.5, "turns": [
        {"content": "Let me read the median function.", "tool_calls": [run(f"cat {MEDIAN}")]},
        {"content": "The middle pair is off by one; fixing it and running the tests.",
         "tool_calls": [run(f"{patch} && {TESTS}")]},
        {"content": "Fixed `median` for even-length lists."},
    ]}


#: swebench-mini's jpvanhal__inflection-1 (its problem statement starts "humanize() eats"): print the
#: function, anchor the regex with sed, run the issue's example, then a final answer: four calls.
ANCHOR = r"sed -i 's/re.sub(r\"_id\", \"\", word)/re.sub(r\"_id$\", \"\", word)/' " + HUMANIZE
INFLECTION = {"label": "inflection", "match": "humanize() eats", "match_any_user": True, "turns": [
    {"content": "Let me look at humanize.", "tool_calls": [run(f"grep -n '_id' {HUMANIZE}")]},
    {"content": "The regex strips `_id` anywhere; anchor it at the end.", "tool_calls": [run(ANCHOR)]},
    {"content": "Checking the example from the issue.", "tool_calls": [run(CHECK)]},
    {"content": "`humanize` now strips only a trailing `_id`."},
]}

SCRIPT = {"plays": [play("right", FIX), play("wrong", WRONG), INFLECTION]}
TURNS = 3


@pytest.fixture(scope="module")
def engine(docker_url):
    return require_image(docker_url, IMAGE)


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-codex")
    script = data_dir / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with docker_stack(engine, data_dir, script, "cx") as (stack, settings):
        yield stack, settings


def tool_outputs(session: bytes) -> list[str]:
    """The command outputs in Codex's session record (its ``function_call_output`` items)."""
    out = []
    for line in session.splitlines():
        entry = json.loads(line)
        payload = entry.get("payload") or {}
        if entry.get("type") == "response_item" and payload.get("type") == "function_call_output":
            out.append(json.dumps(payload.get("output")))
    return out


def test_codex_solves_the_quickstart_task_and_a_wrong_script_scores_zero(stack):
    stack_, settings = stack
    views, elapsed = run_group(stack_, settings, scaffold_task(NAME, IMAGE))
    assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
    assert [v.reward for v in views] == [0.0, 1.0]
    assert [v.steps for v in views] == [TURNS, TURNS]
    print(f"\ntwo quickstart rollouts with Codex in {IMAGE} (concurrently): {elapsed:.1f} s")

    client = client_of(stack_, settings)
    for view, expected in zip(views, PATCHED, strict=True):
        traj = client.wait_trajectory(view.rollout_id, timeout=60)
        assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
        assert f"+    return {expected}" in traj.sandbox.diff
        assert [s.api for s in traj.steps] == ["openai.responses"] * TURNS
        assert [c.name for s in traj.steps for c in s.tool_calls] == ["exec_command", "exec_command"]
        for step in traj.steps:
            assert step.stream  # Codex always streams
        # the preset's result: Codex's own JSON events (one turn, completed)
        result = traj.sandbox.result
        assert result["exit_code"] == 0 and result["turns_completed"] == 1 and result["turns_failed"] == 0
        # Codex really ran the commands in the sandbox: their outputs are in its events and session
        events = [json.loads(line) for line in artifact(stack_, traj, "codex.events.jsonl").splitlines()]
        commands = [e["item"] for e in events if e.get("type") == "item.completed"
                    and e["item"].get("type") == "command_execution"]
        assert len(commands) == 2
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in commands[0]["aggregated_output"]  # before the fix
        assert ("7 passed" if view.reward == 1.0 else "failed") in commands[1]["aggregated_output"]
        outputs = tool_outputs(artifact(stack_, traj, "codex.session.jsonl"))
        assert len(outputs) == 2 and ("7 passed" in outputs[1]) == (view.reward == 1.0)
        assert artifact(stack_, traj, "codex.last-message.txt").decode().strip() == "Fixed `median` for even-length lists."
        # the second call carried the command's output back to the model (function_call_output -> tool)
        assert "ordered[mid + 1]" in json.dumps(traj.steps[1].request_messages)
        # one training sequence: every call's prompt extends the one before token for token
        check_sequences(traj, TURNS)
        assert [seq.step_indexes for seq in traj.sequences] == [[0, 1, 2]], traj.sequence_breaks
        assert not traj.sequence_breaks


def test_codex_solves_a_swebench_task(stack, tmp_path):
    """swebench-mini's jpvanhal__inflection-1, the hidden tests run by the verifier in the same image."""
    stack_, settings = stack
    view, elapsed = run_one(stack_, settings, inflection_task(NAME, IMAGE, tmp_path / "repo"))
    turns = len(INFLECTION["turns"])
    assert view.state.value == "completed", view.reason
    assert view.reward == 1.0 and view.steps == turns
    print(f"\nswebench-mini inflection-1 with Codex in {IMAGE}: {elapsed:.1f} s")
    traj = client_of(stack_, settings).wait_trajectory(view.rollout_id, timeout=60)
    check_inflection(traj)
    assert [s.api for s in traj.steps] == ["openai.responses"] * turns
    assert [c.name for s in traj.steps for c in s.tool_calls] == ["exec_command"] * 3
    assert traj.sandbox.result["turns_completed"] == 1
    assert "User identity" in json.dumps(traj.steps[3].request_messages)  # the command's output, back to the model
    check_sequences(traj, turns)
    assert [seq.step_indexes for seq in traj.sequences] == [list(range(turns))], traj.sequence_breaks
    assert not traj.sequence_breaks
