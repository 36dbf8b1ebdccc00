"""The ``reward_file`` verifier: Harbor's rule. The agent's diff on the pristine task in a fresh
sandbox of its image, the task's tests at ``/tests``, its test script run, the reward read from
``/logs/verifier/reward.json`` or ``reward.txt``. docs/tasks.md ("Harbor tasks").

The image carries Arena's layer (``arena images build``): ``/logs`` and ``/tests`` are links into
``/sandbox/.arena/harbor``, the one place of a read-only container both the test script and this
worker can reach; a task without an image gets the same links in a local sandbox. A multi-step
task's step gate grades a step during the rollout (:func:`grade_gate`) as the final verification
grades it, which takes that grade as it is.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import posixpath
import random
import re
import secrets
import time
from pathlib import Path, PurePosixPath

import msgspec

from arena_core.errors import VerificationError
from arena_core.schemas import MinReward, PathSource, RewardFileVerifier, Task, VerificationResult, VerifyJob
from arena_core.step_gate import StepGrade
from arena_core.sources import GitError, SourceCache, SourceError, prepare_workspace
from arena_verification import guard
from arena_verification.restore import InvalidTask
from arena_verification.protected import FLAG_RUNNER_TAMPERED
from arena_verification.tests_verifier import (
    _TEST_DEF,
    ARENA_DIR,
    DIFF_FILE,
    TEST_ENV,
    WORKSPACE,
    Canaries,
    Sandboxes,
    _apply,
    _canary_body,
    _canary_name,
    _Output,
    _tail,
)

#: Where ``/logs`` and ``/tests`` point in an image built by ``arena images build``.
HARBOR_DIR = f"{ARENA_DIR}/harbor"
REWARD_TXT = "logs/verifier/reward.txt"
REWARD_JSON = "logs/verifier/reward.json"
TEST_STDOUT = "logs/verifier/test-stdout.txt"
MAX_REWARD_BYTES = 1024 * 1024
MAX_LOG_BYTES = 4 * 1024 * 1024
#: The exit status of the set-up when the image lacks Arena's layer.
NO_LAYER = 97

FLAG_NO_REWARD = "reward_missing"
#: Terminal-Bench's rule (``pytest_summary``) overruled the reward file.
FLAG_SUMMARY = "tests_not_all_passed"

_SETUP = f"""set -u
H={HARBOR_DIR}
if [ "$(readlink /logs)" != "$H/logs" ] || [ "$(readlink /tests)" != "$H/tests" ]; then
  echo "arena: /logs and /tests of this image are not Arena's (build it with arena images build)"; exit {NO_LAYER}
