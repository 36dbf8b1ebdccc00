"""Evaluation reports kept for the dashboard (docs/evaluation.md, The dashboard's Evaluations page).

``arena eval`` runs on the user's machine and keeps its job there (``$ARENA_DATA_DIR/evals``);
each report it writes (``report.json``, the client's ``EvalReport``) it also posts here, so that
the dashboard, which reads only the services' APIs, can list jobs and show their reports. A report
is stored whole, keyed by job and grading version (a re-post replaces the version's row); the
few fields the listing needs are read from it on the way in. Nothing here computes a figure.

A job belongs to the project of the key that first posted it, and to that key (docs/projects.md):
job ids are per project (another project's ``job-1`` is another job, kept as ``{project}/job-1``,
``owners.scoped_name``); within the project only the job's key, or an admin key, may post a
version of it (403 ``forbidden`` otherwise; keys off: anyone).
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec

from arena_core import owners
from arena_core.apikeys import ApiKey
from arena_core.errors import InvalidRequest, NotFound
from arena_core.schemas import ID_MAX, ID_PATTERN, valid_id
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.tables import DATABASE

#: The largest report body taken (a job of thousands of tasks × a few models fits).
MAX_REPORT_BODY = 32 << 20


class _Estimate(msgspec.Struct, frozen=True):
    value: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


class _Model(msgspec.Struct):
    model: str
    mean_reward: _Estimate = _Estimate()
    pass_at: dict[str, _Estimate] = {}


class _Task(msgspec.Struct):
    task_id: str


class _Spec(msgspec.Struct):
    job_id: Annotated[str, msgspec.Meta(pattern=ID_PATTERN, max_length=ID_MAX)]
    #: Unix seconds; the table's DateTime64 holds 1970 to 2299 (this bound: 2200)
    created_at: Annotated[float, msgspec.Meta(ge=0, le=7_258_118_400)]
    dataset: str
    agent: str
    models: list[str]
    k: Annotated[int, msgspec.Meta(ge=1, le=100_000)]
    tasks: list[_Task]


class _Grading(msgspec.Struct):
    version: Annotated[int, msgspec.Meta(ge=1, le=10_000)]


class EvalReportPost(msgspec.Struct):
    """``POST /v1/evals``: an ``arena eval`` report (its ``report.json``). What the listing reads of it is
    checked; every other field is kept as posted, not read."""

    spec: _Spec
    models: list[_Model]
    grading: _Grading | None = None


class ModelFigures(msgspec.Struct, kw_only=True):
    """A model's headline figures in a job's latest version (None: no estimate)."""

    model: str
    pass_at_1: float | None
    pass_at_k: float | None
    mean_reward: float | None


class EvalSummary(msgspec.Struct, kw_only=True):
    """A job as the listing shows it: its spec's essentials, its grading versions, and each
    model's pass@1, pass@k and mean reward in the latest version."""

    job_id: str
    created_at: float
    dataset: str
    agent: str
    k: int
    tasks: int
    versions: list[int]
    models: list[ModelFigures]
    stored_at: float
    project: str = owners.DEFAULT_PROJECT  # the project it belongs to (an admin key lists every one's)


class EvalList(msgspec.Struct, kw_only=True):
    jobs: list[EvalSummary]


_decode_report = msgspec.json.Decoder(EvalReportPost)


def read_report(body: bytes) -> EvalReportPost:
    if len(body) > MAX_REPORT_BODY:
        raise InvalidRequest(f"evaluation report body over {MAX_REPORT_BODY} bytes")
    try:
        report = _decode_report.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"not an evaluation report (arena eval's report.json): {exc}") from None
    if not valid_id(report.spec.job_id):
        raise InvalidRequest("spec.job_id must be an identifier")
    if report.grading is not None and not 1 <= report.grading.version <= 10_000:
        raise InvalidRequest("grading.version must be 1 to 10000")
    return report


async def job_owner(store: TrajectoryStore, key: str) -> str | None:
    """The owner of the stored job ``key`` (a scoped name): the key of its first version; None
    when no version is stored. A job posted before owners were recorded is ``anonymous``'s."""
    lines = await store.select(
        f"SELECT owner FROM {DATABASE}.eval_reports FINAL WHERE job_id = {{job:String}} "
        "ORDER BY stored_at LIMIT 1", {"job": key})
    if not lines:
        return None
    return msgspec.json.decode(lines[0])["owner"] or owners.ANONYMOUS


