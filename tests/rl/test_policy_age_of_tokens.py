"""The policy version of every consumed token: a step's, or for a partial rollout the span's
that sampled it; when the steps and the sequence disagree, the oldest version for all."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from arena_core.schemas import PolicySpan, RolloutState, Step, TrainingSequence, Trajectory  # noqa: E402
from arena_rl.lm_trainer import token_versions  # noqa: E402


def step(index: int, n: int, version: str, spans=()) -> Step:
    return Step(rollout_id="r", step_index=index, model="m", backend="b", policy_version=version,
                completion_token_ids=list(range(n)), policy_spans=list(spans))


def test_tokens_take_their_step_version_or_their_span_version():
    steps = [step(0, 3, "2"), step(1, 4, "4", [PolicySpan(version="3", start=0), PolicySpan(version="4", start=1)])]
    seq = TrainingSequence(token_ids=list(range(12)), loss_mask=[0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1],
                           logprobs=[0.0] * 12, step_indexes=[0, 1], policy_versions=["2", "4"])
    trajectory = Trajectory(rollout_id="r", task_id="t", final_state=RolloutState.COMPLETED, steps=steps,
                            sequences=[seq])
    assert token_versions(trajectory, seq) == [2, 2, 2, 3, 4, 4, 4]


def test_a_sequence_the_steps_do_not_explain_gets_its_oldest_version():
    seq = TrainingSequence(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0] * 3, step_indexes=[0, 1],
                           policy_versions=["5", "7"])
    trajectory = Trajectory(rollout_id="r", task_id="t", final_state=RolloutState.COMPLETED, sequences=[seq])
    assert token_versions(trajectory, seq) == [5, 5]
