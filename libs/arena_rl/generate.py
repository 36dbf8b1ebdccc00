"""Batched sampling from a :class:`PolicyModel`: one forward per new token for the whole
batch (left-padded, no KV cache: contexts are tiny), per-request sampling parameters and
seeds, and the temperature-1 log-probability of every sampled token (vLLM's default
``raw_logprobs``: the policy's own distribution, what the trainer's ratio needs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from arena_rl.model import PolicyModel
from arena_rl.tokenizer import EOS, PAD


@dataclass(frozen=True)
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    top_logprobs: int = 0


@dataclass
class GenResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = "length"
    #: (completion token index, policy version): a weight update took over from that token on
    switches: list[tuple[int, int]] = field(default_factory=list)


def top_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` (1-D) with the tokens outside top-k and top-p set to -inf."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= top_p  # keep the token that crosses top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample_into(res: GenResult, req: GenRequest, logits: torch.Tensor, logp: torch.Tensor,
                gen: torch.Generator) -> int:
    """Sample one token of ``req`` from a row of next-token ``logits`` (greedy at temperature 0,
    else top-k / top-p filtered) and append it to ``res`` with its raw logprob (``logp``, the
    unfiltered temperature-1 log-softmax) and, when asked, the top logprobs; the token."""
    if req.temperature == 0:
        tok = int(torch.argmax(logits))
    else:
        probs = torch.softmax(top_filter(logits / req.temperature, req.top_k, req.top_p), -1)
        tok = int(torch.multinomial(probs, 1, generator=gen))
    res.token_ids.append(tok)
    res.logprobs.append(float(logp[tok]))
    if req.top_logprobs:
        top = torch.topk(logp, min(req.top_logprobs, logp.shape[-1]))
        res.top_logprobs.append([(int(t), float(v)) for v, t in zip(top.values, top.indices, strict=True)])
    return tok


@torch.no_grad()
def generate(model: PolicyModel, requests: list[GenRequest]) -> list[GenResult]:
    """Sample a completion for each request; stops at ``</s>`` (included) or ``max_tokens``."""
    if not requests:
        return []
    max_len = model.cfg.max_len
    for req in requests:
        if not req.prompt_ids:
            raise ValueError("empty prompt")
        if len(req.prompt_ids) >= max_len:
            raise ValueError(f"prompt of {len(req.prompt_ids)} tokens does not fit the context of {max_len}")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if req.temperature < 0 or not 0 < req.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
    gens = [torch.Generator().manual_seed(req.seed if req.seed is not None else random.getrandbits(62))
            for req in requests]
    budgets = [min(req.max_tokens, max_len - len(req.prompt_ids)) for req in requests]
    results = [GenResult() for _ in requests]
    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(requests), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(requests), width, dtype=torch.long)
    for i, req in enumerate(requests):
        ids[i, width - len(req.prompt_ids):] = torch.tensor(req.prompt_ids)
        mask[i, width - len(req.prompt_ids):] = 1
    active = [True] * len(requests)
    while any(active):
        logits = model(ids, mask)[:, -1, :].float()
        logp = torch.log_softmax(logits, -1)
        nxt = torch.full((len(requests),), PAD, dtype=torch.long)
        for i, req in enumerate(requests):
            if not active[i]:
                continue
            res = results[i]
            tok = sample_into(res, req, logits[i], logp[i], gens[i])
            nxt[i] = tok
            if tok == EOS:
                active[i], res.finish_reason = False, "stop"
            elif len(res.token_ids) >= budgets[i]:
                active[i], res.finish_reason = False, "length"
        if not any(active):
            break
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, torch.tensor([[1 if a else 0] for a in active])], dim=1)
    return results
