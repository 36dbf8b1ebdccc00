"""Writing a task with the ``arena`` command (run as a process): ``tasks init`` writes a skeleton
that ``load_task`` reads; ``tasks shell`` runs commands fed on stdin in the task's bubblewrap sandbox
as its agent would have it (an image task's container: tests/e2e/test_tasks_shell_in_task_image.py);
``tasks check`` runs the oracle (scores 1) and an empty attempt (scores 0) through a real stack with keys on, with a progress line per finished rollout on stderr; ``submit
--scaffold/--model`` runs another agent than the task's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from arena.authoring import with_agent
from arena.tasks import load_task
from arena_core.errors import InvalidRequest
from arena_core.schemas import AgentSpec, ScaffoldSpec, TestsVerifier
from arena_stack.stack import Stack

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def arena(*args: str, cwd: Path, env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ARENA_")}
    return subprocess.run([sys.executable, "-m", "arena.cli", *args], cwd=cwd, env={**base, **(env or {})},
                          input=stdin, capture_output=True, text=True, timeout=400)


def test_init_writes_a_task_load_task_reads_and_refuses_to_overwrite(tmp_path):
    made = arena("tasks", "init", "hello-task", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    task = load_task(tmp_path / "hello-task")
    assert task.id == "hello-task" and isinstance(task.verifier, TestsVerifier)
    assert task.repo == str(tmp_path / "hello-task" / "repo")
    assert (tmp_path / "hello-task" / "gold" / "hello-task.patch").read_text().startswith("diff --git a/greet.py")
    assert task.agent.path == str(tmp_path / "hello-task" / "agent")
    again = arena("tasks", "init", "hello-task", cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.strip().endswith("is not an empty directory: nothing written")
    bad = arena("tasks", "init", "not an id", cwd=tmp_path)
    assert bad.returncode == 2 and "cannot be a task id" in bad.stderr


@needs_bwrap
def test_shell_runs_stdin_in_the_agents_sandbox_and_keeps_nothing(tmp_path):
    assert arena("tasks", "init", "shelled", cwd=tmp_path).returncode == 0
    script = ("pwd; id -u; git log --format=%s; ls /sandbox/agent; "
              "python -c \"import json; t = json.load(open('/sandbox/.arena/task.json'))['task']; "
              "print('verifier', t.get('verifier'))\"; "
              "python -m pytest -q -p no:cacheprovider tests | tail -1; "
              "echo changed > greet.py; exit 7\n")
    ran = arena("tasks", "shell", "shelled", cwd=tmp_path, stdin=script)
    assert ran.returncode == 7, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[:5] == ["/sandbox/workspace", "1000", "base", "agent.py", "verifier None"]
    assert lines[5].startswith("2 failed, 1 passed")  # the bug is there: the verifier's FAIL_TO_PASS fail
    assert "changed" not in (tmp_path / "shelled" / "repo" / "greet.py").read_text()  # the task is untouched
    # a command after -- instead of the shell
    one = arena("tasks", "shell", "shelled", "--", "sh", "-c", "cat greet.py | head -1", cwd=tmp_path)
    assert one.returncode == 0 and one.stdout == '"""Greetings."""\n'


def test_the_command_line_agent_replaces_the_tasks_or_only_its_model():
    task = load_task(QUICKSTART)
    preset = with_agent(task, scaffold="mini-swe-agent", model="qwen-coder")
    assert preset.agent == AgentSpec(scaffold=ScaffoldSpec(name="mini-swe-agent", model="qwen-coder"))
    assert with_agent(task, scaffold=None, model="qwen-coder").agent == task.agent  # a command keeps its command
    scaffolded = msgspec.structs.replace(task, agent=AgentSpec(
        scaffold=ScaffoldSpec(name="opencode", model="a", config={"k": 1}), env={"X": "1"}))
    assert with_agent(scaffolded, scaffold=None, model="b").agent.scaffold == ScaffoldSpec(
        name="opencode", model="b", config={"k": 1})
    other = with_agent(scaffolded, scaffold="claude-code", model=None).agent
    assert other == AgentSpec(scaffold=ScaffoldSpec(name="claude-code", model="a"), env={"X": "1"})
    with pytest.raises(InvalidRequest, match="needs --model"):
        with_agent(task, scaffold="opencode", model=None)



def env_of(stack: Stack) -> dict[str, str]:
    return {"ARENA_URL": stack.settings.rollout_url, "ARENA_TRAJECTORY_URL": stack.settings.trajectory_url,
            "ARENA_DATA_DIR": str(stack.data_dir)}


@needs_bwrap
@pytest.mark.timeout(600)
def test_init_then_check_through_the_stack_oracle_scores_one_and_nothing_zero(stack, tmp_path):
    assert arena("tasks", "init", "greet", cwd=tmp_path).returncode == 0
    checked = arena("tasks", "check", "greet", "-v", cwd=tmp_path, env=env_of(stack))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[1].split() == ["greet", "1", "0", "ok"]
    assert "1/1 valid" in checked.stdout
    # stderr is no terminal: no bar, a line per finished rollout with the counts
    progress = checked.stderr.splitlines()
    assert len(progress) == 2 and all(line.startswith("validate [") for line in progress), checked.stderr
    assert progress[-1].startswith("validate [2/2] greet ") and "2 completed, 0 failed, 0 infrastructure" in progress[-1]

    # a task without its oracle is refused before anything is submitted
    (tmp_path / "greet" / "gold" / "greet.patch").unlink()
    missing = arena("tasks", "check", "greet", cwd=tmp_path, env=env_of(stack))
    assert missing.returncode == 2 and "no oracle solution for task greet" in missing.stderr


@needs_bwrap
@pytest.mark.timeout(600)
def test_submit_with_a_scaffold_and_model_from_the_command_line(stack, tmp_path):
    # the quickstart's own agent is a command; with --scaffold the server is asked for the preset,
    # which this stack's workers cannot launch (nothing installed in its scaffolds directory):
    # refused at submission, naming what to install, rather than failing at run time
    submitted = arena("submit", str(QUICKSTART), "--scaffold", "mini-swe-agent", "--model", "scripted",
                      "--wait", "--timeout", "300", cwd=tmp_path, env=env_of(stack))
    assert "Traceback" not in submitted.stderr, submitted.stderr
    assert submitted.returncode == 2 and not submitted.stdout.strip(), submitted.stdout
    assert "mini-swe-agent" in submitted.stderr and "scaffolds.install mini-swe-agent" in submitted.stderr, \
        submitted.stderr
    refused = arena("submit", str(QUICKSTART), "--scaffold", "aider", "--model", "m", cwd=tmp_path,
                    env=env_of(stack))
    assert refused.returncode == 2 and "invalid choice: 'aider'" in refused.stderr


def _task_file(directory: Path, source: dict, **extra) -> Path:
    """A task.json in ``directory`` whose repository is ``source`` (the skeleton's instructions)."""
    directory.mkdir(parents=True, exist_ok=True)
    task = {"id": directory.name, "source": source, "instructions": "Fix greeting.",
            "agent": {"command": ["true"]}, "verifier": {"type": "exact", "answers": ["x"]}, **extra}
    (directory / "task.json").write_bytes(msgspec.json.encode(task))
    return directory


@needs_bwrap
@pytest.mark.timeout(600)
def test_shell_unpacks_a_bundle_source_from_the_stack_with_the_clients_key(stack, tmp_path):
    """A task whose source and agent are bundles (as `tasks import` writes them): the shell reads
    both from the running stack with the key the CLI finds, and a read-only key may not."""
    assert arena("tasks", "init", "greet", cwd=tmp_path).returncode == 0
    (tmp_path / "greet" / "repo" / "README.md").write_text("a bundled greeting\n")
    pushed = [arena("tasks", "push", str(tmp_path / "greet" / part), cwd=tmp_path, env=env_of(stack))
              for part in ("repo", "agent")]
    assert all(p.returncode == 0 for p in pushed), [p.stderr for p in pushed]
    source, agent = (p.stdout.strip() for p in pushed)
    assert source.startswith("sha256:") and agent.startswith("sha256:")
    _task_file(tmp_path / "bundled", {"type": "bundle", "digest": source},
               agent={"command": ["python3", "/sandbox/agent/agent.py"], "bundle": agent})

    ran = arena("tasks", "shell", "bundled", cwd=tmp_path, env=env_of(stack),
                stdin="cat README.md; ls /sandbox/agent; git log --format=%s; python -m pytest -q tests | tail -1; "
                      "exit 3\n")
    assert ran.returncode == 3, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[:3] == ["a bundled greeting", "agent.py", "base"], ran.stdout
    assert lines[3].startswith("2 failed, 1 passed"), ran.stdout
    assert "Traceback" not in ran.stderr

    # a bundle the stack does not hold, and a key that may only read: one line, exit 2
    _task_file(tmp_path / "missing", {"type": "bundle", "digest": "sha256:" + "0" * 64})
    missing = arena("tasks", "shell", "missing", "--", "true", cwd=tmp_path, env=env_of(stack))
    assert missing.returncode == 2 and missing.stderr.startswith("arena: not_found: bundle sha256:000"), missing.stderr
    made = arena("keys", "create", "--name", "reader", "--scope", "read", cwd=tmp_path,
                 env={**env_of(stack), "ARENA_NATS_URL": stack.settings.nats_url})
    assert made.returncode == 0, made.stderr
    reader = made.stdout.strip().splitlines()[-1]
    refused = arena("tasks", "shell", "bundled", "--", "true", cwd=tmp_path,
                    env={**env_of(stack), "ARENA_API_KEY": reader})
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith("arena: forbidden:") and "'submit'" in refused.stderr, refused.stderr


@needs_bwrap
def test_shell_fetches_a_git_source_under_the_services_url_policy(tmp_path):
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    (upstream / "README.md").write_text("from git\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(upstream)], check=True)
    subprocess.run([*git, "-C", str(upstream), "add", "-A"], check=True)
    subprocess.run([*git, "-C", str(upstream), "commit", "-q", "-m", "upstream"], check=True)
    commit = subprocess.run(["git", "-C", str(upstream), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    _task_file(tmp_path / "cloned", {"type": "git", "url": f"file://{upstream}", "commit": commit})
    ran = arena("tasks", "shell", "cloned", cwd=tmp_path, stdin="cat README.md; git log --format=%s\n")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["from git", "base"]  # the commit's tree, as one base commit

    # the URL policy the services apply (ARENA_GIT_ALLOWED_SCHEMES, public hosts only): refused, one line
    _task_file(tmp_path / "plain-http", {"type": "git", "url": "http://127.0.0.1/x.git", "commit": commit})
    refused = arena("tasks", "shell", "plain-http", "--", "true", cwd=tmp_path)
    assert refused.returncode == 2 and "scheme must be one of https" in refused.stderr, refused.stderr
    _task_file(tmp_path / "loopback", {"type": "git", "url": "https://127.0.0.1/x.git", "commit": commit})
    refused = arena("tasks", "shell", "loopback", "--", "true", cwd=tmp_path)
    assert refused.returncode == 2 and "not a public address" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_shell_of_an_image_source_without_an_engine_is_one_line_naming_where_it_looked(tmp_path):
    """An image task's shell runs on the docker provider's engine (tests/e2e/test_tasks_shell_in_task_image.py);
    none answering at ARENA_DOCKER_URL (or DOCKER_HOST) is one line naming the address, exit 2."""
    _task_file(tmp_path / "imaged", {"type": "image", "image": "arena/quickstart", "path": "/testbed"})
    nowhere = f"unix://{tmp_path}/no-engine.sock"
    for env in ({"ARENA_DOCKER_URL": nowhere}, {"DOCKER_HOST": nowhere}):
        refused = arena("tasks", "shell", "imaged", "--", "true", cwd=tmp_path, env=env)
        assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
        assert refused.stderr.startswith(f"arena: invalid_request: no Docker-API engine answers at {nowhere} "
                                         "(No such file or directory)"), refused.stderr
        assert "ARENA_DOCKER_URL" in refused.stderr
