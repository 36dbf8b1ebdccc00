"""Provider lifecycle against real sandboxes: warm pool, orphan reaping after a crash
(a new provider instance of the same owner, as after ``kill -9`` and restart)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from arena_core.schemas import AgentSpec, Budget, SandboxJob, SandboxOutcome, Task, TestsVerifier
from arena_sandbox import runner
from arena_sandbox_providers import local
from arena_sandbox.pool import WarmPool
from arena_sandbox_providers.provider import CreateSpec, Sandbox, SandboxError, SandboxProvider
from arena_sandbox.runner import RunnerConfig
from arena_sandbox_providers.testing import make_provider


@pytest.fixture(params=["local", "docker", "mock"])
def name_and_url(request):
    if request.param == "local" and local.available() is not None:
        pytest.skip(f"no bubblewrap: {local.available()}")
    url = request.getfixturevalue("docker_url") if request.param == "docker" else ""
    return request.param, url


async def test_interface_exec_streams_and_files(tmp_path, name_and_url):
    name, url = name_and_url
    provider = make_provider(name, tmp_path / "d", docker_url=url)
    assert isinstance(provider, SandboxProvider)
    assert await provider.health() is None
    sandbox = await provider.create(CreateSpec())
    assert isinstance(sandbox, Sandbox)
    try:
        await sandbox.put_files({"/sandbox/workspace/in.txt": b"hello"})
        chunks: list[bytes] = []
        result = await sandbox.exec(["sh", "-c", "cat in.txt; echo; echo out > /sandbox/.arena/o"], env={},
                                    timeout_s=30, on_output=chunks.append)
        assert result.exit_code == 0
        if name == "mock":
            assert b"no process was run" in b"".join(chunks)
        else:
            assert b"hello" in b"".join(chunks)
            assert await sandbox.read_file("/sandbox/.arena/o", max_bytes=100) == b"out\n"
            assert not await sandbox.exists("/sandbox/.arena/nothing")
    finally:
        await sandbox.destroy()
        await sandbox.destroy()  # idempotent
    if name == "docker":  # the container is removed, not only stopped
        assert not provider.client.api.containers(all=True, filters={"id": sandbox.container_id})


@pytest.mark.parametrize("agent", [
    "true",  # nothing changed: the diff is "" without git
    # an edit of the same size whose mtime is put back: its ctime still moved
    "printf 'b' > f.txt && touch -d @1000000000 f.txt",
    "touch gone && rm gone",  # a file made and removed: the directory's ctime moved
    "chmod +x f.txt",
])
@pytest.mark.parametrize("stable", [False, True], ids=["copied", "stable-base"])
async def test_diff_of_a_workspace_put_at_base(tmp_path, name_and_url, agent, stable):
    name, url = name_and_url
    if name == "mock":
        pytest.skip("the mock runs no process")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "f.txt").write_text("a")
    os.utime(repo / "f.txt", (1000000000, 1000000000))
    workspace = tmp_path / "ws"
    base = local.prepare_workspace(repo, workspace)
    (workspace / "f.txt").write_text("c")  # not clean at base any more: only git can tell
    os.utime(workspace / "f.txt", (1000000000, 1000000000))
    provider = make_provider(name, tmp_path / "d", docker_url=url)
    sandbox = await provider.create(CreateSpec())
    try:
        await sandbox.put_dir(workspace, local.WORKSPACE, src_stable=stable)
        ran = await sandbox.exec(["sh", "-c", agent], env={}, timeout_s=30)
        assert ran.exit_code == 0
        told = await sandbox.diff(base, put_at_base=True)
        real = await sandbox.diff(base)
    finally:
        await sandbox.destroy()
    if agent == "true":
        assert told == "" and "+c" in real  # the caller said it was at base: no git ran
    else:
        assert told == real and real  # a change was seen: git ran
        assert ("old mode" in real) == agent.startswith("chmod")


def _tree(top: Path) -> dict[str, tuple]:
    """Every entry under ``top``: its kind, mode, size, mtime and content (files)."""
    out = {}
    for path in sorted(top.rglob("*")):
        st = path.lstat()
        data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        out[str(path.relative_to(top))] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino, data)
    return out


def _mounts_under(top: Path) -> list[str]:
    real = os.path.realpath(top)
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if line.split()[4].startswith(real)]


async def test_a_stable_base_put_as_the_workspace_is_never_modified(tmp_path, name_and_url):
    """A base put with ``src_stable`` (the local provider mounts it as an overlay's lower layer
    where it may mount): the agent's edits, new files, deletions, a renamed directory and a
    chmod are all in the diff, git in the sandbox sees them, the base is byte for byte and
    stat for stat as before, and nothing is left mounted after the destroy."""
    name, url = name_and_url
    if name == "mock":
        pytest.skip("the mock runs no process")
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "f.txt").write_text("a\n")
    (repo / "gone.txt").write_text("x\n")
    (repo / "pkg" / "m.py").write_text("m = 1\n")
    workspace = tmp_path / "ws"
    base = local.prepare_workspace(repo, workspace)
    before = _tree(workspace)
    provider = make_provider(name, tmp_path / "d", docker_url=url)
    sandbox = await provider.create(CreateSpec())
    try:
        await sandbox.put_dir(workspace, local.WORKSPACE, src_stable=True)
        if name == "local" and os.geteuid() == 0:
            assert (sandbox.root / "upper").is_dir(), "the workspace is not an overlay of the base"
            # mounted in each of the sandbox's own namespaces, never in the service's
            assert not _mounts_under(tmp_path / "d")
        agent = ("echo b >> f.txt && rm gone.txt && mv pkg lib && echo new > n.txt && chmod +x f.txt && "
                 "git status --porcelain | sort > /sandbox/.arena/status")
        ran = await sandbox.exec(["sh", "-c", agent], env={"GIT_CONFIG_NOSYSTEM": "1"}, timeout_s=30)
        assert ran.exit_code == 0
        status = await sandbox.read_file("/sandbox/.arena/status", max_bytes=10_000)
        diff = await sandbox.diff(base, put_at_base=True)
        assert _tree(workspace) == before  # the agent's sandbox never wrote into the base
    finally:
        await sandbox.destroy()
    assert b" D gone.txt" in status and b" M f.txt" in status and b"?? lib/" in status, status
    assert "+b" in diff and "deleted file mode" in diff and "rename from pkg/m.py" in diff and "old mode" in diff
    assert "+new" in diff
    assert _tree(workspace) == before
    assert not _mounts_under(tmp_path / "d")
    assert list(provider.base.iterdir()) == []


async def test_a_refused_overlay_falls_back_to_a_copy(tmp_path):
    """Where the kernel refuses the overlay (here: a base path the mount options cannot carry),
    the local provider copies the base, as without overlays, and copies from then on."""
    if local.available() is not None:
        pytest.skip(f"no bubblewrap: {local.available()}")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "f.txt").write_text("a\n")
    workspace = tmp_path / "a,b" / "ws"  # a comma: no overlay option string can name it
    base = local.prepare_workspace(repo, workspace)
    provider = make_provider("local", tmp_path / "d")
    sandbox = await provider.create(CreateSpec())
    try:
        await sandbox.put_dir(workspace, local.WORKSPACE, src_stable=True)
        assert not _mounts_under(tmp_path / "d")
        assert not provider.overlays.usable
        ran = await sandbox.exec(["sh", "-c", "echo b >> f.txt"], env={}, timeout_s=30)
        assert ran.exit_code == 0
        assert "+b" in await sandbox.diff(base, put_at_base=True)
    finally:
        await sandbox.destroy()
    assert (workspace / "f.txt").read_text() == "a\n"


async def test_exec_streams_output_while_the_command_runs(tmp_path, name_and_url):
    name, url = name_and_url
    if name == "mock":
        pytest.skip("mock sandboxes run nothing")
    provider = make_provider(name, tmp_path / "d", docker_url=url)
    sandbox = await provider.create(CreateSpec())
    try:
        first = asyncio.Event()
        chunks: list[bytes] = []

        def on_output(chunk: bytes) -> None:
            chunks.append(chunk)
            seen = b"".join(chunks)
            if b"first" in seen and b"err" in seen:  # stdout and stderr travel apart: wait for both
                first.set()

        cancel = asyncio.Event()
        running = asyncio.ensure_future(sandbox.exec(["sh", "-c", "echo first; echo err >&2; sleep 100"], env={},
                                                     timeout_s=120, cancel=cancel, on_output=on_output))
        await asyncio.wait_for(first.wait(), 30)
        assert not running.done()  # the output came while the command still ran
        cancel.set()
        result = await asyncio.wait_for(running, 30)
        assert result.killed and not result.timed_out and result.exit_code is None
        assert b"first" in b"".join(chunks) and b"err" in b"".join(chunks)  # stdout and stderr
    finally:
        await sandbox.destroy()


async def test_warm_pool_hands_out_ready_sandboxes(tmp_path, name_and_url):
    name, url = name_and_url
    provider = make_provider(name, tmp_path / "d", docker_url=url)
    pool = WarmPool(provider, size=1)
    await pool.prefill(CreateSpec())
    assert pool.idle(CreateSpec()) == 1
    first = await pool.acquire(CreateSpec())
    await first.destroy()
    await pool.close()
    assert pool.idle(CreateSpec()) == 0
    if name != "mock":
        assert list(provider.base.iterdir()) == []


async def _until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _job(tmp_path: Path, *, image: str | None = None) -> SandboxJob:
    repo, agent = tmp_path / "repo", tmp_path / "agent"
    repo.mkdir(exist_ok=True)
    agent.mkdir(exist_ok=True)
    (repo / "a.txt").write_text("a\n")
    (agent / "agent.py").write_text("open('a.txt', 'w').write('b\\n')\nopen('/sandbox/.arena/done', 'w')\n")
    task = Task(id="t", repo=str(repo), instructions="-", verifier=TestsVerifier(), image=image,
                agent=AgentSpec(command=["python3", "/sandbox/agent/agent.py"], path=str(agent)),
                budget=Budget(wall_clock_s=60))
    return SandboxJob(rollout_id="rw", task=task, proxy_url="http://127.0.0.1:9/v1", api_key="k")


async def test_jobs_take_warm_sandboxes_and_the_pool_refills(tmp_path, name_and_url):
    """Acquiring from a full pool hands out a sandbox created ahead (no create on the
    way); the pool refills in the background; a job's sandbox is destroyed, never reused."""
    name, url = name_and_url
    provider = make_provider(name, tmp_path / "d", docker_url=url)
    pool = WarmPool(provider, size=2)
    spec = CreateSpec(limits=RunnerConfig().sandbox_limits)  # what run_job asks for
    await pool.prefill(spec)
    try:
        # one pool per sandbox kind: local ignores images, docker's "" is its default image
        other = "any/image:tag" if name != "docker" else provider.default_image
        assert pool.idle(spec) == 2 and pool.idle(CreateSpec(image=other, limits=spec.limits)) == 2
        ready = {p.name for p in provider.base.iterdir()} if name != "mock" else set()
        started = time.perf_counter()
        sandbox = await pool.acquire(spec)
        took = time.perf_counter() - started
        assert pool.idle(spec) == 1 and took < 0.05, took  # a list pop (a docker create is ~70 ms)
        assert name == "mock" or sandbox.id in ready
        await sandbox.destroy()
        await _until(lambda: pool.idle(spec) == 2)  # refilled in the background
        job = _job(tmp_path, image=other if name == "local" else None)
        out = await runner.run_job(job, data_dir=tmp_path / "d", provider=pool)
        assert out.done.outcome is SandboxOutcome.COMPLETED, out.done.reason
        assert name == "mock" or "+b" in out.done.diff
        if name == "mock":  # clearly labelled: nothing ran
            assert out.done.reason.startswith("mock provider (no process was run)")
            assert out.done.provider == "mock" and out.done.result == {"mock": True}
        await _until(lambda: pool.idle(spec) == 2)
        if name != "mock":  # the job's sandbox is gone: only the two idle ones are left
            assert len(list(provider.base.iterdir())) == 2
    finally:
        await pool.close()
    assert pool.idle(spec) == 0
    if name != "mock":
        assert list(provider.base.iterdir()) == []
    if name == "docker":
        assert not provider.client.api.containers(all=True, filters={"label": f"arena.owner={provider.owner}"})


