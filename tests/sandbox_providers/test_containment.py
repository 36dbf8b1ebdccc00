"""Containment suite, run against each real provider (local = bubblewrap, docker =
the test engine): hostile agents are contained and reported with the right final
state, every sandbox is gone afterwards and the host is unharmed. Plus the contract:
the quickstart agent completes the example task through the proxy relay.

Each agent runs as ``python3 /sandbox/agent/agent.py <marker>``: the marker, unique per
test, finds every process of the sandbox on the host (bubblewrap's and the proxy
relay's command lines carry it too), so the suite can watch a fork bomb from outside
and check that nothing of a sandbox is left running afterwards.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from arena_core.schemas import AgentSpec, Budget, SandboxJob, SandboxOutcome, Task, TestsVerifier
from arena_sandbox import runner
from arena_sandbox_providers import local, netns
from arena_sandbox_providers.provider import SandboxLimits
from arena_sandbox.runner import RunnerConfig
from arena_sandbox_providers.testing import make_provider

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = REPO_ROOT / "examples" / "quickstart"
LIMITS = SandboxLimits(memory_bytes=256 * 2**20, pids=64, cpus=1.0, open_files=256)
CONFIG = RunnerConfig(sandbox_limits=LIMITS, diff_timeout_s=60)


@pytest.fixture(params=["local", "docker"])
def provider(request, tmp_path):
    if request.param == "local":
        if local.available() is not None:
            pytest.skip(f"no bubblewrap: {local.available()}")
        return make_provider("local", tmp_path / "data")
    return make_provider("docker", tmp_path / "data", docker_url=request.getfixturevalue("docker_url"))


@pytest.fixture
def marker() -> str:
    return f"arena-containment-{uuid.uuid4().hex}"


def make_job(tmp_path: Path, code: str, marker: str, *, wall_clock_s: float = 30.0, port: int = 9,
             repo: Path | None = None, image: str | None = None) -> SandboxJob:
    if repo is None:
        repo = tmp_path / "repo"
        repo.mkdir(exist_ok=True)
        (repo / "a.txt").write_text("base\n")
    agent = tmp_path / "agent"
    agent.mkdir(exist_ok=True)
    (agent / "agent.py").write_text(code)
    task = Task(id="hostile", repo=str(repo), instructions="-", verifier=TestsVerifier(), image=image,
                agent=AgentSpec(command=["python3", "/sandbox/agent/agent.py", marker], path=str(agent)),
                budget=Budget(wall_clock_s=wall_clock_s))
    return SandboxJob(rollout_id="r1", task=task, proxy_url=f"http://127.0.0.1:{port}/v1", api_key="ak")


def marked(marker: str) -> list[int]:
    """Live processes of this host whose command line carries ``marker``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if marker.encode() not in Path(f"/proc/{entry}/cmdline").read_bytes():
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            pids.append(int(entry))
    return pids


class Watcher:
    """Counts the marked processes on the host while a sandbox runs (the peak)."""

    def __init__(self, marker: str):
        self.marker = marker
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, len(marked(self.marker)))
            self._stop.wait(0.05)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _gone(provider) -> bool:
    """No directory of the provider's sandboxes left (docker: nor any container; local:
    nor any cgroup)."""
    if provider.name == "docker" and provider.client.api.containers(
            all=True, filters={"label": f"arena.owner={provider.owner}"}):
        return False
    if provider.name == "local" and provider.use_cgroups:
        for controller in ("pids", "memory", "cpu", ""):
            group = Path("/sys/fs/cgroup", controller, "arena", provider.cgroup_owner)
            if group.is_dir() and any(p.is_dir() for p in group.iterdir()):
                return False
    return not provider.base.exists() or list(provider.base.iterdir()) == []


def assert_host_unharmed(provider, marker: str) -> None:
    assert _gone(provider), "a sandbox (directory, container or cgroup) was left behind"
    assert marked(marker) == [], "a process of the sandbox is still running on the host"
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork
    assert not any(Path(p).exists() for p in ("/usr/pwned", "/pwned", "/etc/pwned"))


FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


