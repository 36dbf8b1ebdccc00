"""GRPO on an OpenEnv environment through Arena, on the CPU.

The environment is ``examples/openenv-majority`` (an OpenEnv server: the majority bit of a
bit string, reward 1 or 0), hosted by Arena as a task: each episode is one rollout in its
own bubblewrap sandbox running the environment's server. The policy is the demo's tiny
character transformer behind ``arena_rl.policy_server``; the driver plays each episode with
OpenEnv's unmodified ``GenericEnvClient``: ``reset`` (the bits, and the group the episode
belongs to), one LLM call through Arena's proxy (captured token-exact), ``step`` with the
answer. The trainer reads finished groups from the trajectory stream. Prints the curve.

    .venv/bin/python examples/openenv-grpo/run.py [--steps 40] [--group-size 4] [--batch-groups 4]
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
import uuid
from pathlib import Path

import httpx
import torch
from openenv.core import GenericEnvClient

from arena.stream import TrajectoryStream
from arena_core.settings import Settings
from arena_rl.model import new_policy, save_checkpoint
from arena_rl.tasks import ALPHABET, majority_family
from arena_rl.tokenizer import CharTokenizer
from arena_rl.trainer import GRPOTrainer, TrainerConfig
from arena_stack.natsserver import free_port, wait_port
from arena_stack.stack import Child, Stack

HERE = Path(__file__).resolve().parent
ENVIRONMENT = HERE.parent / "openenv-majority"


async def play(url: str, bits: str, http: httpx.AsyncClient, *, group: tuple[str, int, int] | None = None,
               seed: int = 0) -> float | None:
    """One episode with OpenEnv's client: the policy's answer through Arena's proxy."""
    extra = {"group_id": group[0], "group_index": group[1], "group_size": group[2]} if group else {}
    async with GenericEnvClient(base_url=url, message_timeout_s=300) as env:
        first = await env.reset(bits=bits, seed=seed, **extra)
        where = await env.state()  # the rollout's proxy and key: the LLM call is captured there
        answer = await http.post(f"{where['llm_base_url']}/chat/completions",
                                 headers={"authorization": f"Bearer {where['llm_api_key']}"},
                                 json={"model": "default", "max_tokens": 1,
                                       "messages": [{"role": "user", "content": first.observation["prompt"]}]})
        answer.raise_for_status()
        text = answer.json()["choices"][0]["message"]["content"] or ""
        result = await env.step({"message": text})
        return result.reward


async def evaluate(url: str, items: list[str], http: httpx.AsyncClient, repeats: int, concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, bits: str) -> float:
        async with gate:
            return await play(url, bits, http, seed=10_000 + i) or 0.0

    rewards = await asyncio.gather(*(one(i, b) for i, b in enumerate(items * repeats)))
    return sum(rewards) / len(rewards)


