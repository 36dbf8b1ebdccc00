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
