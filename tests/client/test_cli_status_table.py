"""``arena status`` lists rollouts as a table a person reads: a header, one line per rollout (a
long reason cut to the terminal, never wrapped), and the filters ``--group`` and ``--state`` (the
rollout API's), ``--task`` and ``--limit`` (here, once another filter is on), against a real stack
(keys on) with the CLI run as a process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arena.table import format_table
from arena_stack.stack import Stack

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


def test_a_table_keeps_one_line_per_row_and_cuts_only_the_last_column():
    rows = [("r-1", "task-a", "completed", "1", "multi\nline reason " + "x" * 80), ("r-22", "task-bb", "failed", "-", "")]
    lines = format_table(["ROLLOUT", "TASK", "STATE", "REWARD", "REASON"], rows, width=50, right=["REWARD"])
    assert len(lines) == 3
    assert lines[0].split() == ["ROLLOUT", "TASK", "STATE", "REWARD", "REASON"]
    assert lines[1] == "r-1      task-a   completed       1  multi line r…"  # 50 columns
    assert lines[2] == "r-22     task-bb  failed          -"


def test_a_table_too_wide_leaves_out_the_columns_it_may_drop_before_it_wraps():
    rows = [("r-" + "a" * 20, "some-task", "completed", "2m ago", "the reason")]
    headers = ["ROLLOUT", "TASK", "STATE", "CREATED", "REASON"]
    assert format_table(headers, rows, width=80, drop=["CREATED"])[1].split() == [*rows[0][:3], "2m", "ago", "the",
                                                                                "reason"]
    narrow = format_table(headers, rows, width=60, drop=["CREATED"])
    assert [line.split()[:4] for line in narrow] == [["ROLLOUT", "TASK", "STATE", "REASON"],
                                                   [rows[0][0], "some-task", "completed", "the"]]
    assert all(len(line) <= 60 for line in narrow)



def arena(stack: Stack, *args: str, cwd: Path, columns: str = "160") -> subprocess.CompletedProcess[str]:
    """The CLI with the stack's URLs and the key from its data directory, ``columns`` wide."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARENA_")}
    env.update(ARENA_URL=stack.settings.rollout_url, ARENA_TRAJECTORY_URL=stack.settings.trajectory_url,
               ARENA_DATA_DIR=str(stack.data_dir), COLUMNS=columns)
    return subprocess.run([sys.executable, "-m", "arena.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=400)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
@pytest.mark.timeout(600)
def test_status_lists_a_table_filtered_by_group_task_state_and_limit(stack, tmp_path):
    group = arena(stack, "submit", str(QUICKSTART), "--n", "2", "--seed", "0", "--wait", cwd=tmp_path)
    assert "Traceback" not in group.stderr, group.stderr
    group_id, *members = group.stdout.splitlines()[:3]
    group_id = group_id.split()[1]
    single = arena(stack, "submit", str(QUICKSTART), "--wait", cwd=tmp_path)
    assert "Traceback" not in single.stderr, single.stderr
    single_id = single.stdout.split()[0]

    listed = arena(stack, "status", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["ROLLOUT", "TASK", "STATE", "REWARD", "STEPS", "GROUP", "CREATED", "REASON"]
    assert [line.split()[0] for line in lines[1:]] == [*members, single_id]  # oldest first
    assert all(len(line) <= 160 for line in lines)
    assert all(line.split()[1] == "quickstart-textstats" for line in lines[1:])
    assert f"{group_id} 1/2" in lines[1] and f"{group_id} 2/2" in lines[2]

    # 80 columns: the reason is cut, then the creation time, the steps and the group are left out
    narrow = arena(stack, "status", cwd=tmp_path, columns="80").stdout.splitlines()
    assert narrow[0].split() == ["ROLLOUT", "TASK", "STATE", "REWARD", "REASON"] and len(narrow) == len(lines)
    assert all(len(line) <= 80 for line in narrow)

    in_group = arena(stack, "status", "--group", group_id, cwd=tmp_path).stdout.splitlines()
    assert [line.split()[0] for line in in_group[1:]] == members
    newest = arena(stack, "status", "--task", "quickstart-textstats", "--limit", "1", cwd=tmp_path).stdout
    assert [line.split()[0] for line in newest.splitlines()[1:]] == [single_id]
    assert [line.split()[0] for line in arena(stack, "status", "--limit", "2", cwd=tmp_path)
            .stdout.splitlines()[1:]] == [members[1], single_id]
    completed = arena(stack, "status", "--state", "completed", cwd=tmp_path).stdout.splitlines()[1:]
    assert all(line.split()[2] == "completed" for line in completed)

    none = arena(stack, "status", "--task", "no-such-task", cwd=tmp_path)
    assert none.returncode == 0 and none.stdout == ""
    assert none.stderr.strip() == "no rollouts match --task no-such-task"
    bad = arena(stack, "status", "--limit", "0", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("arena: invalid_request: --limit takes 1 to")
