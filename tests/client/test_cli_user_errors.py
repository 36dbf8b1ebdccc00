"""A user's mistake ends the real ``arena`` command (run as a process) in one line on stderr,
``arena: ...``, and exit status 2, never a traceback: a missing or malformed file, an unknown
choice, a stack that is not running. An export whose filter matches nothing says so on stderr,
with the task ids it may have meant (from a real trajectory API), and exits 1."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import uvicorn

from arena_stack.natsserver import free_port
from arena_trajectory.app import create_app
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.store import TrajectoryStore

from tests.client.test_export import trajectory

pytestmark = pytest.mark.timeout(180)

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


def arena(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it, in ``cwd`` (no ``.arena`` there unless the test makes one)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ARENA_")}
    return subprocess.run([sys.executable, "-m", "arena.cli", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("arena: "), done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)
    return lines[0]


def test_an_llm_script_that_does_not_exist_is_named_before_anything_starts(tmp_path):
    line = one_line_error(arena("up", "--llm-script", "typo.json", "--data-dir", str(tmp_path / "d"), cwd=tmp_path))
    assert "--llm-script typo.json" in line and "No such file" in line
    assert not (tmp_path / "d" / "nats").exists()  # nothing was started


def test_an_llm_script_that_is_not_json_is_named(tmp_path):
    (tmp_path / "script.json").write_text('{"responses": [')
    line = one_line_error(arena("up", "--llm-script", "script.json", "--data-dir", str(tmp_path / "d"),
                                cwd=tmp_path))
    assert "--llm-script script.json is not a script" in line


def test_a_completion_policy_without_a_group_is_refused_before_any_call(tmp_path):
    line = one_line_error(arena("submit", str(QUICKSTART), "--first-k", "2", cwd=tmp_path))
    assert line.endswith("--first-k and --deadline are a group's completion policy: give --n N (N >= 2)")


def test_a_task_path_that_does_not_exist(tmp_path):
    line = one_line_error(arena("submit", "examples/nowhere", cwd=tmp_path))
    assert line.endswith("task file not found: examples/nowhere")


def test_a_task_file_with_bad_json_or_an_unknown_enum_value(tmp_path):
    (tmp_path / "broken.json").write_text('{"id": "t",')
    assert "not valid JSON" in one_line_error(arena("submit", "broken.json", cwd=tmp_path))
    task = (QUICKSTART / "task.json").read_text()
    (tmp_path / "enum.json").write_text(task.replace('"type": "tests"', '"type": "testz"', 1))
    line = one_line_error(arena("submit", "enum.json", cwd=tmp_path))
    assert "invalid task file enum.json" in line and "'testz'" in line


def test_an_unknown_choice_is_one_line_not_the_usage(tmp_path):
    line = one_line_error(arena("export", "--view", "grpoo", "--out", "x", cwd=tmp_path))
    assert "invalid choice: 'grpoo'" in line and "arena export --help" in line
    assert "invalid choice: 'done'" in one_line_error(arena("status", "--state", "done", cwd=tmp_path))


def test_a_verifier_file_that_does_not_exist(tmp_path):
    line = one_line_error(arena("verify", "r1", "--verifier", "typo.json", cwd=tmp_path))
    assert "typo.json" in line


def test_an_id_that_cannot_be_in_a_url_is_one_line(tmp_path):
    # two ids captured by a shell's $(...) (a newline between them), passed as one
    line = one_line_error(arena("verify", "r-1\nr-1", "--verifier", '{"type": "exact", "answers": ["1"]}',
                                cwd=tmp_path))
    assert line.startswith("arena: invalid_request: '/v1/trajectories/r-1\\nr-1' cannot be asked for")


@pytest.mark.parametrize("command", [["status"], ["trajectory", "r1"], ["submit", str(QUICKSTART)],
                                     ["export", "--view", "sft", "--format", "jsonl", "--out", "x.jsonl"]])
def test_a_stack_that_is_not_running_is_named_with_arena_up(tmp_path, command):
    url, traj_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    line = one_line_error(arena(*command, "--url", url, "--trajectory-url", traj_url, cwd=tmp_path))
    named = traj_url if command[0] in ("trajectory", "export") else url
    assert f"nothing answers at {named}" in line and "`arena up`" in line


@pytest.fixture
async def trajectory_api(tmp_path):
    """The trajectory API (real uvicorn, chDB store) holding groups of tasks calc.add and calc.sub."""
    store = TrajectoryStore(ChdbBackend(tmp_path / "data" / "clickhouse"))
    await store.init()
    await store.insert_trajectories([trajectory(g, i, "calc.add" if g % 3 else "calc.sub", g % 2)
                                     for g in range(6) for i in range(2)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(store), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        await store.close()


async def test_an_export_filter_that_matches_nothing_names_the_near_task_ids_and_exits_1(trajectory_api, tmp_path):
    def export(*filters: str) -> subprocess.CompletedProcess[str]:
        return arena("export", "--view", "sft", "--format", "jsonl", "--out", "sft.jsonl", "--quiet", *filters,
                     cwd=tmp_path, env={"ARENA_TRAJECTORY_URL": trajectory_api})

    typo = await asyncio.to_thread(export, "--task-id", "calc")
    assert typo.returncode == 1 and "Traceback" not in typo.stderr
    assert f"no trajectory in {trajectory_api} matches --task-id calc" in typo.stderr
    assert "task ids near 'calc': calc.add, calc.sub" in typo.stderr
    assert "task ids near 'calc.sbu': calc.sub" in (await asyncio.to_thread(export, "--task-id", "calc.sbu")).stderr
    later = await asyncio.to_thread(export, "--task-id", "calc.add", "--since", "4000000000")
    assert later.returncode == 1 and "task 'calc.add' is stored: the other filters leave none" in later.stderr
    found = await asyncio.to_thread(export, "--task-id", "calc.sub")
    assert found.returncode == 0 and found.stderr == "" and "from 4 trajectories" in found.stdout
