"""``arena eval regrade``: grade a finished job again with another verifier, as ``arena verify``
does for one rollout (``arena.replay``: the stored diff and result go to the verification workers
with the new verifier; the result is stored beside the original under its own name, the rollout
left alone). The new verdicts make a new grading version and report (``versions.py``).

Which attempts: those graded the first time (outcome ``completed``). One the agent failed stays a
failure (there is nothing of the agent's to grade differently); one Arena could not run stays left
out. A new verdict without a reward (the verifier's infrastructure error) leaves its attempt out of
that version's statistics, as an infrastructure outcome.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from arena.evaluation.records import AttemptFinished, final_results, read_log, read_spec
from arena.evaluation.runner import load_dataset, plan
from arena.evaluation.versions import GradingVersion, add_version, read_versions
from arena_core.errors import InvalidRequest
from arena_core.schemas import Trajectory, VerificationResult, Verifier

#: Re-verifies one stored rollout with ``verifier`` under ``name`` (``arena.replay`` on the bus).
Reverify = Callable[[str, Verifier, str], Awaitable[VerificationResult]]


def verifiers_from_task_dir(path: str | Path, task_ids: list[str]) -> dict[str, Verifier]:
    """Each task's verifier as the tasks in ``path`` (any dataset form ``arena eval run`` takes) give it."""
    found = {t.id: t.verifier for _, t in load_dataset(path)}
    missing = [t for t in task_ids if t not in found]
    if missing:
        raise InvalidRequest(f"--task-dir {path} has no task {', '.join(missing[:5])}"
                             + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""))
    unverified = [t for t in task_ids if found[t] is None]
    if unverified:
        raise InvalidRequest(f"--task-dir {path}: task {', '.join(unverified[:5])} has no verifier")
    return {t: found[t] for t in task_ids}


def version_name(job_id: str, version: int, verifiers: dict[str, Verifier]) -> str:
    """The name the version's results are stored under: the job, the version and a hash of the verifiers."""
    digest = hashlib.sha256(msgspec.json.encode(sorted(verifiers.items()))).hexdigest()[:8]
    return f"eval-{job_id}-v{version}-{digest}"


def regraded_try(first: AttemptFinished, result: VerificationResult, name: str) -> AttemptFinished:
    """``first`` graded by ``result``: its reward (none: an infrastructure outcome), and its cost
    with the new verifier's run and judge calls in place of the first one's."""
    judge_prompt: dict[str, int] = {}
    judge_completion: dict[str, int] = {}
    judge_cached: dict[str, int] = {}
    for call in result.judge_calls:
        u = call.usage
        judge_prompt[call.model] = judge_prompt.get(call.model, 0) + (u.prompt_tokens if u else 0)
        judge_completion[call.model] = judge_completion.get(call.model, 0) + (u.completion_tokens if u else 0)
        if u and u.cached_tokens:
            judge_cached[call.model] = judge_cached.get(call.model, 0) + u.cached_tokens
    cost = msgspec.structs.replace(first.cost, judge_calls=len(result.judge_calls), judge_prompt_tokens=judge_prompt,
                                   judge_completion_tokens=judge_completion, judge_cached_tokens=judge_cached,
                                   verify_s=max(0.0, result.finished_at - result.started_at))
    if result.reward is None:
        return msgspec.structs.replace(first, outcome="infrastructure", reward=None, cost=cost, at=time.time(),
                                       reason=f"re-graded by {name}: no reward ({', '.join(result.flags)})")
    return msgspec.structs.replace(first, outcome="completed", reward=result.reward, cost=cost, at=time.time(),
                                   reason=f"re-graded by {name}")


async def regrade(directory: Path, *, verifiers: dict[str, Verifier], source: str, reverify: Reverify,
                  concurrency: int | None = None) -> GradingVersion:
    """Verify every graded attempt of the job again (``verifiers`` by task id), at most
    ``concurrency`` at once (default: the job's), and add the grading as the next version."""
    spec = read_spec(directory)
    final = final_results(read_log(directory))
    left = [key for key in plan(spec) if key not in final]
    if left:
        raise InvalidRequest(f"job {spec.job_id} has {len(left)} attempt(s) not settled: "
                             f"`arena eval resume {spec.job_id}` first")
    number = read_versions(directory)[-1].version + 1
    name = version_name(spec.job_id, number, verifiers)
    targets = [r for r in final.values() if r.outcome == "completed"]
    gate = asyncio.Semaphore(concurrency or spec.concurrency)

    async def one(first: AttemptFinished) -> AttemptFinished:
        async with gate:
            return regraded_try(first, await reverify(first.rollout_id, verifiers[first.task_id], name), name)

    grades = await asyncio.gather(*(one(r) for r in targets))
    version = GradingVersion(version=number, created_at=time.time(), verifier=name, source=source,
                             grades=f"grades.v{number}.jsonl", regraded=len(grades),
                             infrastructure=sum(g.outcome == "infrastructure" for g in grades))
    add_version(directory, version, list(grades))
    return version


def bus_reverify(bus, trajectory_of: Callable[[str], Trajectory], *, timeout: float) -> Reverify:
    """``arena verify``'s machinery: the rollout's task from its record, its stored diff and result,
    the new verifier, queued for the verification workers and waited for by name."""
    from arena import replay

    async def reverify(rollout_id: str, verifier: Verifier, name: str) -> VerificationResult:
        trajectory = await asyncio.to_thread(trajectory_of, rollout_id)
        task = await replay.rollout_task(bus, rollout_id)
        return await replay.replay(bus, replay.build_job(trajectory, task, verifier, name), timeout=timeout)

    return reverify
