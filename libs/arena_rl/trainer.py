"""GRPO on Arena's trajectory stream: batches of complete groups in, new weights out.

``GRPOTrainer`` trains on the captured token ids and logprobs of each batch, bumps the version and
pushes the weights to policy servers (and, through :mod:`arena_rl.vllm_sync`, vLLM replicas);
``sync`` or ``async`` mode, metrics per step. See docs/rl.md (Trainer).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import httpx
import msgspec
import torch

from arena_core.apikeys import auth_headers
from arena_core.grpo import group_advantages
from arena_rl.loss import grpo_loss, pad
from arena_rl.model import PolicyModel, completion_entropy, completion_logprobs, save_checkpoint, to_blob
from arena_rl.tokenizer import CharTokenizer
from arena_core.schemas import GroupCompleted, TrainerMetrics, Trajectory
from arena_core.sequences import sequences_of

if TYPE_CHECKING:
    from arena.trackers import Tracker

log = logging.getLogger("arena_rl.trainer")


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True):
    lr: float = 3e-3
    epochs: int = 4  # optimiser passes over each batch (PPO-style reuse; the clip keeps it near)
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0 keeps a frozen copy of the initial policy as the KL reference
    aggregation: Literal["sequence", "token"] = "sequence"
    normalize_std: bool = True
    batch_groups: int = 8
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 2  # async mode
    grad_clip: float = 1.0


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    reward: float
    policy_version: int | None


class BatchInfo(msgspec.Struct, kw_only=True):
    samples: list[Sample]
    groups: int
    trajectories: int
    rewards: list[float]
    skipped_uniform_groups: int = 0
    skipped_steps_without_ids: int = 0


class StepMetrics(msgspec.Struct, kw_only=True):
    step: int
    policy_version: int
    groups: int
    trajectories: int
    samples: int
    tokens: int
    mean_reward: float
    loss: float
    pg_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    entropy: float  # the sampling policy's mean token entropy over the batch (nats)
    grad_norm: float  # the first pass's gradient norm, before clipping
    lr: float
    tokens_per_s: float
    staleness_mean: float
    staleness_max: int
    skipped_uniform_groups: int
    skipped_steps_without_ids: int
    train_s: float
    push_s: float
    at: float


def _version(raw: str | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def samples_from_groups(groups: list[GroupCompleted], *, normalize_std: bool = True) -> BatchInfo:
    """Flatten groups into per-LLM-call samples carrying their trajectory's advantage.

    A group whose rewards are all equal has zero advantage everywhere and is skipped;
    a step without backend token ids (``token_ids_source == "unavailable"``) cannot be
    trained on and is skipped and counted, never re-tokenised."""
    info = BatchInfo(samples=[], groups=len(groups), trajectories=0, rewards=[])
    for group in groups:
        # infrastructure outcomes (no reward) are no evidence about the policy: left out
        members = [t for t in group.trajectories if t.reward is not None]
        rewards = [t.reward for t in members]
        info.rewards.extend(rewards)
        info.trajectories += len(members)
        advantages = group_advantages(rewards, normalize_std=normalize_std) if rewards else []
        if not any(advantages):
            info.skipped_uniform_groups += 1
            continue
        for trajectory, advantage in zip(members, advantages, strict=True):
            for step in trajectory.steps:
                if (step.token_ids_source != "backend" or step.prompt_token_ids is None
                        or not step.completion_token_ids or step.logprobs is None
                        or len(step.logprobs) != len(step.completion_token_ids)):
                    info.skipped_steps_without_ids += 1
                    continue
                info.samples.append(Sample(prompt_ids=list(step.prompt_token_ids),
                                           completion_ids=list(step.completion_token_ids),
                                           old_logprobs=list(step.logprobs), advantage=advantage,
                                           reward=trajectory.reward, policy_version=_version(step.policy_version)))
    return info


@dataclass
class _Losses:
    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    ratio_mean: float = 0.0
    entropy: float = 0.0
    grad_norm: float = 0.0
    tokens: int = 0


class GRPOTrainer:
    def __init__(self, model: PolicyModel, tokenizer: CharTokenizer, config: TrainerConfig, *,
                 version: int = 0, push_urls: list[str] = (),
                 extra_push: list[Callable[[bytes, int], Awaitable[None]]] = ()):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.version = version
        self.push_urls = list(push_urls)
        self.extra_push = list(extra_push)
        self.step = 0
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        self.reference = None
        if config.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)

    # ----------------------------------------------------------------- pure training

    def train_on(self, info: BatchInfo) -> _Losses:
        """``epochs`` optimiser passes over the samples, then the version is bumped: the
        version counts trainer steps (a step whose groups all had uniform rewards changes
        no weight but still publishes the next version, so versions and steps agree)."""
        out = _Losses()
        if not info.samples:
            self.version += 1
            return out
        cfg = self.config
        prompts = [s.prompt_ids for s in info.samples]
        completions = [s.completion_ids for s in info.samples]
        old, mask = pad([torch.tensor(s.old_logprobs) for s in info.samples])
        adv = torch.tensor([s.advantage for s in info.samples])
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref, _ = pad(completion_logprobs(self.reference, prompts, completions))
        entropy = completion_entropy(self.model, prompts, completions)  # of the policy that sampled
        self.model.train()
        for epoch in range(cfg.epochs):
            new, _ = pad(completion_logprobs(self.model, prompts, completions))
            result = grpo_loss(new, old, adv, mask, ref_logprobs=ref, clip_eps=cfg.clip_eps,
                               kl_coef=cfg.kl_coef, aggregation=cfg.aggregation)
            self.optimizer.zero_grad()
            result.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            if epoch == 0:  # first pass: loss, KL and ratio of the policy that sampled
                out = _Losses(loss=float(result.loss.detach()), pg_loss=result.pg_loss, kl=result.kl,
                              clip_fraction=result.clip_fraction, ratio_mean=result.ratio_mean,
                              entropy=entropy, grad_norm=float(grad_norm), tokens=result.tokens)
            else:
                out.clip_fraction = max(out.clip_fraction, result.clip_fraction)  # the most clipped pass
        self.model.eval()
        self.version += 1
        return out

    def checkpoint(self, path: str | Path) -> Path:
        return save_checkpoint(path, self.model, self.tokenizer, self.version)

    # ----------------------------------------------------------------- weights out

    async def push(self, http: httpx.AsyncClient) -> None:
        """Send the current weights to every policy server (and the extra sinks)."""
        blob = to_blob(self.model, self.tokenizer, self.version)

        async def one(url: str) -> None:
            resp = await http.post(url.rstrip("/") + "/weights", content=blob,
                                   headers={"Content-Type": "application/octet-stream"})
            if resp.status_code != 200:
                raise RuntimeError(f"weight push to {url} failed: {resp.status_code} {resp.text[:300]}")
            served = resp.json().get("policy_version")
            if served != str(self.version):
                raise RuntimeError(f"{url} serves version {served} after the push of {self.version}")

        await asyncio.gather(*(one(u) for u in self.push_urls), *(sink(blob, self.version) for sink in self.extra_push))

    # ----------------------------------------------------------------- the loop

    async def train_step(self, groups: list[GroupCompleted], http: httpx.AsyncClient) -> StepMetrics:
        info = samples_from_groups(groups, normalize_std=self.config.normalize_std)
        trained_from = self.version
        started = time.monotonic()
        losses = await asyncio.to_thread(self.train_on, info)
        train_s = time.monotonic() - started
        push_started = time.monotonic()
        await self.push(http)
        push_s = time.monotonic() - push_started
        versions = [s.policy_version for s in info.samples if s.policy_version is not None]
        stale = [trained_from - v for v in versions]
        self.step += 1
        tokens = sum(len(s.completion_ids) for s in info.samples)
        return StepMetrics(
            step=self.step, policy_version=self.version, groups=info.groups, trajectories=info.trajectories,
            samples=len(info.samples), tokens=tokens,
            mean_reward=sum(info.rewards) / len(info.rewards) if info.rewards else 0.0,
            loss=losses.loss, pg_loss=losses.pg_loss, kl=losses.kl, clip_fraction=losses.clip_fraction,
            ratio_mean=losses.ratio_mean, entropy=losses.entropy, grad_norm=losses.grad_norm,
            lr=self.optimizer.param_groups[0]["lr"], tokens_per_s=tokens * max(self.config.epochs, 1) / max(train_s, 1e-9),
            staleness_mean=sum(stale) / len(stale) if stale else 0.0, staleness_max=max(stale, default=0),
            skipped_uniform_groups=info.skipped_uniform_groups,
            skipped_steps_without_ids=info.skipped_steps_without_ids,
            train_s=train_s, push_s=push_s, at=time.time())

    async def run(self, stream, *, steps: int, metrics_path: str | Path | None = None,
                  accept: Callable[[GroupCompleted], bool] = lambda g: True,
                  on_step: Callable[[StepMetrics], None] | None = None,
                  metrics_url: str | None = None, run_name: str = "grpo",
                  tracker: Tracker | None = None) -> list[StepMetrics]:
        """Train ``steps`` steps of ``batch_groups`` groups from ``stream`` (a
        :class:`arena.stream.TrajectoryStream`); groups ``accept`` rejects (held-out
        evaluation) are committed without training. Groups are committed after the step
        that used them, so a crash mid-step trains on them again after a restart. With
        ``metrics_url`` (the trajectory service) each step's metrics are posted there, and the
        trainer's logprobs of every sequence it trained on (``post_logprobs``). With ``tracker``
        (:mod:`arena.trackers`: W&B, MLflow, TensorBoard) each step's metrics are logged to it at the
        step's number (the same figures as posted); the caller closes it."""
        history: list[StepMetrics] = []
        buffer: list[GroupCompleted] = []
        handles = []
        path = Path(metrics_path) if metrics_path else None
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
        async with httpx.AsyncClient(timeout=60.0) as http:
            async for batch in stream.groups(batch_size=self.config.batch_groups, max_wait=0.5):
                handles.append(batch)
                buffer.extend(g for g in batch.groups if accept(g))
                if len(buffer) < self.config.batch_groups:
                    continue
                take, buffer = buffer[: self.config.batch_groups], buffer[self.config.batch_groups:]
                if metrics_url:  # the weights that sampled (on-policy), before this step changes them
                    computed_by = str(self.version)
                    logprobs = await asyncio.to_thread(trainer_logprobs, self.model, trained_members(take))
                metrics = await self.train_step(take, http)
                if not buffer:  # a batch is committed once every group it brought was trained on
                    for handle in handles:
                        await handle.commit()
                    handles = []
                history.append(metrics)
                if path:
                    with path.open("ab") as f:
                        f.write(msgspec.json.encode(metrics) + b"\n")
                if tracker is not None:
                    await asyncio.to_thread(tracker.log, metric_values(metrics), metrics.step)
                if metrics_url:
                    await post_metrics(http, metrics_url, run_name, metrics)
                    await post_logprobs(http, metrics_url, run_name, computed_by, logprobs)
                if on_step is not None:
                    on_step(metrics)
                log.info("step %d: version %d, reward %.3f, loss %.4f, clip %.3f, staleness %.1f",
                         metrics.step, metrics.policy_version, metrics.mean_reward, metrics.loss,
                         metrics.clip_fraction, metrics.staleness_mean)
                if len(history) >= steps:
                    break
        return history


