"""Sandboxes run at a lower CPU priority than the service that starts them (ARENA_SANDBOX_NICE):
every process of a local sandbox at the nice level, its session's autogroup too, and the cgroup
all sandboxes share weighted down; the docker provider asks for the matching CPU shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from arena_core.settings import Settings, SettingsError
from arena_sandbox_providers import cgroups, local, priority
from arena_sandbox_providers.factory import build_provider
from arena_sandbox_providers.local_provider import LocalProvider
from arena_sandbox_providers.provider import CreateSpec

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no bubblewrap: {local.available()}")

#: prints the nice level of the command and of a process it starts, and its autogroup line
PROBE = ("import os, subprocess; print(os.getpriority(os.PRIO_PROCESS, 0)); "
         "print(subprocess.run(['python3', '-c', 'import os; print(os.nice(0))'], capture_output=True, text=True).stdout.strip()); "
         "print(open('/proc/self/autogroup').read().strip() if os.path.exists('/proc/self/autogroup') else 'none')")


async def _probe(provider: LocalProvider) -> list[str]:
    sandbox = await provider.create(CreateSpec())
    try:
        out: list[bytes] = []
        result = await sandbox.exec(["python3", "-c", PROBE], env={}, timeout_s=60, on_output=out.append)
        assert result.exit_code == 0, b"".join(out)
        return b"".join(out).decode().split("\n")
    finally:
        await sandbox.destroy()


async def test_every_process_of_a_local_sandbox_runs_at_the_nice_level(tmp_path: Path):
    own = Settings().sandbox_nice
    assert own == 10  # the default: sandboxes below the services unless a user says otherwise
    provider = build_provider("local", Settings(data_dir=str(tmp_path / "d"), sandbox_owner="prio-test"))
    lines = await _probe(provider)
    assert lines[0] == "10" and lines[1] == "10"
    if provider.use_cgroups:  # the group all sandboxes share is weighted down against the services
        if cgroups.mode() == "v2":
            assert (cgroups.ROOT / "arena" / "cpu.weight").read_text().strip() == str(priority.cgroup_v2_weight(10))
        elif (cgroups.ROOT / "cpu" / "arena" / "cpu.shares").exists():
            assert (cgroups.ROOT / "cpu" / "arena" / "cpu.shares").read_text().strip() == str(priority.cpu_shares(10))


async def test_without_cgroups_the_sandboxes_session_is_weighted_down(tmp_path: Path):
    # no cgroup: the scheduler weighs each session (autogroup) first, so its nice is set too
    provider = LocalProvider(data_dir=tmp_path / "d", owner="prio-test-nocg", use_cgroups=False, nice=10)
    lines = await _probe(provider)
    assert lines[0] == "10" and lines[1] == "10"
    if lines[2] != "none":  # a kernel with autogroups
        assert lines[2].endswith("nice 10"), lines[2]


async def test_nice_zero_leaves_sandboxes_at_the_services_priority(tmp_path: Path):
    provider = LocalProvider(data_dir=tmp_path / "d", owner="prio-test-0", use_cgroups=False, nice=0)
    lines = await _probe(provider)
    assert lines[0] == "0" and lines[1] == "0"


def test_the_weights_are_the_kernels_per_nice_level():
    assert priority.cpu_shares(0) == 1024 and priority.cgroup_v2_weight(0) == 100
    assert priority.cpu_shares(10) == 110 and priority.cgroup_v2_weight(10) == 11  # about a tenth
    assert priority.cpu_shares(19) >= 2 and priority.cgroup_v2_weight(19) >= 1
    with pytest.raises(SettingsError, match="ARENA_SANDBOX_NICE"):
        Settings.from_env({"ARENA_SANDBOX_NICE": "25"})
