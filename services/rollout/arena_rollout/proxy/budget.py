"""Budgets, checked before a call is sent: turns, wall clock, tokens. Pure."""

from __future__ import annotations

from typing import Any

from arena.errors import BudgetExhausted, WallClockExceeded
from arena.schemas import RolloutRecord


def check_budget(record: RolloutRecord, body: dict[str, Any], *, now: float) -> dict[str, Any]:
    """Refuse a call the budget cannot afford; cap ``max_tokens`` to what remains.

    Raises ``WallClockExceeded`` once ``wall_clock_s`` has passed since the rollout was
    created, ``BudgetExhausted`` when turns or tokens are spent. Returns the body, with
    ``max_tokens`` lowered when the agent asked for more than the tokens left (or for
    nothing: then the cap is what remains).
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
        asked = body.get("max_tokens") or body.get("max_completion_tokens")
        if asked is None or asked > remaining:
            body = dict(body)
            body["max_tokens"] = remaining
            body.pop("max_completion_tokens", None)
    return body
