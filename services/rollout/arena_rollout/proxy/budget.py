"""Budgets, checked before a call is sent: turns, wall clock, tokens. Pure.

``admit`` is the one entry the handler uses: the rollout's sampling is injected first
and the token budget is applied last, to what will actually be sent, so no sampling
policy (``override`` with a rollout ``max_tokens``, say) can lift the cap again.
"""

from __future__ import annotations

from typing import Any

import msgspec

from arena.errors import BudgetExhausted, InvalidRequest, WallClockExceeded
from arena.schemas import RolloutRecord, SamplingParams

from arena_rollout.proxy.policy import Api, apply_sampling

#: What an OpenAI-compatible ``/v1/completions`` generates when ``max_tokens`` is not
#: sent (OpenAI, vLLM and SGLang alike); chat has no such default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def known_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens the proxy knows exactly before sending: a completions prompt given as
    token ids. Anything else is text only the backend's tokenizer can count (0 here)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    return 0


def check_budget(record: RolloutRecord, body: dict[str, Any], *, now: float,
                 default_max_tokens: int | None = None) -> dict[str, Any]:
    """Refuse a call the budget cannot afford; cap ``max_tokens`` to what remains.

    Raises ``WallClockExceeded`` once ``wall_clock_s`` has passed since the rollout was
    created, ``BudgetExhausted`` when turns or tokens are spent. Returns the body, with
    ``max_tokens`` lowered when the agent asked for more than the tokens left (or for
    nothing and the API has no default of its own, ``default_max_tokens``: then the cap
    is what remains). A prompt of token ids counts against what remains before sending.
    """
    budget = record.task.budget
    elapsed = now - record.created_at
    if elapsed > budget.wall_clock_s:
        raise WallClockExceeded(f"wall-clock budget exhausted: {elapsed:.1f} s of {budget.wall_clock_s:g} s used")
    if budget.max_turns is not None and record.steps >= budget.max_turns:
        raise BudgetExhausted(f"turn budget exhausted: {record.steps} of {budget.max_turns} LLM calls used")
    if budget.max_total_tokens is not None:
        remaining = budget.max_total_tokens - record.total_tokens
        if remaining <= 0:
            raise BudgetExhausted(
                f"token budget exhausted: {record.total_tokens} of {budget.max_total_tokens} tokens used"
            )
        prompt = known_prompt_tokens(body)
        if prompt and prompt >= remaining:
            raise BudgetExhausted(
                f"token budget exhausted: a prompt of {prompt} tokens does not fit in the {remaining} of "
                f"{budget.max_total_tokens} tokens left"
            )
        remaining -= prompt
        asked = body.get("max_tokens") or body.get("max_completion_tokens") or default_max_tokens
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool)):
            raise InvalidRequest(f"'max_tokens' must be an integer, got {asked!r}")
        if asked is None or asked > remaining:
            body = dict(body)
            body["max_tokens"] = remaining
            body.pop("max_completion_tokens", None)
    return body


def admit(record: RolloutRecord, body: dict[str, Any], *, api: Api,
          now: float) -> tuple[dict[str, Any], SamplingParams]:
    """The body to send and the sampling applied: the rollout's sampling injected per its
    policy, then the budgets checked and ``max_tokens`` capped on the result (the applied
    ``max_tokens`` says what was sent). Raises like ``check_budget``; nothing is sent."""
    sent, applied = apply_sampling(body, record.sampling, api=api)
    default = COMPLETIONS_DEFAULT_MAX_TOKENS if api == "openai.completions" else None
    sent = check_budget(record, sent, now=now, default_max_tokens=default)
    if sent.get("max_tokens") != applied.max_tokens:
        applied = msgspec.structs.replace(applied, max_tokens=sent.get("max_tokens"))
    return sent, applied
