"""The row datasets (SWE-smith, R2E-Gym, SWE-Gym fixtures: real projects, real suites) through the
real stack, as on separate machines (services as processes, no host paths accepted):
``arena tasks import FORMAT`` pushes each task's tree and hidden tests as bundles, ``arena tasks
validate`` runs every oracle (must score 1) and a do-nothing agent (must score 0), and ``arena
tasks audit`` runs the hack agents against every task: none may score above doing nothing. An
agent that looks for R2E-Gym's hidden tests in its sandbox finds none.
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

from arena.sdk import ArenaClient
from arena_core.schemas import AgentSpec, Task
from arena_stack.stack import Stack, free_port_settings

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "datasets"
MIRRORS = ROOT / "examples" / "swebench-mini" / "repos"
sys.path.insert(0, str(FIXTURES))
import row_fixtures as fixture_build  # noqa: E402

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-rows")
    settings = free_port_settings(data_dir, backend_policy_version="", sandbox_concurrency=4, verify_concurrency=2,
                                  allow_host_paths=False)
    stack = Stack(settings, nats_sync="1s", log=lambda m: None, separate_data_dirs=True)
    asyncio.run(stack.start())
    try:
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)
    finally:
        stack.stop()


def arena(stack: Stack, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arena.cli", "--url", stack.settings.rollout_url, *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "ARENA_API_KEY": stack.api_key})


def import_args(fmt: str, tmp: Path) -> list[str]:
    rows = str(FIXTURES / fmt / "dataset.jsonl")
    if fmt == "swe-smith":
        return [rows, "--mirrors", str(MIRRORS), "--profiles", str(FIXTURES / "swe-smith" / "profiles.json")]
    if fmt == "r2e-gym":
        records = [json.loads(line) for line in Path(rows).read_text().splitlines()]
        return [rows, "--roots", str(fixture_build.r2e_roots(records, tmp / "roots"))]
    return [rows, "--mirrors", str(MIRRORS), "--specs", str(ROOT / "examples" / "swebench-mini" / "specs.json")]


@pytest.fixture(scope="module")
def imported(stack, tmp_path_factory) -> dict[str, Path]:
    stack_, _ = stack
    tmp = tmp_path_factory.mktemp("imports")
    out = {}
    for fmt in ("swe-smith", "r2e-gym", "swe-gym"):
        done = arena(stack_, "tasks", "import", fmt, *import_args(fmt, tmp), "--out", str(tmp / fmt))
        assert done.returncode == 0, done.stdout + done.stderr
        out[fmt] = tmp / fmt
    return out


@pytest.mark.parametrize("fmt", ["swe-smith", "r2e-gym", "swe-gym"])
def test_import_then_validate_each_format(stack, imported, fmt):
    stack_, _ = stack
    tasks = sorted(imported[fmt].glob("*.json"))
    assert len(tasks) == 3
    for path in tasks:
        task = msgspec.json.decode(path.read_bytes(), type=Task)
        assert task.source.__struct_config__.tag == "bundle" and task.metadata["dataset"] == fmt
        assert (imported[fmt] / "gold" / f"{task.id}.patch").is_file()
    validated = arena(stack_, "tasks", "validate", str(imported[fmt]), "-v")
    print(validated.stdout)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "3/3 valid" in validated.stdout


def test_an_r2e_agent_finds_no_hidden_tests_in_its_sandbox(stack, imported):
    """The agent looks for R2E-Gym's hidden tests everywhere it can read: by name (r2e_tests,
    run_tests.sh) and by the name of a hidden test function (each searched for in two halves:
    the agent's own command is in its task.json)."""
    _, client = stack
    path = sorted(imported["r2e-gym"].glob("*inflection*.json"))[0]
    task = msgspec.json.decode(path.read_bytes(), type=Task)
    name = "test_humanize_strips_only_a_trailing_id"
    assert any(key.startswith(name) for key in task.verifier.expected_statuses)
    spy = (f"A=r2e_; B=tests; C=run_tests; D=.sh; E={name[:10]}; F={name[10:]}; "
           "{ find / -xdev \\( -name \"$A$B\" -o -name \"$C$D\" \\) 2>/dev/null;"
           "  grep -rlF \"$E$F\" /sandbox /tmp /root /home /opt /srv /var /r2e_tests /testbed 2>/dev/null; } > /tmp/found;"
           " cp /sandbox/.arena/task.json /tmp/task.json;"
           " python3 -c \"import json; print(json.dumps({'answer': json.dumps({"
           "'task': json.load(open('/tmp/task.json')), 'found': open('/tmp/found').read()})}))\""
           " > /sandbox/.arena/result.json; touch /sandbox/.arena/done")
    view = client.submit(msgspec.structs.replace(task, agent=AgentSpec(command=["sh", "-c", spy])))
    view = client.wait(view.rollout_id, timeout=900)
    assert view.state.value == "completed", view.reason
    traj = client.wait_trajectory(view.rollout_id, timeout=60)
    seen = json.loads(traj.sandbox.result["answer"])
    assert "verifier" not in seen["task"]["task"]
    assert seen["found"] == ""  # neither the hidden tests nor the script are anywhere in the agent's reach
    assert traj.reward == 0.0  # and they are back for the verifier: the unfixed code fails them


def test_audit_finds_no_hack_above_doing_nothing(stack, imported, tmp_path):
    """The hack suite on one task of each format (``make test-datasets`` audits every task in images)."""
    stack_, _ = stack
    one = tmp_path / "one-of-each"
    one.mkdir()
    for fmt in ("swe-smith", "r2e-gym", "swe-gym"):
        path = sorted(imported[fmt].glob("*.json"))[0]
        shutil.copy(path, one / path.name)
    audited = arena(stack_, "tasks", "audit", str(one), "-v")
    print(audited.stdout[-8000:])
    assert audited.returncode == 0, audited.stdout + audited.stderr
    hacks = 9
    assert f"hacks above a do-nothing agent: 0/{3 * hacks} (0.0%)" in audited.stdout
