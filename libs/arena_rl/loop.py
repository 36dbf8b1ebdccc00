"""The closed loop in one process: a rollout driver submitting groups to Arena's HTTP
API, a :class:`GRPOTrainer` reading the trajectory stream, and held-out evaluation
through the same stack. The policy server and the Arena stack run beside it.

``run_loop`` is what ``examples/grpo-loop/run.py`` (``make demo-rl``) and the
end-to-end test call.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import msgspec

from arena_rl.tasks import majority_task, is_heldout
from arena_rl.trainer import GRPOTrainer, StepMetrics
from arena_core.schemas import SamplingParams
from arena.sdk import ArenaClient
from arena.stream import TrajectoryStream

log = logging.getLogger("arena_rl.loop")


class LoopConfig(msgspec.Struct, frozen=True, kw_only=True):
    steps: int = 20
    group_size: int = 8
    temperature: float = 1.0
    async_inflight: int = 12  # async mode: groups submitted ahead of the trainer
    seed: int = 0


class EvalResult(msgspec.Struct, kw_only=True):
    policy_versions: list[str]
    mean_reward: float
    n: int
    states: dict[str, int]


def evaluate(client: ArenaClient, items: list[str], *, repeats: int = 1, seed: int = 12345,
             timeout: float = 600.0) -> EvalResult:
    """``repeats`` rollouts per held-out item (temperature 1, fixed seeds) through the
    stack; the mean reward (an attempt that ended unverified counts 0, an infrastructure outcome
    not at all). Blocking: call it with ``asyncio.to_thread``."""
    sampling = SamplingParams(temperature=1.0)
    ids = []
    for i, digits in enumerate([item for item in items for _ in range(repeats)]):
        s = msgspec.structs.replace(sampling, seed=seed + i)
        ids.append(client.submit(majority_task(digits, split="heldout"), sampling=s).rollout_id)
    rewards, states, versions = [], {}, set()
    for rid in ids:
        view = client.wait(rid, timeout=timeout)
        states[view.state.value] = states.get(view.state.value, 0) + 1
        if not view.infrastructure:  # Arena's fault: not the policy's score
            rewards.append(view.reward if view.reward is not None else 0.0)  # unverified: a failed attempt
    for rid in ids[:3]:
        try:
            versions.update(client.wait_trajectory(rid, timeout=30).policy_versions)
        except Exception:  # noqa: BLE001 - informational only
            pass
    return EvalResult(policy_versions=sorted(versions), mean_reward=sum(rewards) / max(len(rewards), 1),
                      n=len(rewards), states=states)


class Driver:
    """Submits training groups: in ``sync`` mode a batch per trainer version, waiting for
    the new version; in ``async`` mode continuously, ``async_inflight`` groups ahead."""

    def __init__(self, client: ArenaClient, trainer: GRPOTrainer, stream: TrajectoryStream, train_items: list[str],
                 config: LoopConfig):
        self.client, self.trainer, self.stream, self.config = client, trainer, stream, config
        self.items = train_items
        self.rng = random.Random(config.seed)
        self.submitted = 0

    def _submit_one(self) -> None:
        digits = self.rng.choice(self.items)
        sampling = SamplingParams(temperature=self.config.temperature)
        self.client.submit_group(majority_task(digits), n=self.config.group_size, seed=self.rng.getrandbits(30),
                                 sampling=sampling)
        self.submitted += 1

    async def run(self, stop: asyncio.Event) -> None:
        batch = self.trainer.config.batch_groups
        batches = 0  # sync: one batch per step, so exactly ``steps`` of them (the version moves
        # before the trainer's step counter does: waiting on the counter sent one batch too many)
        while not stop.is_set() and self.trainer.step < self.config.steps:
            if self.trainer.config.mode == "sync":
                if batches == self.config.steps:
                    return
                version = self.trainer.version
                for _ in range(batch):
                    await asyncio.to_thread(self._submit_one)
                batches += 1
                while self.trainer.version == version and not stop.is_set():
                    await asyncio.sleep(0.1)
            else:
                ahead = self.submitted - self.stream.stats.received
                if ahead < self.config.async_inflight:
                    await asyncio.to_thread(self._submit_one)
                else:
                    await asyncio.sleep(0.1)


async def run_loop(*, client: ArenaClient, trainer: GRPOTrainer, nats_url: str, train_items: list[str],
                   config: LoopConfig, metrics_path: str | None = None, stream_name: str = "grpo-loop",
                   on_step: Callable[[StepMetrics], None] | None = None,
                   metrics_url: str | None = None) -> list[StepMetrics]:
    """Drive rollouts and train ``config.steps`` steps; returns the per-step metrics."""
    cfg = trainer.config
    stream = TrajectoryStream(nats_url, name=stream_name,
                              max_staleness=cfg.max_staleness if cfg.mode == "async" else None,
                              current_policy_version=(lambda: trainer.version) if cfg.mode == "async" else None)
    stop = asyncio.Event()
    async with stream:
        driver = Driver(client, trainer, stream, train_items, config)
        task = asyncio.create_task(driver.run(stop))
        try:
            history = await trainer.run(stream, steps=config.steps, metrics_path=metrics_path,
                                        accept=lambda g: not is_heldout(g.task_id), on_step=on_step,
                                        metrics_url=metrics_url, run_name=stream_name)
        finally:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)
    return history