async def test_orphans_are_reaped_by_the_next_process(tmp_path, name_and_url):
    name, url = name_and_url
    if name == "mock":
        pytest.skip("mock sandboxes hold no resources")
    owner = f"crashy-{uuid.uuid4().hex[:8]}"
    crashed = make_provider(name, tmp_path / "d", docker_url=url, owner=owner)
    other = make_provider(name, tmp_path / "d", docker_url=url)
    left = [await crashed.create(CreateSpec())]
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "f.txt").write_text("a")
    local.prepare_workspace(repo, tmp_path / "ws")
    await left[0].put_dir(tmp_path / "ws", local.WORKSPACE, src_stable=True)  # local: an overlay left mounted
    kept = await other.create(CreateSpec())
    restarted = make_provider(name, tmp_path / "d", docker_url=url, owner=owner)
    assert await restarted.reap_orphans() == 1
    assert list(restarted.base.iterdir()) == []
    assert not _mounts_under(restarted.base)
    assert (tmp_path / "ws" / "f.txt").read_text() == "a"  # reaping empties no base through a mount
    if name == "docker":
        for sandbox in left:
            assert not restarted.client.api.containers(all=True, filters={"id": sandbox.container_id})
        assert restarted.client.api.containers(all=True, filters={"id": kept.container_id})
    assert list(other.base.iterdir())  # another owner's sandbox is left alone
    if name == "local" and restarted.use_cgroups:  # and the orphan's cgroups are gone, another owner's kept
        for controller in ("pids", "memory", "cpu", ""):
            root = Path("/sys/fs/cgroup", controller, "arena")
            if (root / other.cgroup_owner).is_dir():
                assert not (root / restarted.cgroup_owner / left[0].id).exists()
                assert (root / other.cgroup_owner / kept.id).is_dir()
    await kept.destroy()


