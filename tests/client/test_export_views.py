"""Training views (arena.export): GRPO advantages, DPO pairs, SFT selection, token rows."""

from __future__ import annotations

import msgspec
import pytest

from arena.export import ExportOptions, ExportStats, export_rows, step_tokens
from arena_core.schemas import RolloutState, Step, TrainingSequence, Trajectory

T0 = 1_763_769_600.0  # 2025-11-22 00:00 UTC


def member(gid: str | None, i: int, reward: float, *, size: int = 3, incomplete=(), ids: bool = True) -> Trajectory:
    steps = [Step(rollout_id=f"{gid}-{i}", step_index=s, model="m", backend="b", policy_version="4",
                  request_messages=[{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}],
                  prompt_token_ids=[1, 2, 3] if ids else None, completion_token_ids=[7, 8] if ids else None,
                  logprobs=[-0.1, -0.2] if ids else None, completion_text=f"answer {i}.{s}",
                  token_ids_source="backend" if ids else "unavailable")
             for s in range(2)]
    return Trajectory(rollout_id=f"{gid}-{i}", task_id="calc.add", group_id=gid, group_index=i, group_size=size,
                      final_state=RolloutState.COMPLETED, reward=reward, steps=steps, policy_versions=["4"],
                      completed_at=T0 + 3600, incomplete=list(incomplete))


def rows(trajectories, view, **options):
    stats = ExportStats()
    return list(export_rows(trajectories, view, ExportOptions(**options), stats)), stats


def test_grpo_rows_carry_group_normalised_advantages():
    out, stats = rows([member("g", 0, 1.0), member("g", 1, 0.0), member("g", 2, 0.0)], "grpo")
    assert [r["group_index"] for r in out] == [0, 1, 2]
    assert out[0]["advantage"] == pytest.approx(1.4142, abs=1e-3) and out[1]["advantage"] == out[2]["advantage"] < 0
    assert sum(r["advantage"] for r in out) == pytest.approx(0.0, abs=1e-9)
    assert out[0]["date"] == "2025-11-22" and out[0]["completions"] == ["answer 0.0", "answer 0.1"]
    no_std, _ = rows([member("g", 0, 1.0), member("g", 1, 0.0), member("g", 2, 0.0)], "grpo", normalize_std=False)
    assert [r["advantage"] for r in no_std] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert stats.rows == 3 and stats.groups == 1


def test_partial_incomplete_and_ungrouped_are_skipped_unless_asked():
    group = [member("g", 0, 1.0), member("g", 1, 0.0, incomplete=["verification"]), member("g", 2, 0.5)]
    out, stats = rows(group + [member(None, 0, 1.0)], "grpo")
    assert out == [] and stats.skipped == {"incomplete trajectory": 1, "partial group": 2, "not in a group": 1}
    out, _ = rows(group, "grpo", include_partial_groups=True)
    assert [r["group_index"] for r in out] == [0, 2]
    out, _ = rows(group, "grpo", include_incomplete=True)
    assert len(out) == 3


def test_dpo_pairs_best_against_worst_or_all():
    group = [member("g", 0, 0.5), member("g", 1, 1.0), member("g", 2, 0.0)]
    [pair], _ = rows(group, "dpo")
    assert (pair["chosen_rollout_id"], pair["rejected_rollout_id"]) == ("g-1", "g-2")
    assert pair["chosen_messages"][-1] == {"role": "assistant", "content": "answer 1.1"}
    assert pair["chosen_messages"][1]["content"] == '[{"type": "text", "text": "2+2?"}]'
    every, _ = rows(group, "dpo", dpo_pairs="all")
    assert {(p["chosen_reward"], p["rejected_reward"]) for p in every} == {(1.0, 0.5), (1.0, 0.0), (0.5, 0.0)}
    assert len(rows(group, "dpo", dpo_pairs="all", dpo_margin=0.5)[0]) == 1
    flat, stats = rows([member("h", i, 1.0) for i in range(3)], "dpo")
    assert flat == [] and stats.skipped == {"no pair above the margin": 1}


def test_sft_takes_the_best_member_above_the_threshold():
    [best], _ = rows([member("g", 0, 0.0), member("g", 1, 1.0), member("g", 2, 1.0)], "sft")
    assert best["rollout_id"] == "g-1" and best["messages"][0] == {"role": "system", "content": "be brief"}
    none, stats = rows([member("g", 0, 0.5), member("g", 1, 0.2), member("g", 2, 0.0)], "sft")
    assert none == [] and stats.skipped == {"best below the threshold": 1}
    [solo], _ = rows([member(None, 0, 1.0, size=1)], "sft")  # a single rollout qualifies on its own
    assert solo["group_id"] == ""


