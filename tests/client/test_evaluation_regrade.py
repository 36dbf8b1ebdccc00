"""Re-grading a finished evaluation job (libs/arena/evaluation/regrade.py, versions.py) with the
verifications answered in memory: a new grading version whose report is report.v2.*, the first
report and log untouched, failed and infrastructure attempts not re-graded, a verdict without a
reward left out, and a job not finished refused."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from arena.evaluation import records, regrade, report, runner, versions
from arena_core.errors import InvalidRequest
from arena_core.schemas import ExactVerifier, RolloutState, VerificationResult
from tests.client.test_evaluation_job import FakeClient, dataset

ANSWERS = {("a", "t0"): 1.0, ("a", "t1"): 0.0, ("b", "t0"): 0.0, ("b", "t1"): 0.0}


def decide(task, model, seed, try_):
    if (model, task) == ("b", "t1"):
        return RolloutState.FAILED, None, False  # the agent failed: a failure, not re-graded
    return RolloutState.COMPLETED, ANSWERS[(model, task)], False


@pytest.fixture
def job(tmp_path):
    directory = runner.create_job(dataset(tmp_path, 2), agent="task", models=["a", "b"], k=2, concurrency=2,
                                  root=tmp_path / "evals")
    runner.run_job(FakeClient(decide), directory, stream=io.StringIO(), tty=False)
    return directory


def test_a_regrade_is_a_new_version_and_the_first_report_is_kept(job):
    first = report.write_files(report.build(job), job)
    before = {p.name: p.read_bytes() for p in [*first, job / records.LOG_FILE]}
    asked: list[tuple[str, str]] = []

    async def reverify(rollout_id, verifier, name):
        asked.append((rollout_id, name))
        graded = next(r for r in records.final_results(records.read_log(job)).values() if r.rollout_id == rollout_id)
        # the new verifier passes everything of model b on t0, and cannot grade a's t1 attempt 1
        if (graded.model, graded.task_id, graded.attempt) == ("a", "t1", 1):
            return VerificationResult(rollout_id=rollout_id, verifier=name, reward=None, passed=False,
                                      flags=["infrastructure_error"], started_at=1.0, finished_at=2.0)
        reward = 1.0 if graded.task_id == "t0" else 0.5
        return VerificationResult(rollout_id=rollout_id, verifier=name, reward=reward, passed=reward == 1.0,
                                  started_at=1.0, finished_at=4.0)

    spec = ExactVerifier(answers=["x"])
    v = asyncio.run(regrade.regrade(job, verifiers={"t0": spec, "t1": spec}, source="--verifier v.json",
                                    reverify=reverify))
    assert v.version == 2 and v.regraded == 6 and v.infrastructure == 1  # b's t1 failed: not asked
    assert len(asked) == 6 and len({name for _, name in asked}) == 1 and asked[0][1] == v.verifier
    assert [x.version for x in versions.read_versions(job)] == [1, 2]

    r2 = report.build(job, version=2)
    written = report.write_files(r2, job)
    assert [p.name for p in written] == ["report.v2.md", "report.v2.json", "report.v2.html"]
    assert {p.name: p.read_bytes() for p in [*first, job / records.LOG_FILE]} == before  # version 1 untouched
    cells = {(c.model, c.task_id): c for c in r2.tasks}
    assert cells[("b", "t0")].rewards == [1.0, 1.0]  # was 0, 0
    assert cells[("a", "t1")].rewards == [0.5, None] and cells[("a", "t1")].infrastructure == 1
    assert cells[("b", "t1")].rewards == [0.0, 0.0]  # failed: stays a failure
    assert r2.cost.verify_s == pytest.approx(5 * 3.0 + 1.0)  # the new verifier's time on the re-graded tries
    assert "grading version 2" in (job / "report.v2.md").read_text()
    r1 = report.build(job, version=1)
    assert {(c.model, c.task_id): c.rewards for c in r1.tasks}[("b", "t0")] == [0.0, 0.0]
    assert json.loads((job / "report.v2.json").read_text())["grading"]["version"] == 2
    with pytest.raises(InvalidRequest, match="versions 1 to 2"):
        report.build(job, version=3)


def test_a_job_with_attempts_not_settled_is_not_regraded(tmp_path):
    directory = runner.create_job(dataset(tmp_path, 1), agent="task", models=["a"], k=2, concurrency=1,
                                  root=tmp_path / "evals")

    async def never(*_):
        raise AssertionError("nothing is verified")

    with pytest.raises(InvalidRequest, match="2 attempt\\(s\\) not settled"):
        asyncio.run(regrade.regrade(directory, verifiers={}, source="-", reverify=never))
    assert [x.version for x in versions.read_versions(directory)] == [1]


def test_task_dir_verifiers_are_taken_by_task_id_and_a_missing_task_is_named(tmp_path):
    other = dataset(tmp_path / "new", 2)
    found = regrade.verifiers_from_task_dir(other, ["t0", "t1"])
    assert set(found) == {"t0", "t1"} and all(type(v).__name__ == "TestsVerifier" for v in found.values())
    with pytest.raises(InvalidRequest, match="has no task t7"):
        regrade.verifiers_from_task_dir(other, ["t0", "t7"])