fi
rm -rf -- "$H/tests" "$H/logs/verifier" && mkdir -p "$H/tests" "$H/logs/verifier" "$H/logs/agent" "$H/logs/artifacts"
"""
_RUN = 'chmod +x "$0" 2>/dev/null; "$0" > /logs/verifier/test-stdout.txt 2>&1'


class RewardFileError(ValueError):
    """The reward file is missing, empty or not what Harbor reads."""


def parse_rewards(text_file: bytes | None, json_file: bytes | None) -> dict[str, float]:
    """Harbor's reading: ``reward.json`` (a map of finite numbers, or one number) wins over
    ``reward.txt`` (one finite number, as ``reward``)."""
    if json_file is not None:
        if not json_file.strip():
            raise RewardFileError("reward.json is empty")
        try:
            value = json.loads(json_file)
        except ValueError as exc:
            raise RewardFileError(f"reward.json is not JSON: {exc}") from None
        rewards = value if isinstance(value, dict) else {"reward": value}
        for key, number in rewards.items():
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise RewardFileError(f"reward.json: {key} is {number!r}, not a number")
            if not math.isfinite(number):
                raise RewardFileError(f"reward.json: {key} is {number!r}, not finite")
        return {str(k): float(v) for k, v in rewards.items()}
    if text_file is not None:
        if not text_file.strip():
            raise RewardFileError("reward.txt is empty")
        try:
            number = float(text_file.decode("utf-8", errors="replace").strip())
        except ValueError:
            raise RewardFileError(f"reward.txt is not a number: {text_file[:80]!r}") from None
        if not math.isfinite(number):
            raise RewardFileError(f"reward.txt is {number!r}, not finite")
        return {"reward": number}
    raise RewardFileError("the test script wrote neither /logs/verifier/reward.txt nor reward.json")


_SUMMARY = re.compile(r"=+\s*short test summary info\s*=+", re.IGNORECASE)
_PASSING = {"PASSED", "SKIPPED", "XFAIL"}
_FAILING = {"FAILED", "XPASS", "ERROR"}


def summary_statuses(log: str) -> dict[str, str] | None:
    """Each test pytest's short test summary (``-rA``) lists, by name, with its status (a FAILED
    line's `` - message`` cut first, as Terminal-Bench's parser cuts it); ``None`` without a summary."""
    parts = _SUMMARY.split(log, maxsplit=1)
    if len(parts) < 2:
        return None
    statuses: dict[str, str] = {}
    for line in parts[1].splitlines():
        if line.startswith("FAILED") and " - " in line:
            line = " - ".join(line.split(" - ")[:-1])
        words = line.split(maxsplit=1)
        if len(words) < 2 or words[0].strip(":") not in _PASSING | _FAILING:
            continue
        name = words[1].strip().split("::", 1)[-1]
        if name:
            statuses[name] = words[0].strip(":")
    return statuses


def pytest_summary_failure(log: str, canaries: Canaries | None = None) -> str:
    """Why pytest's output fails Terminal-Bench v1's rule ("" when it passes): its short test
    summary (``-rA``) must list at least one test and every one PASSED, SKIPPED or XFAIL (the
    statuses Terminal-Bench's parser counts as passed). With ``canaries`` (planted by
    :func:`plan_summary_canaries`) the summary must also tell the truth about them (a reason
    starting "runner tampered"), and they are not counted as the task's tests."""
    statuses = summary_statuses(log)
    if statuses is None:
        return "no pytest short test summary in the test output (Terminal-Bench's rule needs -rA)"
    if canaries is not None:
        if (lie := canary_lie(statuses, canaries)):
            return lie
        planted = {name for must_fail, must_pass, _ in canaries.files.values() for name in (must_fail, must_pass)}
        statuses = {name: status for name, status in statuses.items() if name not in planted}
    if not statuses:
        return "pytest's short test summary lists no test"
    failing = sorted(name for name, status in statuses.items() if status in _FAILING)
    if failing:
        return f"{len(failing)} of {len(statuses)} test(s) did not pass: {', '.join(failing[:5])}"
    return ""


#: Options that stop pytest at a failure or select tests: a failing canary could end the run before
#: the task's own tests, or be left out. A test file naming one gets no canaries.
_NO_CANARIES = re.compile(r"(?<![\w-])(?:-x|--exitfirst|--maxfail|-k|--lf|--last-failed|--sw|--stepwise)(?![\w-])")
_PY_TEST_FILE = re.compile(r"^(test_.*|.*_test)\.py$")


def plan_summary_canaries(files: dict[str, bytes]) -> Canaries | None:
    """For Terminal-Bench's rule: a test that must fail and one that must pass appended to (at most
    three of) the task's Python test files, named and written like their own tests, so that code
    under test rewriting pytest's reports from inside the test process is caught (as the ``tests``
    verifier's canaries catch it). ``None`` when there is no such file, or a file of the tests stops
    pytest early or selects tests (``-x``, ``--maxfail``, ``-k``, ...)."""
    texts = {rel: data.decode("utf-8", errors="replace") for rel, data in files.items()}
    if any(_NO_CANARIES.search(text) for text in texts.values()):
        return None
    targets = sorted(rel for rel in texts if _PY_TEST_FILE.match(PurePosixPath(rel).name))[:3]
    if not targets:
        return None
    rng = random.Random(secrets.randbits(64))
    # every test name of every file (the summary names a test without its file): a canary takes none
    existing = {name for text in texts.values() for name in _TEST_DEF.findall(text)}
    planned: dict[str, tuple[str, str, str]] = {}
    for rel in targets:
        must_fail, must_pass = _canary_name(existing, rng), _canary_name(existing, rng)  # each added to it
        tests = [(must_fail, _canary_body(rng, fail=True)), (must_pass, _canary_body(rng, fail=False))]
        rng.shuffle(tests)
        planned[rel] = (must_fail, must_pass, "\n\n" + "\n\n".join(f"def {n}():\n    {b}\n" for n, b in tests))
    return Canaries(files=planned)


