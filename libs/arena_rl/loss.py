"""Policy-gradient losses (GRPO, Dr. GRPO, GSPO, PPO), GAE and the value loss: pure tensor math.

The formulas: docs/rl.md ("Losses").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class GRPOLoss:
    loss: torch.Tensor  # scalar, differentiable
    pg_loss: float  # the clipped term averaged over tokens (over sequences for GSPO), for reports
    kl: float  # mean k3 KL to the reference over tokens (0 without a reference)
    clip_fraction: float  # share of tokens whose ratio was clipped (in the direction that matters)
    ratio_mean: float
    tokens: int


def pad(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors to ``[N, T]``; returns ``(values, mask)``."""
    width = max((len(s) for s in seqs), default=0)
    values = torch.zeros(len(seqs), width, dtype=torch.float32)
    mask = torch.zeros(len(seqs), width, dtype=torch.float32)
    rows = []
    for i, s in enumerate(seqs):
        row = torch.cat([s.float(), s.new_zeros(width - len(s)).float()]) if len(s) < width else s.float()
        rows.append(row)
        mask[i, : len(s)] = 1.0
    if rows:
        values = torch.stack(rows)
    return values, mask


Variant = Literal["grpo", "dr_grpo", "gspo", "ppo"]


def grpo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    aggregation: Literal["sequence", "token"] = "sequence",
) -> GRPOLoss:
    """``new/old/ref_logprobs`` and ``mask``: ``[N, T]``; ``advantages``: ``[N]``."""
    if aggregation not in ("sequence", "token"):
        raise ValueError(f"unknown aggregation {aggregation!r}: use 'sequence' or 'token'")
    if advantages.shape != new_logprobs.shape[:1]:
        raise ValueError(f"advantages must be [N]={new_logprobs.shape[0]}, got {tuple(advantages.shape)}")
    return policy_loss(new_logprobs, old_logprobs, advantages.float()[:, None].expand_as(new_logprobs), mask,
                       variant="grpo" if aggregation == "sequence" else "ppo", ref_logprobs=ref_logprobs,
                       clip_eps=clip_eps, clip_eps_high=clip_eps_high, kl_coef=kl_coef)


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    variant: Variant = "grpo",
    ref_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    max_tokens: int | None = None,
) -> GRPOLoss:
    """The policy-gradient loss of one batch; every tensor ``[N, T]`` (``advantages`` per token).

    - ``grpo``: the token ratio clipped, averaged over each sequence, then over sequences;
    - ``dr_grpo``: the same terms summed and divided by a constant, ``N * max_tokens`` (the
      generation budget; ``T`` when not given): no length normalisation;
    - ``gspo``: one ratio per sequence, the geometric mean of its token ratios, clipped as a
      whole (use a small ``clip_eps``, ~3e-4), the sequence's advantage (its first token's);
    - ``ppo``: the token ratio clipped with per-token advantages, averaged over tokens.

    ``kl_coef`` adds the k3 estimate of KL(policy || reference) per token (averaged over tokens).
    The formulas: docs/rl.md ("Losses")."""
    if not (new_logprobs.shape == old_logprobs.shape == mask.shape == advantages.shape):
        raise ValueError(f"shape mismatch: new {tuple(new_logprobs.shape)}, old {tuple(old_logprobs.shape)}, "
                         f"advantages {tuple(advantages.shape)}, mask {tuple(mask.shape)}")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    mask = mask.float()
    adv = advantages.float()
    high = clip_eps if clip_eps_high is None else clip_eps_high
    tokens = mask.sum()
    denom = tokens.clamp(min=1.0)
    lengths = mask.sum(-1)
    present = (lengths > 0).float()
    log_ratio = (new_logprobs - old_logprobs.detach()) * mask
    if variant == "gspo":
        seq_ratio = torch.exp(log_ratio.sum(-1) / lengths.clamp(min=1.0))
        seq_adv = adv[:, 0]
        unclipped = seq_ratio * seq_adv
        clipped = torch.clamp(seq_ratio, 1.0 - clip_eps, 1.0 + high) * seq_adv
        per_seq = -torch.minimum(unclipped, clipped)
        pg = (per_seq * present).sum() / present.sum().clamp(min=1.0)
        pg_token_mean = pg
        ratio, was_clipped = seq_ratio[:, None].expand_as(mask), ((clipped < unclipped).float() * present)
        clip_share = was_clipped.sum() / present.sum().clamp(min=1.0)
    else:
        ratio = torch.exp(log_ratio)
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * adv
        per_token = -torch.minimum(unclipped, clipped) * mask
        if variant == "grpo":
            pg = ((per_token.sum(-1) / lengths.clamp(min=1.0)) * present).sum() / present.sum().clamp(min=1.0)
        elif variant == "dr_grpo":
            pg = per_token.sum() / (mask.shape[0] * (max_tokens or mask.shape[1]))
        elif variant == "ppo":
            pg = per_token.sum() / denom
        else:
            raise ValueError(f"unknown loss {variant!r}: use grpo, dr_grpo, gspo or ppo")
        clip_share = (((clipped < unclipped).float() * mask).sum() / denom)
        pg_token_mean = per_token.sum() / denom
    kl = torch.zeros_like(mask)
    if ref_logprobs is not None:
        delta = ref_logprobs.detach() - new_logprobs
        kl = (torch.exp(delta) - delta - 1.0) * mask
    loss = pg + kl_coef * kl.sum() / denom
    with torch.no_grad():
        return GRPOLoss(loss=loss, pg_loss=float(pg_token_mean), kl=float(kl.sum() / denom), clip_fraction=float(clip_share),
                        ratio_mean=float((ratio * mask).sum() / denom), tokens=int(tokens))


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns over each row's masked positions (the
    policy's tokens, in order; context between them is skipped): ``[N, T]`` each."""
    advantages = torch.zeros_like(values, dtype=torch.float32)
    for i in range(values.shape[0]):
        at = torch.nonzero(mask[i] > 0).flatten()
        following, running = 0.0, 0.0
        for j in reversed(at.tolist()):
            v = float(values[i, j])
            delta = float(rewards[i, j]) + gamma * following - v
            running = delta + gamma * lam * running
            advantages[i, j] = running
            following = v
    returns = (advantages + values.detach().float()) * mask
    return advantages, returns


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float | None = 0.2) -> torch.Tensor:
    """PPO's clipped value loss, ``0.5 * max((v - R)^2, (clip(v) - R)^2)`` averaged over tokens."""
    mask = mask.float()
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * (err * mask).sum() / mask.sum().clamp(min=1.0)


def entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy of the next-token distributions at the masked positions (``logits``:
    ``[N, T, V]``)."""
    logp = torch.log_softmax(logits.float(), -1)
    per = -(logp.exp() * logp).sum(-1)
    mask = mask.float()
    return (per * mask).sum() / mask.sum().clamp(min=1.0)
