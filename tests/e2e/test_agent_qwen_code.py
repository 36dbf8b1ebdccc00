"""Qwen Code, unmodified (npm ``@qwen-code/qwen-code`` in ``arena/qwen-code``), in a docker sandbox
(Podman) through the real stack: its OpenAI chat calls go through Arena's proxy to the scripted
backend, which plays Qwen Code's own tools (``read_file``, ``edit``, ``run_shell_command``); Qwen Code
runs them in the sandbox and ends; Arena captures each call as a step, verifies the workspace (the
quickstart's tests; swebench-mini's hidden tests, run in the same image) and keeps Qwen Code's
stream-json events and its session record as artifacts.

Needs the image (``make images``) and a Docker-API engine (the ``docker_url`` fixture); skipped
without them. ``make test-agents`` builds the images and runs this file.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.scaffold_cases import (BUGGY, CHECK, FIX, FIXED, HUMANIZE, MEDIAN, PATCHED, TESTS, WRONG, artifact,
                                      check_inflection, check_sequences, client_of, inflection_task, run_group, run_one,
                                      scaffold_task, tool)
from tests.e2e.scaffold_stacks import docker_stack, require_image

IMAGE = "arena/qwen-code:latest"
NAME = "qwen-code"

pytestmark = [pytest.mark.timeout(900)]


def play(label: str, patch: str) -> dict:
    """Read the file, patch it and run the tests (one shell command), then a final answer: three calls."""
    return {"label": label, "match": "textstats", "weight": 0.5, "turns": [
        {"content": "Let me read the median function.", "tool_calls": [tool("read_file", file_path=MEDIAN)]},
        {"content": "The middle pair is off by one; fixing it and running the tests.",
         "tool_calls": [tool("run_shell_command", command=f"{patch} && {TESTS}",
                             description="Fix median and run the tests", is_background=False)]},
        {"content": "Fixed `median` for even-length lists."},
    ]}


#: swebench-mini's jpvanhal__inflection-1 (its problem statement starts "humanize() eats"): read the
#: module, edit the regex, run the issue's example, then a final answer: four calls.
INFLECTION = {"label": "inflection", "match": "humanize() eats", "turns": [
    {"content": "Let me look at humanize.",
     "tool_calls": [tool("read_file", file_path=HUMANIZE, offset=180, limit=30)]},
    {"content": "The regex strips `_id` anywhere; anchor it at the end.",
     "tool_calls": [tool("edit", file_path=HUMANIZE, old_string=BUGGY, new_string=FIXED)]},
    {"content": "Checking the example from the issue.",
     "tool_calls": [tool("run_shell_command", command=CHECK, description="Check humanize", is_background=False)]},
    {"content": "`humanize` now strips only a trailing `_id`."},
]}

# seeds 0 and 1 draw the second and the first quickstart play (weights 0.5/0.5); the inflection
# play matches only its own task
SCRIPT = {"plays": [play("right", FIX), play("wrong", WRONG), INFLECTION]}
TURNS = 3


@pytest.fixture(scope="module")
def engine(docker_url):
    return require_image(docker_url, IMAGE)


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-qwen-code")
    script = data_dir / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with docker_stack(engine, data_dir, script, "qw") as (stack, settings):
        yield stack, settings


def test_qwen_code_solves_the_quickstart_task_and_a_wrong_script_scores_zero(stack):
    stack_, settings = stack
    views, elapsed = run_group(stack_, settings, scaffold_task(NAME, IMAGE))
    assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
    assert [v.reward for v in views] == [0.0, 1.0]
    assert [v.steps for v in views] == [TURNS, TURNS]
    print(f"\ntwo quickstart rollouts with Qwen Code in {IMAGE} (concurrently): {elapsed:.1f} s")

    client = client_of(stack_, settings)
    for view, expected in zip(views, PATCHED, strict=True):
        traj = client.wait_trajectory(view.rollout_id, timeout=60)
        assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
        assert f"+    return {expected}" in traj.sandbox.diff
        assert [s.api for s in traj.steps] == ["openai.chat"] * TURNS
        assert [c.name for s in traj.steps for c in s.tool_calls] == ["read_file", "run_shell_command"]
        for step in traj.steps:
            assert step.stream
        # the preset's result: Qwen Code's own final `result` event
        result = traj.sandbox.result
        assert result["exit_code"] == 0 and result["subtype"] == "success" and result["is_error"] is False
        assert result["num_turns"] == TURNS
        # Qwen Code really ran the tools in the sandbox: their outputs are in its events and session
        events = [json.loads(line) for line in artifact(stack_, traj, "qwen-code.events.jsonl").splitlines()]
        outputs = [json.dumps(block.get("content")) for e in events if e.get("type") == "user"
                   for block in e["message"]["content"] if isinstance(block, dict) and block.get("type") == "tool_result"]
        assert len(outputs) == 2
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in outputs[0]  # read_file, before the fix
        assert ("7 passed" if view.reward == 1.0 else "failed") in outputs[1]  # pytest in the sandbox
        session = artifact(stack_, traj, "qwen-code.session.jsonl")
        assert result["session_id"].encode() in session
        assert (b"7 passed" in session) == (view.reward == 1.0)
        # the second call carried the file's content back to the model as a tool message
        assert "ordered[mid + 1]" in json.dumps(traj.steps[1].request_messages)
        # one training sequence: every call's prompt extends the one before token for token
        check_sequences(traj, TURNS)
        assert [seq.step_indexes for seq in traj.sequences] == [[0, 1, 2]], traj.sequence_breaks
        assert not traj.sequence_breaks


def test_qwen_code_solves_a_swebench_task(stack, tmp_path):
    """swebench-mini's jpvanhal__inflection-1, the hidden tests run by the verifier in the same image
    (Python 3.11 and pytest from ``arena/agent-node``)."""
    stack_, settings = stack
    view, elapsed = run_one(stack_, settings, inflection_task(NAME, IMAGE, tmp_path / "repo"))
    turns = len(INFLECTION["turns"])
    assert view.state.value == "completed", view.reason
    assert view.reward == 1.0 and view.steps == turns
    print(f"\nswebench-mini inflection-1 with Qwen Code in {IMAGE}: {elapsed:.1f} s")
    traj = client_of(stack_, settings).wait_trajectory(view.rollout_id, timeout=60)
    check_inflection(traj)
    assert [s.api for s in traj.steps] == ["openai.chat"] * turns
    assert [c.name for s in traj.steps for c in s.tool_calls] == ["read_file", "edit", "run_shell_command"]
    assert traj.sandbox.result["num_turns"] == turns and traj.sandbox.result["subtype"] == "success"
    assert "User identity" in json.dumps(traj.steps[3].request_messages)  # the shell's output, back to the model
    check_sequences(traj, turns)
    assert [seq.step_indexes for seq in traj.sequences] == [list(range(turns))], traj.sequence_breaks
    assert not traj.sequence_breaks
