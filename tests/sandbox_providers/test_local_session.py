"""A local sandbox created with ``CreateSpec(session=True)`` (an OpenEnv episode's) runs its commands
through one command server, the init of one long-lived bwrap, instead of a bwrap (and mount namespace)
per command: the commands share the sandbox's namespaces and /tmp as a container's do, each with the
environment and directory it asks for, its timeout and cancel killing everything it started; the
service's writes into the workspace and its diff see and are seen as with a bwrap per command; a
command with an LLM relay and one while another runs get a sandbox of their own; nothing is left
running after destroy."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from arena_sandbox_providers import local
from arena_sandbox_providers.provider import CreateSpec, SandboxError
from arena_sandbox_providers.testing import make_provider

pytestmark = pytest.mark.skipif(local.available() is not None or os.geteuid() != 0,
                                reason="needs bubblewrap and root (overlay mounts)")

PROBE = 'echo "$FOO|$(pwd)|$(readlink /proc/self/ns/mnt)|$(cat /proc/1/cmdline | tr "\\0" " ")"'


async def run(sandbox, script: str, **kw) -> tuple[object, str]:
    out: list[bytes] = []
    kw.setdefault("env", {})
    kw.setdefault("timeout_s", 30)
    result = await sandbox.exec(["sh", "-c", script], on_output=out.append, **kw)
    return result, b"".join(out).decode()


@pytest.fixture
async def workspace(tmp_path):
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    (repo / "a.txt").write_text("one\n")
    base = local.prepare_workspace(repo, tmp_path / "base")
    provider = make_provider("local", tmp_path / "d")
    made = []

    async def create(session: bool):
        sandbox = await provider.create(CreateSpec(session=session))
        await sandbox.put_dir(tmp_path / "base", local.WORKSPACE, src_stable=True)
        made.append(sandbox)
        return sandbox

    yield create, base
    for sandbox in made:
        await sandbox.destroy()


def _processes_under(root: Path) -> list[int]:
    """Host pids whose command line names ``root`` (a sandbox's bwrap or its command server)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(root).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


async def test_commands_share_one_sandbox_process_its_namespaces_and_tmp(workspace):
    create, _ = workspace
    sandbox = await create(session=True)
    seen = []
    for i in range(5):
        result, out = await run(sandbox, f"{PROBE}; echo {i} >> /tmp/count; wc -l < /tmp/count", env={"FOO": f"f{i}"})
        assert result.exit_code == 0 and not result.killed, (result, out)
        probe, count = out.splitlines()
        seen.append(probe.split("|"))
        assert count.strip() == str(i + 1)  # /tmp lives as long as the session
    assert [s[0] for s in seen] == [f"f{i}" for i in range(5)]  # each command's own environment
    assert {s[1] for s in seen} == {local.WORKSPACE}
    assert len({s[2] for s in seen}) == 1  # one mount namespace for all five
    assert all("cmdserver.py" in s[3] for s in seen)  # PID 1 is the command server
    # a fresh sandbox per command: a namespace each, a fresh /tmp each time (what one command leaves
    # there the next does not see; /tmp may hold the bind of a venv that lives under the host's /tmp)
    plain = await create(session=False)
    namespaces = set()
    for _ in range(2):
        result, out = await run(plain, f"{PROBE}; test -e /tmp/left && echo kept || echo fresh; touch /tmp/left")
        probe, seen_tmp = out.splitlines()
        namespaces.add(probe.split("|")[2])
        assert seen_tmp == "fresh"
    assert len(namespaces) == 2


async def test_directory_exit_code_timeout_and_cancel_end_only_the_command(workspace):
    create, _ = workspace
    sandbox = await create(session=True)
    result, out = await run(sandbox, "pwd; exit 7", workdir=f"{local.WORKSPACE}/sub")
    assert (result.exit_code, out) == (7, f"{local.WORKSPACE}/sub\n")
    with pytest.raises(SandboxError, match="not a directory"):
        await run(sandbox, "true", workdir=f"{local.WORKSPACE}/missing")
    # the wall clock kills the command and what it left behind, not the session
    result, _ = await run(sandbox, "sleep 300 & echo $! > /tmp/bg; sleep 300", timeout_s=1)
    assert (result.exit_code, result.timed_out, result.killed) == (None, True, True)
    result, out = await run(sandbox, 'kill -0 "$(cat /tmp/bg)" 2>/dev/null && echo alive || echo gone')
    assert (result.exit_code, out) == (0, "gone\n")
    # a cancel kills it too (killed, not timed out)
    cancel = asyncio.Event()
    asyncio.get_running_loop().call_later(0.5, cancel.set)
    result, _ = await run(sandbox, "sleep 300", cancel=cancel)
    assert (result.exit_code, result.timed_out, result.killed) == (None, False, True)
    # a background process never outlives its command
    result, out = await run(sandbox, "sleep 300 & echo $!")
    assert result.exit_code == 0
    result, out = await run(sandbox, f'kill -0 {out.strip()} 2>/dev/null && echo alive || echo gone')
    assert (result.exit_code, out) == (0, "gone\n")


async def test_the_services_writes_and_diff_agree_with_the_session(workspace):
    create, base = workspace
    sandbox = await create(session=True)
    result, _ = await run(sandbox, "echo two >> a.txt && echo made > new.txt && echo t > /tmp/t")
    assert result.exit_code == 0
    assert await sandbox.read_file(f"{local.WORKSPACE}/new.txt", max_bytes=100) == b"made\n"
    # the service writes into the workspace between commands (the session restarts under it)
    await sandbox.put_files({f"{local.WORKSPACE}/from-service.txt": b"hello\n"})
    result, out = await run(sandbox, "cat from-service.txt a.txt")
    assert (result.exit_code, out) == (0, "hello\none\ntwo\n")
    diff = await sandbox.diff(base)
    assert "+two" in diff and "new.txt" in diff and "from-service.txt" in diff
    result, out = await run(sandbox, "cat new.txt")  # a new session after the diff: same workspace
    assert (result.exit_code, out) == (0, "made\n")


async def test_concurrent_commands_run_side_by_side_and_destroy_leaves_nothing(workspace):
    create, _ = workspace
    sandbox = await create(session=True)
    started = asyncio.ensure_future(run(sandbox, "echo long; sleep 2; echo done"))
    await asyncio.sleep(0.3)
    result, out = await run(sandbox, "echo meanwhile")  # the server is busy: a bwrap of its own
    assert (result.exit_code, out) == (0, "meanwhile\n")
    result, out = await started
    assert (result.exit_code, out) == (0, "long\ndone\n")
    assert _processes_under(sandbox.root)  # the command server is up
    await sandbox.destroy()
    for _ in range(50):
        if not _processes_under(sandbox.root):
            break
        await asyncio.sleep(0.1)
    assert _processes_under(sandbox.root) == []
