"""GRPO, Dr. GRPO, GSPO and PPO with LoRA on a real language model, from Arena's groups.

Trains on each trajectory's training sequences (the tokens the server sampled, their
logprobs, the loss mask), pushes the adapter to the policy servers under a new policy
version, and reports loss, KL to the reference, entropy, grad norm, learning rate and the
policy age of every consumed token. docs/rl.md ("The LoRA trainer").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

import httpx
import msgspec
import torch

from arena_core.grpo import group_advantages
from arena_core.schemas import GroupCompleted, TrainingSequence, Trajectory
from arena_core.sequences import sequences_of
from arena_rl.lm import LanguageModel
from arena_rl.loss import Variant, entropy, gae, pad, policy_loss, value_loss
from arena_rl.policy_server import VERSION_HEADER
from arena_rl.trainer import post_logprobs

log = logging.getLogger("arena_rl.lm_trainer")


class LMTrainerConfig(msgspec.Struct, frozen=True, kw_only=True):
    loss: Variant = "grpo"
    lr: float = 2e-4
    epochs: int = 1  # optimiser passes over each batch
    clip_eps: float = 0.2  # GSPO: use ~3e-4 (its ratio is a per-token geometric mean)
    clip_eps_high: float | None = None
    kl_coef: float = 0.0  # > 0: KL to the reference (the adapter off) in the loss; always reported
    normalize_std: bool = True  # GRPO's advantage divided by the group's std (Dr. GRPO never does)
    max_tokens: int | None = None  # Dr. GRPO's constant normaliser (the generation budget)
    batch_groups: int = 2
    micro_batch: int = 4  # sequences per forward pass (gradients accumulate over a batch)
    max_staleness: int | None = None  # sequences sampled more versions ago than this are dropped
    critic: Literal["value_head", "critic"] = "value_head"  # PPO: a head on the policy, or its own net
    value_coef: float = 0.5
    whiten: bool = True  # PPO: advantages to zero mean and unit std over a micro-batch's policy tokens
    gamma: float = 1.0
    lam: float = 0.95
    grad_clip: float = 1.0


class Row(msgspec.Struct, kw_only=True):
    """One training sequence of one trajectory."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float
    advantage: float  # group-relative (GRPO family); PPO computes its own per token
    ages: list[int]  # the policy age of each policy token (trainer version - the version that sampled it)
    rollout_id: str = ""
    sequence_index: int = 0  # in ``Trajectory.sequences``


class LMStepMetrics(msgspec.Struct, kw_only=True):
    step: int
    policy_version: int
    loss_kind: str
    groups: int
    sequences: int
    tokens: int
    mean_reward: float
    loss: float
    pg_loss: float
    kl: float
    entropy: float
    grad_norm: float
    lr: float
    clip_fraction: float
    value_loss: float
    staleness_mean: float  # over consumed tokens
    staleness_max: int
    dropped_stale: int
    skipped_uniform_groups: int
    train_s: float
    push_s: float
    at: float


