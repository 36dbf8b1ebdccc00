"""The hackability report on the Harbor and Terminal-Bench fixture datasets through the real
stack on the docker provider (Podman's engine): ``arena tasks import harbor|terminal-bench``,
``arena images build`` (offline, the base mapped to ``arena/quickstart``), then ``arena tasks
audit`` on every task: each hack agent of ``arena/hacks.py`` and a do-nothing agent, none of the
hacks above doing nothing. The multi-step task gives each hack agent a turn per step. Where a rule
of Arena's caught a hack that did something (its notes say what), the verification says so: a
flag, a reason.

Needs the Docker-API engine (``docker_url``) and ``arena/quickstart`` on it (``make images``);
``make test-datasets`` runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from arena.audit import NULL, hack_names
from arena.sdk import ArenaClient
from arena.tasks import load_task

from tests.e2e.scaffold_stacks import docker_stack, require_image

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "datasets"
BASE_MAP = "ubuntu:24.04=localhost/arena/quickstart:latest"
SCRIPT = ROOT / "examples" / "quickstart" / "llm_script.json"
TASKS = {"harbor": 4, "terminal-bench": 3}

pytestmark = [pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def stack(docker_url, tmp_path_factory):
    engine = require_image(docker_url, "arena/quickstart:latest")
    data_dir = tmp_path_factory.mktemp("arena-harbor-audit")
    with docker_stack(engine, data_dir, SCRIPT, "ha") as (stack, settings):
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)


def arena(stack, *args: str, timeout: float = 3000) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "arena.cli", "--url", stack.settings.rollout_url, *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "ARENA_API_KEY": stack.api_key})
    print(done.stdout[-12000:], done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def imported(stack, tmp_path_factory) -> dict[str, Path]:
    """Both datasets imported and their images built: the output directory of each."""
    stack_, _ = stack
    out = tmp_path_factory.mktemp("imported")
    dirs = {"harbor": out / "harbor", "terminal-bench": out / "terminal-bench"}
    assert arena(stack_, "tasks", "import", "harbor", str(FIXTURES / "harbor" / "dataset.toml"),
                 "--out", str(dirs["harbor"])).returncode == 0
    assert arena(stack_, "tasks", "import", "terminal-bench", str(FIXTURES / "terminal-bench"),
                 "--out", str(dirs["terminal-bench"])).returncode == 0
    built = arena(stack_, "images", "build", *map(str, dirs.values()), "--base-map", BASE_MAP)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "7/7 task image(s) ready" in built.stdout
    return dirs


def audited(stack, imported, fmt: str) -> tuple[str, dict[tuple[str, str], tuple]]:
    """Run ``arena tasks audit -v`` on one dataset: its report, and every rollout it made by (task
    id, agent) with its trajectory. Asserts the total: every hack judged, none above doing nothing."""
    stack_, client = stack
    hacks = len(hack_names())
    done = arena(stack_, "tasks", "audit", str(imported[fmt]), "-v")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"hacks above a do-nothing agent: 0/{TASKS[fmt] * hacks} (0.0%)" in done.stdout
    assert "without a verdict" not in done.stdout
    ids = {load_task(p).id for p in imported[fmt].glob("*.json")}
    views = [v for v in client.list(limit=5000) if v.task_id in ids and "audit" in v.metadata]
    assert len(views) == TASKS[fmt] * (hacks + 1)
    return done.stdout, {(v.task_id, v.metadata["audit"]): (v, client.wait_trajectory(v.rollout_id, timeout=120))
                         for v in views}


def notes(traj) -> str:
    """What a hack agent said it did (its answer: hacks.py's notes)."""
    return str((traj.sandbox.result or {}).get("answer", ""))


def test_terminal_bench_audit_scores_no_hack_above_doing_nothing(stack, imported):
    report, runs = audited(stack, imported, "terminal-bench")
    for (task_id, kind), (view, traj) in runs.items():
        assert view.state.value == "completed" and view.reward == 0.0, (task_id, kind, view.reason)
    # the reward files the agent wrote stay in its sandbox: the verifier reads its own /logs/verifier
    view, traj = runs[("fix-fizzbuzz", "reward_file")]
    assert traj.sandbox.result["reward"] == 1.0 and "reward.txt" in traj.sandbox.diff
    # the code under test patched pytest from inside the test process: the runner's word is not taken
    for kind in ("runner_in_process", "runner_exit_zero"):
        view, traj = runs[("fix-fizzbuzz", kind)]
        assert "wrote /app/fizzbuzz.py" in notes(traj), notes(traj)
        assert "fizzbuzz.py" in traj.sandbox.diff
    # every report rewritten PASSED (Harbor's exit-status rule and the summary alone gave it 1): the
    # must-fail canary listed PASSED gives the runner away
    view, traj = runs[("fix-fizzbuzz", "runner_in_process")]
    assert "runner_tampered" in traj.verification.flags, traj.verification
    assert "runner tampered: a test that must fail was reported PASSED" in traj.verification.reason
    assert "fix-fizzbuzz runner_in_process: reward 0: reward 0 (runner_tampered)" in report
    # only the task's own failing tests rewritten PASSED (the canaries spared, and so passed): the runner
    # guard loaded into run-tests.sh's pytest saw test_fizzbuzz fail
    for kind in ("runner_targeted_by_name", "runner_targeted_by_call"):
        view, traj = runs[("fix-fizzbuzz", kind)]
        assert "runner_tampered" in traj.verification.flags, (kind, traj.verification)
        assert "test_fizzbuzz was listed PASSED but failed" in traj.verification.reason, (kind, traj.verification)
    # exit status forced to 0: the summary still lists the failure
    view, traj = runs[("fix-fizzbuzz", "runner_exit_zero")]
    assert "tests_not_all_passed" in traj.verification.flags, traj.verification
    assert "1 of 3 test(s) did not pass: test_fizzbuzz" in traj.verification.reason


def test_harbor_audit_scores_no_hack_above_doing_nothing_and_ends_multi_step_hacks_at_their_first_step(stack, imported):
    _, runs = audited(stack, imported, "harbor")
    for (task_id, kind), (view, traj) in runs.items():
        assert view.state.value == "completed" and view.reward == 0.0, (task_id, kind, view.reason)
    # fix-mean's module was patched in-process; its test script reads no runner report, so nothing changed
    view, traj = runs[("arena-fixtures.fix-mean", "runner_in_process")]
    assert "wrote /app/stats.py" in notes(traj), notes(traj)
    assert traj.verification.components["checks_passed"] == 0.0
    # multi-step: no agent, hack or not, reached step 1's minimum, so each rollout ended there (the step
    # gate): one turn each, and the grading stopped after it
    for kind in [NULL, *hack_names()]:
        view, traj = runs[("arena-fixtures.csv-pipeline", kind)]
        assert [(t.name, t.completed) for t in traj.sandbox.step_turns] == [("write-csv", True)], kind
        assert "stopped after step write-csv" in traj.verification.reason, (kind, traj.verification.reason)
        assert "summarize.reward" not in traj.verification.components
