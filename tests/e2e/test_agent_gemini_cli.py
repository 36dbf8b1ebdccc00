"""Gemini CLI, unmodified (npm ``@google/gemini-cli`` in ``arena/gemini-cli``), in a docker sandbox
(Podman) through the real stack: it talks the Gemini API (``models/{model}:streamGenerateContent``,
``contents`` of ``parts``, ``functionCall`` / ``functionResponse``) to Arena's proxy
(``GOOGLE_GEMINI_BASE_URL``), which translates each call to the scripted backend's chat completions
and the answer back; the backend plays Gemini CLI's own tools (``read_file``, ``replace``,
``run_shell_command``); Gemini CLI runs them in the sandbox and ends; Arena captures each call as a
step (``gemini.generate_content``), verifies the workspace and keeps Gemini CLI's stream-json events
and its session record as artifacts.

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

IMAGE = "arena/gemini-cli:latest"
NAME = "gemini-cli"

pytestmark = [pytest.mark.timeout(900)]

if proxy_routes.route_of(b"POST", b"/proxy/r1/v1beta/models/m:streamGenerateContent?alt=sse", "/proxy/r1") is None:
    pytest.skip("the proxy has no Gemini API route", allow_module_level=True)


def play(label: str, patch: str) -> dict:
    """Read the file, patch it and run the tests (one shell command), then a final answer: three calls."""
    return {"label": label, "match": "textstats", "weight": 0.5, "turns": [
        {"content": "Let me read the median function.", "tool_calls": [tool("read_file", file_path=MEDIAN)]},
        {"content": "The middle pair is off by one; fixing it and running the tests.",
         "tool_calls": [tool("run_shell_command", command=f"{patch} && {TESTS}",
                             description="Fix median and run the tests")]},
        {"content": "Fixed `median` for even-length lists."},
    ]}


#: swebench-mini's jpvanhal__inflection-1 (its problem statement starts "humanize() eats"): read the
#: module, replace the regex, run the issue's example, then a final answer: four calls.
INFLECTION = {"label": "inflection", "match": "humanize() eats", "turns": [
    {"content": "Let me look at humanize.",
     "tool_calls": [tool("read_file", file_path=HUMANIZE, start_line=180, end_line=210)]},
    {"content": "The regex strips `_id` anywhere; anchor it at the end.",
     "tool_calls": [tool("replace", file_path=HUMANIZE, instruction="Strip only a trailing _id in humanize.",
                         old_string=BUGGY, new_string=FIXED)]},
    {"content": "Checking the example from the issue.",
     "tool_calls": [tool("run_shell_command", command=CHECK, description="Check humanize")]},
    {"content": "`humanize` now strips only a trailing `_id`."},
]}

SCRIPT = {"plays": [play("right", FIX), play("wrong", WRONG), INFLECTION]}
TURNS = 3


@pytest.fixture(scope="module")
def engine(docker_url):
    return require_image(docker_url, IMAGE)


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-gemini-cli")
    script = data_dir / "script.json"
    script.write_text(json.dumps(SCRIPT))
    with docker_stack(engine, data_dir, script, "gm") as (stack, settings):
        yield stack, settings


def test_gemini_cli_solves_the_quickstart_task_and_a_wrong_script_scores_zero(stack):
    stack_, settings = stack
    views, elapsed = run_group(stack_, settings, scaffold_task(NAME, IMAGE))
    assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
    assert [v.reward for v in views] == [0.0, 1.0]
    assert [v.steps for v in views] == [TURNS, TURNS]
    print(f"\ntwo quickstart rollouts with Gemini CLI in {IMAGE} (concurrently): {elapsed:.1f} s")

    client = client_of(stack_, settings)
    for view, expected in zip(views, PATCHED, strict=True):
        traj = client.wait_trajectory(view.rollout_id, timeout=60)
        assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
        assert f"+    return {expected}" in traj.sandbox.diff
        assert [s.api for s in traj.steps] == ["gemini.generate_content"] * TURNS
        assert [c.name for s in traj.steps for c in s.tool_calls] == ["read_file", "run_shell_command"]
        for step in traj.steps:
            assert step.stream  # streamGenerateContent
        # the preset's result: Gemini CLI's own final `result` event
        result = traj.sandbox.result
        assert result["exit_code"] == 0 and result["status"] == "success"
        assert result["stats"]["tool_calls"] == 2
        # Gemini CLI really ran the tools in the sandbox: both succeeded in its events (which show
        # no output for read_file), their outputs are in its session record
        events = [json.loads(line) for line in artifact(stack_, traj, "gemini-cli.events.jsonl").splitlines()]
        assert [e["status"] for e in events if e.get("type") == "tool_result"] == ["success", "success"]
        session = artifact(stack_, traj, "gemini-cli.session.jsonl").decode()
        assert result["session_id"] in session
        assert "return (ordered[mid] + ordered[mid + 1]) / 2" in session  # read_file, before the fix
        assert ("7 passed" in session) == (view.reward == 1.0)  # pytest in the sandbox
        # the second call carried the file's content back to the model (functionResponse -> tool)
        assert "ordered[mid + 1]" in json.dumps(traj.steps[1].request_messages)
        check_sequences(traj, TURNS)
        assert [seq.step_indexes for seq in traj.sequences] == [[0, 1, 2]], traj.sequence_breaks
        assert not traj.sequence_breaks


def test_gemini_cli_solves_a_swebench_task(stack, tmp_path):
    """swebench-mini's jpvanhal__inflection-1, the hidden tests run by the verifier in the same image."""
    stack_, settings = stack
    view, elapsed = run_one(stack_, settings, inflection_task(NAME, IMAGE, tmp_path / "repo"))
    turns = len(INFLECTION["turns"])
    assert view.state.value == "completed", view.reason
    assert view.reward == 1.0 and view.steps == turns
    print(f"\nswebench-mini inflection-1 with Gemini CLI in {IMAGE}: {elapsed:.1f} s")
    traj = client_of(stack_, settings).wait_trajectory(view.rollout_id, timeout=60)
    check_inflection(traj)
    assert [s.api for s in traj.steps] == ["gemini.generate_content"] * turns
    assert [c.name for s in traj.steps for c in s.tool_calls] == ["read_file", "replace", "run_shell_command"]
    assert traj.sandbox.result["status"] == "success"
    assert "User identity" in json.dumps(traj.steps[3].request_messages)  # the shell's output, back to the model
    check_sequences(traj, turns)
    assert [seq.step_indexes for seq in traj.sequences] == [list(range(turns))], traj.sequence_breaks
    assert not traj.sequence_breaks
