"""A multi-step task's step gate: after a step's turn the sandbox plane asks the verification plane
(core NATS request/reply on ``arena.verify.step.{rollout_id}``) whether the rollout goes on; the
step's grade is kept for the final verification. docs/tasks.md ("Multi-step tasks").
"""

from __future__ import annotations

from typing import Literal

import msgspec

from arena_core.schemas import Base, Task


class StepVerifyRequest(Base, kw_only=True):
    """``arena.verify.step.{rollout_id}``: grade step ``index`` now, on the diff its turn left.

    Sent after every turn but the last that ended with ``done``; the sandbox plane does not know which
    steps have a minimum (the verifier is private), the verification plane answers at once for those
    without one. Replies (``StepVerdict``) come to the request's reply subject: ``grading`` first,
    then the verdict."""

    rollout_id: str
    task: Task  # public; a replay carries its verifier here
    #: Key of the task's private part in the ``arena_verifiers`` bucket (when ``task.verifier`` is None).
    verifier_ref: str = ""
    step: str
    index: int  # 0-based, in ``task.steps``
    #: The workspace's diff against the base commit when this step's turn ended.
    diff: str = ""


class StepVerdict(Base, kw_only=True):
    """A reply to a ``StepVerifyRequest``.

    ``decision``: ``grading``, the request was taken and the verdict follows within ``budget_s``;
    ``continue``, the next step gets its turn (the step reached its minimum, or has none);
    ``stop``, no more turns: the step is under its minimum, or its grade already decides the task's
    (its diff does not apply, its test script gave no reward); ``error``, Arena could not grade it
    (an infrastructure outcome: the rollout ends with no reward)."""

    rollout_id: str
    step: str
    decision: Literal["grading", "continue", "stop", "error"]
    budget_s: float = 0.0
    #: The step's rewards as graded (empty when it has no minimum: not graded now).
    rewards: dict[str, float] = {}
    reason: str = ""


class StepGrade(Base, kw_only=True):
    """One step of a ``reward_file`` task as graded on one diff, kept in the ``arena_step_grades``
    bucket under ``{rollout_id}.{index}`` by the gate, so that the final verification reuses it
    (the reward equals what the gate saw) while the diff it was graded on is the turn's."""

    step: str
    diff_sha256: str = ""
    #: The step's rewards after Arena's checks (``None``: ``patch_error`` or ``no_reward`` says why).
    rewards: dict[str, float] | None = None
    #: The verdict's notes for this step, in order (its rewards, any check that overruled them).
    notes: list[str] = []
    flags: list[str] = []
    log_tail: str = ""
    #: The diff does not apply: the task's reward is 0.
    patch_error: str = ""
    #: The step's test script gave no reward: neither does the task.
    no_reward: str = ""
    #: Why the rewards are under the step's ``min_reward`` ("" when they reach it or there is none).
    below: str = ""


def grade_key(rollout_id: str, index: int) -> str:
    return f"{rollout_id}.{index}"


#: Every message of this module, by name (``proto/schemas``).
MESSAGES: dict[str, type] = {"StepVerifyRequest": StepVerifyRequest, "StepVerdict": StepVerdict,
                             "StepGrade": StepGrade}

verdict_decoder = msgspec.json.Decoder(StepVerdict)
request_decoder = msgspec.json.Decoder(StepVerifyRequest)
grade_decoder = msgspec.json.Decoder(StepGrade)
