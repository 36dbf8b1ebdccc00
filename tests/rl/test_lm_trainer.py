"""The LoRA trainer on the real 135M model (``make test-rl``): a GRPO step moves probability
towards the rewarded completion and away from the other; every loss trains and reports
finite metrics with KL to the reference once the adapter moved; PPO's value function
learns (head or critic); stale sequences are dropped and the age of consumed tokens reported."""

from __future__ import annotations

import math

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from arena_core.schemas import GroupCompleted, RolloutState, TrainingSequence, Trajectory  # noqa: E402
from arena_rl.generate import GenRequest  # noqa: E402
from arena_rl.lm import LanguageModel, LoRASpec, ModelUnavailable, gguf_path  # noqa: E402
from arena_rl.lm_trainer import LMTrainer, LMTrainerConfig  # noqa: E402

try:
    gguf_path()
except ModelUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return LanguageModel.load(lora=LoRASpec(r=4, alpha=8))


@pytest.fixture(scope="module")
def sampled(lm):
    """Two completions of one chat prompt, sampled by the model: (prompt ids, [(ids, logprobs)])."""
    prompt = lm.render_chat([{"role": "user", "content": "My dog died yesterday."}])
    results = lm.generate([GenRequest(prompt_ids=prompt, max_tokens=12, seed=s) for s in (1, 2)])
    return prompt, [(r.token_ids, r.logprobs) for r in results]


def group_of(prompt, completions, rewards, versions=("0", "0")) -> GroupCompleted:
    members = []
    for i, ((ids, lps), reward, version) in enumerate(zip(completions, rewards, versions, strict=True)):
        seq = TrainingSequence(token_ids=prompt + ids, loss_mask=[0] * len(prompt) + [1] * len(ids),
                               logprobs=[0.0] * len(prompt) + list(lps), step_indexes=[0], policy_versions=[version])
        members.append(Trajectory(rollout_id=f"r{i}", task_id="t", group_id="g", group_index=i, group_size=2,
                                  final_state=RolloutState.COMPLETED, reward=reward, sequences=[seq]))
    return GroupCompleted(group_id="g", task_id="t", size=2, trajectories=members, rewards=list(rewards),
                          advantages=[0.0, 0.0], completed_at=0.0)


def total_logprob(lm, prompt, ids) -> float:
    with torch.no_grad():
        return float(lm.sequence_logprobs([prompt], [ids])[0].sum())


def reset(lm):
    with torch.no_grad():
        for name, param in lm.model.named_parameters():
            if "lora_B" in name:
                param.zero_()


async def test_a_grpo_step_moves_probability_towards_the_rewarded_completion(lm, sampled):
    reset(lm)
    prompt, completions = sampled
    before = [total_logprob(lm, prompt, ids) for ids, _ in completions]
    trainer = LMTrainer(lm, LMTrainerConfig(loss="grpo", lr=2e-3))
    async with httpx.AsyncClient() as http:
        metrics = await trainer.train_step([group_of(prompt, completions, [1.0, 0.0])], http)
    after = [total_logprob(lm, prompt, ids) for ids, _ in completions]
    assert after[0] > before[0] and after[1] < before[1], (before, after)
    assert metrics.policy_version == 1 and metrics.sequences == 2 and metrics.mean_reward == 0.5
    assert metrics.kl == pytest.approx(0.0, abs=1e-6)  # measured before the update: the adapter was zero
    assert metrics.grad_norm > 0 and metrics.entropy > 0 and metrics.lr == 2e-3


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "gspo", "ppo"])
async def test_every_loss_trains_and_reports_kl_to_the_reference(lm, sampled, loss):
    reset(lm)
    prompt, completions = sampled
    trainer = LMTrainer(lm, LMTrainerConfig(loss=loss, lr=2e-3, kl_coef=0.1, max_tokens=16,
                                            clip_eps=3e-4 if loss == "gspo" else 0.2))
    async with httpx.AsyncClient() as http:
        first = await trainer.train_step([group_of(prompt, completions, [1.0, 0.0])], http)
        second = await trainer.train_step([group_of(prompt, completions, [1.0, 0.0], ("1", "1"))], http)
    for m in (first, second):
        assert all(math.isfinite(v) for v in (m.loss, m.pg_loss, m.kl, m.entropy, m.grad_norm, m.value_loss))
    assert second.kl > 0  # the adapter moved: the policy differs from the reference
    assert (first.value_loss > 0) == (loss == "ppo")


@pytest.mark.parametrize("critic", ["value_head", "critic"])
async def test_ppo_value_function_learns_the_returns(lm, sampled, critic):
    reset(lm)
    prompt, completions = sampled
    trainer = LMTrainer(lm, LMTrainerConfig(loss="ppo", lr=1e-3, critic=critic))
    losses = []
    async with httpx.AsyncClient() as http:
        for version in range(4):
            m = await trainer.train_step([group_of(prompt, completions, [1.0, 1.0], (str(version),) * 2)], http)
            losses.append(m.value_loss)
    assert losses[-1] < losses[0], losses  # uniform rewards still train PPO's critic


async def test_stale_sequences_are_dropped_and_token_ages_reported(lm, sampled):
    reset(lm)
    prompt, completions = sampled
    trainer = LMTrainer(lm, LMTrainerConfig(loss="grpo", lr=1e-4, max_staleness=2), version=5)
    async with httpx.AsyncClient() as http:
        m = await trainer.train_step([group_of(prompt, completions, [1.0, 0.0], ("4", "1"))], http)
    assert m.dropped_stale == 1 and m.sequences == 1
    assert m.staleness_mean == 1.0 and m.staleness_max == 1  # the kept one: sampled one version ago
