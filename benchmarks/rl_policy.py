"""RL pieces without the stack: policy-server batching throughput, trainer step speed, and
the demo task's learning curve with an in-process reward (same model, sampler, loss and
trainer as ``make demo-rl``; only the sandbox/verification round trip is replaced).

    .venv/bin/python benchmarks/rl_policy.py [--steps 40]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch

from arena_core.grpo import group_advantages
from arena_rl.generate import GenRequest
from arena_rl.model import new_policy
from arena_rl.openai_api import CharEngine
from arena_rl.policy_server import Policy, PolicyServer
from arena_rl.tasks import ALPHABET, majority, majority_family
from arena_rl.tokenizer import CharTokenizer
from arena_rl.trainer import BatchInfo, GRPOTrainer, Sample, TrainerConfig


async def serve_rate(server: PolicyServer, requests: list[GenRequest], concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(req):
        async with sem:
            await server.submit(req)

    started = time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    return len(requests) / (time.perf_counter() - started)


async def bench_server(tok: CharTokenizer) -> None:
    model = new_policy(tok, seed=0, d_model=32, n_layers=1, max_len=16).eval()
    prompt = tok.render_chat([{"role": "user", "content": "1011011"}])
    reqs = [GenRequest(prompt_ids=prompt, max_tokens=4, seed=i) for i in range(256)]
    print(f"{'policy server (in-process)':<34} {'concurrency':>11} {'req/s':>8}")
    for max_batch in (1, 32):
        server = PolicyServer(Policy(CharEngine(model, tok), 0), max_batch=max_batch, batch_wait_ms=2)
        await server.start()
        for conc in (1, 8, 32):
            rate = await serve_rate(server, reqs, conc)
            print(f"{'max_batch=' + str(max_batch):<34} {conc:>11} {rate:>8.0f}")
        await server.stop()


def learning_curve(tok: CharTokenizer, steps: int) -> None:
    train, heldout = majority_family()
    model = new_policy(tok, seed=0, d_model=32, n_layers=1, max_len=16)
    trainer = GRPOTrainer(model, tok, TrainerConfig(lr=2e-3, epochs=2, batch_groups=4))
    rng = random.Random(0)
    from arena_rl.generate import generate
    from arena_rl.model import completion_logprobs

    def p_correct(items):
        with torch.no_grad():
            lps = completion_logprobs(model, [tok.render_chat([{"role": "user", "content": s}]) for s in items],
                                      [tok.encode(majority(s)) for s in items])
        return float(torch.stack([lp.sum() for lp in lps]).exp().mean())

    print(f"\n{'step':>4} {'rollouts':>8} {'batch reward':>12} {'P(correct) train':>16} {'P(correct) held-out':>19} "
          f"{'train ms':>8}")
    for step in range(steps + 1):
        if step % 4 == 0:
            print(f"{step:>4} {step * 16:>8} {'':>12} {p_correct(train):>16.3f} {p_correct(heldout):>19.3f}")
        if step == steps:
            break
        batch = [rng.choice(train) for _ in range(4)]
        reqs = [GenRequest(prompt_ids=tok.render_chat([{"role": "user", "content": s}]), max_tokens=1,
                           seed=rng.getrandbits(30)) for s in batch for _ in range(4)]
        results = generate(model.eval(), reqs)
        info = BatchInfo(samples=[], groups=4, trajectories=16, rewards=[])
        for g, s in enumerate(batch):
            group = results[g * 4:(g + 1) * 4]
            rewards = [float(tok.decode(r.token_ids) == majority(s)) for r in group]
            info.rewards.extend(rewards)
            for r, req, adv in zip(group, reqs[g * 4:(g + 1) * 4], group_advantages(rewards), strict=True):
                if adv:
                    info.samples.append(Sample(prompt_ids=req.prompt_ids, completion_ids=r.token_ids,
                                               old_logprobs=r.logprobs, advantage=adv, reward=rewards[0],
                                               policy_version=trainer.version))
        started = time.perf_counter()
        trainer.train_on(info)
        if step % 4 == 3:
            print(f"{step + 1:>4} {(step + 1) * 16:>8} {sum(info.rewards) / 16:>12.3f} {'':>16} {'':>19} "
                  f"{(time.perf_counter() - started) * 1000:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = CharTokenizer(alphabet=ALPHABET)
    asyncio.run(bench_server(tok))
    learning_curve(tok, args.steps)


if __name__ == "__main__":
    main()
