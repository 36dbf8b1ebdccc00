"""Evaluation reports kept for the dashboard (arena_trajectory/evals.py): ``arena eval``'s own
report.json posted, listed with its headline figures and read back whole by job and version."""

from __future__ import annotations

import io

import httpx
import msgspec
import pytest

from arena.evaluation import report, runner
from arena_core.schemas import RolloutState
from arena_trajectory.app import create_app
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.store import TrajectoryStore
from tests.client.test_evaluation_job import FakeClient, dataset


@pytest.fixture
def job(tmp_path):
    directory = runner.create_job(dataset(tmp_path, 2), agent="task", models=["a", "b"], k=2, concurrency=2,
                                  root=tmp_path / "evals")
    runner.run_job(FakeClient(lambda task, model, *_: (RolloutState.COMPLETED, 1.0 if model == "a" else 0.0, False)),
                   directory, stream=io.StringIO(), tty=False)
    return directory


@pytest.fixture
async def api(tmp_path):
    store = TrajectoryStore(ChdbBackend(tmp_path / "clickhouse"))
    await store.init()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(store)), base_url="http://t") as c:
        yield c
    await store.close()


async def test_a_posted_report_is_listed_with_its_figures_and_read_back_by_version(api, job):
    built = report.build(job)
    body = msgspec.json.encode(built)
    r = await api.post("/v1/evals", content=body)
    assert r.status_code == 201 and r.json() == {"stored": True, "job_id": built.spec.job_id, "version": 1}
    assert (await api.post("/v1/evals", content=body)).status_code == 201  # posted again: one row
    v2 = msgspec.structs.replace(built, grading=msgspec.structs.replace(
        report.read_versions(job)[0], version=2, verifier="eval-x-v2", source="--verifier v.json", regraded=8))
    assert (await api.post("/v1/evals", content=msgspec.json.encode(v2))).json()["version"] == 2

    [listed] = (await api.get("/v1/evals")).json()["jobs"]
    assert listed["job_id"] == built.spec.job_id and listed["versions"] == [1, 2]
    assert (listed["k"], listed["tasks"], listed["agent"]) == (2, 2, "task")
    assert [(m["model"], m["pass_at_1"], m["pass_at_k"], m["mean_reward"]) for m in listed["models"]] == [
        ("a", 1.0, 1.0, 1.0), ("b", 0.0, 0.0, 0.0)]

    latest = (await api.get(f"/v1/evals/{built.spec.job_id}")).json()
    assert latest["versions"] == [1, 2] and latest["version"] == 2 and latest["report"]["grading"]["version"] == 2
    first = (await api.get(f"/v1/evals/{built.spec.job_id}", params={"version": 1})).json()
    assert first["report"] == msgspec.json.decode(body)  # as posted
    missing = await api.get(f"/v1/evals/{built.spec.job_id}", params={"version": 3})
    assert missing.status_code == 404 and "versions [1, 2]" in missing.json()["error"]["message"]
    assert (await api.get("/v1/evals/ev-nope")).status_code == 404


async def test_what_is_not_a_report_is_refused_with_a_reason(api):
    r = await api.post("/v1/evals", content=b'{"spec": {"job_id": "x"}}')
    assert r.status_code == 422 and "not an evaluation report" in r.json()["error"]["message"]
    r = await api.post("/v1/evals", content=b"not json")
    assert r.status_code == 422
