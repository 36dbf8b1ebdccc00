"""The ``tests`` verifier: the agent's diff on the pristine task, tests run in a fresh sandbox.

``verify_tests(job, spec, root)`` does, in ``root`` (a temporary directory the caller removes):

1. copy the pristine task repository and commit it as the base
   (:func:`arena_sandbox.local.prepare_workspace`), and keep the pristine test files and
   every protected path the diff touches (:mod:`arena_verification.protected`);
2. ``git apply`` the agent's diff *inside a sandbox* (nothing the agent wrote runs on the
   host); if it does not apply: reward 0, flag ``patch_failed``;
3. flag ``tests_tampered`` if the diff touches a test file, and the protected-path flags;
   then restore all of them from the pristine copy;
4. run the verifier's command (``sh -c``) in another fresh sandbox without network;
5. parse the log -- or the ``report_file`` the run wrote -- with the verifier's parser
   (:mod:`arena_verification.parsers`) and score it (:mod:`arena_verification.reward`).

A verdict is only positive for a complete, consistent run: a timeout (flag ``timeout``),
a log without the runner's final summary (flag ``parse_failed``) or one naming more tests
than the runner counted (flag ``parse_suspect``) scores 0.

A failing test is a result, never an exception. An exception means Arena could not
verify (the sandbox would not start, the disk is full, the task is invalid).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import stat
import time
from pathlib import Path, PurePosixPath

from arena.errors import VerificationError
from arena.schemas import TestResult, TestsVerifier, VerificationResult, VerifyJob
from arena_sandbox import local
from arena_verification import patch, protected, reward
from arena_verification.parsed import ParsedOutput
from arena_verification.parsers import get_parser
from arena_verification.restore import InvalidTask, check_workdir, repo_path, restore, scrub_bytecode, snapshot

log = logging.getLogger("arena.verification")

FLAG_PATCH_FAILED = "patch_failed"
FLAG_TESTS_TAMPERED = "tests_tampered"
FLAG_TEST_CONFIG_TOUCHED = protected.FLAG_TEST_CONFIG_TOUCHED
FLAG_TIMEOUT = "timeout"
FLAG_PARSE_FAILED = "parse_failed"
FLAG_PARSE_SUSPECT = "parse_suspect"

APPLY_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 40
LOG_TAIL_CHARS = 8_000
#: Only the end of a huge test log is parsed: the runners' summaries are at the end.
MAX_LOG_BYTES = 16 * 1024 * 1024
#: Results carried on the wire: the listed tests first, then the others up to this many.
MAX_REPORTED_TESTS = 2_000
MAX_REPORT_FILES = 1_000

DIFF_FILE = "agent.diff"

#: The test command's environment on top of the sandbox's: unbuffered (a killed run keeps
#: what it printed), no colours, and Python's ordinary bytecode cache instead of the
#: sandbox's empty ``/tmp/pycache`` -- importing pytest from a cold cache costs seconds;
#: the workspace's own bytecode was scrubbed before (:func:`restore.scrub_bytecode`).
TEST_ENV = {"PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "CI": "1", "PYTHONPYCACHEPREFIX": ""}


def job_budget_s(spec: TestsVerifier) -> float:
    """How long one ``tests`` verification may take, at most, with set-up and a margin."""
    return APPLY_TIMEOUT_S + spec.timeout_s + 120.0


async def verify_tests(job: VerifyJob, spec: TestsVerifier, root: Path, started: float) -> VerificationResult:
    task = job.task
    try:
        parser = get_parser(spec.parser)
    except KeyError as exc:
        raise InvalidTask(str(exc)) from exc
    workspace = root / "workspace"
    arena_dir = root / "arena"
    arena_dir.mkdir()
    check_workdir(task.workdir)
    test_paths = [repo_path(task.workdir, rel) for rel in spec.test_files]

    touched = patch.touched_paths(job.diff)
    guarded, flag_only = protected.classify(spec.parser, touched, task.workdir)
    flags: list[str] = []
    if any(patch.touches(touched, str(p)) for p in test_paths):
        flags.append(FLAG_TESTS_TAMPERED)
    flags += [flag for flag in guarded if flag not in flags]
    flags += [flag for flag in flag_only if flag not in flags]
    guarded_paths = [PurePosixPath(p) for paths in guarded.values() for p in paths]

    try:
        await asyncio.to_thread(local.prepare_workspace, Path(task.repo), workspace)
    except FileNotFoundError as exc:
        raise InvalidTask(str(exc)) from exc
    pristine = await asyncio.to_thread(snapshot, workspace, test_paths)
    pristine.update(await asyncio.to_thread(_snapshot_guarded, workspace, guarded_paths))

    if job.diff.strip():
        error = await _apply(job.diff, workspace, arena_dir, root / "apply.log")
        if error is not None:
            return VerificationResult(
                rollout_id=job.rollout_id, verifier="tests", reward=0.0, passed=False, started_at=started,
                finished_at=time.time(), components={"tests": 0.0, "partial": 0.0},
                flags=[FLAG_PATCH_FAILED, *flags], reason=f"the diff does not apply: {error}",
                log_tail=_tail(error), parser=spec.parser,
            )
    await asyncio.to_thread(restore, workspace, pristine)
    await asyncio.to_thread(scrub_bytecode, workspace)

    log_path = root / "tests.log"
    run = await local.run(
        local.SandboxSpec(
            command=["sh", "-c", spec.command],
            workspace=workspace,
            workdir=task.workdir,
            env=TEST_ENV,
            timeout_s=spec.timeout_s,
            log_path=log_path,
        )
    )
    text = _read_log(log_path)
    _raise_if_sandbox_failed(run, text)

    if spec.report_file:
        report = await asyncio.to_thread(read_reports, workspace, task.workdir, spec.report_file)
        parsed = parser(report)
    else:
        parsed = parser(text)
    return _result(job, spec, parsed, run, text, flags, started)


def _result(job: VerifyJob, spec: TestsVerifier, parsed: ParsedOutput, run: local.RunResult, text: str,
            flags: list[str], started: float) -> VerificationResult:
    score = reward.score(spec, parsed.results)
    flags = flags + score.flags
    reasons = [score.reason]
    if run.timed_out:
        flags.append(FLAG_TIMEOUT)
        reasons.insert(0, f"the test command timed out after {spec.timeout_s:g}s")
    if parsed.truncated or not parsed.results:
        flags.append(FLAG_PARSE_FAILED)
        if not run.timed_out:
            what = f"report {spec.report_file}" if spec.report_file else "log"
            reasons.insert(0, f"no complete {spec.parser} report in the {what} (exit code {run.exit_code})")
    if parsed.suspect:
        flags.append(FLAG_PARSE_SUSPECT)
        reasons.insert(0, "; ".join(n for n in parsed.notes if "counted" in n or "declares" in n))
    trusted = not run.timed_out and parsed.complete and not parsed.suspect
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
        parser=spec.parser,
    )


def _snapshot_guarded(workspace: Path, paths: list[PurePosixPath]):
    """Pristine copies of protected paths; a directory in the pristine repo is left alone."""
    keep = [p for p in paths if not (workspace / p).is_dir() or (workspace / p).is_symlink()]
    return snapshot(workspace, keep)


def read_reports(workspace: Path, workdir: str, pattern: str) -> str:
    """The report files the run wrote (``pattern`` may be a glob), concatenated.

    The run controlled the workspace, so only regular files inside it are read, never
    through a symlink, each up to ``MAX_LOG_BYTES``.
    """
    base = (workspace / (workdir or ".")).resolve()
    root = workspace.resolve()
    if os.path.isabs(pattern) or ".." in PurePosixPath(pattern).parts:
        raise InvalidTask(f"report_file {pattern!r} is not a path inside the working directory")
    chunks: list[str] = []
    for name in sorted(glob.glob(str(base / pattern), recursive=True))[:MAX_REPORT_FILES]:
        path = Path(name)
        try:
            if not path.resolve().is_relative_to(root):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            chunks.append(fh.read(MAX_LOG_BYTES).decode("utf-8", errors="replace"))
    return "".join(chunks)


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
