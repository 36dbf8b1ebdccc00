"""Running an evaluation job: every task × model × attempt as a rollout through the SDK, at most
``concurrency`` in flight, each try logged as it is submitted and as it ends, infrastructure
outcomes tried again (a bounded number of times), and a killed job resumed from its log without
running a finished attempt again. docs/evaluation.md (The job, Resuming).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Protocol, TextIO

import msgspec

from arena.evaluation.cost import attempt_cost
from arena.evaluation.records import (
    AttemptCost,
    AttemptFinished,
    AttemptKey,
    AttemptSubmitted,
    EvalSpec,
    EvalTask,
    Log,
    Outcome,
    finished_attempts,
    new_job_id,
    read_log,
    read_spec,
    write_spec,
)
from arena_core.errors import InvalidRequest, NotFound
from arena_core.schemas import RolloutView, SamplingParams, Task, Trajectory

#: Metadata every rollout of a job carries: the job, the attempt (task|model|index) and the try.
META_JOB, META_ATTEMPT, META_TRY = "eval.job", "eval.attempt", "eval.try"
#: The most rollouts ``resume`` looks through for tries submitted but not logged (the API's most).
LIST_MAX = 100_000
#: Each wait on a rollout is cut into polls this long, so a stopped job stops within one.
POLL_S = 20.0


class EvalClient(Protocol):
    """What the runner needs of ``arena.sdk.ArenaClient``."""

    def prepare(self, task: Task) -> Task: ...

    def submit(self, task: Task, *, sampling: SamplingParams | None = None, model: str = "default",
               metadata: dict[str, str] | None = None, provider: str = "local") -> RolloutView: ...

    def wait(self, rollout_id: str, *, timeout: float = 600.0) -> RolloutView: ...

    def wait_trajectory(self, rollout_id: str, *, timeout: float = 60.0) -> Trajectory: ...

    def list(self, *, state: str | None = None, group_id: str | None = None,
             limit: int | None = None) -> list[RolloutView]: ...


def load_dataset(path: str | Path) -> list[tuple[EvalTask, Task]]:
    """The tasks of ``path``: a task file; a directory holding ``task.json`` (one task); a Harbor
    ``dataset.toml`` (or a directory holding one: its tasks, as ``arena tasks import harbor`` reads
    them); else the task files of an import's output directory (``*.json``) and of its
    subdirectories' ``task.json``."""
    from arena import datasets
    from arena.tasks import load_task

    path = Path(path).resolve()
    if path.is_dir() and (path / "task.json").is_file():
        files = [path / "task.json"]
    elif path.suffix == ".toml" or (path.is_dir() and (path / "dataset.toml").is_file()):
        from arena.formats import harbor

        manifest = path if path.suffix == ".toml" else path / "dataset.toml"
        return [(EvalTask(task_id=i.task.id, path=str(manifest)), i.task) for i in harbor.import_source(manifest)]
    elif path.is_dir():
        files = list(datasets.iter_task_files(path)) + sorted(p for p in path.glob("*/task.json"))
    elif path.is_file():
        files = [path]
    else:
        raise InvalidRequest(f"dataset {path}: no such file or directory")
    tasks = [(EvalTask(task_id=t.id, path=str(f)), t) for f in files for t in [load_task(f)]]
    if not tasks:
        raise InvalidRequest(f"dataset {path}: no task files")
    ids = [t.task_id for t, _ in tasks]
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"dataset {path}: two tasks have the same id: "
                             f"{sorted({i for i in ids if ids.count(i) > 1})}")
    return tasks


def seed_of(seed: int, task_id: str, attempt: int) -> int:
    """The sampling seed of attempt ``attempt`` of ``task_id``: the same for every model (the models
    meet the same draws), different across tasks and attempts."""
    return zlib.crc32(f"{seed}:{task_id}:{attempt}".encode()) & 0x7FFFFFFF