@pytest.fixture
def docker_provider(tmp_path, request):
    return make_provider("docker", tmp_path / "d", docker_url=request.getfixturevalue("docker_url"))


async def test_docker_command_server_is_out_of_the_agents_reach(docker_provider):
    """The container's init (the command server) runs as the sandbox user, like the
    agent: it must not be traceable or readable by it, nor its socket reachable."""
    sandbox = await docker_provider.create(CreateSpec())
    try:
        chunks: list[bytes] = []
        probe = ("import ctypes, os\n"
                 "libc = ctypes.CDLL(None, use_errno=True)\n"
                 "print('ptrace', libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH to PID 1
                 "print('environ', os.access('/proc/1/environ', os.R_OK))\n"
                 "print('socket', os.path.exists('/run/arena/ctl.sock'))\n"
                 "os.kill(1, 9)\n"  # a container's init ignores signals from inside,
                 "os.kill(1, 2)\n")  # and handles none (SIGINT ended Python's)
        result = await sandbox.exec(["python3", "-c", probe], env={}, timeout_s=30, on_output=chunks.append)
        assert result.exit_code == 0, b"".join(chunks)
        out = b"".join(chunks).decode().split("\n")
        assert out[0].startswith("ptrace -1 ") and out[1:4] == ["environ False", "socket False", ""]
        assert (await sandbox.exec(["true"], env={}, timeout_s=30)).exit_code == 0  # still serving
    finally:
        await sandbox.destroy()


