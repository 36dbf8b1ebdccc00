"""deploy/docker-engine.sh's store directory: the script runs podman as root with a
store that defaults to /dev/shm, writable by every user, so a directory it did not
make (or a symlink) must never become the engine's store."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "docker-engine.sh"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("podman") is None,
                                reason="the engine script runs as root with podman")


def run(store: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), "podman", "--version"], env={**os.environ, "ARENA_ENGINE_DIR": str(store)},
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_store_of_another_user_or_a_symlink_is_refused(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    for store in (foreign, link):
        proc = run(store)
        assert proc.returncode == 3 and "not using it as the engine's store" in proc.stderr, proc.stderr
    assert not (tmp_path / "elsewhere").exists()


def test_a_new_store_is_private(tmp_path):
    proc = run(tmp_path / "store")
    assert proc.returncode == 0 and "podman" in proc.stdout, proc.stderr
    assert stat.S_IMODE((tmp_path / "store").stat().st_mode) == 0o700
