"""Verify one job: pick the verifier by type, run it, compose the parts into one result.

A failing verdict is a result; an exception means Arena could not verify (the worker retries,
then dead-letters). See docs/verification.md (Verifiers; Messages for the ack policy).
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

from arena_core.schemas import (
    CompositeVerifier,
    EnvRewardVerifier,
    ExactVerifier,
    LlmJudgeVerifier,
    PythonVerifier,
    RewardFileVerifier,
    RubricVerifier,
    TestCounts,
    TestsVerifier,
    VerificationResult,
    VerifyJob,
)
from arena_verification import answers, judge, plugins, reward_file
from arena_verification.answers import InvalidRubric, Outcome
from arena_verification.restore import InvalidTask
from arena_core.sources import SourceCache
from arena_core.step_gate import StepGrade
from arena_verification.sandboxes import LocalSandboxes, Sandboxes
from arena_verification.tests_verifier import job_budget_s, verify_tests

log = logging.getLogger("arena.verification")

LeafSpec = (TestsVerifier | RubricVerifier | ExactVerifier | LlmJudgeVerifier | PythonVerifier | EnvRewardVerifier
            | RewardFileVerifier)


def verifier_type(spec: object) -> str:
    return type(spec).__struct_config__.tag  # type: ignore[attr-defined]


def grades_answer(spec: object) -> bool:
    """Whether ``spec`` (or a part of it) reads the agent's ``result.json``."""
    if isinstance(spec, CompositeVerifier):
        return any(grades_answer(part.verifier) for part in spec.verifiers)
    if isinstance(spec, (PythonVerifier, ExactVerifier)):
        return True
    if isinstance(spec, (RubricVerifier, LlmJudgeVerifier)):
        return spec.source == "answer"
    return False


def time_budget_s(spec: object) -> float:
    """An upper bound on how long verifying with ``spec`` may take (the worker's per-job timeout)."""
    if isinstance(spec, CompositeVerifier):
        return sum(time_budget_s(part.verifier) for part in spec.verifiers) or 60.0
    if isinstance(spec, TestsVerifier):
        return job_budget_s(spec)
    if isinstance(spec, RewardFileVerifier):
        return reward_file.time_budget_s(spec)
    if isinstance(spec, LlmJudgeVerifier):
        return spec.timeout_s + 30.0
    return 120.0


async def verify(job: VerifyJob, *, scratch_dir: Path | None = None, http: httpx.AsyncClient | None = None,
                 sandboxes: Sandboxes | None = None, sources: SourceCache | None = None,
                 kept: dict[int, StepGrade] | None = None) -> VerificationResult:
    """Verify ``job`` (its task carrying its verifier); raises only when verification itself
    could not be done.

    Temporary directories are made under ``scratch_dir`` (default: the system's) and always
    removed. ``http`` is the client for judge calls (default: one per call). ``sandboxes``
    gives the ``tests`` verifier its sandbox (default: local bubblewrap sandboxes under the
    scratch directory); ``sources`` reads task sources (default: host paths allowed, no bundles).
    ``kept``: a multi-step ``reward_file`` task's steps as its step gate graded them, by index.
    """
    spec = job.task.verifier
    if spec is None:
        raise InvalidTask("the verify job carries no verifier")
    if sandboxes is not None and sources is not None:
        return await _verify(job, spec, scratch_dir, http, sandboxes, sources, kept)
    if scratch_dir is not None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="arena-verify-own-", dir=scratch_dir) as tmp:
        own = LocalSandboxes(Path(tmp) / "sandboxes") if sandboxes is None else None
        try:
            return await _verify(job, spec, scratch_dir, http, sandboxes or own,
                                 sources or SourceCache(Path(tmp) / "sources", allow_paths=True), kept)
        finally:
            if own is not None:
                await own.close()


async def _verify(job: VerifyJob, spec, scratch_dir: Path | None, http, sandboxes: Sandboxes,
                  sources: SourceCache, kept: dict[int, StepGrade] | None = None) -> VerificationResult:
    started = time.time()
    if scratch_dir is not None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(spec, CompositeVerifier):
        result = await _composite(job, spec, started, scratch_dir, http, sandboxes, sources)
    else:
        result = await _leaf(job, spec, started, scratch_dir, http, sandboxes, sources, kept)
    if job.name:
        result = msgspec.structs.replace(result, verifier=job.name)
    log.info("verified: reward=%.2f verifier=%s flags=%s (%s)", result.reward, result.verifier,
             ",".join(result.flags) or "-", result.reason, extra={"rollout_id": job.rollout_id})
    return result


