"""A row graded by a spec table in SWE-bench's own shape (``MAP_REPO_VERSION_TO_SPECS``: keyed by
version, with the environment fields SWE-bench keeps beside ``test_cmd``) in a real bubblewrap
sandbox: the test command gets the test patch's test files appended as SWE-bench's harness does,
``eval_commands`` run first, the gold patch scores 1 and an empty patch 0."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from arena import datasets
from arena_core.schemas import PathSource, VerifyJob
from arena_sandbox_providers import local
from arena_verification.runner import verify

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no sandbox: {local.available()}")

DATASET = Path(__file__).resolve().parents[2] / "examples" / "swebench-mini"


def swebench_spec(row: datasets.SwebenchRow, eval_commands: list[str]) -> dict:
    """A spec table for ``row`` as SWE-bench keeps one (fields as in its MAP_REPO_VERSION_TO_SPECS)."""
    return {row.repo: {row.version: {
        "python": "3.11",
        "packages": "pytest",
        "pip_packages": ["pytest==8.3.3"],
        "pre_install": ["apt-get update && apt-get install -y locales"],
        "install": "python -m pip install -e .",
        "eval_commands": eval_commands,
        "test_cmd": "python -m pytest -rA -p no:cacheprovider",
    }}}


def test_swebench_shaped_spec_grades_gold_1_and_empty_0_in_a_real_sandbox(tmp_path):
    row = next(r for r in datasets.read_rows(DATASET / "dataset.jsonl") if r.repo == "benjaminp/six")
    checkout = tmp_path / "checkout"
    datasets.checkout(datasets.mirror_of(DATASET / "repos", row.repo), row.base_commit, checkout)
    plain_f2p = next(t for t in row.tests("FAIL_TO_PASS") if "[" not in t)

    def task_of(eval_commands: list[str]):
        spec = datasets.spec_for(swebench_spec(row, eval_commands), row)
        assert spec.test_cmd.splitlines() == [*eval_commands, "python -m pytest -rA -p no:cacheprovider test_six.py"]
        return datasets.to_task(row, source=PathSource(path=str(checkout)), command=spec.test_cmd,
                                extra_test_files=spec.test_files, spec=spec)

    task = task_of(["export LANG=C.UTF-8"])
    assert json.loads(task.metadata["swebench_spec"])["install"] == "python -m pip install -e ."
    # eval_commands run before the tests, in the same shell: deselecting a FAIL_TO_PASS test there fails gold
    deselecting = task_of([f"export PYTEST_ADDOPTS='--deselect {plain_f2p}'"])

    async def runs():
        return await asyncio.gather(*(verify(VerifyJob(rollout_id=f"six-spec-{name}", task=t, diff=diff),
                                             scratch_dir=tmp_path / "scratch")
                                      for name, t, diff in (("gold", task, row.patch), ("empty", task, ""),
                                                            ("deselected", deselecting, row.patch))))

    gold, empty, deselected = asyncio.run(runs())
    assert (gold.reward, gold.passed, gold.flags) == (1.0, True, []), gold.log_tail
    assert gold.counts.f2p_passed == len(task.verifier.fail_to_pass) > 0
    assert (empty.reward, empty.passed, empty.counts.f2p_passed) == (0.0, False, 0), empty.log_tail
    assert deselected.reward == 0.0 and deselected.counts.f2p_passed == len(task.verifier.fail_to_pass) - 1, \
        deselected.log_tail
