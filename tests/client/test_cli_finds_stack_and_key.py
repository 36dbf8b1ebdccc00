"""The ``arena`` command (run as a process), ``ArenaClient()`` and the exports find a real stack
(``Stack``, keys on, as ``arena up`` runs it) and its key one way (``arena.endpoints``): flags
before or after the subcommand, then ``ARENA_URL`` / ``ARENA_TRAJECTORY_URL`` / ``ARENA_API_KEY``,
then the key ``arena up`` left in ``$ARENA_DATA_DIR/api-key`` (default ``.arena``). On one
rollout of the quickstart: ``arena trajectory ID`` is a summary, ``--json`` the whole, and a
reader that stops early (``| head``) ends it quietly."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from arena import endpoints
from arena.export_io import ExportFilter, HttpSource, run_export
from arena.sdk import ArenaClient
from arena_core.schemas import Trajectory
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.timeout(600)]



def arena(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in ``cwd`` with no ``ARENA_*`` variable but ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ARENA_")}
    return subprocess.run([sys.executable, "-m", "arena.cli", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=300)


def urls(stack: Stack) -> dict[str, str]:
    return {"ARENA_URL": stack.settings.rollout_url, "ARENA_TRAJECTORY_URL": stack.settings.trajectory_url}


@pytest.fixture(scope="module")
def rollout_id(stack, tmp_path_factory) -> str:
    """One quickstart rollout, submitted by the CLI with the key from ``ARENA_API_KEY``, stored."""
    done = arena("submit", str(QUICKSTART), "--wait", "--timeout", "300", cwd=tmp_path_factory.mktemp("submit"),
                 env={**urls(stack), "ARENA_API_KEY": stack.api_key})
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr
    # stderr is no terminal here: no progress bar, one line for the finished rollout
    assert [line.split(":")[0] for line in done.stderr.splitlines()] == [f"rollouts [1/1] {done.stdout.split()[0]}"]
    rid = done.stdout.split()[0]
    with ArenaClient(stack.settings.rollout_url, stack.settings.trajectory_url, api_key=stack.api_key) as client:
        assert client.wait_trajectory(rid, timeout=60).reward is not None
    return rid


def test_flags_before_or_after_the_subcommand_and_the_key_from_the_data_dir(stack, tmp_path):
    env = {"ARENA_DATA_DIR": str(stack.data_dir)}
    flags = ["--url", stack.settings.rollout_url, "--trajectory-url", stack.settings.trajectory_url]
    after = arena("status", *flags, cwd=tmp_path, env=env)
    assert after.returncode == 0, after.stderr
    before = arena(*flags, "status", cwd=tmp_path, env=env)
    assert before.returncode == 0, before.stderr
    # a flag wins over the environment, wherever it is
    wrong = {**env, "ARENA_URL": f"http://127.0.0.1:{free_port()}"}
    assert arena("status", "--url", stack.settings.rollout_url, cwd=tmp_path, env=wrong).returncode == 0


def test_the_default_data_dir_is_dot_arena_where_the_command_runs(stack, tmp_path):
    local = tmp_path / ".arena"
    local.mkdir(mode=0o700)
    shutil.copy(stack.data_dir / endpoints.LOCAL_KEY_FILE, local / endpoints.LOCAL_KEY_FILE)
    done = arena("status", cwd=tmp_path, env=urls(stack))
    assert done.returncode == 0, done.stderr


def test_a_refused_key_says_where_it_came_from_in_one_line(stack, tmp_path):
    wrong = arena("status", cwd=tmp_path, env={**urls(stack), "ARENA_API_KEY": "ak_0000_nope"})
    lines = wrong.stderr.strip().splitlines()
    assert wrong.returncode == 2 and len(lines) == 1 and "Traceback" not in wrong.stderr
    assert lines[0].startswith("arena: unauthorized:") and "came from ARENA_API_KEY" in lines[0]
    none = arena("status", cwd=tmp_path, env=urls(stack))  # no variable, no .arena here
    assert none.returncode == 2 and "no key sent" in none.stderr and ".arena/api-key" in none.stderr


def test_arena_client_and_http_source_with_no_arguments_find_the_stack_and_key(stack, rollout_id, monkeypatch,
                                                                                 tmp_path):
    for name in [k for k in os.environ if k.startswith("ARENA_")]:
        monkeypatch.delenv(name)
    for name, value in {**urls(stack), "ARENA_DATA_DIR": str(stack.data_dir)}.items():
        monkeypatch.setenv(name, value)
    with ArenaClient() as client:
        assert client.endpoints.key_from == str(stack.data_dir / endpoints.LOCAL_KEY_FILE)
        assert rollout_id in [v.rollout_id for v in client.list()]
        assert client.trajectory(rollout_id).rollout_id == rollout_id
    source = HttpSource(None, ExportFilter(task_id="quickstart-textstats"))
    stats, _ = asyncio.run(run_export(source, view="sft", fmt="jsonl", out=tmp_path / "sft.jsonl"))
    assert source.url == stack.settings.trajectory_url and stats.trajectories >= 1


def test_arena_export_finds_the_key_and_names_the_task_a_filter_nearly_matched(stack, rollout_id, tmp_path):
    env = {**urls(stack), "ARENA_DATA_DIR": str(stack.data_dir)}
    near = arena("export", "--view", "tokens", "--format", "jsonl", "--out", "t.jsonl", "--task-id", "quickstart",
                 cwd=tmp_path, env=env)
    assert near.returncode == 1 and "Traceback" not in near.stderr
    assert "task ids near 'quickstart': quickstart-textstats" in near.stderr
    whole = arena("export", "--view", "tokens", "--format", "jsonl", "--out", "t.jsonl", "--task-id",
                  "quickstart-textstats", cwd=tmp_path, env=env)
    assert whole.returncode == 0, whole.stderr
    # found: a single rollout is no group, so the tokens view skips it (and says so)
    assert "from 1 trajectories" in whole.stdout and "1 not in a group" in whole.stdout


def test_arena_trajectory_is_a_summary_and_json_on_request(stack, rollout_id, tmp_path):
    env = {**urls(stack), "ARENA_DATA_DIR": str(stack.data_dir)}
    summary = arena("trajectory", rollout_id, cwd=tmp_path, env=env)
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    assert len(lines) < 15, summary.stdout
    for label in ("state", "reward", "turns", "tokens", "verification", "flags"):
        assert any(line.startswith(label) for line in lines), (label, summary.stdout)
    assert "FAIL_TO_PASS" in summary.stdout and "prompt" in summary.stdout and "completion" in summary.stdout
    whole = arena("trajectory", rollout_id, "--json", cwd=tmp_path, env=env)
    assert whole.returncode == 0
    assert msgspec.json.decode(whole.stdout, type=Trajectory).rollout_id == rollout_id
    assert len(whole.stdout) > 128 * 1024  # more than a pipe holds (64 KiB): `| head` closes it mid-write

    pipeline = (f"{sys.executable} -m arena.cli trajectory {rollout_id} --json | head -c 100; "
                "status=(\"${PIPESTATUS[@]}\"); echo; echo \"arena exit ${status[0]}\"")
    piped = subprocess.run(["bash", "-c", pipeline], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env={**{k: v for k, v in os.environ.items() if not k.startswith("ARENA_")}, **env})
    assert piped.stdout.startswith("{") and piped.stderr == "", piped.stderr
    assert piped.stdout.endswith("arena exit 141\n")  # the reader went away; the command ended quietly, as SIGPIPE