def multi_turn(gid: str, i: int, reward: float) -> Trajectory:
    """Two turns: the second prompt extends the first turn's ids with a tool result (9, 9)."""
    s0 = Step(rollout_id=f"{gid}-{i}", step_index=0, model="m", backend="b", policy_version="4",
              prompt_token_ids=[1, 2, 3], completion_token_ids=[7, 8], logprobs=[-0.1, -0.2])
    s1 = Step(rollout_id=f"{gid}-{i}", step_index=1, model="m", backend="b", policy_version="5",
              prompt_token_ids=[1, 2, 3, 7, 8, 9, 9], completion_token_ids=[6], logprobs=[-0.3])
    return Trajectory(rollout_id=f"{gid}-{i}", task_id="t", group_id=gid, group_index=i, group_size=2,
                      final_state=RolloutState.COMPLETED, reward=reward, steps=[s0, s1], completed_at=T0)


def test_token_rows_are_loss_masked_sequences_with_the_group_advantage():
    out, stats = rows([multi_turn("g", 0, 1.0), multi_turn("g", 1, 0.0)], "tokens")
    assert len(out) == 2 and stats.skipped == {}
    r = out[0]
    assert r["input_ids"] == [1, 2, 3, 7, 8, 9, 9, 6] and r["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1]
    assert r["logprobs"] == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3] and r["num_loss_tokens"] == 3
    assert r["steps"] == [0, 1] and r["policy_versions"] == ["4", "5"]
    assert r["advantage"] == pytest.approx(1.0, abs=1e-5) and out[1]["advantage"] == pytest.approx(-1.0, abs=1e-5)
    assert (r["sequence_index"], r["num_sequences"]) == (0, 1)
    # a rewritten history starts a new sequence; steps without token ids are in none
    out, stats = rows([member("h", 0, 1.0, size=2), member("h", 1, 0.0, size=2, ids=False)], "tokens")
    assert [(r["rollout_id"], r["steps"], r["sequence_index"], r["num_sequences"]) for r in out] == [
        ("h-0", [0], 0, 2), ("h-0", [1], 1, 2)]
    assert stats.skipped == {"step without token ids": 2}
    misaligned = Step(rollout_id="x", step_index=0, model="m", backend="b", prompt_token_ids=[1],
                      completion_token_ids=[2, 3], logprobs=[-0.1])
    assert step_tokens(misaligned) is None


def test_token_rows_leave_out_abandoned_and_cut_short_calls_and_count_them():
    g = [multi_turn("g", 0, 1.0), multi_turn("g", 1, 0.0)]
    s0, s1 = g[0].steps
    gave_up = Step(rollout_id="g-0", step_index=1, model="m", backend="b", abandoned=True,
                   prompt_token_ids=[1, 2, 3, 7, 8, 9, 9], completion_token_ids=[5, 5], logprobs=[-1.0, -1.0])
    cut = Step(rollout_id="g-0", step_index=3, model="m", backend="b", incomplete=True,
               prompt_token_ids=[1, 2, 3, 7, 8, 9, 9, 6], completion_token_ids=[4], logprobs=[-0.5])
    retry = msgspec.structs.replace(s1, step_index=2)
    g[0] = msgspec.structs.replace(g[0], steps=[s0, gave_up, retry, cut])
    out, stats = rows(g, "tokens")
    assert out[0]["input_ids"] == [1, 2, 3, 7, 8, 9, 9, 6] and out[0]["steps"] == [0, 2]
    assert out[0]["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1] and out[0]["num_loss_tokens"] == 3
    assert stats.skipped == {"step the agent never received (abandoned)": 1, "step cut short (incomplete)": 1}
    # the sequences the trajectory plane put on the trajectory are the ones exported
    carried = msgspec.structs.replace(g[1], sequences=[TrainingSequence(
        token_ids=[5, 6], loss_mask=[0, 1], logprobs=[0.0, -0.9], step_indexes=[0], policy_versions=["4"])])
    out, _ = rows([g[0], carried], "tokens")
    assert out[1]["input_ids"] == [5, 6] and out[1]["logprobs"] == [0.0, -0.9]


def test_unknown_view_fails_loudly():
    with pytest.raises(ValueError, match="unknown view"):
        list(export_rows([], "ppo"))
