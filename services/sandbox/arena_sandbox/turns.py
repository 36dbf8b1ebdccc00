"""A multi-step task's turns (``task.steps``): one agent turn per step, in order, in one sandbox,
each with its step's instruction in ``task.json`` (and ``ARENA_STEP``), the workspace's diff
taken when it ends; with a step gate, the verification plane decides after each turn but the last
whether the next one runs. docs/tasks.md ("Multi-step tasks").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from arena_core.schemas import SandboxJob, StepTurn, Task
from arena_core.sources import DiffTooLarge
from arena_sandbox.gate import StepGate
from arena_sandbox_providers import local
from arena_sandbox_providers.provider import ExecResult, OutputCallback, Sandbox

#: What the agent wrote for the previous turn: gone before the next one starts.
_TURN_FILES = (f"{local.ARENA_DIR}/done", f"{local.ARENA_DIR}/result.json")


class StepRuns(msgspec.Struct, frozen=True, kw_only=True):
    """How the turns went: one :class:`ExecResult` for them all, each turn, a failure of the
    policy that ends the rollout as ``failed`` ("" if none), where the step gate ended the turns
    (``ended``: "" if it did not) and a step gate that could not decide (``gate_error``: Arena's
    failure, an infrastructure outcome)."""

    run: ExecResult
    turns: list[StepTurn]
    first_done: bool
    failure: str = ""
    ended: str = ""
    gate_error: str = ""


def turn_task(task: Task, index: int) -> Task:
    """The task as the agent sees it in turn ``index``: that step's instruction."""
    return msgspec.structs.replace(task, instructions=task.steps[index].instructions)


def turn_env(task: Task, index: int) -> dict[str, str]:
    return {"ARENA_STEP": task.steps[index].name, "ARENA_STEP_INDEX": str(index + 1),
            "ARENA_STEPS": str(len(task.steps))}


def combined(runs: list[ExecResult]) -> ExecResult:
    """The turns as one run: the last turn's end, any kill or OOM, the first proxy fault, the total time."""
    last = runs[-1]
    return ExecResult(exit_code=last.exit_code, timed_out=last.timed_out, killed=any(r.killed for r in runs),
                      oom_killed=any(r.oom_killed for r in runs), duration_s=sum(r.duration_s for r in runs),
                      proxy_fault=next((r.proxy_fault for r in runs if r.proxy_fault), ""))


def turn_reason(run: ExecResult, done: bool) -> str:
    if run.killed and not run.timed_out:
        return "cancelled"
    if done:
        return "done"
    if run.timed_out:
        return "timed out without writing done"
    return f"exited with code {run.exit_code} without writing done"


async def run_steps(job: SandboxJob, sandbox: Sandbox, *, launch: Callable[[Task], tuple[list[str], dict[str, str],
                    dict[str, bytes]]], task_file: Callable[[Task, int], bytes], base: str, workdir: str, proxy,
                    cancel: asyncio.Event | None, on_output: OutputCallback, diff_timeout_s: float,
                    max_diff_bytes: int, gate: StepGate | None = None) -> StepRuns:
    """Every step's turn until one ends without ``done`` (that step is still graded on what it left),
    the rollout is cancelled, or ``gate`` (asked after each turn but the last that ended with ``done``)
    ends the rollout there. ``launch(task)`` is the agent's command, environment and files for a
    turn's task; ``task_file(task, index)`` its ``task.json``. Without ``gate`` every step gets its
    turn, and the final verification alone stops at a step under its minimum."""
    task = job.task
    started = time.monotonic()
    runs: list[ExecResult] = []
    turns: list[StepTurn] = []
    diff_bytes = 0
    failure = ""
    for index, step in enumerate(task.steps):
        left = task.budget.wall_clock_s - (time.monotonic() - started)
        view = turn_task(task, index)
        command, env, files = launch(view)
        if index:
            await sandbox.exec(["rm", "-f", "--", *_TURN_FILES], env={}, workdir=local.WORKSPACE, timeout_s=30.0)
            if await sandbox.exists(_TURN_FILES[0]):
                # the agent kept the last turn's done from being removed: this step is graded as it stands
                diff, failure = await _diff(sandbox, base, diff_timeout_s, max_diff_bytes - diff_bytes)
                turns.append(StepTurn(name=step.name, diff=diff, reason="no turn: /sandbox/.arena/done of the "
                                      "previous turn could not be removed"))
                return StepRuns(run=combined(runs), turns=turns, first_done=turns[0].completed, failure=failure)
        if left <= 0:
            diff, failure = await _diff(sandbox, base, diff_timeout_s, max_diff_bytes - diff_bytes)
            turns.append(StepTurn(name=step.name, diff=diff, reason="no turn: the task's wall clock was used up"))
            return StepRuns(run=combined(runs), turns=turns, first_done=turns[0].completed, failure=failure)
        await sandbox.put_files({f"{local.ARENA_DIR}/task.json": task_file(view, index), **files})
        run = await sandbox.exec(command, env={**env, **turn_env(task, index)}, workdir=workdir,
                                 timeout_s=min(step.wall_clock_s or left, left), proxy=proxy, cancel=cancel,
                                 on_output=on_output)
        runs.append(run)
        if run.killed and not run.timed_out:  # cancelled: no more turns, no diffs needed
            turns.append(StepTurn(name=step.name, reason="cancelled"))
            return StepRuns(run=combined(runs), turns=turns, first_done=False)
        done = await sandbox.exists(_TURN_FILES[0])
        diff, failure = await _diff(sandbox, base, diff_timeout_s, max_diff_bytes - diff_bytes)
        diff_bytes += len(diff.encode())
        turns.append(StepTurn(name=step.name, diff=diff, completed=done, reason=turn_reason(run, done)))
        if failure or not done or run.proxy_fault:
            break
        if gate is not None and index + 1 < len(task.steps):
            verdict = await gate(index, step.name, diff, cancel)
            if verdict.decision == "error":
                return StepRuns(run=combined(runs), turns=turns, first_done=turns[0].completed,
                                gate_error=f"step {step.name}'s gate could not decide: {verdict.reason}")
            if verdict.decision == "stop":
                ended = f"the rollout ended at step {index + 1} of {len(task.steps)} ({step.name}): {verdict.reason}"
                turns[-1] = msgspec.structs.replace(turns[-1], reason=f"{turns[-1].reason}; {ended}")
                return StepRuns(run=combined(runs), turns=turns, first_done=turns[0].completed, ended=ended)
            if verdict.rewards:  # graded now: the final verification takes this grade as it is
                turns[-1] = msgspec.structs.replace(turns[-1],
                                                    reason=f"{turns[-1].reason}; step gate: {verdict.reason}")
    return StepRuns(run=combined(runs), turns=turns, first_done=turns[0].completed, failure=failure)


async def _diff(sandbox: Sandbox, base: str, timeout_s: float, max_bytes: int) -> tuple[str, str]:
    """The workspace's diff now, or why there is none (a failure of the policy: it broke the
    repository, or its diffs together are over the limit)."""
    try:
        return await sandbox.diff(base, timeout_s=timeout_s, put_at_base=True, max_bytes=max(max_bytes, 0)), ""
    except DiffTooLarge as exc:
        return "", f"the steps' diffs together are over the limit ({exc})"
    except local.GitError as exc:
        return "", f"cannot extract a step's diff (the agent broke the repository): {exc}"