def plan(spec: EvalSpec) -> list[AttemptKey]:
    """Every attempt of the job, task by task."""
    return [(t.task_id, m, i) for t in spec.tasks for m in spec.models for i in range(spec.k)]


def create_job(dataset: str | Path, *, agent: str, models: list[str], k: int, concurrency: int,
               provider: str | None = None, max_infra_retries: int = 2, timeout_s: float = 1800.0,
               seed: int = 0, success_threshold: float = 1.0, root: Path) -> Path:
    """Write a new job's spec under ``root`` (checked: the tasks load, the agent fits); its directory."""
    if not models or len(set(models)) != len(models):
        raise InvalidRequest("give each model once: --model M [--model M2 ...]")
    if not 1 <= k <= 1000:
        raise InvalidRequest(f"--k takes 1 to 1000, not {k}")
    if not 1 <= concurrency <= 4096:
        raise InvalidRequest(f"--concurrency takes 1 to 4096, not {concurrency}")
    if not 0 <= max_infra_retries <= 20:
        raise InvalidRequest(f"--max-infra-retries takes 0 to 20, not {max_infra_retries}")
    loaded = load_dataset(dataset)
    for _, task in loaded:
        agent_for(task, agent, models[0])  # a bad preset or a missing model fails before anything runs
    spec = EvalSpec(job_id=new_job_id(), created_at=time.time(), dataset=str(Path(dataset).resolve()),
                    tasks=[t for t, _ in loaded], agent=agent, models=list(models), k=k, concurrency=concurrency,
                    provider=provider, max_infra_retries=max_infra_retries, timeout_s=timeout_s, seed=seed,
                    success_threshold=success_threshold)
    directory = root / spec.job_id
    write_spec(directory, spec)
    return directory


def agent_for(task: Task, agent: str, model: str) -> Task:
    """``task`` played by ``agent`` (a scaffold preset; ``task``: its own agent) with ``model``."""
    from arena.authoring import with_agent

    return with_agent(task, scaffold=None if agent == "task" else agent, model=model)


class RunResult(msgspec.Struct, kw_only=True):
    """What one ``run`` (or ``resume``) did: attempts settled by outcome, tries retried after an
    infrastructure outcome, tries adopted from an earlier run, and attempts still running when
    their wait ran out (``resume`` picks them up)."""

    settled: dict[str, int]
    retried: int = 0
    adopted: int = 0
    still_running: int = 0
    already_done: int = 0


