"""The bubblewrap provider with real sandboxes: isolation, network, limits, kill, diff."""

from __future__ import annotations

import asyncio
import http.server
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from arena_sandbox_providers import local, netns
from arena_sandbox_providers.local import ProxyForward, SandboxSpec

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no bubblewrap: {local.available()}")


def _py(code: str) -> list[str]:
    return ["python3", "-c", code]


def _spec(tmp_path: Path, command: list[str], **kw) -> SandboxSpec:
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    return SandboxSpec(command=command, workspace=ws, log_path=tmp_path / "log", **kw)


def _log(tmp_path: Path) -> str:
    return (tmp_path / "log").read_text()


def _pids_with_marker(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                pids.append(int(entry))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def test_exit_code_log_and_identity(tmp_path):
    result = await local.run(_spec(tmp_path, ["sh", "-c", "echo out; echo err >&2; id -u; exit 3"]))
    assert result.exit_code == 3 and not result.timed_out and not result.killed
    log = _log(tmp_path)
    assert "out" in log and "err" in log and "1000" in log


async def test_python_with_pytest_is_the_venv(tmp_path):
    result = await local.run(_spec(tmp_path, _py("import sys, pytest; print(sys.prefix)")))
    assert result.exit_code == 0, _log(tmp_path)
    assert _log(tmp_path).strip() == sys.prefix


async def test_python_reads_installed_bytecode_and_writes_none_into_the_workspace(tmp_path):
    # no cache prefix: a Python program in a sandbox loads the bytecode installed beside the modules
    # it imports instead of recompiling them, and writes none (the workspace stays the agent's)
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "helper.py").write_text("VALUE = 7\n")
    code = ("import sys, os, json, helper; print(sys.pycache_prefix, helper.VALUE); "
            "print(os.path.exists(json.__cached__), json.__cached__.startswith(os.path.dirname(json.__file__)))")
    result = await local.run(_spec(tmp_path, _py(code)))
    assert result.exit_code == 0, _log(tmp_path)
    assert _log(tmp_path).split() == ["None", "7", "True", "True"]
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == ["helper.py"]  # no __pycache__


async def test_host_filesystem_is_read_only_and_hidden(tmp_path):
    secret = Path.home() / f".arena-test-secret-{uuid.uuid4().hex}"
    secret.write_text("secret")
    try:
        code = f"""
import os
for path in ['/usr/x', '/etc/x', '/x', '/sandbox/x', '/sandbox/agent/x']:
    try:
        open(path, 'w').write('1')
        print('WROTE', path)
    except OSError as exc:
        print('denied', path, exc.errno)
print('secret visible' if os.path.exists({str(secret)!r}) else 'secret hidden')
print('etc:', sorted(os.listdir('/etc')))
open('/tmp/scratch', 'w').write('ok')
open('/sandbox/workspace/mine', 'w').write('ok')
"""
        agent = tmp_path / "agent"
        agent.mkdir()
        result = await local.run(_spec(tmp_path, _py(code), agent_dir=agent))
    finally:
        secret.unlink()
    log = _log(tmp_path)
    assert result.exit_code == 0, log
    assert "WROTE" not in log
    assert "secret hidden" in log
    assert "shadow" not in log and "passwd" in log
    assert (tmp_path / "ws" / "mine").read_text() == "ok"
    assert list((tmp_path / "agent").iterdir()) == []


async def test_arena_and_agent_dirs(tmp_path):
    arena, agent = tmp_path / "arena", tmp_path / "agent"
    arena.mkdir()
    agent.mkdir()
    (agent / "agent.py").write_text("open('/sandbox/.arena/done', 'w').write('')\nprint('agent ran')\n")
    result = await local.run(
        _spec(tmp_path, ["python3", "/sandbox/agent/agent.py"], arena_dir=arena, agent_dir=agent)
    )
    assert result.exit_code == 0, _log(tmp_path)
    assert (arena / "done").exists()
    assert "agent ran" in _log(tmp_path)


