"""TRL's GRPOTrainer trains SmolLM2-135M-Instruct on rollouts and rewards from the real stack
(``make test-rl``, a few minutes on 2 cores): examples/trl-grpo-arena's trainer, 2 steps of
one Arena group of 4 two-turn chat rollouts each, graded by the rubric verifier.

TRL trains on exactly the token ids the trajectories hold (its logged token counts are
theirs), its rewards are the verifier's, every step's rollouts were served by the adapter
TRL had at that step, and the policy server's version advances after each optimizer step."""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("trl")
pytest.importorskip("datasets")

from transformers import TrainerCallback  # noqa: E402

from arena.sdk import ArenaClient  # noqa: E402
from arena_core.schemas import RolloutState  # noqa: E402
from arena_core.sequences import sequences_of  # noqa: E402
from arena_core.settings import Settings  # noqa: E402
from arena_rl.chat_tasks import chat_family  # noqa: E402
from arena_rl.lm import LoRASpec, ModelUnavailable, gguf_path, load_base  # noqa: E402
from arena_stack.natsserver import free_port, wait_port  # noqa: E402
from arena_stack.stack import Stack  # noqa: E402

try:
    gguf_path()
except ModelUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl-grpo-arena" / "run.py"
STEPS, GROUP, TURNS, MAX_TOKENS = 2, 4, 2, 12


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("trl_grpo_arena_run", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class ServedVersions(TrainerCallback):
    """The policy server's version right after each optimizer step (after ``ArenaWeightSync``)."""

    def __init__(self, root: str):
        self.root = root
        self.versions: list[str] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.versions.append(httpx.get(self.root + "/health", timeout=30).json()["policy_version"])


async def test_trl_grpo_trains_the_served_model_on_arena_rollouts(tmp_path, monkeypatch):
    example = _example()
    policy_port = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{policy_port}/v1",
                        sandbox_concurrency=GROUP, verify_concurrency=2)
    lora = LoRASpec(r=8, alpha=16)
    stack = Stack(settings, nats_sync="1s", log=lambda m: None)
    server = None
    await stack.start()
    settings = stack.settings  # its NATS URL carries the administrator's credentials
    monkeypatch.setenv("ARENA_API_KEY", stack.api_key)  # what the clients and trainers send by default
    try:
        log = open(tmp_path / "policy.log", "wb")
        server = subprocess.Popen([sys.executable, "-m", "arena_rl.policy_server", "--engine", "smollm2",
                                   "--port", str(policy_port), "--nats-url", settings.nats_url, "--threads", "2",
                                   "--lora-r", str(lora.r), "--lora-alpha", str(lora.alpha),
                                   "--batch-wait-ms", "50"], stdout=log, stderr=log)
        model, tokenizer = await asyncio.to_thread(load_base)
        await asyncio.to_thread(wait_port, "127.0.0.1", policy_port, 300, server)
        torch.set_num_threads(2)
        train, _ = chat_family(seed=0)
        with ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120) as client:
            trainer, rollouts, sync = example.build_trainer(
                model=model, tokenizer=tokenizer, client=client, backend_url=settings.backend_url, lora=lora,
                train=example.prompts(train), out=tmp_path / "trl", max_steps=STEPS, num_generations=GROUP,
                prompts_per_step=1, turns=TURNS, max_tokens=MAX_TOKENS, lr=1e-4, seed=0)
            served = ServedVersions(f"http://127.0.0.1:{policy_port}")
            trainer.add_callback(served)
            await asyncio.to_thread(trainer.train)

            # the policy server took an adapter after every optimizer step
            assert sync.pushed == [1, 2]
            assert served.versions == ["1", "2"]

            logs = [entry for entry in trainer.state.log_history if "rewards/arena_reward/mean" in entry]
            assert [b.global_step for b in rollouts.batches] == [0, 1] and len(logs) == STEPS
            tokens_seen = 0
            for step, (batch, logged) in enumerate(zip(rollouts.batches, logs, strict=True)):
                out = batch.output
                assert len(out["completion_ids"]) == GROUP and len(set(batch.group_ids)) == 1
                for i, rid in enumerate(batch.rollout_ids):
                    trajectory = client.trajectory(rid)  # fetched again: what Arena stores
                    assert trajectory.final_state == RolloutState.COMPLETED, \
                        (trajectory.reason, (tmp_path / "policy.log").read_text()[-2000:])
                    # TRL got the trajectory's own ids and logprobs: its one two-turn training sequence
                    sequences, breaks = sequences_of(trajectory)
                    assert len(sequences) == 1 and breaks == []
                    seq = sequences[0]
                    prompt, completion = out["prompt_ids"][i], out["completion_ids"][i]
                    assert prompt + completion == seq.token_ids
                    assert out["env_mask"][i] == seq.loss_mask[len(prompt):] and 0 in out["env_mask"][i]
                    assert out["logprobs"][i] == seq.logprobs[len(prompt):]
                    first = min(trajectory.steps, key=lambda s: s.step_index)
                    assert prompt == first.prompt_token_ids
                    assert completion[:len(first.completion_token_ids)] == first.completion_token_ids
                    # the reward is the rubric verifier's
                    assert trajectory.verification is not None and trajectory.verification.verifier == "rubric"
                    assert out["arena_reward"][i] == trajectory.reward == trajectory.verification.reward
                    # served by the adapter TRL had when it asked for this batch
                    assert trajectory.policy_versions == [str(step)]
                    assert {s.policy_version for s in trajectory.steps} == {str(step)}
                # TRL's logs count exactly these tokens (prompts + the policy's tokens, env_mask 1) and
                # average exactly these rewards
                tokens_seen += sum(len(p) + sum(m) for p, m in zip(out["prompt_ids"], out["env_mask"], strict=True))
                assert logged["num_tokens"] == tokens_seen
                assert logged["completions/mean_length"] == pytest.approx(
                    sum(sum(m) for m in out["env_mask"]) / GROUP)
                assert logged["rewards/arena_reward/mean"] == pytest.approx(sum(out["arena_reward"]) / GROUP)
        health = httpx.get(f"http://127.0.0.1:{policy_port}/health", timeout=30).json()
        assert health["policy_version"] == "2"
    finally:
        if server is not None:
            server.terminate()
            server.wait(20)
        stack.stop()