def with_canaries(files: dict[str, bytes], canaries: Canaries | None) -> dict[str, bytes]:
    if canaries is None:
        return files
    return {rel: data + canaries.files[rel][2].encode() if rel in canaries.files else data
            for rel, data in files.items()}


def canary_lie(statuses: dict[str, str], canaries: Canaries) -> str:
    """Why the summary lies about the canaries ("" if it does not): a must-fail canary listed as
    anything but FAILED or ERROR, or missing while its must-pass sibling passed. A pair missing
    altogether is a file the script did not run."""
    problems = []
    for rel, (must_fail, must_pass, _) in sorted(canaries.files.items()):
        bad, good = statuses.get(must_fail), statuses.get(must_pass)
        if bad is not None and bad not in _FAILING - {"XPASS"}:
            problems.append(f"a test that must fail was reported {bad} ({rel})")
        elif bad is None and good == "PASSED":
            problems.append(f"a test that must fail was missing from the summary while its sibling passed ({rel})")
    return "; ".join(f"runner tampered: {p}" for p in problems)


def scalar_reward(rewards: dict[str, float]) -> float | None:
    """Harbor's primary reward: ``reward`` if named, else the only number, else none."""
    if "reward" in rewards:
        return rewards["reward"]
    if len(rewards) == 1:
        return next(iter(rewards.values()))
    return None


def below_minimum(rewards: dict[str, float] | None, min_reward: MinReward | None) -> str:
    """Why ``rewards`` miss ``min_reward`` ("" when they reach it): a number gates ``reward``,
    a map each key; a key missing counts as minus infinity (Harbor's ``_min_reward_failure``)."""
    if min_reward is None:
        return ""
    thresholds = {"reward": min_reward} if isinstance(min_reward, (int, float)) else min_reward
    for key, threshold in thresholds.items():
        actual = (rewards or {}).get(key, float("-inf"))
        if actual < threshold:
            return f"{key}={actual:g} below min_reward {threshold:g}"
    return ""


def combine_steps(graded: list[dict[str, float]], strategy: str) -> dict[str, float]:
    """The task's rewards from its steps' (those graded): ``final`` the last step's, ``mean`` the
    per-key mean with a key a step lacks counted 0 (Harbor's ``_aggregate_step_rewards``)."""
    if not graded:
        return {}
    if strategy == "final":
        return dict(graded[-1])
    keys = sorted({key for rewards in graded for key in rewards})
    return {key: sum(r.get(key, 0.0) for r in graded) / len(graded) for key in keys}


def time_budget_s(spec: RewardFileVerifier) -> float:
    """How long one verification may take, at most: every step's script, set-up and a margin (a
    step graded on its own turn's diff has a fresh sandbox: a minute more each)."""
    if not spec.steps:
        return spec.timeout_s + 150.0
    return sum((s.timeout_s or spec.timeout_s) + 60.0 for s in spec.steps) + 150.0


def grading_plan(job: VerifyJob, spec: RewardFileVerifier) -> tuple[list[tuple[str, list[tuple]]], list[str]]:
    """Which diff each step is graded on, grouped by diff (one fresh sandbox per group), in order,
    and notes on steps left out. With the sandbox plane's turns (``job.step_turns``) each step is
    graded on the diff its own turn left, and a step the agent had no turn for is not graded (as
    Harbor leaves out the steps after it stopped); without them, every step on the final diff."""
    steps = [(s.name, {**spec.files, **s.files}, s.script, s.min_reward, s.timeout_s or spec.timeout_s)
             for s in spec.steps] or [("", spec.files, spec.script, None, spec.timeout_s)]
    if not (spec.steps and job.step_turns):
        return [(job.diff, steps)], []
    diffs = {turn.name: turn.diff for turn in job.step_turns}
    groups: list[tuple[str, list[tuple]]] = []
    for i, step in enumerate(steps):
        if step[0] not in diffs:
            return groups, [f"steps {', '.join(s[0] for s in steps[i:])}: no agent turn, not graded"]
        groups.append((diffs[step[0]], [step]))
    return groups, []