async def test_timeout_kills_the_whole_tree(tmp_path):
    marker = f"arena-marker-{uuid.uuid4().hex}"
    # A parent, a child in the background, and a grandchild in its own session.
    script = f"sleep 1000 & setsid sh -c 'sleep 1000; : {marker}' & sleep 1000; : {marker}"
    spec = _spec(tmp_path, ["sh", "-c", script], timeout_s=1.0)
    task = asyncio.create_task(local.run(spec))
    pids: list[int] = []
    for _ in range(50):
        await asyncio.sleep(0.05)
        pids = _pids_with_marker(marker)
        if len(pids) >= 3:  # outer bwrap, init bwrap, sh, setsid sh
            break
    assert pids, "sandbox processes not found"
    pgids = {os.getpgid(p) for p in pids if _alive(p)}
    started = time.monotonic()
    result = await task
    assert result.timed_out and result.killed and result.exit_code is None
    assert 0.9 < result.duration_s < 2.5
    assert time.monotonic() - started < 2.5
    assert [p for p in pids if _alive(p)] == []
    for pgid in pgids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pgid, 0)


async def test_cancel_event_kills(tmp_path):
    cancel = asyncio.Event()
    task = asyncio.create_task(local.run(_spec(tmp_path, ["sleep", "1000"], timeout_s=60), cancel=cancel))
    await asyncio.sleep(0.3)
    cancel.set()
    result = await asyncio.wait_for(task, 5)
    assert result.killed and not result.timed_out and result.exit_code is None


async def test_cancelling_the_caller_kills_the_sandbox(tmp_path):
    marker = f"arena-marker-{uuid.uuid4().hex}"
    task = asyncio.create_task(local.run(_spec(tmp_path, ["sh", "-c", f"sleep 1000; : {marker}"], timeout_s=60)))
    await asyncio.sleep(0.4)
    pids = _pids_with_marker(marker)
    assert pids
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [p for p in pids if _alive(p)] == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        reply = b"proxy got " + body + b" auth=" + self.headers.get("Authorization", "").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_proxy():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", _free_port()), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("shim_relay", [False, True], ids=["namespace-relay", "shim-relay"])
async def test_network_reaches_only_the_proxy(tmp_path, http_proxy, shim_relay):
    if not shim_relay and netns.available() is not None:
        pytest.skip(f"the service cannot make the sandbox's network namespace here: {netns.available()}")
    # Another TCP server on the host that the sandbox must NOT reach.
    other = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    other_port = other.sockets[0].getsockname()[1]
    code = f"""
import socket, urllib.request
req = urllib.request.Request('http://127.0.0.1:{http_proxy}/v1/chat', data=b'hello',
                             headers={{'Authorization': 'Bearer k'}})
for i in range(3):  # several connections through the relay
    print(urllib.request.urlopen(req, timeout=10).read().decode())
for host, port in [('127.0.0.1', {other_port}), ('8.8.8.8', 53), ('1.1.1.1', 443)]:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, port))
        print('CONNECTED', host, port)
    except OSError as exc:
        print('blocked', host, port, type(exc).__name__)
"""
    try:
        result = await local.run(
            _spec(tmp_path, _py(code), proxy=ProxyForward("127.0.0.1", http_proxy), timeout_s=30, shim_relay=shim_relay)
        )
    finally:
        other.close()
        await other.wait_closed()
    log = _log(tmp_path)
    assert result.exit_code == 0, log
    assert log.count("proxy got hello auth=Bearer k") == 3
    assert "CONNECTED" not in log
    assert log.count("blocked") == 3