async def test_fork_bomb_is_contained(tmp_path, provider, marker):
    job = make_job(tmp_path, FORK_BOMB, marker, wall_clock_s=3)
    with Watcher(marker) as watcher:
        out = await runner.run_job(job, provider=provider, data_dir=tmp_path / "data", config=CONFIG)
    assert out.done.outcome is SandboxOutcome.TIMED_OUT, out.done.reason
    assert out.done.reason == "wall clock of 3s exceeded" and out.done.exit_code is None
    assert_host_unharmed(provider, marker)
    if provider.name == "local" and not provider.use_cgroups:
        pytest.skip("no writable cgroups here: the local provider has no pids limit (docs/sandbox.md)")
    # it did fork (the watcher saw it), and never past the sandbox's pids limit
    assert 10 <= watcher.peak <= LIMITS.pids, watcher.peak


async def test_memory_hog_is_oom_killed_and_reported(tmp_path, provider, marker):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 * 2**20))\n"
    out = await runner.run_job(make_job(tmp_path, code, marker), provider=provider, data_dir=tmp_path / "data",
                               config=CONFIG)
    assert out.done.outcome is SandboxOutcome.FAILED
    assert out.done.oom_killed, out.done.reason
    assert out.done.reason.startswith("out of memory: the OOM killer fired (memory limit of 256 MiB)")
    assert out.done.exit_code == 137
    assert_host_unharmed(provider, marker)


async def test_infinite_loop_times_out(tmp_path, provider, marker):
    # 5 s: sandboxes run below the services (ARENA_SANDBOX_NICE), so with the suite's own processes
    # busy on both cores the agent may wait seconds for the CPU before it prints
    job = make_job(tmp_path, "print('spinning', flush=True)\nwhile True:\n    pass\n", marker, wall_clock_s=5)
    out = await runner.run_job(job, provider=provider, data_dir=tmp_path / "data", config=CONFIG)
    assert out.done.outcome is SandboxOutcome.TIMED_OUT
    assert out.done.reason == "wall clock of 5s exceeded" and out.done.exit_code is None
    assert "spinning" in out.done.log_tail
    assert 5 <= out.run.duration_s < 60  # generous: 2 busy cores
    assert_host_unharmed(provider, marker)


LIMITS_PROBE = r"""
import json, os, resource, time
out = {}
children = []  # as many processes as the pids limit lets it have
try:
    while len(children) < 1000:
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
except OSError as exc:
    out["fork_error"] = exc.errno
out["processes"] = len(children) + 1
for pid in children:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
files = []
try:
    while len(files) < 10000:
        files.append(open("/dev/null"))
except OSError as exc:
    out["open_error"] = exc.errno
out["open_files"] = len(files)
for f in files:
    f.close()
out["nofile"] = list(resource.getrlimit(resource.RLIMIT_NOFILE))
try:  # larger than the file size limit
    with open("/sandbox/workspace/big", "wb") as f:
        f.write(b"x" * (2 * 2**20))
    out["big_file"] = "written"
except OSError as exc:
    out["big_file"] = exc.errno
os.unlink("/sandbox/workspace/big")
# CPU: two busy processes for 1.5 s of wall clock; their CPU time is what the quota gave
start = time.monotonic()
busy = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        while time.monotonic() - start < 1.5:
            pass
        os._exit(0)
    busy.append(pid)
for pid in busy:
    os.waitpid(pid, 0)
times = os.times()
out["cpu_s"] = times.children_user + times.children_system
out["wall_s"] = time.monotonic() - start
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
out["status"] = {k: status[k].strip() for k in ("CapEff", "CapPrm", "NoNewPrivs")}
json.dump(out, open("/sandbox/.arena/result.json", "w"))
open("/sandbox/.arena/done", "w").close()
"""


