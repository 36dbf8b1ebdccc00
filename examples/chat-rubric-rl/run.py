"""A 135M instruct model learns empathy through Arena: GRPO or PPO with LoRA on CPU.

Starts nats-server and the four services, the policy server serving SmolLM2-135M-Instruct
(``--engine smollm2``, registered as a backend replica), then: held-out evaluation -> steps
of (groups of multi-turn chat rollouts graded by the rubric verifier, streamed to the
trainer, one LoRA update pushed under a new policy version) -> held-out evaluation every
few steps. Prints the curve; trainer metrics go to the trajectory service (and live on
``arena.trainer.metrics.{run}``). docs/rl.md ("The chat example").

    .venv/bin/python examples/chat-rubric-rl/run.py [--loss grpo|dr_grpo|gspo|ppo] [--minutes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
import msgspec
import torch

from arena.sdk import ArenaClient
from arena.stream import TrajectoryStream
from arena_core.schemas import LlmJudgeVerifier, SamplingParams
from arena_core.settings import Settings
from arena_rl.chat_tasks import JUDGE_RUBRIC, chat_family, chat_task
from arena_rl.lm import LanguageModel, LoRASpec
from arena_rl.lm_trainer import LMTrainer, LMTrainerConfig
from arena_rl.trainer import post_metrics
from arena_stack.natsserver import free_port, wait_port
from arena_stack.stack import Child, Stack


def evaluate(client: ArenaClient, items: list[int], *, repeats: int, turns: int, max_tokens: int,
             judge: LlmJudgeVerifier | None) -> float:
    """Mean reward of the held-out tasks (fixed seeds); blocking."""
    ids = [client.submit(chat_task(i, split="heldout", turns=turns, max_tokens=max_tokens, judge=judge),
                         sampling=SamplingParams(temperature=1.0, seed=1000 + k)).rollout_id
           for k, i in enumerate(i for i in items for _ in range(repeats))]
    rewards = [client.wait(rid, timeout=900).reward or 0.0 for rid in ids]
    return sum(rewards) / len(rewards)


async def collect(stream: TrajectoryStream, n: int) -> list:
    groups = []
    async for batch in stream.groups(batch_size=n, max_wait=0.5):
        groups.extend(g for g in batch.groups if not g.task_id.startswith("heldout-"))
        await batch.commit()
        if len(groups) >= n:
            return groups


async def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    data = Path(args.data_dir).resolve()
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    policy_port = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{policy_port}/v1",
                        sandbox_concurrency=args.group_size * args.batch_groups, verify_concurrency=4)
    lora = LoRASpec(r=args.lora_r, alpha=2 * args.lora_r)
    stack = Stack(settings, log=lambda m: print("  " + m))
    server = None
    train, heldout = chat_family(seed=args.seed)
    rng = random.Random(args.seed)
    run_name = f"chat-rubric-{args.loss}"
    judge = LlmJudgeVerifier(rubric=JUDGE_RUBRIC, model=args.judge_model, base_url=args.judge_url) \
        if args.judge_url else None
    try:
        await stack.start()
        settings = stack.settings  # its NATS URL carries the administrator's credentials
        os.environ["ARENA_API_KEY"] = stack.api_key or ""  # what the client and the trainer send
        server = Child("policy-server", [sys.executable, "-m", "arena_rl.policy_server", "--engine", "smollm2",
                                         "--port", str(policy_port), "--nats-url", settings.nats_url,
                                         "--lora-r", str(lora.r), "--lora-alpha", str(lora.alpha),
                                         "--threads", str(args.threads), "--max-batch", "64", "--batch-wait-ms", "50"],
                       dict(os.environ), data / "logs" / "policy-server.log")
        server.start()
        lm = await asyncio.to_thread(LanguageModel.load, lora=lora)
        await asyncio.to_thread(wait_port, "127.0.0.1", policy_port, 600, server.proc)
        print(f"  policy server   {settings.backend_url} (SmolLM2-135M-Instruct, LoRA r={lora.r}, version 0)")
        config = LMTrainerConfig(loss=args.loss, lr=args.lr, batch_groups=args.batch_groups, kl_coef=args.kl_coef,
                                 clip_eps=3e-4 if args.loss == "gspo" else 0.2, max_tokens=args.max_tokens,
                                 critic=args.critic, micro_batch=4)
        trainer = LMTrainer(lm, config, push_urls=[settings.backend_url])
        t0 = time.monotonic()
        curve: list[tuple[int, float, float]] = []
        with ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120) as client:
            def held_out() -> float:
                return evaluate(client, heldout, repeats=args.eval_repeats, turns=args.turns,
                                max_tokens=args.max_tokens, judge=judge)

            score = await asyncio.to_thread(held_out)
            curve.append((0, score, time.monotonic() - t0))
            print(f"held-out mean reward at version 0: {score:.3f}", flush=True)
            print(f"{'step':>4} {'version':>7} {'reward':>7} {'loss':>8} {'kl':>7} {'entropy':>7} {'gnorm':>6} "
                  f"{'stale':>5} {'elapsed':>8}")
            async with TrajectoryStream(settings.nats_url, name=run_name) as stream, \
                    httpx.AsyncClient(timeout=120) as http:
                while time.monotonic() - t0 < args.minutes * 60 and trainer.step < args.max_steps:
                    for _ in range(args.batch_groups):
                        task = chat_task(rng.choice(train), turns=args.turns, max_tokens=args.max_tokens, judge=judge)
                        await asyncio.to_thread(client.submit_group, task, n=args.group_size,
                                                seed=rng.getrandbits(30), sampling=SamplingParams(temperature=1.0))
                    groups = await collect(stream, args.batch_groups)
                    m = await trainer.train_step(groups, http)
                    await post_metrics(http, settings.trajectory_url, run_name, m)
                    with (data / "metrics.jsonl").open("ab") as f:
                        f.write(msgspec.json.encode(m) + b"\n")
                    print(f"{m.step:>4} {m.policy_version:>7} {m.mean_reward:>7.3f} {m.loss:>8.4f} {m.kl:>7.4f} "
                          f"{m.entropy:>7.3f} {m.grad_norm:>6.2f} {m.staleness_mean:>5.1f} "
                          f"{time.monotonic() - t0:>7.0f}s", flush=True)
                    if m.step % args.eval_every == 0:
                        score = await asyncio.to_thread(held_out)
                        curve.append((m.policy_version, score, time.monotonic() - t0))
                        print(f"held-out mean reward at version {m.policy_version}: {score:.3f}", flush=True)
            if curve[-1][0] != trainer.version:
                score = await asyncio.to_thread(held_out)
                curve.append((trainer.version, score, time.monotonic() - t0))
        print("curve (policy version, held-out mean reward, elapsed s):")
        for version, score, at in curve:
            print(f"  {version:>4} {score:6.3f} {'#' * int(score * 40):<40} {at:6.0f}s")
        print(f"RESULT {args.loss}: held-out mean reward {curve[0][1]:.3f} -> {curve[-1][1]:.3f} "
              f"in {time.monotonic() - t0:.0f}s")
        return 0 if curve[-1][1] > curve[0][1] + args.min_gain else 1
    finally:
        if server is not None:
            server.stop()
        stack.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loss", choices=["grpo", "dr_grpo", "gspo", "ppo"], default="grpo")
    p.add_argument("--critic", choices=["value_head", "critic"], default="value_head", help="PPO's value function")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--batch-groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--judge-url", default="", help="also grade with an LLM judge at this OpenAI-compatible URL")
    p.add_argument("--judge-model", default="judge")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-gain", type=float, default=0.1, help="exit 1 unless held-out reward rises this much")
    p.add_argument("--data-dir", default=".arena-chat-rl")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    raise SystemExit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