async def test_a_sandbox_born_in_its_namespace_is_killed_whole_and_the_service_stays_in_its_own(tmp_path, http_proxy):
    """The namespace path spawns the sandbox from the service's own thread, entered into the
    sandbox's network namespace for the spawn: the thread is back at once, the sandbox keeps
    the namespace, and a timeout still kills every process of it."""
    if netns.available() is not None:
        pytest.skip(f"the service cannot make the sandbox's network namespace here: {netns.available()}")
    home = os.readlink("/proc/thread-self/ns/net")
    marker = f"arena-marker-{uuid.uuid4().hex}"
    script = f"readlink /proc/self/ns/net; sleep 1000 & setsid sh -c 'sleep 1000; : {marker}' & sleep 1000; : {marker}"
    spec = _spec(tmp_path, ["sh", "-c", script], proxy=ProxyForward("127.0.0.1", http_proxy), timeout_s=1.0)
    task = asyncio.create_task(local.run(spec))
    pids: list[int] = []
    for _ in range(50):
        await asyncio.sleep(0.05)
        pids = _pids_with_marker(marker)
        if len(pids) >= 3:
            break
    assert pids, "sandbox processes not found"
    assert os.readlink("/proc/thread-self/ns/net") == home  # the loop's thread is back in its own
    result = await task
    assert result.timed_out and result.killed and result.exit_code is None
    assert [p for p in pids if _alive(p)] == []
    inside = _log(tmp_path).splitlines()[0]
    assert inside.startswith("net:[") and inside != home


async def test_no_proxy_means_no_network(tmp_path, http_proxy):
    code = f"""
import socket
s = socket.socket(); s.settimeout(2)
try:
    s.connect(('127.0.0.1', {http_proxy})); print('CONNECTED')
except OSError:
    print('blocked')
"""
    result = await local.run(_spec(tmp_path, _py(code)))
    assert result.exit_code == 0 and _log(tmp_path).strip() == "blocked"


async def test_shim_relays_the_exit_code(tmp_path, http_proxy):
    result = await local.run(
        _spec(tmp_path, ["sh", "-c", "exit 7"], proxy=ProxyForward("127.0.0.1", http_proxy), shim_relay=True)
    )
    assert result.exit_code == 7


async def test_a_sandbox_that_cannot_join_its_cgroup_never_runs(tmp_path):
    # the gate waits for its cgroups and limits: when they cannot be set, it is killed first
    spec = _spec(tmp_path, ["sh", "-c", "touch /sandbox/workspace/ran"],
                 cgroup_procs=(str(tmp_path / "no-such-cgroup" / "cgroup.procs"),))
    with pytest.raises(FileNotFoundError):
        await local.run(spec)
    assert not (tmp_path / "ws" / "ran").exists()


async def test_resource_limits(tmp_path):
    code = """
import resource
print(resource.getrlimit(resource.RLIMIT_CORE), resource.getrlimit(resource.RLIMIT_NOFILE))
"""
    limits = local.ResourceLimits(open_files=256)
    result = await local.run(_spec(tmp_path, _py(code), limits=limits))
    assert result.exit_code == 0
    assert _log(tmp_path).strip() == "(0, 0) (256, 256)"


async def test_prepare_workspace_and_git_diff(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "README").write_text("readme\n")
    ws = tmp_path / "ws"
    base = local.prepare_workspace(repo, ws)
    assert len(base) == 40
    assert local.prepare_workspace(repo, tmp_path / "ws2") == base  # deterministic base commit
    assert await local.git_diff(ws, base) == ""

    edit = """
import os
open('pkg/calc.py', 'w').write('def add(a, b):\\n    return a + b\\n')
os.remove('README')
os.makedirs('pkg/__pycache__')
open('pkg/__pycache__/calc.cpython-311.pyc', 'wb').write(b'junk')
open('NEW.md', 'w').write('brand new\\n')
open('blob.bin', 'wb').write(bytes(range(256)))
# an agent that commits its own work (or plants a hook) changes nothing for the diff
os.system('git add -A >/dev/null && git -c user.name=a -c user.email=a@b commit -qm mine')
open('.git/hooks/pre-commit', 'w').write('#!/bin/sh\\ntouch /sandbox/workspace/HOOKED\\n')
os.chmod('.git/hooks/pre-commit', 0o755)
"""
    result = await local.run(SandboxSpec(command=_py(edit), workspace=ws, log_path=tmp_path / "log"))
    assert result.exit_code == 0, _log(tmp_path)
    diff = await local.git_diff(ws, base)
    assert "-    return a - b\n+    return a + b" in diff
    assert "diff --git a/NEW.md b/NEW.md\nnew file mode 100644" in diff
    assert "deleted file mode 100644" in diff and "a/README" in diff
    assert "GIT binary patch" in diff and "blob.bin" in diff
    assert "__pycache__" not in diff
    assert not (ws / "HOOKED").exists()