def diff_digest(diff: str) -> str:
    return hashlib.sha256(diff.encode("utf-8")).hexdigest()


async def _pristine(task: Task, root: Path, sources: SourceCache) -> Path:
    """The task's source, as it was before the agent, under ``root``."""
    workspace = root / "workspace"
    async with sources.lease() as lease:
        try:
            tree = await sources.tree(task.source_of(), lease)
            await asyncio.to_thread(prepare_workspace, tree, workspace)
        except FileNotFoundError as exc:
            raise InvalidTask(str(exc)) from exc
        except (SourceError, GitError) as exc:
            if isinstance(task.source_of(), PathSource):
                raise InvalidTask(str(exc)) from exc
            raise VerificationError(f"cannot get the task's source: {exc}") from exc
    return workspace


async def grade_steps(task: Task, spec: RewardFileVerifier, diff: str, steps: list[tuple], workspace: Path, *,
                      sandboxes: Sandboxes) -> list[StepGrade]:
    """``steps`` (of :func:`grading_plan`) graded in turn on ``diff`` in one fresh sandbox of the task's
    image (a local one with Harbor's ``/logs`` and ``/tests`` without an image), until one is under its
    minimum or cannot be graded (its grade says why: the last one returned)."""
    mount = task.workspace_mount()
    workdir = posixpath.normpath(posixpath.join(mount or WORKSPACE, task.workdir or "."))
    digest = diff_digest(diff)
    grades: list[StepGrade] = []
    sandbox = await sandboxes.sandbox_for(task.image_of(), mount, tuple(task.services),
                                          harbor_layout=not task.image_of())
    try:
        await sandbox.put_dir(workspace, WORKSPACE)
        await sandbox.put_files({f"{ARENA_DIR}/{DIFF_FILE}": diff.encode("utf-8")})
        if diff and not diff.isspace():
            error = await _apply(sandbox)
            if error is not None:
                label = f" of step {steps[0][0]}" if steps[0][0] else ""
                return [StepGrade(step=steps[0][0], diff_sha256=digest, log_tail=_tail(error),
                                  patch_error=f"the diff{label} does not apply: {error}")]
        for name, files, script, min_reward, timeout_s in steps:
            canaries = plan_summary_canaries(files) if spec.pytest_summary else None
            step = await _run_step(sandbox, with_canaries(files, canaries), script, timeout_s, workdir, spec.env,
                                   root=mount or WORKSPACE)
            rewards, log = step.rewards, step.log
            label = f"step {name}: " if name else ""
            notes = [f"{label}{note}" for note in step.notes]
            flags: list[str] = []
            if isinstance(rewards, str):  # no reward: the step (and the task) could not be graded
                grades.append(StepGrade(step=name, diff_sha256=digest, notes=notes, log_tail=step.log_tail,
                                        no_reward=f"{label}{rewards}"))
                return grades
            lies = step.lies(rewarded=(scalar_reward(rewards) or 0.0) > 0)
            if spec.pytest_summary and (failure := pytest_summary_failure(log, canaries)):
                lies = ([failure] if failure.startswith("runner tampered") else []) + lies
                if not lies:
                    rewards = {**rewards, "reward": 0.0}  # Terminal-Bench's own rule: not every test passed
                    notes.append(f"{label}reward 0: {failure}")
                    flags.append(FLAG_SUMMARY)
            elif canaries is not None and not lies:
                # the must-fail canary made the script's exit status (and so its reward file) 0:
                # Terminal-Bench's own rule decides, every listed test of the task's passed
                rewards = {**rewards, "reward": 1.0}
            if lies:  # the canaries or the guard caught the test process lying: its reward is worthless
                rewards = {**rewards, "reward": 0.0}
                notes.append(f"{label}reward 0: " + "; ".join(lies))
                flags.append(FLAG_RUNNER_TAMPERED)
            if name:
                notes.append(f"step {name}: " + ", ".join(f"{k}={v:g}" for k, v in sorted(rewards.items())))
            missed = below_minimum(rewards, min_reward)
            if missed:
                notes.append(f"stopped after step {name}: {missed}")
            grades.append(StepGrade(step=name, diff_sha256=digest, rewards=rewards, notes=notes, flags=flags,
                                    log_tail=step.log_tail, below=missed))
            if missed:
                return grades
    finally:
        await asyncio.shield(sandbox.destroy())
    return grades