async def demo(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    data = Path(args.data_dir).resolve()
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    policy_port = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{policy_port}/v1",
                        sandbox_concurrency=args.concurrency, verify_concurrency=2, allow_host_paths=True)
    tokenizer = CharTokenizer(alphabet=ALPHABET)
    model = new_policy(tokenizer, seed=args.seed, d_model=32, n_layers=1, n_heads=4, max_len=16)
    checkpoint = save_checkpoint(data / "policy-v0.pt", model, tokenizer, 0)
    train, heldout = majority_family(seed=args.seed)
    heldout = heldout[: args.eval_items]
    stack = Stack(settings, log=lambda m: print("  " + m))
    server = None
    try:
        await stack.start()
        settings = stack.settings  # its NATS URL carries the administrator's credentials
        os.environ["ARENA_API_KEY"] = stack.api_key or ""  # what the client and the trainer send
        server = Child("policy-server", [sys.executable, "-m", "arena_rl.policy_server", "--checkpoint",
                                         str(checkpoint), "--port", str(policy_port), "--nats-url", settings.nats_url],
                       dict(os.environ), data / "logs" / "policy-server.log")
        server.start()
        wait_port("127.0.0.1", policy_port, 60, server.proc)
        task = {"id": "openenv-majority", "instructions": "Answer with the majority bit.", "agent": {"external": True},
                "environment": {"path": str(ENVIRONMENT)}, "budget": {"wall_clock_s": 300}}
        async with httpx.AsyncClient(timeout=300) as http:
            got = await http.put(f"{settings.rollout_url}/v1/environments/majority",
                                 json={"task": task, "sampling": {"temperature": 1.0}},
                                 headers={"authorization": f"Bearer {stack.api_key}"} if stack.api_key else {})
            got.raise_for_status()
            url = got.json()["url"]
            if stack.api_key:  # OpenEnv's client sends no headers: the key goes in its base URL (docs/openenv.md)
                url = url.replace("/openenv/", f"/openenv/k/{stack.api_key}/", 1)
            print(f"  environment     {url} (examples/openenv-majority, hosted under bubblewrap)")
            t0 = time.monotonic()
            before = await evaluate(url, heldout, http, args.eval_repeats, args.concurrency)
            print(f"held-out before: mean reward {before:.3f} over {len(heldout) * args.eval_repeats} episodes")
            trainer = GRPOTrainer(model, tokenizer, TrainerConfig(lr=args.lr, epochs=args.epochs,
                                                                  batch_groups=args.batch_groups, mode="sync"),
                                  push_urls=[settings.backend_url])
            rng = random.Random(args.seed)
            gate = asyncio.Semaphore(args.concurrency)

            async def member(gid: str, index: int, bits: str) -> None:
                async with gate:
                    await play(url, bits, http, group=(gid, index, args.group_size), seed=rng.getrandbits(30))

            async def drive(stop: asyncio.Event) -> None:
                for _ in range(args.steps):
                    version = trainer.version
                    plays = []
                    for _ in range(args.batch_groups):
                        gid, bits = f"g-{uuid.uuid4().hex[:12]}", rng.choice(train)
                        plays += [member(gid, i, bits) for i in range(args.group_size)]
                    await asyncio.gather(*plays)
                    while trainer.version == version and not stop.is_set():
                        await asyncio.sleep(0.1)

            print(f"{'step':>4} {'version':>7} {'reward':>7} {'samples':>7} {'entropy':>7} {'grad':>7} {'elapsed':>8}")
            stop = asyncio.Event()
            async with TrajectoryStream(settings.nats_url, name="openenv-grpo") as stream:
                driver = asyncio.create_task(drive(stop))
                try:
                    await trainer.run(stream, steps=args.steps, on_step=lambda m: print(
                        f"{m.step:>4} {m.policy_version:>7} {m.mean_reward:>7.3f} {m.samples:>7} {m.entropy:>7.3f} "
                        f"{m.grad_norm:>7.3f} {time.monotonic() - t0:>7.0f}s", flush=True), metrics_url=settings.trajectory_url,
                        run_name="openenv-grpo")
                finally:
                    stop.set()
                    await asyncio.gather(driver, return_exceptions=True)
            after = await evaluate(url, heldout, http, args.eval_repeats, args.concurrency)
            print(f"held-out after:  mean reward {after:.3f} over {len(heldout) * args.eval_repeats} episodes; "
                  f"{time.monotonic() - t0:.0f}s")
        print(f"RESULT held-out mean reward: start {before:.3f} -> end {after:.3f}")
        return 0 if after > before + args.min_gain else 1
    finally:
        if server is not None:
            server.stop()
        stack.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--eval-items", type=int, default=30, help="held-out bit strings evaluated")
    p.add_argument("--eval-repeats", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-gain", type=float, default=0.15, help="exit 1 unless held-out reward rises this much")
    p.add_argument("--data-dir", default=".arena-openenv-grpo")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    raise SystemExit(asyncio.run(demo(p.parse_args())))


if __name__ == "__main__":
    main()