async def test_limits_are_enforced(tmp_path, provider, marker):
    """pids, open files, file size and CPU limits, no capabilities, no new privileges."""
    limits = SandboxLimits(memory_bytes=512 * 2**20, pids=32, cpus=0.25, open_files=128,
                           file_size_bytes=2**20)
    config = RunnerConfig(sandbox_limits=limits, diff_timeout_s=60)
    out = await runner.run_job(make_job(tmp_path, LIMITS_PROBE, marker, wall_clock_s=60), provider=provider,
                               data_dir=tmp_path / "data", config=config)
    assert out.done.outcome is SandboxOutcome.COMPLETED, out.done.reason
    r = out.done.result
    assert r["nofile"] == [128, 128] and r["open_files"] < 128 and r["open_error"] == 24  # EMFILE
    assert r["big_file"] == 27  # EFBIG
    assert r["status"] == {"CapEff": "0000000000000000", "CapPrm": "0000000000000000", "NoNewPrivs": "1"}
    assert_host_unharmed(provider, marker)
    if provider.name == "local" and not provider.use_cgroups:
        pytest.skip("no writable cgroups here: the local provider has no pids/CPU limit (docs/sandbox.md)")
    assert r["fork_error"] == 11 and r["processes"] <= 32, r  # EAGAIN at the pids limit
    # a quarter of a CPU: at most ~0.4 s of CPU in 1.5 s (unlimited: up to 3 s)
    assert r["cpu_s"] <= 0.25 * r["wall_s"] * 1.6 + 0.15, r


PROBE = r"""
import ctypes, json, os, socket, stat, subprocess
config = json.loads(CONFIG)
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except Exception as exc:
        out[name] = type(exc).__name__
targets = {"internet": ("1.1.1.1", 80), "host_port": ("127.0.0.1", config["host_port"]),
           "host_port_v6": ("::1", config["host_port"]), "dns": ("example.com", 80)}
for ip in config["host_ips"]:
    targets["host_ip_" + ip] = (ip, config["host_port"])
for name, addr in targets.items():
    attempt("tcp_" + name, lambda a=addr: socket.create_connection(a, timeout=2).close())
attempt("tcp_proxy", lambda: socket.create_connection(("127.0.0.1", config["proxy_port"]), timeout=2).close())
attempt("udp_internet", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("1.1.1.1", 53)))
for path in ["/etc/shadow", "/root/.bashrc", *config["host_files"]]:
    attempt("read_" + path, lambda p=path: open(p, "rb").read())
for path in config["host_dirs"]:
    attempt("list_" + path, lambda p=path: os.listdir(p))
def connect_unix(path):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    s.connect(path)
for path in ["/var/run/docker.sock", "/run/docker.sock", "/run/podman/podman.sock", *config["engine_sockets"]]:
    attempt("engine_" + path, lambda p=path: connect_unix(p))
sockets = []  # every Unix socket file visible in the sandbox (not under /proc, /sys, /usr)
def walk(top):
    try:
        entries = list(os.scandir(top))
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.path not in ("/proc", "/sys", "/usr"):
                walk(entry.path)
        elif not entry.is_file(follow_symlinks=False) and not entry.is_symlink():
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    sockets.append(entry.path)
            except OSError:
                pass
walk("/")
out["sockets"] = sockets
for path in ["/usr/pwned", "/etc/pwned", "/pwned", "/sandbox/pwned", "/sandbox/agent/pwned", "/run/arena/pwned",
             *config["host_writes"]]:
    attempt("write_" + path, lambda p=path: open(p, "w").write("x"))
attempt("write_/tmp/ok", lambda: open("/tmp/ok", "w").write("x"))
libc = ctypes.CDLL(None, use_errno=True)
out["new_user_namespace"] = libc.unshare(0x10000000) == 0  # capabilities regained in one?
log = subprocess.run(["git", "log", "--all", "--format=%s"], capture_output=True, text=True).stdout.split()
out["git_commits"] = log
every_object = subprocess.run(["git", "cat-file", "--batch-all-objects", "--batch"], capture_output=True).stdout
out["history_secret"] = b"hunter2" in every_object  # any object in .git, reachable or not
out["reflog"] = subprocess.run(["git", "reflog", "--format=%s"], capture_output=True, text=True).stdout.split("\n")
out["uid"] = os.getuid()
out["caps"] = [l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1]
json.dump(out, open("/sandbox/.arena/result.json", "w"))
open("/sandbox/.arena/done", "w").close()
"""


def _host_ips(port: int) -> list[str]:
    """This host's own non-loopback addresses at which the host reaches its service on
    ``port`` (so that the sandbox failing to is the sandbox's doing)."""
    try:
        found = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout.split()
    except OSError:
        return []
    reachable = []
    for ip in found:
        try:
            socket.create_connection((ip, port), timeout=2).close()
        except OSError:
            continue
        reachable.append(ip)
    return reachable


