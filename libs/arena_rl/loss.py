"""The GRPO loss: pure tensor math, no I/O.

:func:`grpo_loss`: the clipped policy-gradient term plus an optional k3 KL to a reference,
averaged per sequence or per token. The formula: docs/rl.md ("The GRPO loss").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class GRPOLoss:
    loss: torch.Tensor  # scalar, differentiable
    pg_loss: float
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
    if new_logprobs.shape != old_logprobs.shape or new_logprobs.shape != mask.shape:
        raise ValueError(f"shape mismatch: new {tuple(new_logprobs.shape)}, old {tuple(old_logprobs.shape)}, "
                         f"mask {tuple(mask.shape)}")
    if advantages.shape != new_logprobs.shape[:1]:
        raise ValueError(f"advantages must be [N]={new_logprobs.shape[0]}, got {tuple(advantages.shape)}")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    mask = mask.float()
    high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = advantages.float()[:, None]
    ratio = torch.exp(new_logprobs - old_logprobs.detach())
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        delta = ref_logprobs.detach() - new_logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
    tokens = mask.sum()
    denom = tokens.clamp(min=1.0)
    if aggregation == "sequence":
        lengths = mask.sum(-1)
        seq = (per_token * mask).sum(-1) / lengths.clamp(min=1.0)
        present = (lengths > 0).float()
        loss = (seq * present).sum() / present.sum().clamp(min=1.0)
    elif aggregation == "token":
        loss = (per_token * mask).sum() / denom
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}: use 'sequence' or 'token'")
    with torch.no_grad():
        was_clipped = ((clipped < unclipped) & (mask > 0)).float().sum() / denom
        pg = ((-torch.minimum(unclipped, clipped)) * mask).sum() / denom
        return GRPOLoss(
            loss=loss,
            pg_loss=float(pg),
            kl=float((kl * mask).sum() / denom),
            clip_fraction=float(was_clipped),
            ratio_mean=float((ratio * mask).sum() / denom),
            tokens=int(tokens),
        )
