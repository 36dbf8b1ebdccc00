"""Provider lifecycle against real sandboxes: warm pool, orphan reaping after a crash
(a new provider instance of the same owner, as after ``kill -9`` and restart)."""

from __future__ import annotations

import uuid

import pytest

from arena_sandbox import local
from arena_sandbox.pool import WarmPool
from arena_sandbox.provider import CreateSpec, Sandbox, SandboxProvider
from arena_sandbox.testing import make_provider


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


async def test_orphans_are_reaped_by_the_next_process(tmp_path, name_and_url):
    name, url = name_and_url
    if name == "mock":
        pytest.skip("mock sandboxes hold no resources")
    owner = f"crashy-{uuid.uuid4().hex[:8]}"
    crashed = make_provider(name, tmp_path / "d", docker_url=url, owner=owner)
    other = make_provider(name, tmp_path / "d", docker_url=url)
    left = [await crashed.create(CreateSpec())]
    kept = await other.create(CreateSpec())
    restarted = make_provider(name, tmp_path / "d", docker_url=url, owner=owner)
    assert await restarted.reap_orphans() == 1
    assert list(restarted.base.iterdir()) == []
    if name == "docker":
        for sandbox in left:
            assert not restarted.client.api.containers(all=True, filters={"id": sandbox.container_id})
        assert restarted.client.api.containers(all=True, filters={"id": kept.container_id})
    assert list(other.base.iterdir())  # another owner's sandbox is left alone
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
                 "os.kill(1, 9)\n")  # a container's init ignores signals from inside
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
