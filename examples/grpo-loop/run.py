"""``make demo-rl``: a tiny transformer learns, from scratch, through the real Arena stack.

Starts nats-server and the four services (``arena_stack.stack.Stack``), a policy server
(``python -m arena_rl.policy_server``) registered in ``arena_backends`` and set as
``ARENA_BACKEND_URL``, then: held-out evaluation -> GRPO steps (rollouts, proxy capture,
sandbox, verification, trajectory stream, weight push) -> held-out evaluation; writes a
checkpoint, reloads it, prints the curve. Everything is stopped by PID on exit.

    .venv/bin/python examples/grpo-loop/run.py [--steps 40] [--mode sync|async] [--data-dir .arena-rl]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from arena_stack.natsserver import free_port, wait_port
from arena_rl.loop import LoopConfig, evaluate, run_loop
from arena_rl.model import load_checkpoint, new_policy, save_checkpoint
from arena_rl.tasks import ALPHABET, majority_family
from arena_rl.tokenizer import CharTokenizer
from arena_rl.trainer import GRPOTrainer, TrainerConfig
from arena.sdk import ArenaClient
from arena_core.settings import Settings
from arena_stack.stack import Child, Stack


def start_policy_server(checkpoint: Path, port: int, nats_url: str, log_path: Path) -> Child:
    """The policy server as a child that dies with this process (``arena_stack.stack.Child``)."""
    child = Child("policy-server", [sys.executable, "-m", "arena_rl.policy_server", "--checkpoint", str(checkpoint),
                                    "--port", str(port), "--nats-url", nats_url, "--replica-id", "policy-demo"],
                  dict(os.environ), log_path)
    child.start()
    wait_port("127.0.0.1", port, 60, child.proc)
    return child


async def demo(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    data = Path(args.data_dir).resolve()
    if data.exists():
        shutil.rmtree(data)
    data.mkdir(parents=True)
    policy_port = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{policy_port}/v1",
                        sandbox_concurrency=args.concurrency, verify_concurrency=max(2, args.concurrency // 2))
    tokenizer = CharTokenizer(alphabet=ALPHABET)
    model = new_policy(tokenizer, seed=args.seed, d_model=32, n_layers=1, n_heads=4, max_len=16)
    init_ckpt = save_checkpoint(data / "policy-v0.pt", model, tokenizer, 0)
    train, heldout = majority_family(seed=args.seed)
    stack = Stack(settings, log=lambda m: print("  " + m))
    server = None
    try:
        await stack.start()
        settings = stack.settings  # its NATS URL carries the administrator's credentials
        os.environ["ARENA_API_KEY"] = stack.api_key or ""  # what the client and the trainer send
        server = start_policy_server(init_ckpt, policy_port, settings.nats_url, data / "logs" / "policy-server.log")
        print(f"  policy server   {settings.backend_url} (pid {server.pid}, version 0)")
        config = TrainerConfig(lr=args.lr, epochs=args.epochs, batch_groups=args.batch_groups, mode=args.mode)
        trainer = GRPOTrainer(model, tokenizer, config, push_urls=[settings.backend_url])
        with ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120) as client:
            t0 = time.monotonic()
            before = await asyncio.to_thread(evaluate, client, heldout, repeats=args.eval_repeats)
            print(f"held-out before: mean reward {before.mean_reward:.3f} over {before.n} rollouts "
                  f"(policy {before.policy_versions}, states {before.states})")
            print(f"{'step':>4} {'version':>7} {'reward':>7} {'loss':>8} {'clip':>6} {'kl':>7} {'stale':>5} "
                  f"{'tok/s':>8} {'elapsed':>8}")

            def show(m):
                print(f"{m.step:>4} {m.policy_version:>7} {m.mean_reward:>7.3f} {m.loss:>8.4f} {m.clip_fraction:>6.3f} "
                      f"{m.kl:>7.4f} {m.staleness_mean:>5.1f} {m.tokens_per_s:>8.0f} {time.monotonic() - t0:>7.0f}s",
                      flush=True)

            await run_loop(client=client, trainer=trainer, nats_url=settings.nats_url, train_items=train,
                           config=LoopConfig(steps=args.steps, group_size=args.group_size, seed=args.seed),
                           metrics_path=str(data / "metrics.jsonl"), on_step=show,
                           metrics_url=settings.trajectory_url)
            after = await asyncio.to_thread(evaluate, client, heldout, repeats=args.eval_repeats)
            print(f"held-out after:  mean reward {after.mean_reward:.3f} over {after.n} rollouts "
                  f"(policy {after.policy_versions}, states {after.states})")
        ckpt = trainer.checkpoint(data / f"policy-v{trainer.version}.pt")
        _, _, version = load_checkpoint(ckpt)
        print(f"checkpoint {ckpt} (reloaded: version {version}); metrics {data / 'metrics.jsonl'}; "
              f"{time.monotonic() - t0:.0f}s")
        print(f"RESULT held-out mean reward: start {before.mean_reward:.3f} -> end {after.mean_reward:.3f}")
        return 0 if after.mean_reward > before.mean_reward + args.min_gain else 1
    finally:
        if server is not None:
            server.stop()
        stack.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("RL_STEPS", "40")))
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--batch-groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--eval-repeats", type=int, default=2, help="rollouts per held-out prompt")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-gain", type=float, default=0.15, help="exit 1 unless held-out reward rises this much")
    p.add_argument("--data-dir", default=".arena-rl")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # clean up on TERM
    raise SystemExit(asyncio.run(demo(p.parse_args())))


if __name__ == "__main__":
    main()