async def grade_gate(task: Task, spec: RewardFileVerifier, index: int, diff: str, root: Path, *,
                     sandboxes: Sandboxes, sources: SourceCache) -> StepGrade | None:
    """The step gate (``arena_core.step_gate``): step ``index`` graded now on the diff its turn left,
    as the final verification grades it; ``None`` when it has no ``min_reward`` (nothing to decide now)."""
    if not 0 <= index < len(spec.steps):
        raise InvalidTask(f"the task has no step {index + 1} (its verifier has {len(spec.steps)})")
    s = spec.steps[index]
    if s.min_reward is None:
        return None
    workspace = await _pristine(task, root, sources)
    step = (s.name, {**spec.files, **s.files}, s.script, s.min_reward, s.timeout_s or spec.timeout_s)
    (grade,) = await grade_steps(task, spec, diff, [step], workspace, sandboxes=sandboxes)
    return grade


def gate_budget_s(spec: RewardFileVerifier, index: int) -> float:
    """How long the step gate of step ``index`` may take, at most: its script, set-up and a margin."""
    step = spec.steps[index] if 0 <= index < len(spec.steps) else None
    return ((step.timeout_s if step is not None else None) or spec.timeout_s) + 150.0


async def verify_reward_file(job: VerifyJob, spec: RewardFileVerifier, root: Path, started: float, *,
                             sandboxes: Sandboxes, sources: SourceCache,
                             kept: dict[int, StepGrade] | None = None) -> VerificationResult:
    """``kept``: the steps the step gate graded during the rollout, by index: each one whose turn's
    diff is the one it graded is taken as it is, not graded again (the reward is what the gate saw)."""
    task = job.task
    workspace: Path | None = None
    groups, skipped = grading_plan(job, spec)
    graded: list[tuple[str, dict[str, float]]] = []
    notes: list[str] = []
    flags: list[str] = []
    log_tail = ""
    stopped = False
    per_step = bool(spec.steps and job.step_turns)  # each group one step, in order
    for position, (diff, steps) in enumerate(groups):
        grade = (kept or {}).get(position) if per_step else None
        if grade is not None and grade.step == steps[0][0] and grade.diff_sha256 == diff_digest(diff):
            grades = [grade]
        else:
            if workspace is None:
                workspace = await _pristine(task, root, sources)
            grades = await grade_steps(task, spec, diff, steps, workspace, sandboxes=sandboxes)
        for grade in grades:
            notes += grade.notes
            log_tail = grade.log_tail
            if grade.patch_error:
                return VerificationResult(
                    rollout_id=job.rollout_id, verifier="reward_file", reward=0.0, passed=False,
                    started_at=started, finished_at=time.time(), flags=["patch_failed"],
                    reason=grade.patch_error, log_tail=grade.log_tail)
            if grade.no_reward or grade.rewards is None:
                return _no_reward(job, started, grade.no_reward or "the step has no rewards", grade.log_tail)
            flags += [f for f in grade.flags if not (f == FLAG_RUNNER_TAMPERED and f in flags)]
            graded.append((grade.step, grade.rewards))
            stopped = bool(grade.below)
        if stopped:
            break
    if not stopped:
        notes += skipped
    rewards = combine_steps([r for _, r in graded], spec.strategy)
    reward = scalar_reward(rewards)
    if reward is None:
        return _no_reward(job, started, f"several rewards and none named reward: {sorted(rewards)}", log_tail)
    components = dict(rewards)
    for name, step_rewards in graded:
        if name:
            components.update({f"{name}.{k}": v for k, v in step_rewards.items()})
    return VerificationResult(
        rollout_id=job.rollout_id, verifier="reward_file", reward=reward, passed=reward >= spec.pass_threshold,
        started_at=started, finished_at=time.time(), components=components, flags=[*flags, *job.flags],
        reason="; ".join(notes), log_tail=log_tail)


