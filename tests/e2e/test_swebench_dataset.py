"""A real SWE-bench-format dataset through the real stack, as on separate machines.

The services run as processes, each with its own data directory and no host paths
accepted: `arena tasks import swebench` checks every instance out of its local mirror and
uploads it as a bundle; `arena tasks validate` runs each instance's gold patch (must score
1) and an empty patch (must score 0). Then the agent's view: the task file inside the
sandbox holds no verifier, and an agent that reads what it can see cannot find the hidden tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from arena_core.schemas import AgentSpec, Task
from arena.sdk import ArenaClient
from arena_stack.stack import Stack, free_port_settings

DATASET = Path(__file__).resolve().parents[2] / "examples" / "swebench-mini"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-swebench")
    settings = free_port_settings(data_dir, backend_policy_version="", sandbox_concurrency=4, verify_concurrency=2,
                                  allow_host_paths=False)
    stack = Stack(settings, nats_sync="1s", log=lambda m: None, separate_data_dirs=True)
    asyncio.run(stack.start())
    try:
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)
    finally:
        stack.stop()


def arena(stack: Stack, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arena.cli", "--url", stack.settings.rollout_url, *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "ARENA_API_KEY": stack.api_key})


def test_import_and_validate_the_dataset(stack, tmp_path):
    stack_, client = stack
    out = tmp_path / "tasks"
    imported = arena(stack_, "tasks", "import", "swebench", str(DATASET / "dataset.jsonl"), "--mirrors",
                     str(DATASET / "repos"), "--specs", str(DATASET / "specs.json"), "--out", str(out))
    assert imported.returncode == 0, imported.stderr
    rows = [json.loads(line) for line in (DATASET / "dataset.jsonl").read_text().splitlines()]
    assert len(rows) >= 4
    for row in rows:
        task = msgspec.json.decode((out / f"{row['instance_id']}.json").read_bytes(), type=Task)
        assert task.source is not None and task.source.__struct_config__.tag == "bundle"
        assert task.verifier.fail_to_pass == json.loads(row["FAIL_TO_PASS"])
        assert task.verifier.test_patch == row["test_patch"]
        assert (out / "gold" / f"{row['instance_id']}.patch").read_text() == row["patch"]

    validated = arena(stack_, "tasks", "validate", str(out), "-v")
    print(validated.stdout)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert f"{len(rows)}/{len(rows)} valid" in validated.stdout
    # every sandbox and verification worker read the task from NATS alone
    assert not (Path(stack_.data_dir) / "services" / "sandbox" / "staging").exists() or not any(
        (Path(stack_.data_dir) / "services" / "sandbox" / "staging").iterdir())


def test_the_agent_sees_the_task_never_the_verifier(stack, tmp_path):
    stack_, client = stack
    out = tmp_path / "tasks"
    row = json.loads((DATASET / "dataset.jsonl").read_text().splitlines()[0])
    (tmp_path / "one.jsonl").write_text(json.dumps(row) + "\n")
    imported = arena(stack_, "tasks", "import", "swebench", str(tmp_path / "one.jsonl"), "--mirrors",
                     str(DATASET / "repos"), "--out", str(out))
    assert imported.returncode == 0, imported.stderr
    task = msgspec.json.decode((out / f"{row['instance_id']}.json").read_bytes(), type=Task)
    hidden_test = [line[1:].strip() for line in row["test_patch"].splitlines()
                   if line.startswith("+def test_")][0].split("(")[0]
    # An agent that copies everything it can read into its answer.
    # (the name is searched for in two halves: the agent's own command is in its task.json)
    half = len(hidden_test) // 2
    spy = ("cat /sandbox/.arena/task.json > /tmp/task.json; "
           f"A={hidden_test[:half]!r}; B={hidden_test[half:]!r}; "
           "grep -rlF \"$A$B\" /sandbox /tmp 2>/dev/null > /tmp/found;"
           " git -C /sandbox/workspace log --all --oneline | wc -l > /tmp/commits;"
           " git -C /sandbox/workspace for-each-ref | wc -l > /tmp/refs;"
           " python3 -c \"import json; print(json.dumps({'answer': json.dumps({"
           "'task': json.load(open('/tmp/task.json')), 'found': open('/tmp/found').read(),"
           " 'commits': open('/tmp/commits').read().strip(), 'refs': open('/tmp/refs').read().strip()})}))\""
           " > /sandbox/.arena/result.json; touch /sandbox/.arena/done")
    view = client.submit(msgspec.structs.replace(task, agent=AgentSpec(command=["sh", "-c", spy])))
    view = client.wait(view.rollout_id, timeout=300)
    assert view.state.value == "completed", view.reason
    traj = client.wait_trajectory(view.rollout_id, timeout=60)
    seen = json.loads(traj.sandbox.result["answer"])
    task_file = seen["task"]  # /sandbox/.arena/task.json: {"rollout_id", "task"}
    assert task_file["rollout_id"] == view.rollout_id and task_file["task"]["id"] == task.id
    assert "verifier" not in task_file["task"] and task_file["task"]["instructions"] == task.instructions
    assert seen["found"] == ""  # the hidden test is nowhere in the agent's reach
    assert (seen["commits"], seen["refs"]) == ("1", "1")  # one base commit, one branch: no history
    assert traj.reward == 0.0 and traj.verification.counts.f2p_failed == len(task.verifier.fail_to_pass)
    # nor in the API's view of the rollout
    raw = client._http.get(f"/v1/rollouts/{view.rollout_id}").text
    assert "fail_to_pass" not in raw and hidden_test not in raw