#: Figures of an optimiser pass: a step that trained on nothing (every group uniform) has none,
#: rather than zeros that would read as a converged loss.
_TRAINING_ONLY = frozenset({"loss", "pg_loss", "kl", "clip_fraction", "ratio_mean", "entropy", "grad_norm",
                            "tokens_per_s"})


def metric_values(metrics: StepMetrics) -> dict[str, float]:
    """A step's figures by name (``step`` and ``at`` apart); a step that trained on nothing has
    none of the optimiser's (``_TRAINING_ONLY``)."""
    return {k: float(v) for k, v in msgspec.structs.asdict(metrics).items()
            if isinstance(v, (int, float)) and k not in ("step", "at")
            and not (metrics.samples == 0 and k in _TRAINING_ONLY)}


async def post_metrics(http: httpx.AsyncClient, url: str, run: str, metrics: StepMetrics) -> None:
    """Send one step's metrics to the trajectory service. A failure is logged, never
    fatal: the JSONL file is the record, the service feeds the dashboard."""
    values = metric_values(metrics)
    body = TrainerMetrics(run=run, step=metrics.step, at=metrics.at, policy_version=str(metrics.policy_version),
                          metrics=values)
    try:
        resp = await http.post(url.rstrip("/") + "/v1/trainer-metrics", content=msgspec.json.encode(body),
                               headers={"content-type": "application/json", **auth_headers()})
        if resp.status_code >= 400:
            log.warning("trajectory service refused metrics of step %d: %s", metrics.step, resp.text[:300])
    except httpx.HTTPError as exc:
        log.warning("could not send metrics of step %d to %s: %s", metrics.step, url, exc)


