"""Harbor and Terminal-Bench datasets through the real stack: `arena tasks import` (the Harbor dataset
through its dataset.toml, digests checked), `arena images build` (each task's Dockerfile with Podman,
offline, its base mapped to a local image), `arena tasks validate --runs 3` (each oracle scores 1
and a do-nothing agent 0, every time) in docker sandboxes (Podman's engine); then Harbor's grading
rule as it lands in the trajectory (named metrics beside the reward, a multi-step task's turn per
step, each step graded on its own turn's state, stopped at its first step under its minimum), and
what an agent can see (neither tests nor solution).

Needs the Docker-API engine (``docker_url``) and ``arena/quickstart`` on it (``make images``);
``make test-datasets`` runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.schemas import AgentSpec

from tests.e2e.scaffold_stacks import docker_stack, require_image

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "datasets"
BASE = "localhost/arena/quickstart:latest"
BASE_MAP = f"ubuntu:24.04={BASE}"
SCRIPT = ROOT / "examples" / "quickstart" / "llm_script.json"

pytestmark = [pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def stack(docker_url, tmp_path_factory):
    engine = require_image(docker_url, "arena/quickstart:latest")
    data_dir = tmp_path_factory.mktemp("arena-harbor")
    with docker_stack(engine, data_dir, SCRIPT, "hb") as (stack, settings):
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)


def arena(stack, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "arena.cli", "--url", stack.settings.rollout_url, *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "ARENA_API_KEY": stack.api_key})
    print(done.stdout[-6000:], done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def imported(stack, tmp_path_factory):
    """Both datasets imported and their images built; the output directories."""
    stack_, _ = stack
    out = tmp_path_factory.mktemp("imported")
    harbor, tbench = out / "harbor", out / "terminal-bench"
    assert arena(stack_, "tasks", "import", "harbor", str(FIXTURES / "harbor" / "dataset.toml"),
                 "--out", str(harbor)).returncode == 0
    assert arena(stack_, "tasks", "import", "terminal-bench", str(FIXTURES / "terminal-bench"),
                 "--out", str(tbench)).returncode == 0
    built = arena(stack_, "images", "build", str(harbor), str(tbench), "--base-map", BASE_MAP)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "7/7 task image(s) ready" in built.stdout
    again = arena(stack_, "images", "build", str(tbench), "--base-map", BASE_MAP)
    assert again.stdout.count(": cached ") == 3, again.stdout  # the digest of the inputs: kept
    return harbor, tbench


def test_harbor_dataset_validates_oracle_one_and_null_zero_on_every_run(stack, imported):
    stack_, _ = stack
    harbor, _ = imported
    validated = arena(stack_, "tasks", "validate", str(harbor), "--runs", "3", "-v")
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "4/4 valid (3 runs each)" in validated.stdout
    assert "INVALID" not in validated.stdout


def test_terminal_bench_dataset_validates_oracle_one_and_null_zero_on_every_run(stack, imported):
    stack_, _ = stack
    _, tbench = imported
    validated = arena(stack_, "tasks", "validate", str(tbench), "--runs", "3", "-v")
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "3/3 valid (3 runs each)" in validated.stdout


def test_named_metrics_from_reward_json_are_kept_beside_the_reward(stack, imported):
    _, client = stack
    harbor, _ = imported
    task = load_task(harbor / "arena-fixtures.fix-mean.json")
    fix = AgentSpec(command=["sh", "-c", "sed -i 's|(len(values) + 1)|len(values)|' /app/stats.py; "
                                         "mkdir -p /sandbox/.arena && touch /sandbox/.arena/done"])
    view = client.submit(msgspec.structs.replace(task, agent=fix), provider="docker")
    view = client.wait(view.rollout_id, timeout=600)
    assert view.reward == 1.0, view.reason
    traj = client.wait_trajectory(view.rollout_id, timeout=60)
    assert traj.verification.verifier == "reward_file"
    assert traj.verification.components == {"reward": 1.0, "checks_passed": 3.0, "share": 1.0}
    assert "3/3 checks passed" in traj.verification.log_tail


def per_step(**turns: str) -> AgentSpec:
    """An agent whose turn runs the shell of its step (``ARENA_STEP``), then writes done."""
    cases = " ".join(f"{name}) {body};;" for name, body in turns.items())
    return AgentSpec(command=["sh", "-c", f'case "$ARENA_STEP" in {cases} esac; '
                                          "mkdir -p /sandbox/.arena && touch /sandbox/.arena/done"])


def test_a_multi_step_task_gives_a_turn_per_step_and_grades_each_on_its_own_state(stack, imported):
    _, client = stack
    harbor, _ = imported
    task = load_task(harbor / "arena-fixtures.csv-pipeline.json")
    csv = "printf 'name,amount\\na,1\\nb,2\\nc,4\\n' > /app/data.csv"
    agents = {
        "right-then-wrong": per_step(**{"write-csv": csv, "summarize": "echo 8 > /app/total.txt"}),
        "wrong-first": per_step(**{"write-csv": "true", "summarize": "echo 7 > /app/total.txt"}),
        # step 1 is graded on what its own turn left, whatever turn 2 does to it later
        "undo-later": per_step(**{"write-csv": csv, "summarize": "rm /app/data.csv; echo 7 > /app/total.txt"}),
    }
    views = {name: client.submit(msgspec.structs.replace(task, agent=a), provider="docker")
             for name, a in agents.items()}
    ended = {name: client.wait(v.rollout_id, timeout=600) for name, v in views.items()}
    traj = {name: client.wait_trajectory(v.rollout_id, timeout=60) for name, v in ended.items()}
    # each step its own turn, the diff taken after each
    turns = traj["right-then-wrong"].sandbox.step_turns
    assert [(t.name, t.completed) for t in turns] == [("write-csv", True), ("summarize", True)]
    assert "data.csv" in turns[0].diff and "total.txt" not in turns[0].diff and "total.txt" in turns[1].diff
    # step 1 passed (1), step 2 did not (0): the mean of both, each step's rewards named beside it
    assert ended["right-then-wrong"].reward == 0.5, ended["right-then-wrong"].reason
    components = traj["right-then-wrong"].verification.components
    assert components["write-csv.reward"] == 1.0 and components["summarize.reward"] == 0.0
    assert components["summarize.total_ok"] == 0.0
    # step 1 under its minimum: the step gate ends the rollout there (step 2 gets no turn), grading
    # stops there; step 2 (which would pass) never counts
    assert [t.name for t in traj["wrong-first"].sandbox.step_turns] == ["write-csv"]
    assert ended["wrong-first"].reward == 0.0, ended["wrong-first"].reason
    assert "stopped after step write-csv" in traj["wrong-first"].verification.reason
    assert "summarize.reward" not in traj["wrong-first"].verification.components
    assert ended["undo-later"].reward == 1.0, ended["undo-later"].reason
    assert traj["undo-later"].verification.components["write-csv.reward"] == 1.0


def test_the_agent_sees_neither_tests_nor_solution(stack, imported):
    _, client = stack
    _, tbench = imported
    task = load_task(tbench / "hello-world.json")
    look = ("(ls -la /tests /solution /logs/verifier; cat /tests/test_outputs.py /tests/test.sh /solution/solve.sh; "
            "cat /sandbox/.arena/task.json; find / -name 'test_outputs.py' -o -name 'solution.sh' -o -name "
            "'run-tests.sh' 2>/dev/null) > /app/seen.txt 2>&1; mkdir -p /sandbox/.arena && touch /sandbox/.arena/done")
    view = client.submit(msgspec.structs.replace(task, agent=AgentSpec(command=["sh", "-c", look])), provider="docker")
    view = client.wait(view.rollout_id, timeout=600)
    assert view.reward == 0.0, view.reason
    diff = client.wait_trajectory(view.rollout_id, timeout=60).sandbox.diff
    assert "seen.txt" in diff
    assert "test_hello_file_content" not in diff and "reward.txt" not in diff and "echo \"Hello" not in diff
    assert '"verifier"' not in diff and "reward_file" not in diff


def test_a_digest_mismatch_refuses_the_task_and_a_missing_base_fails_its_build(stack, tmp_path):
    stack_, _ = stack
    dataset = tmp_path / "harbor"
    subprocess.run(["cp", "-r", str(FIXTURES / "harbor"), str(dataset)], check=True)
    (dataset / "word-count" / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    refused = arena(stack_, "tasks", "import", "harbor", str(dataset / "dataset.toml"), "--out", str(tmp_path / "o"))
    assert refused.returncode == 2
    assert "task arena-fixtures/word-count: digest mismatch" in refused.stderr and "refused" in refused.stderr
    tasks = tmp_path / "one"
    assert arena(stack_, "tasks", "import", "harbor", str(dataset / "word-count"), "--out", str(tasks)).returncode == 0
    (tasks / "environments" / "arena-fixtures.word-count" / "Dockerfile").write_text("FROM ubuntu:24.04\n")
    changed = arena(stack_, "images", "build", str(tasks), "--base-map", BASE_MAP)
    assert changed.returncode == 1 and "changed since the import" in changed.stdout
    assert arena(stack_, "tasks", "import", "harbor", str(dataset / "word-count"), "--out", str(tasks)).returncode == 0
    validated = arena(stack_, "tasks", "validate", str(tasks), "--build", "--base-map", "")
    assert validated.returncode == 1
    assert "build: base image ubuntu:24.04 is not in the local store" in validated.stdout
    logs = json.dumps([p.name for p in (tasks / "build-logs").iterdir()])
    assert "arena-fixtures.word-count.log" in logs
