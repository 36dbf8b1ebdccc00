"""The LLM proxy's logic: sampling injection, budget checks, and token-level capture.

Pure functions over JSON dicts; the HTTP forwarding lives in ``service.py``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from arena.errors import BudgetExhausted, InvalidRequest, UpstreamError
from arena.schemas import Budget, RolloutRecord, SamplingParams, Step, Timings, TopLogprob, Usage

SAMPLING_FIELDS = tuple(f.name for f in msgspec.structs.fields(SamplingParams))


def apply_sampling(body: dict[str, Any], sampling: SamplingParams) -> tuple[dict[str, Any], SamplingParams]:
    """Override the agent's sampling fields with the rollout's, and force capture.

    Returns the body to send and the sampling parameters actually applied.
    Logprobs are always requested, and token ids with vLLM's ``return_token_ids``.
    """
    out = dict(body)
    for name in SAMPLING_FIELDS:
        value = getattr(sampling, name)
        if value is not None:
            out[name] = value
    out["logprobs"] = True
    out["return_token_ids"] = True
    out["stream"] = False
    applied = SamplingParams(**{name: out.get(name) for name in SAMPLING_FIELDS})
    return out, applied


def validate_chat_body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    if body.get("stream"):
        raise InvalidRequest("streaming is not supported by this proxy yet; send stream=false")
    if body.get("n", 1) != 1:
        raise InvalidRequest("only n=1 is supported: submit a rollout group for several samples")
    return body


def check_budget(record: RolloutRecord, body: dict[str, Any]) -> dict[str, Any]:
    """Refuse a call that the budget cannot afford; cap ``max_tokens`` to what remains."""
    budget: Budget = record.task.budget
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


def capture(
    *,
    rollout_id: str,
    step_index: int,
    request: dict[str, Any],
    response: Any,
    applied: SamplingParams,
    backend: str,
    policy_version: str | None,
    timings: Timings,
    started_at: float,
) -> Step:
    """Build the ``Step`` from an OpenAI/vLLM chat completion response.

    Token ids are taken only from the backend (vLLM's ``prompt_token_ids`` and
    ``choices[0].token_ids``); when absent the step says ``unavailable``.
    """
    if not isinstance(response, dict) or not isinstance(response.get("choices"), list) or not response["choices"]:
        raise UpstreamError("backend response has no choices")
    choice = response["choices"][0]
    if not isinstance(choice, dict):
        raise UpstreamError("backend response choice is not an object")
    message = choice.get("message") or {}
    text = message.get("content") or ""
    logprob_items = ((choice.get("logprobs") or {}).get("content")) or []
    logprobs = [float(item["logprob"]) for item in logprob_items] or None
    top = None
    if any(item.get("top_logprobs") for item in logprob_items):
        top = [
            [TopLogprob(token=alt["token"], logprob=float(alt["logprob"])) for alt in item.get("top_logprobs") or []]
            for item in logprob_items
        ]
    prompt_ids = response.get("prompt_token_ids")
    completion_ids = choice.get("token_ids")
    source = "backend" if prompt_ids is not None and completion_ids is not None else "unavailable"
    usage_raw = response.get("usage") or {}
    usage = Usage(
        prompt_tokens=int(usage_raw.get("prompt_tokens") or (len(prompt_ids) if prompt_ids else 0)),
        completion_tokens=int(usage_raw.get("completion_tokens") or (len(completion_ids) if completion_ids else 0)),
        total_tokens=int(usage_raw.get("total_tokens") or 0),
    )
    if not usage.total_tokens:
        usage = msgspec.structs.replace(usage, total_tokens=usage.prompt_tokens + usage.completion_tokens)
    return Step(
        rollout_id=rollout_id,
        step_index=step_index,
        model=str(response.get("model") or request.get("model") or ""),
        backend=backend,
        policy_version=policy_version,
        request_messages=list(request.get("messages") or []),
        sampling=applied,
        prompt_token_ids=list(prompt_ids) if source == "backend" else None,
        completion_token_ids=list(completion_ids) if source == "backend" else None,
        logprobs=logprobs,
        top_logprobs=top,
        token_ids_source=source,
        completion_text=text,
        finish_reason=choice.get("finish_reason"),
        usage=usage,
        timings=timings,
        started_at=started_at,
    )