def trained_members(groups: list[GroupCompleted], *, normalize_std: bool = True) -> list[Trajectory]:
    """The trajectories a GRPO step learns from: rewarded members of groups whose rewards differ."""
    out = []
    for group in groups:
        members = [t for t in group.trajectories if t.reward is not None]
        if any(group_advantages([t.reward for t in members], normalize_std=normalize_std) if members else []):
            out.extend(members)
    return out


def trainer_logprobs(model: PolicyModel, trajectories: list[Trajectory]) -> list[tuple[str, int, list[float]]]:
    """``(rollout_id, sequence_index, logprobs)`` for each training sequence: the model's logprob
    of every token given the tokens before it (0.0 for the first), in one forward pass, to set
    beside the logprobs the server sampled with. Sequences over the model's context are left out."""
    items = [(t.rollout_id, i, list(seq.token_ids)) for t in trajectories for i, seq in enumerate(sequences_of(t)[0])
             if 1 < len(seq.token_ids) <= model.cfg.max_len]
    if not items:
        return []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        rows = completion_logprobs(model, [ids[:1] for _, _, ids in items], [ids[1:] for _, _, ids in items])
    model.train(was_training)
    # a token the model cannot produce (a special id) is -inf, which JSON cannot carry: -1e30
    return [(rid, i, [0.0, *row.clamp(min=-1e30).tolist()]) for (rid, i, _), row in zip(items, rows, strict=True)]


async def post_logprobs(http: httpx.AsyncClient, url: str, run: str, policy_version: str,
                        rows: list[tuple[str, int, list[float]]]) -> None:
    """Send each sequence's trainer logprobs (``POST /v1/trainer-logprobs``), concurrently.
    Failures are logged (one line per step), never fatal: they only feed the dashboard."""
    async def one(rollout_id: str, index: int, logprobs: list[float]) -> str | None:
        body = {"run": run, "policy_version": policy_version, "rollout_id": rollout_id, "sequence_index": index,
                "logprobs": logprobs}
        try:
            resp = await http.post(url.rstrip("/") + "/v1/trainer-logprobs", content=msgspec.json.encode(body),
                                   headers={"content-type": "application/json", **auth_headers()})
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return f"{resp.status_code} {resp.text[:200]}" if resp.status_code >= 400 else None

    problems = [p for p in await asyncio.gather(*(one(*row) for row in rows)) if p]
    if problems:
        log.warning("%d of %d trainer logprob posts to %s failed; the first: %s", len(problems), len(rows), url,
                    problems[0])
