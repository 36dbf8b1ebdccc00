"""What an evaluation spent: tokens and seconds per try from its trajectory, and money from a price
table the user edits (a TOML file; docs/evaluation.md, Cost). The agent's LLM calls, the judge's
calls and the verifier's sandbox time are counted apart.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from pathlib import Path

import msgspec

from arena.evaluation.records import AttemptCost, AttemptFinished
from arena_core.errors import InvalidRequest
from arena_core.schemas import Trajectory


def attempt_cost(traj: Trajectory) -> AttemptCost:
    """A try's tokens (every captured step of the policy; every judge call) and seconds."""
    prompt = sum(s.usage.prompt_tokens for s in traj.steps)
    completion = sum(s.usage.completion_tokens for s in traj.steps)
    cached = sum(s.usage.cached_tokens for s in traj.steps)
    judge_prompt: dict[str, int] = {}
    judge_completion: dict[str, int] = {}
    judge_cached: dict[str, int] = {}
    judge_calls = 0
    verify_s = 0.0
    if traj.verification is not None:
        v = traj.verification
        verify_s = max(0.0, v.finished_at - v.started_at)
        for call in v.judge_calls:
            judge_calls += 1
            usage = call.usage
            judge_prompt[call.model] = judge_prompt.get(call.model, 0) + (usage.prompt_tokens if usage else 0)
            judge_completion[call.model] = judge_completion.get(call.model, 0) + (usage.completion_tokens if usage else 0)
            if usage and usage.cached_tokens:
                judge_cached[call.model] = judge_cached.get(call.model, 0) + usage.cached_tokens
    submitted = traj.history[0].at if traj.history else 0.0
    agent_s = queue_s = 0.0
    if traj.sandbox is not None:
        agent_s = max(0.0, traj.sandbox.finished_at - traj.sandbox.started_at)
        if submitted:
            queue_s = max(0.0, traj.sandbox.started_at - submitted)
    wall_s = max(0.0, traj.completed_at - submitted) if submitted and traj.completed_at else 0.0
    return AttemptCost(llm_calls=len(traj.steps), prompt_tokens=prompt, completion_tokens=completion,
                       cached_tokens=cached, judge_calls=judge_calls, judge_prompt_tokens=judge_prompt,
                       judge_completion_tokens=judge_completion, judge_cached_tokens=judge_cached, queue_s=queue_s, agent_s=agent_s,
                       verify_s=verify_s, wall_s=wall_s)


class ModelPrice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Dollars per million tokens for one model name (as the rollouts and judges name it).
    ``cached_input_per_mtok``: prompt tokens the backend served from its prefix cache; unset:
    they are priced as any prompt token."""

    input_per_mtok: float
    output_per_mtok: float
    cached_input_per_mtok: float | None = None


class PriceTable(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[models."NAME"]`` prices per model; ``sandbox_per_hour``: dollars per hour of sandbox time
    (the agent's and the verifier's, priced apart); unset: sandbox time is not priced."""

    models: dict[str, ModelPrice] = {}
    sandbox_per_hour: float | None = None


def read_prices(path: str | Path | None) -> PriceTable:
    """The price table in ``path`` (TOML); none given: an empty one (tokens counted, no money)."""
    if path is None:
        return PriceTable()
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
        return msgspec.convert(data, PriceTable)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequest(f"price table {path} is not TOML: {exc}") from None
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"price table {path}: {exc} (see docs/evaluation.md, Cost)") from None


def _money(prices: PriceTable, model: str, prompt: int, completion: int, cached: int = 0) -> float | None:
    """``cached`` is part of ``prompt``: at the cached rate where the table gives one."""
    price = prices.models.get(model)
    if price is None:
        return None if prompt or completion else 0.0
    cached = min(cached, prompt) if price.cached_input_per_mtok is not None else 0
    return ((prompt - cached) * price.input_per_mtok + cached * (price.cached_input_per_mtok or 0.0)
            + completion * price.output_per_mtok) / 1e6


class CostSummary(msgspec.Struct, kw_only=True):
    """Totals over tries. Money is None where a model the tries used has no price (never a
    silent 0); ``unpriced`` names those models."""

    tries: int = 0
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens
    judge_calls: int = 0
    judge_prompt_tokens: int = 0
    judge_completion_tokens: int = 0
    judge_cached_tokens: int = 0  # of judge_prompt_tokens
    agent_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    agent_usd: float | None = 0.0
    judge_usd: float | None = 0.0
    sandbox_usd: float | None = None  # the agent's sandbox time; None: the table has no sandbox_per_hour
    verifier_usd: float | None = None  # the verifier's sandbox time, likewise
    unpriced: list[str] = []
    missing_trajectories: int = 0

    @property
    def total_usd(self) -> float | None:
        """Tokens (agent and judge) plus sandbox time where the table prices it; None when a
        model used has no price."""
        if self.agent_usd is None or self.judge_usd is None:
            return None
        return self.agent_usd + self.judge_usd + (self.sandbox_usd or 0.0) + (self.verifier_usd or 0.0)


def _add(total: float | None, part: float | None) -> float | None:
    return None if total is None or part is None else total + part


def summarize_cost(tries: Iterable[AttemptFinished], prices: PriceTable) -> CostSummary:
    """Every try counts, infrastructure outcomes too (they were paid for)."""
    out = CostSummary()
    unpriced: set[str] = set()
    for t in tries:
        c = t.cost
        out.tries += 1
        out.missing_trajectories += c.missing
        out.llm_calls += c.llm_calls
        out.prompt_tokens += c.prompt_tokens
        out.completion_tokens += c.completion_tokens
        out.cached_tokens += c.cached_tokens
        out.judge_calls += c.judge_calls
        out.judge_cached_tokens += sum(c.judge_cached_tokens.values())
        out.judge_prompt_tokens += sum(c.judge_prompt_tokens.values())
        out.judge_completion_tokens += sum(c.judge_completion_tokens.values())
        out.agent_s += c.agent_s
        out.verify_s += c.verify_s
        out.wall_s += c.wall_s
        agent = _money(prices, t.model, c.prompt_tokens, c.completion_tokens, c.cached_tokens)
        if agent is None:
            unpriced.add(t.model)
        out.agent_usd = _add(out.agent_usd, agent)
        for judge in c.judge_prompt_tokens.keys() | c.judge_completion_tokens.keys():
            money = _money(prices, judge, c.judge_prompt_tokens.get(judge, 0), c.judge_completion_tokens.get(judge, 0),
                           c.judge_cached_tokens.get(judge, 0))
            if money is None:
                unpriced.add(judge)
            out.judge_usd = _add(out.judge_usd, money)
    hourly = prices.sandbox_per_hour
    out.sandbox_usd = None if hourly is None else out.agent_s / 3600 * hourly
    out.verifier_usd = None if hourly is None else out.verify_s / 3600 * hourly
    out.unpriced = sorted(unpriced)
    return out
