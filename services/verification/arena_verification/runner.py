"""Verify one rollout: the agent's diff on the pristine task, tests run in a fresh sandbox.

``verify(job)`` does, in a temporary directory that is always removed:

1. copy the pristine task repository and commit it as the base
   (:func:`arena_sandbox.local.prepare_workspace`), and keep the pristine test files;
2. ``git apply`` the agent's diff *inside a sandbox* (nothing the agent wrote runs on the
   host); if it does not apply: reward 0, flag ``patch_failed``;
3. flag ``tests_tampered`` if the diff touches a test file (and ``test_config_touched``
   if it touches a ``conftest.py`` or pytest configuration), then restore every test
   file from the pristine copy;
4. run the verifier's command (``sh -c``) in another fresh sandbox without network;
5. parse the log (:mod:`arena_verification.pytest_parser`) and score it
   (:mod:`arena_verification.reward`).

A verdict is only positive for a complete run: a timeout (flag ``timeout``) or a log
without pytest's final line (flag ``parse_failed``) scores 0.

A failing test is a result, never an exception. An exception means Arena could not
verify (the sandbox would not start, the disk is full, the task is invalid): the worker
lets the bus retry it and finally dead-letter it.
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
import tempfile
import time
from pathlib import Path

from arena.errors import VerificationError
from arena.schemas import TestResult, TestsVerifier, VerificationResult, VerifyJob
from arena_sandbox import local
from arena_verification import patch, reward
from arena_verification.pytest_parser import parse_pytest_output
from arena_verification.restore import InvalidTask, check_workdir, repo_path, restore, snapshot

log = logging.getLogger("arena.verification")

FLAG_PATCH_FAILED = "patch_failed"
FLAG_TESTS_TAMPERED = "tests_tampered"
FLAG_TEST_CONFIG_TOUCHED = "test_config_touched"
FLAG_TIMEOUT = "timeout"
FLAG_PARSE_FAILED = "parse_failed"

#: Files through which a diff can change how pytest runs or reports.
TEST_CONFIG_NAMES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"})

APPLY_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 40
LOG_TAIL_CHARS = 8_000
#: Only the end of a huge test log is parsed: pytest's summary is at the end.
MAX_LOG_BYTES = 16 * 1024 * 1024
#: Results carried on the wire: the listed tests first, then the others up to this many.
MAX_REPORTED_TESTS = 2_000

DIFF_FILE = "agent.diff"


async def verify(job: VerifyJob, *, scratch_dir: Path | None = None) -> VerificationResult:
    """Verify ``job``; raises only when verification itself could not be done.

    The temporary directory is made under ``scratch_dir`` (default: the system's).
    """
    spec = job.task.verifier
    if not isinstance(spec, TestsVerifier):
        raise InvalidTask(f"unsupported verifier {type(spec).__name__}")
    started = time.time()
    if scratch_dir is not None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="arena-verify-", dir=scratch_dir) as tmp:
        result = await _verify_tests(job, spec, Path(tmp), started)
    log.info(
        "verified: reward=%.2f flags=%s (%s)",
        result.reward,
        ",".join(result.flags) or "-",
        result.reason,
        extra={"rollout_id": job.rollout_id},
    )
    return result


async def _verify_tests(job: VerifyJob, spec: TestsVerifier, root: Path, started: float) -> VerificationResult:
    task = job.task
    workspace = root / "workspace"
    arena_dir = root / "arena"
    arena_dir.mkdir()
    check_workdir(task.workdir)
    test_paths = [repo_path(task.workdir, rel) for rel in spec.test_files]

    try:
        await asyncio.to_thread(local.prepare_workspace, Path(task.repo), workspace)
    except FileNotFoundError as exc:
        raise InvalidTask(str(exc)) from exc
    pristine = await asyncio.to_thread(snapshot, workspace, test_paths)

    touched = patch.touched_paths(job.diff)
    flags: list[str] = []
    if any(patch.touches(touched, str(p)) for p in test_paths):
        flags.append(FLAG_TESTS_TAMPERED)
    if any(posixpath.basename(p) in TEST_CONFIG_NAMES for p in touched):
        flags.append(FLAG_TEST_CONFIG_TOUCHED)

    if job.diff.strip():
        error = await _apply(job.diff, workspace, arena_dir, root / "apply.log")
        if error is not None:
            return VerificationResult(
                rollout_id=job.rollout_id,
                verifier="tests",
                reward=0.0,
                passed=False,
                started_at=started,
                finished_at=time.time(),
                components={"tests": 0.0, "partial": 0.0},
                flags=[FLAG_PATCH_FAILED, *flags],
                reason=f"the diff does not apply: {error}",
                log_tail=_tail(error),
            )
    await asyncio.to_thread(restore, workspace, pristine)

    log_path = root / "tests.log"
    run = await local.run(
        local.SandboxSpec(
            command=["sh", "-c", spec.command],
            workspace=workspace,
            workdir=task.workdir,
            env={"PYTHONUNBUFFERED": "1"},  # a killed run still leaves what it printed
            timeout_s=spec.timeout_s,
            log_path=log_path,
        )
    )
    text = _read_log(log_path)
    _raise_if_sandbox_failed(run, text)

    parsed = parse_pytest_output(text)
    score = reward.score(spec, parsed.results)
    flags += score.flags
    reasons = [score.reason]
    if run.timed_out:
        flags.append(FLAG_TIMEOUT)
        reasons.insert(0, f"the test command timed out after {spec.timeout_s:g}s")
    if parsed.truncated or not parsed.results:
        flags.append(FLAG_PARSE_FAILED)
        if not run.timed_out:
            reasons.insert(0, f"no complete pytest report (exit code {run.exit_code})")
    trusted = not run.timed_out and parsed.complete
    final_reward = score.reward if trusted else 0.0
    return VerificationResult(
        rollout_id=job.rollout_id,
        verifier="tests",
        reward=final_reward,
        passed=final_reward == 1.0,
        started_at=started,
        finished_at=time.time(),
        components={**score.components, "tests": final_reward},
        tests=_reported(parsed.results, spec),
        counts=score.counts,
        flags=flags,
        reason="; ".join(r for r in reasons if r),
        log_tail=_tail(text),
    )


async def _apply(diff: str, workspace: Path, arena_dir: Path, log_path: Path) -> str | None:
    """``git apply`` in a sandbox; ``None`` on success, else git's complaint."""
    (arena_dir / DIFF_FILE).write_text(diff, encoding="utf-8")
    run = await local.run(
        local.SandboxSpec(
            command=["git", "apply", "--whitespace=nowarn", f"{local.ARENA_DIR}/{DIFF_FILE}"],
            workspace=workspace,
            arena_dir=arena_dir,
            env={"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"},
            timeout_s=APPLY_TIMEOUT_S,
            log_path=log_path,
        )
    )
    output = _read_log(log_path).strip()
    _raise_if_sandbox_failed(run, output)
    if run.timed_out:
        return f"git apply timed out after {APPLY_TIMEOUT_S:g}s"
    if run.exit_code != 0:
        return output or f"git apply exited {run.exit_code}"
    return None


def _raise_if_sandbox_failed(run: local.RunResult, output: str) -> None:
    """bubblewrap reports its own set-up failures as ``bwrap: ...`` with exit code 1."""
    if run.exit_code not in (0, None) and output.startswith("bwrap:"):
        raise VerificationError(f"the sandbox did not start: {output.splitlines()[0]}")


def _read_log(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - MAX_LOG_BYTES))
            return fh.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def _tail(text: str) -> str:
    tail = "\n".join(text.splitlines()[-LOG_TAIL_LINES:])
    return tail[-LOG_TAIL_CHARS:]


def _reported(results: list[TestResult], spec: TestsVerifier) -> list[TestResult]:
    listed = set(spec.fail_to_pass) | set(spec.pass_to_pass)
    first = [r for r in results if r.test_id in listed]
    rest = [r for r in results if r.test_id not in listed]
    return (first + rest)[: max(MAX_REPORTED_TESTS, len(first))]
