"""The trainer on a real JetStream: async mode trains on groups as they come, drops
groups older than ``max_staleness`` versions, reports staleness, writes JSONL metrics
and commits what it trained on."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

torch = pytest.importorskip("torch")

from arena_core import subjects  # noqa: E402
from arena_core.grpo import group_advantages  # noqa: E402
from arena_rl.generate import GenRequest, generate  # noqa: E402
from arena_rl.model import new_policy  # noqa: E402
from arena_rl.tokenizer import CharTokenizer  # noqa: E402
from arena_rl.trainer import GRPOTrainer, StepMetrics, TrainerConfig  # noqa: E402
from arena_core.schemas import GroupCompleted, RolloutState, Step, Trajectory  # noqa: E402
from arena.stream import TrajectoryStream  # noqa: E402

TOK = CharTokenizer(alphabet="01")


def make_group(model, gid: str, version: str, rewards: list[float]) -> GroupCompleted:
    prompt = TOK.render_chat([{"role": "user", "content": "101"}])
    results = generate(model, [GenRequest(prompt_ids=prompt, max_tokens=1, seed=i) for i in range(len(rewards))])
    trajectories = [
        Trajectory(rollout_id=f"{gid}-{i}", task_id="t", group_id=gid, group_index=i, group_size=len(rewards),
                   final_state=RolloutState.COMPLETED, reward=r, policy_versions=[version],
                   steps=[Step(rollout_id=f"{gid}-{i}", step_index=0, model="m", backend="b", policy_version=version,
                               prompt_token_ids=prompt, completion_token_ids=res.token_ids, logprobs=res.logprobs)])
        for i, (r, res) in enumerate(zip(rewards, results, strict=True))]
    return GroupCompleted(group_id=gid, task_id="t", size=len(rewards), trajectories=trajectories, rewards=rewards,
                          advantages=group_advantages(rewards), completed_at=0.0)


async def test_async_mode_drops_stale_groups_and_reports_staleness(bus, nats_server, tmp_path):
    model = new_policy(TOK, seed=0, d_model=32, n_layers=1, max_len=16).eval()
    trainer = GRPOTrainer(model, TOK, TrainerConfig(batch_groups=1, epochs=1, mode="async", max_staleness=1),
                          version=3)
    groups = [make_group(model, "g-stale", "1", [1, 0, 0, 1]),   # 3 - 1 > 1: dropped unseen
              make_group(model, "g-ok", "2", [1, 0, 1, 0]),      # staleness 1: trained on
              make_group(model, "g-flat", "3", [0, 0, 0, 0])]    # no signal, but a step all the same
    for g in groups:
        await bus.publish(subjects.group(g.group_id), g, msg_id=subjects.msg_id(g.group_id, "group"))
    async with TrajectoryStream(nats_server.url, name="t7", max_staleness=1,
                                current_policy_version=lambda: trainer.version) as stream:
        history = await asyncio.wait_for(trainer.run(stream, steps=2, metrics_path=tmp_path / "m.jsonl"), 60)
        assert stream.stats.dropped_stale == 1 and stream.stats.committed == 2
    assert [m.policy_version for m in history] == [4, 5]
    assert history[0].staleness_max == 1 and history[0].samples == 4 and history[0].mean_reward == 0.5
    assert history[1].skipped_uniform_groups == 1 and history[1].samples == 0
    # the optimiser's own figures, for the dashboard: entropy of the sampling policy, the
    # gradient norm before clipping, the learning rate
    assert history[0].entropy > 0 and history[0].grad_norm > 0 and history[0].lr == trainer.config.lr
    lines = (tmp_path / "m.jsonl").read_bytes().splitlines()
    assert [msgspec.json.decode(line, type=StepMetrics).step for line in lines] == [1, 2]