class _Critic(torch.nn.Module):
    """PPO's value function: a head on the policy's last hidden state (``value_head``) or a
    small network of its own on the reference model's (``critic``: the policy untouched)."""

    def __init__(self, hidden: int, kind: str):
        super().__init__()
        self.kind = kind
        self.net = torch.nn.Linear(hidden, 1) if kind == "value_head" else torch.nn.Sequential(
            torch.nn.Linear(hidden, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
        torch.nn.init.zeros_(self.net.weight if kind == "value_head" else self.net[-1].weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net(hidden).squeeze(-1)


def rows_from_groups(groups: list[GroupCompleted], *, version: int, loss: Variant,
                     normalize_std: bool = True) -> tuple[list[Row], int, list[float]]:
    """(rows, groups skipped for uniform rewards, rewards). PPO keeps uniform groups (its
    critic's baseline still gives a signal); the GRPO family skips them."""
    rows, skipped, rewards = [], 0, []
    for group in groups:
        # a trajectory read raw off the stream carries no sequences: assembled from its steps
        group_sequences = {t.rollout_id: sequences_of(t)[0] for t in group.trajectories}
        members = [t for t in group.trajectories if t.reward is not None and group_sequences[t.rollout_id]]
        group_rewards = [float(t.reward) for t in members]
        rewards.extend(group_rewards)
        advantages = group_advantages(group_rewards, normalize_std=normalize_std and loss == "grpo") \
            if members else []
        if loss != "ppo" and not any(advantages):
            skipped += 1
            continue
        for trajectory, advantage in zip(members, advantages or [0.0] * len(members), strict=True):
            for index, seq in enumerate(group_sequences[trajectory.rollout_id]):
                ages = [version - v for v in token_versions(trajectory, seq)] or [0]
                rows.append(Row(token_ids=list(seq.token_ids), loss_mask=list(seq.loss_mask),
                                logprobs=list(seq.logprobs), reward=float(trajectory.reward),
                                advantage=advantage, ages=ages, rollout_id=trajectory.rollout_id,
                                sequence_index=index))
    return rows, skipped, rewards


class LMTrainer:
    def __init__(self, lm: LanguageModel, config: LMTrainerConfig, *, version: int = 0, push_urls: list[str] = ()):
        self.lm = lm
        self.config = config
        self.version = version
        self.push_urls = list(push_urls)
        self.step = 0
        #: (rollout_id, sequence_index, logprob of every token) of the last step, before its update
        self.trainer_logprobs: list[tuple[str, int, list[float]]] = []
        self.critic = _Critic(lm.model.config.hidden_size, config.critic) if config.loss == "ppo" else None
        params = [p for p in lm.model.parameters() if p.requires_grad]
        if self.critic is not None:
            params += list(self.critic.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)

    # ----------------------------------------------------------------- one batch

    def _forward(self, rows: list[Row]):
        """Logprobs of each next token, the logits, the mask and the values for ``rows``."""
        width = max(len(r.token_ids) for r in rows)
        ids = torch.full((len(rows), width), self.lm.pad_id, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.token_ids)] = torch.tensor(r.token_ids)
            attention[i, : len(r.token_ids)] = 1
        want_hidden = self.critic is not None and self.critic.kind == "value_head"
        out = self.lm.model(input_ids=ids, attention_mask=attention, output_hidden_states=want_hidden)
        logits = out.logits[:, :-1].float()
        new = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask, _ = pad([torch.tensor(r.loss_mask[1:], dtype=torch.float32) for r in rows])
        old, _ = pad([torch.tensor(r.logprobs[1:]) for r in rows])
        mask = torch.nn.functional.pad(mask, (0, new.shape[1] - mask.shape[1]))
        old = torch.nn.functional.pad(old, (0, new.shape[1] - old.shape[1]))
        with torch.no_grad(), self.lm.model.disable_adapter():
            ref_out = self.lm.model(input_ids=ids, attention_mask=attention,
                                    output_hidden_states=self.critic is not None and not want_hidden)
            ref = torch.log_softmax(ref_out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        values = None
        if self.critic is not None:
            hidden = out.hidden_states[-1] if want_hidden else ref_out.hidden_states[-1]
            values = self.critic(hidden[:, :-1].float())
        return new, old, ref, mask, logits, values

    def train_on(self, rows: list[Row]) -> dict[str, float]:
        cfg = self.config
        out = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0, "clip_fraction": 0.0,
               "value_loss": 0.0, "tokens": 0}
        self.trainer_logprobs = []
        if not rows:
            return out
        self.lm.model.train()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for epoch in range(cfg.epochs):
            self.optimizer.zero_grad()
            sums = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", "clip_fraction", "value_loss"), 0.0)
            for start in range(0, len(rows), cfg.micro_batch):
                part = rows[start: start + cfg.micro_batch]
                share = len(part) / len(rows)
                new, old, ref, mask, logits, values = self._forward(part)
                if epoch == 0:
                    self.trainer_logprobs += [(r.rollout_id, r.sequence_index,
                                               [0.0, *lp[: len(r.token_ids) - 1].clamp(min=-1e30).tolist()])
                                              for r, lp in zip(part, new.detach(), strict=True)]
                if cfg.loss == "ppo":
                    rewards = torch.zeros_like(mask)
                    for i, r in enumerate(part):  # the reward on each sequence's last policy token
                        last = torch.nonzero(mask[i] > 0).flatten()
                        if len(last):
                            rewards[i, last[-1]] = r.reward
                    old_values = values.detach()
                    adv, returns = gae(rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.lam)
                    if cfg.whiten and mask.sum() > 1:
                        mean = (adv * mask).sum() / mask.sum()
                        std = (((adv - mean) ** 2 * mask).sum() / mask.sum()).sqrt()
                        adv = (adv - mean) / (std + 1e-6) * mask
                    v_loss = value_loss(values, old_values, returns, mask)
                else:
                    adv = torch.tensor([r.advantage for r in part])[:, None].expand_as(mask)
                    v_loss = torch.zeros(())
                result = policy_loss(new, old, adv, mask, variant=cfg.loss, ref_logprobs=ref, kl_coef=cfg.kl_coef,
                                     clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, max_tokens=cfg.max_tokens)
                total = result.loss + cfg.value_coef * v_loss
                (total * share).backward()
                with torch.no_grad():
                    ent = float(entropy(logits, mask))
                for key, value in (("loss", float(total.detach())), ("pg_loss", result.pg_loss), ("kl", result.kl),
                                   ("entropy", ent), ("clip_fraction", result.clip_fraction),
                                   ("value_loss", float(v_loss.detach()))):
                    sums[key] += value * share
                out["tokens"] += result.tokens if epoch == 0 else 0
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            self.optimizer.step()
            if epoch == 0:  # the first pass: the policy that sampled
                out.update(sums, grad_norm=float(norm))
        self.lm.model.eval()
        return out

    # ----------------------------------------------------------------- the step

    async def push(self, http: httpx.AsyncClient) -> None:
        """The adapter to every policy server, as version ``self.version``."""
        blob = await asyncio.to_thread(self.lm.adapter_blob)

        async def one(url: str) -> None:
            resp = await http.post(url.rstrip("/") + "/weights", content=blob,
                                   headers={VERSION_HEADER: str(self.version),
                                            "content-type": "application/octet-stream"})
            if resp.status_code != 200 or resp.json().get("policy_version") != str(self.version):
                raise RuntimeError(f"adapter push to {url} failed: {resp.status_code} {resp.text[:300]}")

        await asyncio.gather(*(one(u) for u in self.push_urls))

    async def train_step(self, groups: list[GroupCompleted], http: httpx.AsyncClient, *,
                         trajectory_url: str | None = None, run: str = "lora") -> LMStepMetrics:
        """One step; with ``trajectory_url``, the trainer's logprobs of each sequence are posted
        there under ``run`` (best effort, ``arena_rl.trainer.post_logprobs``)."""
        cfg = self.config
        rows, skipped, rewards = rows_from_groups(groups, version=self.version, loss=cfg.loss,
                                                  normalize_std=cfg.normalize_std)
        dropped = 0
        if cfg.max_staleness is not None:
            fresh = [r for r in rows if max(r.ages) <= cfg.max_staleness]
            dropped, rows = len(rows) - len(fresh), fresh
        ages = [age for r in rows for age in r.ages]
        started = time.monotonic()
        losses = await asyncio.to_thread(self.train_on, rows)
        train_s = time.monotonic() - started
        self.version += 1
        pushed = time.monotonic()
        await self.push(http)
        if trajectory_url and self.trainer_logprobs:
            await post_logprobs(http, trajectory_url, run, str(self.version - 1), self.trainer_logprobs)
        self.step += 1
        return LMStepMetrics(
            step=self.step, policy_version=self.version, loss_kind=cfg.loss, groups=len(groups), sequences=len(rows),
            tokens=int(losses["tokens"]), mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
            loss=losses["loss"], pg_loss=losses["pg_loss"], kl=losses["kl"], entropy=losses["entropy"],
            grad_norm=losses["grad_norm"], lr=self.optimizer.param_groups[0]["lr"],
            clip_fraction=losses["clip_fraction"], value_loss=losses["value_loss"],
            staleness_mean=sum(ages) / len(ages) if ages else 0.0, staleness_max=max(ages, default=0),
            dropped_stale=dropped, skipped_uniform_groups=skipped, train_s=train_s,
            push_s=time.monotonic() - pushed, at=time.time())


def token_versions(trajectory: Trajectory, seq: TrainingSequence) -> list[int]:
    """The policy version that sampled each policy token of ``seq`` (a partial rollout's step
    has several: ``Step.policy_spans``); unknown versions count as 0."""
    steps = {s.step_index: s for s in trajectory.steps}
    out: list[int] = []
    for index, step_version in zip(seq.step_indexes, seq.policy_versions, strict=False):
        step = steps.get(index)
        n = len(step.completion_token_ids or []) if step is not None else 0
        spans = [(span.start, _int(span.version)) for span in step.policy_spans] if step is not None else []
        if not spans:
            spans = [(0, _int(step_version))]
        for k in range(n):  # the latest span that started at or before token k
            out.append(max((span for span in spans if span[0] <= k), default=spans[0])[1])
    masked = sum(seq.loss_mask)
    if len(out) != masked:  # steps and sequence disagree: the oldest version for every token
        oldest = min((_int(v) for v in seq.policy_versions), default=0)
        out = [oldest] * masked
    return out


def _int(version: str | None) -> int:
    return int(version) if version and version.isdigit() else 0
