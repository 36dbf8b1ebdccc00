"""deploy/sandbox-host.sh: `tune` remounts the cgroup v2 hierarchy with favordynmods and keeps its
other options, and runs twice in a row without error (what it buys is measured in
docs/sandbox.md, not asserted). As root on a host with cgroups; skipped elsewhere, with the reason."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "sandbox-host.sh"


def _v2_mount() -> tuple[str, str] | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] == "cgroup2":
            return fields[4], fields[-1]
    return None


def test_tune_keeps_the_hierarchys_options_and_is_idempotent():
    if os.geteuid() != 0:
        pytest.skip("tuning cgroups needs root")
    before = _v2_mount()
    if before is None:
        pytest.skip("no cgroup v2 hierarchy mounted here")
    first = subprocess.run(["bash", str(SCRIPT), "tune"], capture_output=True, text=True, timeout=60, check=False)
    if first.returncode == 3:
        pytest.skip(f"cannot tune here: {first.stderr.strip()}")
    assert first.returncode == 0, first.stderr
    again = subprocess.run(["bash", str(SCRIPT), "tune"], capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 0, again.stderr
    after = _v2_mount()
    assert after is not None and after[0] == before[0]
    options = set(after[1].split(","))
    assert "favordynmods" in options
    assert set(before[1].split(",")) - {"favordynmods"} <= options  # nothing that was set is lost
    shown = subprocess.run(["bash", str(SCRIPT), "show"], capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0 and "favordynmods" in shown.stdout