async def test_network_files_and_history_are_contained(tmp_path, provider, marker, request):
    listener = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)  # a host service
    proxy = socket.create_server(("127.0.0.1", 0))  # stands in for the LLM proxy
    host_port, proxy_port = listener.getsockname()[1], proxy.getsockname()[1]
    host_ips = _host_ips(host_port)
    secret = tmp_path / "SECRET"
    secret.write_text("host secret")
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GIT_AUTHOR_NAME": "x", "GIT_AUTHOR_EMAIL": "x@x",
           "GIT_COMMITTER_NAME": "x", "GIT_COMMITTER_EMAIL": "x@x"}
    (repo / "a.txt").write_text("password = hunter2\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "leak"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True)
    (repo / "a.txt").write_text("password = <redacted>\n")
    subprocess.run(["git", "commit", "-qam", "redact"], cwd=repo, env=env, check=True)
    engine = request.getfixturevalue("docker_url").removeprefix("unix://") if provider.name == "docker" else ""
    config = {
        "host_port": host_port, "proxy_port": proxy_port, "host_ips": host_ips,
        # the host's paths of: a secret, the task's repository (with its history), the
        # provider's data directory (every sandbox's files), the engine's socket
        "host_files": [str(secret), str(repo / ".git" / "config"), str(REPO_ROOT / "pyproject.toml")],
        "host_dirs": [str(repo), str(tmp_path / "data"), str(tmp_path)],
        "engine_sockets": [engine] if engine else [],
        "host_writes": [str(tmp_path / "escape"), str(tmp_path / "data" / "escape")],
    }
    code = PROBE.replace("CONFIG", repr(json.dumps(config)))
    try:
        out = await runner.run_job(make_job(tmp_path, code, marker, repo=repo, port=proxy_port),
                                   provider=provider, data_dir=tmp_path / "data", config=CONFIG)
    finally:
        listener.close()
        proxy.close()
    assert out.done.outcome is SandboxOutcome.COMPLETED, out.done.reason
    r = out.done.result
    assert r["tcp_proxy"] == "allowed"
    for key, value in r.items():
        if key.startswith(("tcp_", "udp_", "read_", "list_", "engine_", "write_")) and key not in (
                "tcp_proxy", "write_/tmp/ok"):
            assert value != "allowed", (key, r)
    assert len([k for k in r if k.startswith("tcp_host_ip_")]) == len(host_ips)
    assert r["write_/tmp/ok"] == "allowed"
    # the relay to the proxy, no engine or control socket; none at all where the service makes the
    # local sandbox's network namespace (the relay's listeners are in it, served from the host)
    relay = [] if provider.name == "local" and netns.available() is None else ["/run/arena/proxy.sock"]
    assert r["sockets"] == relay
    assert r["new_user_namespace"] is False
    assert r["git_commits"] == ["base"] and r["history_secret"] is False
    assert r["uid"] == 1000 and int(r["caps"], 16) == 0
    assert not (tmp_path / "escape").exists() and not (tmp_path / "data" / "escape").exists()
    assert_host_unharmed(provider, marker)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def scripted_llm():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "arena_stack.scripted_llm", "--script",
                             str(QUICKSTART / "llm_script.json"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


async def test_quickstart_agent_completes_through_the_proxy(tmp_path, provider, scripted_llm):
    """The relay to an OpenAI-compatible server; the same through Arena's own proxy,
    with the whole stack, is ``test_sandbox_stack.py``."""
    task = json.loads((QUICKSTART / "task.json").read_text())
    task["repo"] = str(QUICKSTART / task["repo"])
    task["agent"]["path"] = str(QUICKSTART / task["agent"]["path"])
    task["image"] = "arena/quickstart:latest"
    job = SandboxJob(rollout_id="qs1", task=msgspec.convert(task, Task),
                     proxy_url=f"http://127.0.0.1:{scripted_llm}/v1", api_key="ak-qs")
    out = await runner.run_job(job, provider=provider, data_dir=tmp_path / "data")
    assert out.done.outcome is SandboxOutcome.COMPLETED, out.done.reason
    assert "diff --git a/textstats/core.py b/textstats/core.py" in out.done.diff
    assert "+    return (ordered[mid - 1] + ordered[mid])" in out.done.diff
    assert _gone(provider)
