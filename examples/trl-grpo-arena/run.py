"""TRL's GRPOTrainer trains SmolLM2-135M-Instruct (LoRA, CPU) on rollouts and rewards from Arena.

Starts nats-server and the four services, the policy server serving the 135M model
(``--engine smollm2``, registered as a backend replica), then runs ``trl.GRPOTrainer`` with
``rollout_func=ArenaRollouts(...)`` (each prompt an Arena group of chat rollouts graded by
the rubric verifier) and ``reward_funcs=arena_reward``; after every optimizer step
``ArenaWeightSync`` pushes the LoRA adapter, so the next rollouts use it. Nothing is
downloaded. docs/rl.md ("TRL").

    .venv/bin/python examples/trl-grpo-arena/run.py [--max-steps 3] [--num-generations 4] [--turns 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5's renames, raised inside TRL

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from arena.sdk import ArenaClient  # noqa: E402
from arena_core.settings import Settings  # noqa: E402
from arena_rl.chat_tasks import TROUBLES, chat_family, chat_task  # noqa: E402
from arena_rl.lm import LoRASpec, load_base  # noqa: E402
from arena_rl.trl_rollouts import ArenaRollouts, ArenaWeightSync, arena_reward, lora_config  # noqa: E402
from arena_stack.natsserver import free_port, wait_port  # noqa: E402
from arena_stack.stack import Child, Stack  # noqa: E402


def prompts(items: list[int]) -> Dataset:
    """TRL's conversational prompt format: the partner's first message, one row per task."""
    return Dataset.from_list([{"prompt": [{"role": "user", "content": TROUBLES[i]}]} for i in items])


def task_factory(turns: int, max_tokens: int):
    """A TRL prompt -> the Arena chat task it came from (its trouble is the first message)."""
    def make(prompt: list[dict[str, str]]):
        return chat_task(TROUBLES.index(prompt[0]["content"]), turns=turns, max_tokens=max_tokens)
    return make


class PrintSteps(TrainerCallback):
    """One line per optimizer step: TRL's mean reward (Arena's) and loss, the served version."""

    def __init__(self, rollouts: ArenaRollouts, sync: ArenaWeightSync, t0: float):
        self.rollouts, self.sync, self.t0 = rollouts, sync, t0

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs:
            return
        batch = self.rollouts.batches[-1]
        print(f"{state.global_step:>4} {logs.get('rewards/arena_reward/mean', float('nan')):>7.3f} "
              f"{logs.get('reward_std', float('nan')):>7.3f} {logs['loss']:>9.5f} "
              f"{logs.get('completions/mean_length', float('nan')):>7.1f} "
              f"{','.join(sorted(set(batch.output['arena_policy_version']))):>7} "
              f"{self.sync.pushed[-1] if self.sync.pushed else 0:>6} {batch.seconds:>6.0f}s "
              f"{time.monotonic() - self.t0:>7.0f}s", flush=True)


def build_trainer(*, model: Any, tokenizer: Any, client: ArenaClient, backend_url: str, lora: LoRASpec,
                  train: Dataset, out: Path, max_steps: int, num_generations: int, prompts_per_step: int,
                  turns: int, max_tokens: int, lr: float, seed: int) -> tuple[GRPOTrainer, ArenaRollouts,
                                                                               ArenaWeightSync]:
    rollouts = ArenaRollouts(client, task_factory(turns, max_tokens), seed=seed)
    sync = ArenaWeightSync(backend_url, lora)
    config = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, fp16=False, seed=seed,
                        per_device_train_batch_size=num_generations * prompts_per_step,
                        num_generations=num_generations, gradient_accumulation_steps=1, max_steps=max_steps,
                        learning_rate=lr, max_completion_length=turns * (max_tokens + 64), temperature=1.0,
                        beta=0.0, gradient_checkpointing=False, logging_steps=1, report_to="none",
                        save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=arena_reward, args=config, train_dataset=train,
                          processing_class=tokenizer, peft_config=lora_config(lora), rollout_func=rollouts,
                          callbacks=[sync])
    trainer.remove_callback(PrinterCallback)  # PrintSteps prints one line per step instead
    return trainer, rollouts, sync


async def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    data = Path(args.data_dir).resolve()
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    policy_port = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data / "arena"),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{policy_port}/v1",
                        sandbox_concurrency=args.num_generations * args.prompts_per_step, verify_concurrency=2)
    lora = LoRASpec(r=args.lora_r, alpha=2 * args.lora_r)
    stack = Stack(settings, log=lambda m: print("  " + m))
    server = None
    try:
        await stack.start()
        settings = stack.settings  # its NATS URL carries the administrator's credentials
        os.environ["ARENA_API_KEY"] = stack.api_key or ""  # what the client and the trainer send
        server = Child("policy-server", [sys.executable, "-m", "arena_rl.policy_server", "--engine", "smollm2",
                                         "--port", str(policy_port), "--nats-url", settings.nats_url,
                                         "--lora-r", str(lora.r), "--lora-alpha", str(lora.alpha),
                                         "--threads", str(args.threads), "--batch-wait-ms", "50"],
                       dict(os.environ), data / "logs" / "policy-server.log")
        server.start()
        model, tokenizer = await asyncio.to_thread(load_base)  # the same cached weights the server loads
        await asyncio.to_thread(wait_port, "127.0.0.1", policy_port, 600, server.proc)
        print(f"  policy server   {settings.backend_url} (SmolLM2-135M-Instruct, LoRA r={lora.r}, version 0)")
        train, _ = chat_family(seed=args.seed)
        t0 = time.monotonic()
        with ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120) as client:
            trainer, rollouts, sync = build_trainer(
                model=model, tokenizer=tokenizer, client=client, backend_url=settings.backend_url, lora=lora,
                train=prompts(train), out=data / "trl", max_steps=args.max_steps,
                num_generations=args.num_generations, prompts_per_step=args.prompts_per_step, turns=args.turns,
                max_tokens=args.max_tokens, lr=args.lr, seed=args.seed)
            trainer.add_callback(PrintSteps(rollouts, sync, t0))
            print(f"{'step':>4} {'reward':>7} {'std':>7} {'loss':>9} {'len':>7} {'served':>7} {'pushed':>6} "
                  f"{'arena':>7} {'elapsed':>8}")
            await asyncio.to_thread(trainer.train)
        rewards = [r for b in rollouts.batches for r in b.output["arena_reward"] if r is not None]
        print(f"RESULT {len(rollouts.batches)} TRL GRPO steps on {len(rewards)} Arena rollouts: mean reward "
              f"{sum(rewards) / max(len(rewards), 1):.3f}; policy server at version {sync.served_version()}; "
              f"{time.monotonic() - t0:.0f}s")
        return 0
    finally:
        if server is not None:
            server.stop()
        stack.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt: one Arena group")
    p.add_argument("--prompts-per-step", type=int, default=1, help="Arena groups per optimizer step")
    p.add_argument("--turns", type=int, default=1, help="chat turns per rollout (>1: multi-turn, env_mask)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per reply")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=".arena/trl-grpo", help="wiped at start (.arena/ is git-ignored)")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # clean up on TERM
    raise SystemExit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
