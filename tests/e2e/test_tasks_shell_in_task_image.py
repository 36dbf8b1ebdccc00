"""``arena tasks shell`` of a task whose source is an image, run as a process: a Harbor task imported
from the fixtures, its image built by ``arena images build`` (base mapped to ``arena/quickstart``),
opened in the container the docker provider makes for its agent on Podman's engine. Commands fed on
stdin, after ``--``, and typed on a terminal (a pty); the workspace there, the tests and the solution
not, no network, the sandbox's limits; an image the engine lacks is one line; nothing is left behind.

Needs the Docker-API engine (``docker_url``) and ``arena/quickstart`` on it (``make images``);
``make test-datasets`` runs it.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import docker
import msgspec
import pytest

from arena_sandbox_providers.docker_provider import nproc_limit
from tests.e2e.scaffold_stacks import require_image

ROOT = Path(__file__).resolve().parents[2]
ARENA = str(Path(sys.executable).with_name("arena"))
HARBOR = ROOT / "tests" / "fixtures" / "datasets" / "harbor" / "dataset.toml"
BASE_MAP = "ubuntu:24.04=localhost/arena/quickstart:latest"
TASK_ID = "arena-fixtures.fix-mean"
#: the nproc ulimit the docker provider gives every container (pid_max or the host's hard limit)
NPROC = nproc_limit()

pytestmark = [pytest.mark.timeout(600)]


def arena(*args: str, engine: str, stdin: str | None = "", timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ARENA_")}, "ARENA_DOCKER_URL": engine}
    feed = {"stdin": subprocess.DEVNULL} if stdin is None else {"input": stdin}
    return subprocess.run([ARENA, *args], env=env, capture_output=True, text=True, timeout=timeout, **feed)


@pytest.fixture(scope="module")
def engine(docker_url):
    return require_image(docker_url, "arena/quickstart:latest")


@pytest.fixture(scope="module")
def probe(engine, tmp_path_factory) -> Path:
    """The imported fix-mean task, its image built, with an agent environment variable added."""
    out = tmp_path_factory.mktemp("harbor")
    imported = arena("tasks", "import", "harbor", str(HARBOR), "--out", str(out), engine=engine)
    assert imported.returncode == 0, imported.stderr
    task_file = out / f"{TASK_ID}.json"
    built = arena("images", "build", str(task_file), "--base-map", BASE_MAP, engine=engine, timeout=900)
    assert built.returncode == 0 and "1/1 task image(s) ready" in built.stdout, built.stdout + built.stderr
    task = msgspec.json.decode(task_file.read_bytes())
    assert task["source"] == {"type": "image", "image": task["image"], "path": "/app"}
    assert task["verifier"]["files"]["test.sh"]  # the hidden tests exist, for the verifier only
    task["agent"]["env"] = {"PROBE": "from-the-task"}
    (out / "probe.json").write_bytes(msgspec.json.encode(task))
    return out / "probe.json"


@pytest.fixture(autouse=True)
def leaves_no_container(engine):
    yield
    client = docker.DockerClient(base_url=engine)
    try:
        left = [c.name for c in client.containers.list(all=True, filters={"label": "arena.sandbox=1"})
                if c.labels.get("arena.owner", "").startswith("shell-")]
    finally:
        client.close()
    assert left == []


SCRIPT = r"""pwd; id -u; cat /proc/sys/kernel/hostname; ls; git log --format=%s
ls /app; echo made > /app/new.txt; cat /sandbox/workspace/new.txt
echo "$PROBE $HOME"
python3 -c "import json; t = json.load(open('/sandbox/.arena/task.json'))['task']; print('verifier', t.get('verifier'))"
test -e /tests/test.sh && echo TESTS-VISIBLE; ls -A /solution/ | wc -l; test -e /solution/solve.sh && echo SOLUTION-VISIBLE
python3 -c "import socket; print([name for _, name in socket.if_nameindex()])"
python3 -c "import socket; socket.create_connection(('1.1.1.1', 53), timeout=5)" 2>&1 | tail -1
grep -E '^Max (open files|processes) ' /proc/self/limits | tr -s ' '
grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status | tr -s '\t' ' '
python3 -c "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); print('unshare', libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))"
touch /etc/x 2>&1 | tail -1
exit 7
"""


def test_shell_runs_stdin_in_the_agents_container_tests_hidden_network_off_limits_set(engine, probe):
    ran = arena("tasks", "shell", str(probe), engine=engine, stdin=SCRIPT)
    assert ran.returncode == 7, ran.stdout + ran.stderr
    assert "Traceback" not in ran.stderr
    assert ran.stdout.splitlines() == [
        "/sandbox/workspace",  # the agent's working directory: the image's /app, one base commit
        "1000",
        "sandbox",
        "stats.py",
        "base",
        "stats.py",  # the same tree mounted at the source's path
        "made",
        "from-the-task /tmp",  # the task's agent.env over the image's environment
        "verifier None",  # the public part of the task only
        "0",  # /solution (the agent's files) is empty: the oracle's solve.sh is not there; /tests is not
        "['lo']",  # no network: loopback only
        "OSError: [Errno 101] Network is unreachable",
        f"Max processes {NPROC} {NPROC} processes ",  # the provider's explicit ulimits
        "Max open files 4096 4096 files ",
        "CapEff: 0000000000000000",  # no capabilities, no new privileges, the command server's seccomp filter
        "NoNewPrivs: 1",
        "Seccomp: 2",
        "unshare -1 Operation not permitted",  # no user namespaces, as for an agent's commands
        "touch: cannot touch '/etc/x': Read-only file system",
    ], ran.stdout


def test_a_command_after_dashes_runs_instead_of_the_shell_and_gives_its_exit_code(engine, probe):
    ran = arena("tasks", "shell", str(probe), "--", "python3", "-c",
                "import os, sys; print(os.getcwd(), sorted(os.listdir('.'))); sys.exit(3)", engine=engine, stdin=None)
    assert ran.returncode == 3, ran.stderr
    assert ran.stdout == "/sandbox/workspace ['.git', 'stats.py']\n"
    missing = arena("tasks", "shell", str(probe), "--", "no-such-command", engine=engine, stdin=None)
    assert missing.returncode == 127 and "no-such-command" in missing.stderr, missing.stderr
    assert "Traceback" not in missing.stderr


def test_shell_on_a_terminal_is_interactive_with_the_terminals_size(engine, probe):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ARENA_")}, "ARENA_DOCKER_URL": engine}
    proc = subprocess.Popen([ARENA, "tasks", "shell", str(probe)], stdin=slave, stdout=slave, stderr=slave, env=env,
                            start_new_session=True)
    os.close(slave)
    seen = b""

    def read_until(marker: bytes, timeout: float = 120.0) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker not in seen:
            assert time.monotonic() < deadline, f"no {marker!r} in {seen[-2000:]!r}"
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    seen += os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    assert marker in seen, f"no {marker!r} in {seen[-2000:]!r}"

    try:
        read_until(b"/sandbox/workspace $ ")  # bash's prompt (PS1 names the task)
        assert f"[{TASK_ID}] /sandbox/workspace $ ".encode() in seen
        os.write(master, b"echo $((6*7)); python3 -c 'import os; print(os.isatty(0), os.get_terminal_size())'\r")
        read_until(b"True os.terminal_size(columns=100, lines=30)")
        assert b"\r\n42\r\n" in seen
        os.write(master, b"exit 4\r")
        assert proc.wait(timeout=120) == 4
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_an_image_the_engine_lacks_is_one_line_naming_it_and_images_build(engine, probe, tmp_path):
    task = msgspec.json.decode(probe.read_bytes())
    absent = "localhost/arena-task:" + "0" * 32
    task["image"], task["source"]["image"] = absent, absent
    (tmp_path / "task.json").write_bytes(msgspec.json.encode(task))
    refused = arena("tasks", "shell", str(tmp_path), "--", "true", engine=engine)
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith(f"arena: invalid_request: image {absent} is not on the engine at {engine}")
    assert "arena images build" in refused.stderr