async def store_report(store: TrajectoryStore, body: bytes, caller: ApiKey | None = None) -> tuple[str, int]:
    """Keep a posted report (its version's earlier copy replaced) as ``caller``'s project's; its
    job and version. A job of that project another key posted is refused (403) unless ``caller``
    is an admin key."""
    report = read_report(body)
    project = owners.project_of(caller)
    key = owners.scoped_name(project, report.spec.job_id)
    owner = await job_owner(store, key)
    if owner is not None:
        owners.check(owner, caller, f"evaluation job {report.spec.job_id!r}")
    version = report.grading.version if report.grading is not None else 1
    k = report.spec.k
    models = [ModelFigures(model=m.model, pass_at_1=m.pass_at.get("1", _Estimate()).value,
                           pass_at_k=m.pass_at.get(str(k), _Estimate()).value, mean_reward=m.mean_reward.value)
              for m in report.models]
    row = {"job_id": key, "project": project, "owner": owner or owners.owner_of(caller), "version": version, "created_at": report.spec.created_at,
           "stored_at": time.time(), "dataset": report.spec.dataset, "agent": report.spec.agent, "k": k,
           "tasks": len(report.spec.tasks), "models": msgspec.json.encode(models).decode(), "body": body.decode()}
    await store._insert("eval_reports", [row])  # noqa: SLF001 - the store's typed insert path
    return report.spec.job_id, version


class _Row(msgspec.Struct):
    job_id: str
    versions: list[int]
    created_at: float
    stored_at: float
    dataset: str
    agent: str
    k: int
    tasks: int
    models: str


async def list_jobs(store: TrajectoryStore, *, limit: int = 50, project: str | None = None) -> EvalList:
    """The latest jobs (by their creation), newest first, each with its latest version's figures;
    ``project``'s only when given."""
    lines = await store.select(
        f"SELECT job_id, arraySort(groupArray(version)) AS versions, "
        f"toFloat64(argMax(created_at, version)) AS created_at, toFloat64(max(stored_at)) AS stored_at, "
        f"argMax(dataset, version) AS dataset, argMax(agent, version) AS agent, argMax(k, version) AS k, "
        f"argMax(tasks, version) AS tasks, argMax(models, version) AS models "
        f"FROM {DATABASE}.eval_reports FINAL{' WHERE project = {project:String}' if project is not None else ''} "
        f"GROUP BY job_id ORDER BY created_at DESC, job_id LIMIT {{limit:UInt32}}",
        {"limit": limit, **({"project": project} if project is not None else {})})
    rows = [msgspec.json.decode(line, type=_Row, strict=False) for line in lines]
    return EvalList(jobs=[EvalSummary(job_id=owners.split_scoped(r.job_id)[1], project=owners.split_scoped(r.job_id)[0],
                                      created_at=r.created_at, dataset=r.dataset, agent=r.agent,
                                      k=r.k, tasks=r.tasks, versions=r.versions, stored_at=r.stored_at,
                                      models=msgspec.json.decode(r.models, type=list[ModelFigures]))
                          for r in rows])


async def job_report(store: TrajectoryStore, job_id: str, version: int | None = None,
                     project: str = owners.DEFAULT_PROJECT) -> bytes:
    """``{"job_id", "versions", "version", "report"}``: the report of ``version`` (default the latest)
    of ``project``'s job ``job_id``, as posted."""
    key = owners.scoped_name(project, job_id)
    lines = await store.select(
        f"SELECT version FROM {DATABASE}.eval_reports FINAL WHERE job_id = {{job:String}} ORDER BY version",
        {"job": key})
    versions = [msgspec.json.decode(line)["version"] for line in lines]
    if not versions:
        raise NotFound(f"no evaluation job {job_id!r} (`arena eval report` stores its report here)")
    chosen = versions[-1] if version is None else version
    if chosen not in versions:
        raise NotFound(f"evaluation job {job_id!r} has versions {versions}, not {chosen}")
    [line] = await store.select(
        f"SELECT body FROM {DATABASE}.eval_reports FINAL WHERE job_id = {{job:String}} AND version = {{v:UInt32}}",
        {"job": key, "v": chosen})
    body = msgspec.json.decode(line)["body"]
    return msgspec.json.encode({"job_id": job_id, "versions": versions, "version": chosen,
                                "report": msgspec.Raw(body.encode())})