async def test_docker_sandbox_survives_its_command_server_dying(docker_provider):
    """If the server dies (here: the engine kills the container), the next command
    starts the container again with a fresh server; the workspace is kept."""
    sandbox = await docker_provider.create(CreateSpec())
    try:
        await sandbox.put_files({"/sandbox/workspace/kept.txt": b"kept"})
        docker_provider.client.api.kill(sandbox.container_id, signal="SIGKILL")
        chunks: list[bytes] = []
        result = await sandbox.exec(["cat", "kept.txt"], env={}, timeout_s=60, on_output=chunks.append)
        assert result.exit_code == 0 and b"".join(chunks) == b"kept"
    finally:
        await sandbox.destroy()
    assert not docker_provider.client.api.containers(all=True, filters={"id": sandbox.container_id})


# A host process of the sandbox's uid (a user of the worker's host): it connects to the
# control socket as soon as it exists and answers any command as if it had run it.
IMPOSTOR = r"""
import socket, struct, sys, time
while True:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1])
    except OSError:
        s.close()
        time.sleep(0.0002)
        continue
    s.settimeout(5)
    try:
        if s.recv(65536):
            s.sendall(struct.pack(">cI", b"O", 6) + b"forged" + struct.pack(">cI", b"R", 1) + b"0")
            time.sleep(5)
    except OSError:
        pass
    s.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as the sandbox's uid")
async def test_docker_control_socket_takes_only_the_containers_server(docker_provider):
    sandbox = await docker_provider.create(CreateSpec())
    impostor = None
    try:
        await sandbox.put_files({"/sandbox/workspace/kept.txt": b"kept"})
        docker_provider.client.api.kill(sandbox.container_id, signal="SIGKILL")  # the next exec starts it again
        impostor = subprocess.Popen(["/usr/bin/python3", "-I", "-c", IMPOSTOR, str(sandbox.run_dir / "ctl.sock")],
                                    user=1000, group=1000, extra_groups=[])
        chunks: list[bytes] = []
        result = await sandbox.exec(["cat", "kept.txt"], env={}, timeout_s=60, on_output=chunks.append)
        assert b"".join(chunks) == b"kept" and result.exit_code == 0
    finally:
        if impostor is not None:
            impostor.kill()
            impostor.wait()
        await sandbox.destroy()


async def test_docker_destroy_while_a_command_runs(docker_provider):
    """destroy() does not wait for a running exec: it ends the command (the exec
    raises SandboxError) and removes the container all the same."""
    sandbox = await docker_provider.create(CreateSpec())
    started = asyncio.Event()
    running = asyncio.ensure_future(sandbox.exec(["sh", "-c", "echo started; sleep 100"], env={}, timeout_s=120,
                                                 on_output=lambda chunk: started.set()))
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.wait_for(sandbox.destroy(), 30)
    with pytest.raises(SandboxError, match="destroyed"):
        await asyncio.wait_for(running, 30)
    assert not docker_provider.client.api.containers(all=True, filters={"id": sandbox.container_id})
    assert not sandbox.root.exists() and not sandbox.run_dir.exists()


async def test_docker_create_cancelled_while_the_engine_creates_the_container(docker_provider):
    """A cancelled create leaves nothing, even when it is cancelled while the engine is
    creating the container (a thread that cannot be stopped)."""
    from arena_sandbox_providers.docker_provider import run_dir_of

    creating = asyncio.ensure_future(docker_provider.create(CreateSpec()))
    deadline = asyncio.get_running_loop().time() + 30
    while not any((run_dir_of(root) / "cmdserver.py").exists()  # the last step before the engine's create
                  for root in (docker_provider.base.iterdir() if docker_provider.base.exists() else [])):
        assert asyncio.get_running_loop().time() < deadline and not creating.done()
        await asyncio.sleep(0.0005)
    creating.cancel()
    with pytest.raises(asyncio.CancelledError):
        await creating
    await asyncio.sleep(0.3)  # time for an engine call left running to show (it must not)
    assert not docker_provider.client.api.containers(all=True, filters={"label": f"arena.owner={docker_provider.owner}"})
    assert list(docker_provider.base.iterdir()) == []


async def test_docker_commands_get_the_images_environment(docker_provider):
    sandbox = await docker_provider.create(CreateSpec())
    try:
        chunks: list[bytes] = []
        result = await sandbox.exec(["sh", "-c", 'printf "%s|%s|%s" "$PATH" "$HOME" "$LANG"'], env={}, timeout_s=30,
                                    on_output=chunks.append)
        assert result.exit_code == 0 and b"".join(chunks) == b"/usr/local/bin:/usr/bin:/bin|/tmp|C.UTF-8"
    finally:
        await sandbox.destroy()


async def test_docker_engine_calls_run_on_the_providers_own_threads(docker_provider, monkeypatch):
    """An engine call holds its thread as long as the engine takes (seconds when it is busy). On
    the loop's default executor (6 threads on 2 cores, shared with the service's workspace copies)
    256 sandboxes' creates and starts held every sandbox's files behind them: no agent started before
    the last container had. Create, a command, the OOM counter's look-up and destroy make their
    engine calls on the provider's own threads."""
    import threading

    from arena_sandbox_providers.docker_provider import ENGINE_THREADS

    threads: dict[str, set[str]] = {}
    api = docker_provider.client.api
    for name in ("create_container", "start", "inspect_container", "remove_container", "kill", "wait"):
        def recorded(*args, _name=name, _real=getattr(api, name), **kwargs):
            threads.setdefault(_name, set()).add(threading.current_thread().name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(api, name, recorded)
    sandbox = await docker_provider.create(CreateSpec())
    try:
        await sandbox.put_files({"/sandbox/workspace/f": b"x"})
        assert (await sandbox.exec(["cat", "f"], env={}, timeout_s=60)).exit_code == 0
    finally:
        await sandbox.destroy()
    assert {"create_container", "start", "remove_container"} <= set(threads), threads
    names = set().union(*threads.values())
    assert all(n.startswith("arena-docker-engine") for n in names), threads
    assert len(names) <= ENGINE_THREADS


async def test_docker_sandbox_starts_and_runs_while_the_engine_is_slow_to_answer(docker_provider, monkeypatch,
                                                                                  tmp_path):
    """A busy engine answers in seconds. While the command server has not connected, the provider
    asks the engine every second whether the container is still running; that question must not
    hold the connection up (at 96 and 256 sandboxes at once the agents waited for the engine's whole
    queue: for the last container's start). Nor may a command of a started sandbox wait for an engine
    thread (its OOM counter is found from the server's pid, in /proc). Here the server connects after
    2.5 s, the engine does not answer until the command has run, and every engine thread is taken."""
    import threading

    from arena_sandbox_providers import docker_provider as module

    source = module.CMDSERVER.read_text()
    main_call = 'if __name__ == "__main__":\n    sys.exit(main(sys.argv[1:]))'
    assert main_call in source
    slow = tmp_path / "cmdserver.py"  # the same server, connecting late (after the provider's first look)
    slow.write_text(source.replace(main_call, 'if __name__ == "__main__":\n    import time\n    time.sleep(2.5)\n'
                                              '    sys.exit(main(sys.argv[1:]))'))
    monkeypatch.setattr(module, "CMDSERVER", slow)
    answer, order = threading.Event(), []
    api = docker_provider.client.api
    real_inspect = api.inspect_container

    def busy_inspect(*args, **kwargs):
        order.append("asked")
        answer.wait(180)  # the busy engine answers once the command ran (at the latest after 180 s)
        order.append("answered")
        return real_inspect(*args, **kwargs)

    monkeypatch.setattr(api, "inspect_container", busy_inspect)
    sandbox = await docker_provider.create(CreateSpec())
    try:
        order.append("created")
        taken = [asyncio.ensure_future(docker_provider.call(answer.wait, 180)) for _ in range(module.ENGINE_THREADS)]
        result = await sandbox.exec(["true"], env={}, timeout_s=60)
        order.append("ran")
        answer.set()
        await asyncio.gather(*taken)
        assert result.exit_code == 0
    finally:
        answer.set()
        await sandbox.destroy()
    assert order[:3] == ["asked", "created", "ran"], order


#: A process of the sandbox's uid holding ``argv[1]`` threads until its stdin closes.
_HOLD_THREADS = """
import os, sys, threading
os.setgroups([]); os.setgid(1000); os.setuid(1000)
threading.stack_size(64 * 1024)
never = threading.Event()
for _ in range(int(sys.argv[1])):
    threading.Thread(target=never.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


async def test_docker_sandboxes_start_beside_thousands_of_threads_of_their_uid(docker_provider):
    """RLIMIT_NPROC counts every thread of a uid on the whole host, and containers share the
    host's user namespace: a container's ``nproc`` ulimit caps all sandboxes (and anything else of
    uid 1000) together. At the fixed 4096 it was, no container started once they held 4,096 threads
    (~585 trivial agents at 7 threads each; "exec container process: Resource temporarily
    unavailable"). Here a host process of the sandbox's uid holds more than that: a sandbox still
    starts, forks, and has explicit nproc and nofile ulimits (pids are bounded per container by its
    pids cgroup)."""
    import sys

    from arena_sandbox_providers.docker_provider import NPROC_FLOOR, nproc_limit

    if os.geteuid() != 0:
        pytest.skip("runs a process as the sandbox's uid: needs root")
    assert docker_provider.nproc == nproc_limit() > NPROC_FLOOR + 100
    hold = subprocess.Popen([sys.executable, "-c", _HOLD_THREADS, str(NPROC_FLOOR + 100)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert hold.stdout.readline() == b"ready\n"
        sandbox = await docker_provider.create(CreateSpec())
        try:
            chunks: list[bytes] = []
            result = await sandbox.exec(["sh", "-c", "grep -E 'Max (processes|open files)' /proc/self/limits; "
                                                     "(true) && echo forked"],
                                        env={}, timeout_s=60, on_output=chunks.append)
            out = b"".join(chunks).decode()
            assert result.exit_code == 0, out
            nproc, nofile = (f"{name} {n} {n}" for name, n in (("Max processes", docker_provider.nproc),
                                                               ("Max open files", CreateSpec().limits.open_files)))
            assert [" ".join(line.split()[:-1]) for line in out.splitlines()[:2]] == [nproc, nofile], out
            assert out.endswith("forked\n")
        finally:
            await sandbox.destroy()
    finally:
        hold.kill()
        hold.wait()


async def test_local_runs_in_the_directory_asked_and_refuses_one_it_cannot_honour(tmp_path):
    """A command runs where it is asked (the workspace's subdirectories, the environment's
    directory at /sandbox/agent, so a relative command finds its files); a working directory
    the sandbox has not got is an error naming it, never the workspace instead."""
    if local.available() is not None:
        pytest.skip(f"no bubblewrap: {local.available()}")
    provider = make_provider("local", tmp_path / "d")
    sandbox = await provider.create(CreateSpec())
    try:
        async def pwd(workdir: str) -> str:
            out: list[bytes] = []
            ran = await sandbox.exec(["sh", "-c", "pwd"], env={}, workdir=workdir, timeout_s=30, on_output=out.append)
            assert ran.exit_code == 0
            return b"".join(out).decode().strip()

        await sandbox.put_files({"/sandbox/workspace/sub/x": b""})
        assert await pwd("/sandbox/workspace/sub") == "/sandbox/workspace/sub"
        with pytest.raises(SandboxError, match="nothing at /sandbox/agent"):
            await pwd(local.AGENT_DIR)
        env_dir = tmp_path / "env"
        (env_dir / "bin").mkdir(parents=True)
        (env_dir / "serve.sh").write_text("#!/bin/sh\necho served from \"$(pwd)\"\n")
        (env_dir / "serve.sh").chmod(0o755)
        await sandbox.put_dir(env_dir, local.AGENT_DIR)
        out: list[bytes] = []
        ran = await sandbox.exec(["./serve.sh"], env={}, workdir=local.AGENT_DIR, timeout_s=30, on_output=out.append)
        assert (ran.exit_code, b"".join(out).strip()) == (0, b"served from /sandbox/agent")
        assert await pwd("/sandbox/agent/bin") == "/sandbox/agent/bin"
        for elsewhere, why in (("/testbed", "not under /sandbox"), ("/sandbox/workspace/missing", "not a directory"),
                               ("/sandbox/workspace/sub/x", "not a directory")):
            with pytest.raises(SandboxError, match=why):
                await pwd(elsewhere)
    finally:
        await sandbox.destroy()