async def _leaf(job: VerifyJob, spec: LeafSpec, started: float, scratch_dir: Path | None,
                http: httpx.AsyncClient | None, sandboxes: Sandboxes, sources: SourceCache,
                kept: dict[int, StepGrade] | None = None) -> VerificationResult:
    if isinstance(spec, TestsVerifier):
        with tempfile.TemporaryDirectory(prefix="arena-verify-", dir=scratch_dir) as tmp:
            return await verify_tests(job, spec, Path(tmp), started, sandboxes=sandboxes, sources=sources)
    if isinstance(spec, RewardFileVerifier):
        with tempfile.TemporaryDirectory(prefix="arena-verify-", dir=scratch_dir) as tmp:
            return await reward_file.verify_reward_file(job, spec, Path(tmp), started, sandboxes=sandboxes,
                                                        sources=sources, kept=kept)
    text = job.diff if getattr(spec, "source", "answer") == "diff" else answers.answer_text(job.result)
    judge_calls = []
    try:
        if isinstance(spec, RubricVerifier):
            outcome = answers.rubric(spec, text)
        elif isinstance(spec, ExactVerifier):
            outcome = answers.exact(spec, text)
        elif isinstance(spec, LlmJudgeVerifier):
            outcome, call = await judge.judge(spec, text, client=http, rollout_id=job.rollout_id)
            judge_calls.append(call)
        elif isinstance(spec, EnvRewardVerifier):
            outcome = answers.env_reward(spec, job.result)
        elif isinstance(spec, PythonVerifier):
            request = plugins.PluginRequest(rollout_id=job.rollout_id, task=job.task, diff=job.diff,
                                            answer=answers.answer_text(job.result), result=job.result,
                                            config=spec.config)
            outcome = await plugins.run_plugin(spec, request)
        else:
            raise InvalidTask(f"unsupported verifier {type(spec).__name__}")
    except (InvalidRubric, answers.InvalidEnvResult) as exc:
        raise InvalidTask(str(exc)) from exc
    return _from_outcome(job, verifier_type(spec), outcome, started, judge_calls=judge_calls)


def _from_outcome(job: VerifyJob, name: str, outcome: Outcome, started: float, *, judge_calls=()) -> VerificationResult:
    return VerificationResult(
        rollout_id=job.rollout_id, verifier=name, reward=outcome.reward, passed=outcome.passed,
        started_at=started, finished_at=time.time(), components=dict(outcome.components),
        flags=list(outcome.flags), reason=outcome.reason, judge_calls=list(judge_calls),
    )


async def _composite(job: VerifyJob, spec: CompositeVerifier, started: float, scratch_dir: Path | None,
                     http: httpx.AsyncClient | None, sandboxes: Sandboxes, sources: SourceCache) -> VerificationResult:
    if not spec.verifiers:
        raise InvalidTask("a composite verifier needs at least one part")
    names = [part.name for part in spec.verifiers]
    if len(set(names)) != len(names) or any(not n for n in names):
        raise InvalidTask(f"composite verifier part names must be unique and non-empty: {names}")
    total_weight = sum(part.weight for part in spec.verifiers)
    if total_weight <= 0 or any(part.weight < 0 for part in spec.verifiers):
        raise InvalidTask("composite verifier weights must be >= 0 with a positive sum")
    parts: list[tuple[str, float, VerificationResult]] = []
    for part in spec.verifiers:
        result = await _leaf(job, part.verifier, time.time(), scratch_dir, http, sandboxes, sources)
        parts.append((part.name, part.weight, result))
    return compose(job.rollout_id, parts, started)


def compose(rollout_id: str, parts: list[tuple[str, float, VerificationResult]], started: float) -> VerificationResult:
    """Weighted mean of the parts; named components; flags, tests and judge calls carried over."""
    total_weight = sum(w for _, w, _ in parts)
    reward = sum(w * r.reward for _, w, r in parts) / total_weight
    components: dict[str, float] = {}
    flags: list[str] = []
    for name, _, r in parts:
        components[name] = r.reward
        for key, value in r.components.items():
            components[f"{name}.{key}"] = value
        flags += [f for f in r.flags if f not in flags]
    tests_part = next((r for _, _, r in parts if r.verifier == "tests"), None)
    return VerificationResult(
        rollout_id=rollout_id,
        verifier="composite",
        reward=reward,
        passed=all(r.passed for _, _, r in parts),
        started_at=started,
        finished_at=time.time(),
        components=components,
        tests=tests_part.tests if tests_part else [],
        counts=tests_part.counts if tests_part else TestCounts(),
        flags=flags,
        reason="; ".join(f"{name} ({w:g}): {r.reward:g} {r.reason}".rstrip() for name, w, r in parts),
        log_tail=tests_part.log_tail if tests_part else "",
        judge_calls=[c for _, _, r in parts for c in r.judge_calls],
        parser=tests_part.parser if tests_part else "",
    )
