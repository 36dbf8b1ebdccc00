"""README.md, run as written: every shell command and Python snippet of its code blocks, in
order, against a stack started the way the README starts it (`arena up --llm-script ...`,
keys on, the CLI and the SDK finding the stack and its key by themselves), in a fresh working
directory. A command that exits non-zero, prints a traceback or prints nothing fails the test.
Then, on the same stack, the quick starts of docs/: every block of docs/*.md marked
``<!-- run ... -->`` on the line before its fence (``tests/e2e/docs_blocks.py``), each as one bash
script in a fresh working directory beside the README's (the stack's ``.arena`` linked in, the
suite's virtualenv on ``PATH``, as an activated one has it: the docs write ``arena ...``), failing
the same ways.

What is not run, and why (each named in ``NOT_RUN``): the `make` targets (they create the
virtualenv and run whole suites; this test runs inside `make test`, and `make demo` is
`arena demo`, which tests/e2e/test_stack.py runs). The stack listens on free ports rather
than the README's 9090/9092 (other stacks may run on this host): the test sets them in the
environment, as a user moving ports would (``ARENA_URL``, ``ARENA_TRAJECTORY_URL``,
``ARENA_NATS_URL``), and rewrites the one literal URL (``127.0.0.1:9090``) a snippet could hold.
Quick starts of docs/ left unmarked, and why: docs/tasks.md's SWE-bench import and validate (the
README's, run above); docs/rollout.md's duel (it names models no backend here serves; the
README's duel runs); docs/trajectory.md's exports (``--store`` needs the trajectory service
stopped; the README's exports run); docs/rl.md's policy server and trackers (servers that run
until stopped: an MLflow server, ``tensorboard``); docs/deploy.md's compose and
docs/kubernetes.md (Docker Compose, a cluster).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from arena_stack.natsserver import free_port, wait_port
from tests.e2e.docs_blocks import DOCS, QUICK_START_PAGES, code_blocks, marked_blocks, run_docs_quick_starts

pytestmark = pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="bubblewrap is not installed")

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
#: Commands the test does not run, by their first words, and why (the module's docstring).
NOT_RUN = ("make ",)
#: Placeholders a reader replaces, and what the test puts there.
PLACEHOLDERS = {"path/to/repo": "examples/quickstart"}
#: Ports the README names for processes of its own (the duel's two scripted LLMs): free ones here.
README_PORTS = (9095, 9096)


def shell_commands(body: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comment lines dropped."""
    commands, current = [], ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands


def test_the_readme_code_blocks_are_what_this_test_runs():
    """The parser sees the README's blocks: the stack's start, the CLI, the SDK and OpenEnv snippets."""
    text = README.read_text()
    assert "## The first hour" in text and "tests/e2e/test_readme_runs_as_written.py" in text
    blocks = code_blocks(text)
    commands = [c for lang, body, _ in blocks if lang == "sh" for c in shell_commands(body)]
    assert any(c.startswith(".venv/bin/arena up ") for c in commands)
    assert any(c.startswith(".venv/bin/arena submit ") for c in commands)
    assert sum(lang == "python" for lang, _, _ in blocks) >= 2


def test_the_docs_quick_starts_are_marked_to_run():
    """Each quick start this test keeps true is marked in its page, and every marked block is a shell block."""
    for page in QUICK_START_PAGES:
        assert marked_blocks(DOCS / page), f"docs/{page} has no block marked <!-- run -->"
    assert sum(len(marked_blocks(page)) for page in DOCS.glob("*.md")) >= len(QUICK_START_PAGES)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"arena up exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        if "Arena is up." in log.read_text():
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"arena up not ready after {timeout}s:\n{log.read_text()[-3000:]}")