class _Step(msgspec.Struct, frozen=True, kw_only=True):
    """One step's run: its rewards (or why there are none), its log, and the guard's record."""

    rewards: dict[str, float] | str
    log: str
    log_tail: str
    watch: guard.Guard | None = None
    record: bytes | None = None
    notes: tuple[str, ...] = ()

    def lies(self, *, rewarded: bool) -> list[str]:
        """What the guard's record says the script's pytest runs lied about (``guard.check_script``)."""
        if self.watch is None:
            return []
        seen, _ = guard.check_script(guard.read(self.record.decode("utf-8", "replace")) if self.record else None,
                                     log_text=self.log, marker=self.watch.marker, summary=summary_statuses(self.log),
                                     rewarded=rewarded)
        return [f"runner tampered: {what}" for what in seen]


async def _run_step(sandbox, files: dict[str, bytes], script: str, timeout_s: float, workdir: str,
                    env: dict[str, str], *, root: str) -> _Step:
    """Put one step's tests at /tests, run its script with the guard in its pytest runs, read its
    rewards (or why there are none). A script whose pytest could not import the guard (it set its
    own ``PYTHONPATH``) is run once more without it, and the reason says so."""
    step = await _run_script(sandbox, files, script, timeout_s, workdir, env, watch=guard.plan(HARBOR_DIR), root=root)
    if step.watch is not None and f'Error importing plugin "{step.watch.module}"' in step.log:
        step = await _run_script(sandbox, files, script, timeout_s, workdir, env, watch=None, root=root)
        return msgspec.structs.replace(step, notes=(
            "the test script's pytest could not import the runner guard: run again without it",))
    return step


async def _run_script(sandbox, files: dict[str, bytes], script: str, timeout_s: float, workdir: str,
                      env: dict[str, str], *, watch: guard.Guard | None, root: str) -> _Step:
    setup = _Output(64 * 1024)
    run = await sandbox.exec(["sh", "-c", _SETUP], env={}, workdir=WORKSPACE, timeout_s=60.0, on_output=setup)
    if run.exit_code == NO_LAYER:
        raise VerificationError(setup.text().strip())
    if run.exit_code != 0:
        raise VerificationError(f"cannot prepare /tests and /logs (exit {run.exit_code}): {setup.text()[-1500:]}")
    for rel in files:
        if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
            raise InvalidTask(f"test file {rel!r} is not a path under /tests")
    placed = {f"{HARBOR_DIR}/tests/{rel}": data for rel, data in files.items()}
    command = _RUN
    if watch is not None:  # active in every pytest run of the script, wherever it runs it
        placed.update(guard.files(watch, workdir="", root=root))
        command = guard.command(watch, _RUN)
    await sandbox.put_files(placed)
    path = f"/tests/{script}"
    run = await sandbox.exec(["sh", "-c", command, path], env={**TEST_ENV, "TEST_DIR": "/tests", **env},
                             workdir=workdir, timeout_s=timeout_s, on_output=_Output(64 * 1024))
    log = (await sandbox.read_file(f"{HARBOR_DIR}/{TEST_STDOUT}", max_bytes=MAX_LOG_BYTES) or b"").decode(
        "utf-8", errors="replace")
    record = await sandbox.read_file(watch.record, max_bytes=MAX_LOG_BYTES) if watch is not None else None
    step = _Step(rewards="", log=log, log_tail=_tail(log), watch=watch, record=record)
    if run.timed_out:
        return msgspec.structs.replace(step, rewards=f"the test script timed out after {timeout_s:g}s")
    try:
        rewards = parse_rewards(await sandbox.read_file(f"{HARBOR_DIR}/{REWARD_TXT}", max_bytes=MAX_REWARD_BYTES),
                                await sandbox.read_file(f"{HARBOR_DIR}/{REWARD_JSON}", max_bytes=MAX_REWARD_BYTES))
    except RewardFileError as exc:
        return msgspec.structs.replace(step, rewards=f"{exc} (the test script exited {run.exit_code})")
    return msgspec.structs.replace(step, rewards=rewards)


def _no_reward(job: VerifyJob, started: float, why: str, log_tail: str) -> VerificationResult:
    """Harbor has no reward for this trial: neither has Arena (never a made-up 0)."""
    return VerificationResult(
        rollout_id=job.rollout_id, verifier="reward_file", reward=None, passed=False, started_at=started,
        finished_at=time.time(), flags=[FLAG_NO_REWARD, *job.flags], reason=f"no reward: {why}", error=why,
        log_tail=log_tail)
