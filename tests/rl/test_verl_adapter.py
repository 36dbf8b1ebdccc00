"""arena_rl.verl_adapter against veRL's own classes (verl==0.9.1, the CPU-importable parts):
Arena groups become a veRL ``DataProto`` that veRL's methods and its GRPO advantage accept, and
``ArenaAgentLoop``, built the way veRL's agent-loop worker builds it, runs samples as rollouts of a
real stack (nats, the four services, the scripted LLM) and returns veRL's ``AgentLoopOutput``."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest

pytest.importorskip("verl")
torch = pytest.importorskip("torch")

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, DictConfigWrap  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402

from arena.sdk import ArenaClient  # noqa: E402
from arena_core.schemas import GroupCompleted, RolloutState, SamplingParams, Step, Trajectory, encode  # noqa: E402
from arena_core.sequences import with_sequences  # noqa: E402
from arena_core.settings import Settings  # noqa: E402
from arena_rl.chat_tasks import chat_task  # noqa: E402
from arena_rl.verl_adapter import (  # noqa: E402
    ArenaAgentLoop,
    ArenaRolloutError,
    output_from_trajectory,
    resolve_task_factory,
    sampling_from_verl,
    task_from_sample,
    to_data_proto,
    verl_rows,
)
from arena_stack.natsserver import free_port  # noqa: E402
from arena_stack.stack import Stack  # noqa: E402

PAD, P, R = 0, 6, 10


def step(rid: str, i: int, prompt: list[int], completion: list[int], logprobs: list[float], version: str) -> Step:
    return Step(rollout_id=rid, step_index=i, model="policy", backend="b", policy_version=version,
                prompt_token_ids=prompt, completion_token_ids=completion, logprobs=logprobs)


def two_turns(rid: str, index: int, gid: str, reward: float | None, *, user: list[int], first: list[int],
              tool: list[int], last: list[int]) -> Trajectory:
    """A user prompt, a first answer, tool output (+ template) between, a final answer."""
    lp1 = [-0.1 * (k + 1) - index for k in range(len(first))]
    lp2 = [-0.01 * (k + 1) - index for k in range(len(last))]
    steps = [step(rid, 0, user, first, lp1, "3"), step(rid, 1, user + first + tool, last, lp2, "4")]
    t = Trajectory(rollout_id=rid, task_id="t", group_id=gid, group_index=index, group_size=2,
                   final_state=RolloutState.COMPLETED if reward is not None else RolloutState.FAILED,
                   reward=reward, infrastructure=reward is None, steps=steps, policy_versions=["3", "4"])
    return with_sequences(t)  # what the trajectory plane stores


def groups() -> list[GroupCompleted]:
    a = two_turns("a", 0, "g1", 1.0, user=[1, 2, 3, 4], first=[10, 11], tool=[20, 21, 5], last=[12, 13, 2])
    b = two_turns("b", 1, "g1", 0.0, user=[1, 2, 3], first=[30], tool=[22, 5], last=[31, 2])
    c = two_turns("c", 0, "g2", 0.5, user=[7, 8], first=[40, 41, 42], tool=[23], last=[43, 2])
    d = two_turns("d", 1, "g2", 0.25, user=[7, 8], first=[44], tool=[24, 25], last=[2])
    lost = two_turns("x", 2, "g2", None, user=[7, 8], first=[45], tool=[26], last=[2])
    return [GroupCompleted(group_id="g1", task_id="t", size=2, trajectories=[a, b], rewards=[1.0, 0.0],
                           advantages=[1.0, -1.0], completed_at=1.0),
            GroupCompleted(group_id="g2", task_id="t", size=3, trajectories=[c, d, lost], rewards=[0.5, 0.25, None],
                           advantages=[1.0, -1.0, 0.0], completed_at=2.0, excluded_indexes=[2])]


def test_groups_become_a_left_and_right_padded_data_proto_with_verls_keys():
    dp = to_data_proto(groups(), pad_token_id=PAD, max_prompt_len=P, max_response_len=R)
    assert isinstance(dp, DataProto) and len(dp) == 4  # the infrastructure outcome is left out
    dp.check_consistency()
    b = dp.batch
    assert set(b.keys()) == {"prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                             "rollout_log_probs", "rm_scores", "token_level_scores"}
    assert b["prompts"].shape == (4, P) and b["responses"].shape == (4, R) and b["input_ids"].shape == (4, P + R)
    assert b["prompts"].dtype == torch.int64 and b["rollout_log_probs"].dtype == torch.float32
    # prompts left-padded, responses right-padded, as veRL's agent loop pads them
    assert b["prompts"][0].tolist() == [0, 0, 1, 2, 3, 4] and b["prompts"][1].tolist() == [0, 0, 0, 1, 2, 3]
    assert b["responses"][0].tolist() == [10, 11, 20, 21, 5, 12, 13, 2, 0, 0]
    assert b["responses"][1].tolist() == [30, 22, 5, 31, 2, 0, 0, 0, 0, 0]
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    assert b["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1] + [1] * 8 + [0, 0]
    assert b["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 11]
    # the loss mask: 0 on the tool output and template tokens between the turns, and on padding
    assert b["response_mask"][0].tolist() == [1, 1, 0, 0, 0, 1, 1, 1, 0, 0]
    assert b["response_mask"][1].tolist() == [1, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    assert dp.non_tensor_batch["uid"].tolist() == ["g1", "g1", "g2", "g2"]
    assert dp.non_tensor_batch["arena_rollout_id"].tolist() == ["a", "b", "c", "d"]
    assert dp.non_tensor_batch["arena_policy_version"].tolist() == ["4"] * 4
    assert dp.non_tensor_batch["__num_turns__"].tolist() == [4] * 4


def test_rollout_logprobs_are_the_captured_ones_and_the_reward_sits_on_the_last_response_token():
    gs = groups()
    dp = to_data_proto(gs, pad_token_id=PAD, max_prompt_len=P, max_response_len=R)
    members = [t for g in gs for t in g.trajectories if not t.infrastructure]
    for row, t in enumerate(members):
        mask = dp.batch["response_mask"][row].bool()
        captured = [lp for s in t.steps for lp in s.logprobs]
        assert dp.batch["rollout_log_probs"][row][mask].tolist() == pytest.approx(captured)
        assert dp.batch["rollout_log_probs"][row][~mask].abs().sum() == 0
        sampled = [tok for s in t.steps for tok in s.completion_token_ids]
        assert dp.batch["responses"][row][mask].tolist() == sampled
        last = int(dp.batch["attention_mask"][row, P:].sum()) - 1  # where veRL's agent loop puts rm_scores
        scores = dp.batch["token_level_scores"][row]
        assert scores[last].item() == t.reward and scores.sum().item() == t.reward
        assert torch.equal(scores, dp.batch["rm_scores"][row])


def test_verls_own_methods_and_grpo_advantage_accept_the_batch():
    dp = to_data_proto(groups(), pad_token_id=PAD, max_prompt_len=P, max_response_len=R, meta_info={"step": 3})
    sub = dp.select(batch_keys=["responses", "response_mask"], non_tensor_batch_keys=["uid"])
    assert set(sub.batch.keys()) == {"responses", "response_mask"} and list(sub.non_tensor_batch) == ["uid"]
    halves = dp.chunk(2)
    assert [h.non_tensor_batch["uid"].tolist() for h in halves] == [["g1", "g1"], ["g2", "g2"]]
    again = DataProto.concat(halves)
    assert len(again) == 4 and again.meta_info == {"step": 3}
    for key in dp.batch.keys():
        assert torch.equal(again.batch[key], dp.batch[key])
    assert dp[1].non_tensor_batch["arena_rollout_id"] == "b"
    # veRL's GRPO: token_level_scores as the rewards, grouped by uid
    adv, _ = compute_grpo_outcome_advantage(dp.batch["token_level_scores"], dp.batch["response_mask"],
                                            dp.non_tensor_batch["uid"])
    per_row = [adv[i][dp.batch["response_mask"][i].bool()] for i in range(4)]
    assert all(torch.allclose(r, r[0].expand_as(r)) for r in per_row)  # one advantage per sequence
    assert [round(r[0].item(), 4) for r in per_row] == [0.7071, -0.7071, 0.7071, -0.7071]
    assert all(adv[i][~dp.batch["response_mask"][i].bool()].abs().sum() == 0 for i in range(4))


def test_long_responses_are_cut_long_prompts_refused_and_lost_rollouts_reported():
    dp = to_data_proto(groups(), pad_token_id=PAD, max_prompt_len=P, max_response_len=4)
    assert dp.batch["responses"][0].tolist() == [10, 11, 20, 21]
    assert dp.batch["token_level_scores"][0].tolist() == [0.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="max_prompt_len=3"):
        to_data_proto(groups(), pad_token_id=PAD, max_prompt_len=3, max_response_len=R)
    rows, skipped = verl_rows(groups())
    assert [r.rollout_id for r in rows] == ["a", "b", "c", "d"]
    assert [s.rollout_id for s in skipped] == ["x"] and "infrastructure" in skipped[0].reason
    with pytest.raises(ValueError, match="no trainable trajectory"):
        to_data_proto([groups()[1].trajectories[2]], pad_token_id=PAD, max_prompt_len=P, max_response_len=R)


def test_a_trajectory_becomes_verls_agent_loop_output():
    t = groups()[0].trajectories[0]
    out = output_from_trajectory(t, max_response_len=7)
    assert isinstance(out, AgentLoopOutput)
    assert out.prompt_ids == [1, 2, 3, 4] and out.response_ids == [10, 11, 20, 21, 5, 12, 13]
    assert out.response_mask == [1, 1, 0, 0, 0, 1, 1] and out.num_turns == 4 and out.reward_score == 1.0
    assert out.response_logprobs == pytest.approx([-0.1, -0.2, 0, 0, 0, -0.01, -0.02])
    d = out.as_dict()  # veRL's own conversion: rm_scores with the reward on the last token
    assert d["rm_scores"].tolist() == [0.0] * 6 + [1.0] and d["rollout_log_probs"].shape == (7,)
    with pytest.raises(ArenaRolloutError, match="infrastructure"):
        output_from_trajectory(groups()[1].trajectories[2])
    assert sampling_from_verl({"temperature": 0.7, "top_p": 0.9, "top_k": -1, "logprobs": True}) == \
        SamplingParams(temperature=0.7, top_p=0.9)
    assert sampling_from_verl({"temperature": 0.0, "top_k": 5}) == SamplingParams(temperature=0.0, top_k=5)


REPLY = "I'm so sorry, that sounds hard. I'm here for you."


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
async def test_arena_agent_loop_runs_verl_samples_as_rollouts_of_a_real_stack(tmp_path, monkeypatch):
    hydra_utils = pytest.importorskip("hydra.utils")
    omegaconf = pytest.importorskip("omegaconf")
    script = tmp_path / "llm.json"
    script.write_text(json.dumps({"responses": [{"label": "kind", "content": REPLY}]}))
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{free_port()}/v1",
                        backend_policy_version="0", sandbox_concurrency=2, verify_concurrency=2)
    config = omegaconf.OmegaConf.create({"actor_rollout_ref": {"rollout": {"prompt_length": 256,
                                                                           "response_length": 512}},
                                         "data": {}})
    stack = Stack(settings, llm_script=script, nats_sync="1s", log=lambda m: None)
    await stack.start()
    settings = stack.settings  # its NATS URL carries the administrator's credentials
    monkeypatch.setenv("ARENA_API_KEY", stack.api_key)  # what the clients and trainers send by default
    try:
        async def one(index: int) -> AgentLoopOutput:
            # as veRL's AgentLoopWorker does: hydra-instantiate the registered config per sample, then run
            loop = hydra_utils.instantiate(
                config={"_target_": "arena_rl.verl_adapter.ArenaAgentLoop", "arena_url": settings.rollout_url,
                        "trajectory_url": settings.trajectory_url, "timeout_s": 120.0},
                trainer_config=DictConfigWrap(config=config), server_manager=None, tokenizer=None, processor=None,
                hf_model_type=None, dataset_cls=None, data_config=DictConfigWrap(config.data))
            assert isinstance(loop, ArenaAgentLoop)
            task = chat_task(index, turns=2, max_tokens=64, stream="0")
            sample = {"raw_prompt": [{"role": "user", "content": task.instructions}], "uid": f"u{index}",
                      "extra_info": {"arena_task": encode(task).decode(), "index": index}}
            return await loop.run({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}, **sample)

        outs = await asyncio.wait_for(asyncio.gather(one(0), one(1)), timeout=90)
        with ArenaClient(settings.rollout_url, settings.trajectory_url) as client:
            trajs = [client.trajectory(o.extra_fields["arena_rollout_id"]) for o in outs]
    finally:
        stack.stop()
    reply_ids = [3 + b for b in REPLY.encode()]  # the scripted LLM's ids: bytes + 3
    for out, t in zip(outs, trajs, strict=True):
        assert t.final_state == RolloutState.COMPLETED and t.metadata.get("verl_uid", "").startswith("u")
        assert out.reward_score == t.reward and t.reward > 0
        assert out.num_turns == 4 and len(t.sequences) == 1 and t.sequences[0].step_indexes == [0, 1]
        # both replies are policy tokens; the partner's follow-up and the chat template between are not
        sampled = [tok for tok, m in zip(out.response_ids, out.response_mask) if m]
        assert sampled == reply_ids + reply_ids
        assert out.response_ids[:len(reply_ids)] == reply_ids and 0 in out.response_mask
        assert out.prompt_ids + out.response_ids == t.sequences[0].token_ids
        captured = [lp for s in sorted(t.steps, key=lambda s: s.step_index) for lp in s.logprobs]
        assert [lp for lp, m in zip(out.response_logprobs, out.response_mask) if m] == pytest.approx(captured)
    # the same trajectories through the batch path agree with the agent loop's outputs
    dp = to_data_proto(trajs, pad_token_id=0, max_prompt_len=256, max_response_len=512)
    for row, out in enumerate(outs):
        n = len(out.response_ids)
        assert dp.batch["responses"][row, :n].tolist() == out.response_ids
        assert dp.batch["response_mask"][row, :n].tolist() == out.response_mask
        assert dp.batch["token_level_scores"][row, n - 1].item() == pytest.approx(out.reward_score)
    assert np.array_equal(dp.non_tensor_batch["arena_rollout_id"],
                          np.array([t.rollout_id for t in trajs], dtype=object))


def test_the_task_factory_is_a_callable_or_a_module_path_and_the_default_reads_extra_info():
    task = chat_task(3)
    assert resolve_task_factory("arena_rl.verl_adapter:task_from_sample") is task_from_sample
    assert task_from_sample({"extra_info": {"arena_task": encode(task).decode()}}) == task
    assert resolve_task_factory(lambda sample: task)({}) == task
    with pytest.raises(ValueError, match="task_factory"):
        task_from_sample({"extra_info": {}})
    with pytest.raises(ValueError, match="package.module:function"):
        resolve_task_factory("arena_rl.verl_adapter.task_from_sample")