@pytest.mark.timeout(900)  # a few minutes on a loaded 2-core machine; the default 300 s is too tight
def test_every_readme_command_and_snippet_then_the_docs_quick_starts_run_as_written(tmp_path):
    began = time.monotonic()
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parent.parent)  # this suite's virtualenv
    (work / "examples").symlink_to(REPO / "examples")
    rollout, trajectory = free_port(), free_port()
    env = {**os.environ,
           "ARENA_ROLLOUT_PORT": str(rollout), "ARENA_TRAJECTORY_PORT": str(trajectory),
           "ARENA_DASHBOARD_PORT": str(free_port()), "ARENA_NATS_URL": f"nats://127.0.0.1:{free_port()}",
           "ARENA_BACKEND_URL": f"http://127.0.0.1:{free_port()}/v1",
           "ARENA_URL": f"http://127.0.0.1:{rollout}", "ARENA_TRAJECTORY_URL": f"http://127.0.0.1:{trajectory}",
           "PYTHONUNBUFFERED": "1"}
    for name in ("ARENA_DATA_DIR", "ARENA_API_KEY", "ARENA_AUTH"):  # as a new user's shell has it
        env.pop(name, None)

    blocks = code_blocks(README.read_text())
    up_log = tmp_path / "arena-up.log"
    up: subprocess.Popen | None = None
    background: list[subprocess.Popen] = []  # the README's `command &`, stopped by PID at the end
    ports = {str(p): str(free_port()) for p in README_PORTS}
    ran: list[str] = []
    rollout_ids: list[str] = []
    try:
        for lang, body, line in blocks:
            if lang == "sh":
                for command in shell_commands(body):
                    if command.startswith(NOT_RUN):
                        continue
                    for placeholder, value in PLACEHOLDERS.items():
                        command = command.replace(placeholder, value)
                    if "<rollout-id>" in command:
                        assert rollout_ids, f"README line {line}: {command!r} before any rollout was submitted"
                        command = command.replace("<rollout-id>", rollout_ids[0])
                    for readme_port, port in ports.items():
                        command = re.sub(rf"\b{readme_port}\b", port, command)
                    argv = shlex.split(command, comments=True)
                    if argv[-1] == "&":  # a process the README leaves running: listening before the next line
                        proc = subprocess.Popen(argv[:-1], cwd=work, env=env, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.STDOUT, start_new_session=True)
                        background.append(proc)
                        wait_port("127.0.0.1", int(argv[argv.index("--port") + 1]), 60, proc)
                        ran.append(command)
                        continue
                    if argv[:2] == [".venv/bin/arena", "up"]:  # the README's first shell; the rest is "another"
                        with open(up_log, "wb") as log:
                            up = subprocess.Popen(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True)
                        _wait_ready(env["ARENA_URL"], up, up_log)
                        # the banner says how many agents this host holds at once, and why
                        banner = re.compile(r"Agents at once: \d+ sandboxes on this host \(.*(GiB free|file descriptors)")
                        until = time.monotonic() + 30
                        while not banner.search(up_log.read_text()) and time.monotonic() < until:
                            time.sleep(0.2)
                        assert banner.search(up_log.read_text()), up_log.read_text()[-3000:]
                        ran.append(command)
                        continue
                    done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
                    said = done.stdout + done.stderr
                    assert done.returncode == 0, f"README line {line}: {command}\n{said[-3000:]}"
                    assert "Traceback" not in said, f"README line {line}: {command}\n{said[-3000:]}"
                    assert done.stdout.strip(), f"README line {line}: {command} printed nothing\n{done.stderr}"
                    rollout_ids += re.findall(r"^(r-[0-9a-f]+)\b", done.stdout, re.M)
                    ran.append(command)
            elif lang == "python":
                assert up is not None, f"README line {line}: a snippet before the stack is started"
                code = body.replace("http://127.0.0.1:9090", env["ARENA_URL"])
                done = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True,
                                      timeout=600)
                said = done.stdout + done.stderr
                assert done.returncode == 0 and "Traceback" not in said, f"README line {line}:\n{said[-3000:]}"
                assert done.stdout.strip(), f"README line {line}: the snippet printed nothing\n{done.stderr}"
                ran.append(f"python snippet at line {line}")
        # what the exports wrote is there
        assert any((work / "data" / "grpo").rglob("*.parquet"))
        assert (work / "tokens.jsonl").stat().st_size > 0
        assert up is not None and ran

        print(f"README: {len(ran)} commands and snippets in {time.monotonic() - began:.0f} s")
        # the docs' quick starts, on the same stack, from a fresh directory of the same clone
        docs = tmp_path / "docs-work"
        docs.mkdir()
        for name in (".venv", "examples", ".arena"):
            (docs / name).symlink_to(work / name)
        docs_env = {**env, "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"}
        docs_ran = run_docs_quick_starts(docs, docs_env, rollout_port=rollout, trajectory_port=trajectory)
        assert len(docs_ran) >= len(QUICK_START_PAGES), docs_ran
        print("\n".join(docs_ran))
        assert (docs / "my-task" / "task.json").is_file()  # docs/tasks.md's task, written and checked
    finally:
        for proc in background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
        if up is not None and up.poll() is None:
            up.send_signal(signal.SIGINT)  # Ctrl-C, as the README says
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
    assert up.returncode == 0, up_log.read_text()[-3000:]
