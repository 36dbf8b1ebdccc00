"""The local provider's overlay workspace is mounted in each run's own mount namespace: the
service reads and writes it through the layers (upper first, whiteouts and opaque directories
honoured) and sees exactly what the sandbox sees, and no mount is left on the service's side."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from arena_sandbox_providers import local, overlay
from arena_sandbox_providers.provider import CreateSpec
from arena_sandbox_providers.testing import make_provider

pytestmark = pytest.mark.skipif(local.available() is not None or os.geteuid() != 0,
                                reason="needs bubblewrap and root (overlay mounts)")


def _service_mounts_under(top: Path) -> list[str]:
    real = os.path.realpath(top)
    return [point for point, _ in overlay.mounts() if point.startswith(real)]


async def test_the_service_sees_the_workspace_as_the_sandbox_left_it(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg" / "sub").mkdir(parents=True)
    (repo / "keep.txt").write_text("keep\n")
    (repo / "gone.txt").write_text("gone\n")
    (repo / "pkg" / "sub" / "old.py").write_text("old\n")
    base_dir = tmp_path / "base"
    base = local.prepare_workspace(repo, base_dir)
    provider = make_provider("local", tmp_path / "d")
    sandbox = await provider.create(CreateSpec())
    try:
        await sandbox.put_dir(base_dir, local.WORKSPACE, src_stable=True)
        assert (sandbox.root / "upper").is_dir()
        # the service writes into the workspace before the agent runs: the agent sees it
        await sandbox.put_files({f"{local.WORKSPACE}/notes/todo.txt": b"from the service\n",
                                 f"{local.WORKSPACE}/keep.txt": b"replaced\n"})
        agent = ("cat notes/todo.txt keep.txt > /sandbox/.arena/seen && rm gone.txt && rm -r pkg && "
                 "mkdir -p pkg/sub && echo new > pkg/sub/new.py && sleep 0")
        ran = await sandbox.exec(["sh", "-c", agent], env={}, timeout_s=30)
        assert ran.exit_code == 0
        assert await sandbox.read_file("/sandbox/.arena/seen", max_bytes=1000) == b"from the service\nreplaced\n"
        assert not _service_mounts_under(tmp_path / "d")
        # the service's reads: deleted files are gone, a recreated directory hides the base's content
        assert not await sandbox.exists(f"{local.WORKSPACE}/gone.txt")
        assert not await sandbox.exists(f"{local.WORKSPACE}/pkg/sub/old.py")
        assert await sandbox.read_file(f"{local.WORKSPACE}/pkg/sub/new.py", max_bytes=100) == b"new\n"
        assert await sandbox.read_file(f"{local.WORKSPACE}/keep.txt", max_bytes=100) == b"replaced\n"
        assert await sandbox.read_file(f"{local.WORKSPACE}/.git/HEAD", max_bytes=100)  # from the base
        # a write over a deleted file and into a deleted directory: the sandbox sees those, not the base's
        await sandbox.put_files({f"{local.WORKSPACE}/gone.txt": b"back\n"})
        check = await sandbox.exec(["sh", "-c", "[ \"$(cat gone.txt)\" = back ] && [ \"$(ls pkg/sub)\" = new.py ]"],
                                   env={}, timeout_s=30)
        assert check.exit_code == 0
        diff = await sandbox.diff(base)
    finally:
        await sandbox.destroy()
    assert "+back" in diff  # gone.txt as the service wrote it back
    assert "pkg/sub/old.py" in diff and "pkg/sub/new.py" in diff and "+replaced" in diff
    assert (base_dir / "gone.txt").read_text() == "gone\n"  # the base is never written
    assert (base_dir / "pkg" / "sub" / "old.py").read_text() == "old\n"
    assert not (sandbox.root).exists()


async def test_many_live_sandboxes_leave_the_services_mount_table_as_it_was(tmp_path):
    """Twenty sandboxes running at once over overlay workspaces add no mount on the service's
    side (each bwrap would copy them all)."""

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "f.txt").write_text("a\n")
    base_dir = tmp_path / "base"
    local.prepare_workspace(repo, base_dir)
    provider = make_provider("local", tmp_path / "d")
    before = len(overlay.mounts())
    sandboxes = [await provider.create(CreateSpec()) for _ in range(20)]
    try:
        for sandbox in sandboxes:
            await sandbox.put_dir(base_dir, local.WORKSPACE, src_stable=True)
        runs = [asyncio.create_task(s.exec(["sh", "-c", "cat f.txt > /sandbox/.arena/out; sleep 2"], env={},
                                           timeout_s=30)) for s in sandboxes]
        await asyncio.sleep(1.0)
        during = len(overlay.mounts())
        results = await asyncio.gather(*runs)
    finally:
        for sandbox in sandboxes:
            await sandbox.destroy()
    assert all(r.exit_code == 0 for r in results)
    assert during <= before + 1, (before, during)
