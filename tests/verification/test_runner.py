"""The verification runner on the quickstart task, with real bubblewrap sandboxes.

The gold, wrong and empty patches and every tampering case run in test_verification_hacks.py."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from arena_core.schemas import TestCounts as Counts
from arena_core.schemas import VerifyJob
from arena.tasks import load_task
from arena_sandbox_providers import local
from arena_verification.runner import verify

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no sandbox: {local.available()}")

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
TASK = load_task(QUICKSTART)
TEST_FILE = "tests/test_textstats.py"
CORE = "textstats/core.py"


def scripted_diff(label: str) -> str:
    script = json.loads((QUICKSTART / "llm_script.json").read_text())
    content = next(r["content"] for r in script["responses"] if r["label"] == label)
    return content.split("```diff\n", 1)[1].split("```", 1)[0]


def diff_of(tmp_path: Path, edit: Callable[[Path], None]) -> str:
    """A real ``git diff`` of ``edit`` applied to a copy of the quickstart repository."""
    repo = tmp_path / "edit"
    local.prepare_workspace(Path(TASK.repo), repo)
    edit(repo)
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", "add", "-A"], cwd=repo, env=env, check=True)
    out = subprocess.run(["git", "diff", "--cached", "--binary"], cwd=repo, env=env, check=True, capture_output=True)
    shutil.rmtree(repo)
    return out.stdout.decode()


def fix_median(repo: Path) -> None:
    core = repo / CORE
    core.write_text(core.read_text().replace("ordered[mid] + ordered[mid + 1]", "ordered[mid - 1] + ordered[mid]"))


def weaken_tests(repo: Path) -> None:
    tests = repo / TEST_FILE
    text = tests.read_text()
    text = text.replace("assert median([4, 1, 3, 2]) == 2.5", "assert True")
    text = text.replace("assert median([10, 20]) == 15", "assert True")
    tests.write_text(text)


async def run(tmp_path: Path, diff: str, task=TASK):
    scratch = tmp_path / "scratch"
    result = await verify(VerifyJob(rollout_id="r1", task=task, diff=diff), scratch_dir=scratch)
    assert list(scratch.iterdir()) == []  # the temporary directory is always removed
    return result


async def test_diff_that_does_not_apply(tmp_path):
    diff = scripted_diff("correct").replace("ordered[mid] + ordered[mid + 1]", "ordered[mid] + ordered[mid + 2]")
    r = await run(tmp_path, diff)
    assert (r.reward, r.passed) == (0.0, False)
    assert r.flags == ["patch_failed"]
    assert r.reason.startswith("the diff does not apply: error: patch failed: textstats/core.py")
    assert r.tests == []


async def test_a_test_command_that_hangs_times_out(tmp_path):
    verifier = msgspec.structs.replace(TASK.verifier, command="python -m pytest -rA -v tests; sleep 60",
                                       timeout_s=20)  # the tests' own run fits, the sleep never
    task = msgspec.structs.replace(TASK, verifier=verifier)
    r = await run(tmp_path, scripted_diff("correct"), task)
    # Every listed test passed before the hang, but a run that did not finish is not trusted.
    assert r.counts == Counts(f2p_passed=2, p2p_passed=5)
    assert (r.reward, r.passed) == (0.0, False)
    assert r.flags == ["timeout"]
    assert r.reason.startswith("the test command timed out after 20s")


async def test_output_that_is_not_pytest_is_a_parse_failure(tmp_path):
    verifier = msgspec.structs.replace(TASK.verifier, command="echo tests are fine")
    r = await run(tmp_path, scripted_diff("correct"), msgspec.structs.replace(TASK, verifier=verifier))
    assert r.reward == 0.0
    assert r.flags == ["tests_missing", "parse_failed"]
    assert r.log_tail == "tests are fine"


def with_report(command: str, *, fallback: str | None = "pytest"):
    verifier = msgspec.structs.replace(TASK.verifier, command=command, parser="pytest_junit",
                                       fallback_parser=fallback)
    return msgspec.structs.replace(TASK, verifier=verifier)


async def test_a_structured_report_written_outside_the_workspace_decides(tmp_path):
    task = with_report("python -m pytest -rA -p no:cacheprovider --junitxml={report} tests")
    gold, empty = await asyncio.gather(run(tmp_path / "g", scripted_diff("correct"), task),
                                       run(tmp_path / "e", "", task))
    assert (gold.reward, gold.flags, gold.parser) == (1.0, [], "pytest_junit")
    assert gold.counts == Counts(f2p_passed=2, p2p_passed=5)
    assert (empty.reward, empty.counts) == (0.0, Counts(f2p_failed=2, p2p_passed=5))


async def test_a_missing_report_falls_back_to_the_log_or_fails(tmp_path):
    # the command never writes the report (a runner crash would not either)
    fallback = with_report("python -m pytest -rA -p no:cacheprovider tests # {report}")
    r = await run(tmp_path / "a", scripted_diff("correct"), fallback)
    assert (r.reward, r.flags) == (1.0, [])  # read from the log by the fallback parser
    none = with_report("python -m pytest -rA -p no:cacheprovider tests # {report}", fallback=None)
    r = await run(tmp_path / "b", scripted_diff("correct"), none)
    assert r.reward == 0.0 and "parse_failed" in r.flags


async def test_a_report_at_odds_with_the_exit_code_is_not_trusted(tmp_path):
    # every test passes, the report says so, yet the runner exits non-zero: something is off
    task = with_report("python -m pytest -rA -p no:cacheprovider --junitxml={report} tests; exit 3")
    r = await run(tmp_path, scripted_diff("correct"), msgspec.structs.replace(
        task, verifier=msgspec.structs.replace(task.verifier, canaries=False)))
    assert r.reward == 0.0 and "parse_suspect" in r.flags
    assert "the runner exited 3" in r.reason