async def test_git_diff_of_a_broken_repo_raises(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    with pytest.raises(local.GitError):
        await local.git_diff(ws)


def test_prepare_workspace_missing_repo(tmp_path):
    with pytest.raises(FileNotFoundError):
        local.prepare_workspace(tmp_path / "nope", tmp_path / "ws")


async def test_proxy_on_a_chosen_inside_port(tmp_path, http_proxy):
    code = """
import urllib.request
print(urllib.request.urlopen(urllib.request.Request('http://localhost:12345/x', data=b'hi'), timeout=10).read())
"""
    proxy = ProxyForward("127.0.0.1", http_proxy, sandbox_port=12345)
    result = await local.run(_spec(tmp_path, _py(code), proxy=proxy))
    assert result.exit_code == 0, _log(tmp_path)
    assert "proxy got hi" in _log(tmp_path)


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.02, 0.05])
async def test_cancel_right_after_start_is_quick(tmp_path, delay):
    cancel = asyncio.Event()
    task = asyncio.create_task(local.run(_spec(tmp_path, ["sleep", "1000"], timeout_s=60), cancel=cancel))
    await asyncio.sleep(delay)
    cancel.set()
    started = time.monotonic()
    result = await asyncio.wait_for(task, 5)
    assert result.killed and not result.timed_out
    assert time.monotonic() - started < 1.0


async def test_already_cancelled_never_starts(tmp_path):
    cancel = asyncio.Event()
    cancel.set()
    result = await local.run(_spec(tmp_path, ["touch", "started"]), cancel=cancel)
    assert result.killed and not (tmp_path / "ws" / "started").exists()


async def test_environment_is_exactly_the_sandbox_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HOST_SECRET", "leak")
    env = {"MY_VAR": "x y"}
    result = await local.run(_spec(tmp_path, ["sh", "-c", "env | sort"], env=env))
    log = _log(tmp_path)
    assert result.exit_code == 0, log
    assert "MY_VAR=x y" in log and "HOME=/tmp" in log and "HOST_SECRET" not in log
    assert f"PATH={sys.prefix}/bin:" in log


async def test_invalid_env_name_is_rejected(tmp_path):
    with pytest.raises(ValueError):
        await local.run(_spec(tmp_path, ["true"], env={"A=B": "1"}))


async def test_shim_reports_a_signal_and_a_missing_command(tmp_path, http_proxy):
    proxy = ProxyForward("127.0.0.1", http_proxy)
    killed = await local.run(_spec(tmp_path, ["sh", "-c", "kill -9 $$"], proxy=proxy, shim_relay=True))
    assert killed.exit_code == 137
    missing = await local.run(_spec(tmp_path, ["/no/such/agent"], proxy=proxy, shim_relay=True))
    assert missing.exit_code == 127
    assert "arena shim: cannot run '/no/such/agent'" in _log(tmp_path)


async def test_shim_forwards_sigterm_to_the_command(tmp_path, http_proxy):
    # the shim is the command's parent: a SIGTERM to it reaches the command, whose trap answers
    script = "trap 'echo got-term; exit 3' TERM; kill -TERM $PPID; while :; do sleep 0.01; done"
    result = await local.run(_spec(tmp_path, ["sh", "-c", script], proxy=ProxyForward("127.0.0.1", http_proxy),
                                   timeout_s=30, shim_relay=True))
    assert result.exit_code == 3 and "got-term" in _log(tmp_path)