def run_job(client: EvalClient, directory: Path, *, stream: TextIO | None = None, tty: bool | None = None,
            on_try: Callable[[AttemptFinished], None] | None = None) -> RunResult:
    """Run (or go on with) the job in ``directory`` until every attempt is settled: a try that did
    not end as an infrastructure outcome, or the last of ``1 + max_infra_retries`` that did."""
    from arena.progress import WaitProgress, outcome_of

    spec = read_spec(directory)
    records = read_log(directory)
    tasks = {t.task_id: task for t, task in load_dataset(spec.dataset)}
    missing = [t.task_id for t in spec.tasks if t.task_id not in tasks]
    if missing:
        raise InvalidRequest(f"job {spec.job_id}: tasks no longer in {spec.dataset}: {', '.join(missing)}")
    tries = finished_attempts(records)
    logged: dict[tuple[AttemptKey, int], str] = {
        ((r.task_id, r.model, r.attempt), r.try_): r.rollout_id for r in records if isinstance(r, AttemptSubmitted)}
    on_server: dict[tuple[AttemptKey, int], str] = {}
    if records:  # a resume: tries submitted by a client killed before it logged them
        for view in client.list(limit=LIST_MAX):
            meta = view.metadata
            if meta.get(META_JOB) == spec.job_id and META_ATTEMPT in meta:
                task_id, model, index = meta[META_ATTEMPT].rsplit("|", 2)
                on_server.setdefault(((task_id, model, int(index)), int(meta.get(META_TRY, "0"))), view.rollout_id)

    work: list[tuple[AttemptKey, int, str | None]] = []
    done = 0
    for key in plan(spec):
        earlier = tries.get(key, [])
        if any(t.outcome != "infrastructure" for t in earlier) or len(earlier) > spec.max_infra_retries:
            done += 1
            continue
        n = len(earlier)
        work.append((key, n, logged.get((key, n)) or on_server.get((key, n))))

    result = RunResult(settled={"completed": 0, "failed": 0, "infrastructure": 0}, already_done=done)
    lock = threading.Lock()
    stop = threading.Event()
    prepared: dict[tuple[str, str], Task] = {}

    def task_for(task_id: str, model: str) -> Task:
        with lock:
            found = prepared.get((task_id, model))
        if found is None:  # bundles uploaded once per task and model (the agent's files may differ)
            found = client.prepare(agent_for(tasks[task_id], spec.agent, model))
            with lock:
                prepared[(task_id, model)] = found
        return found

    def provider_of(task: Task) -> str:
        return spec.provider or ("docker" if task.image_of() else "local")

    log = Log(directory)

    def one(item: tuple[AttemptKey, int, str | None]) -> tuple[AttemptKey, Outcome | None]:
        (task_id, model, index), try_, rid = item
        if rid is not None:
            with lock:
                result.adopted += 1
        while not stop.is_set():
            if rid is None:
                task = task_for(task_id, model)
                view = client.submit(task, sampling=SamplingParams(seed=seed_of(spec.seed, task_id, index)),
                                     model=model, provider=provider_of(task),
                                     metadata={META_JOB: spec.job_id, META_ATTEMPT: f"{task_id}|{model}|{index}",
                                               META_TRY: str(try_)})
                rid = view.rollout_id
                log.append(AttemptSubmitted(task_id=task_id, model=model, attempt=index, try_=try_, rollout_id=rid,
                                            at=time.time()))
            deadline = time.monotonic() + spec.timeout_s
            view = client.wait(rid, timeout=min(POLL_S, spec.timeout_s))
            while not view.state.is_final and time.monotonic() < deadline and not stop.is_set():
                view = client.wait(rid, timeout=min(POLL_S, max(0.0, deadline - time.monotonic())))
            if not view.state.is_final:
                return (task_id, model, index), None  # still running: left for resume
            outcome = outcome_of(view)
            try:
                cost = attempt_cost(client.wait_trajectory(rid, timeout=60.0))
            except NotFound:
                cost = AttemptCost(missing=True)
            finished = AttemptFinished(task_id=task_id, model=model, attempt=index, try_=try_, rollout_id=rid,
                                       outcome=outcome, state=view.state.value, reason=view.reason,
                                       reward=view.reward, cost=cost, at=time.time())
            log.append(finished)
            if on_try is not None:
                on_try(finished)
            if outcome != "infrastructure" or try_ >= spec.max_infra_retries:
                return (task_id, model, index), outcome
            with lock:
                result.retried += 1
            try_, rid = try_ + 1, None
        return (task_id, model, index), None

    try:
        with WaitProgress(len(work), f"eval {spec.job_id}", stream=stream, tty=tty) as progress, \
                ThreadPoolExecutor(max_workers=max(1, min(spec.concurrency, len(work) or 1)),
                                   thread_name_prefix="arena-eval") as pool:
            futures = {pool.submit(one, item) for item in work}
            try:
                while futures:
                    finished_now, futures = wait(futures, return_when=FIRST_EXCEPTION)
                    for future in finished_now:
                        key, outcome = future.result()  # an error (the API gone, say) stops the job
                        if outcome is None:  # not counted as an outcome: resume waits for it
                            result.still_running += 1
                        else:
                            result.settled[outcome] += 1
                            progress.finished("|".join(map(str, key)), outcome)
            except BaseException:
                stop.set()
                for future in futures:
                    future.cancel()
                raise
    finally:
        log.close()
    return result
