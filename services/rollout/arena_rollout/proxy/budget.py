"""Budgets, checked before a call is sent: turns, wall clock, tokens. Pure.

``admit`` is the one entry the handler uses: the rollout's sampling is injected first
and the token budget is applied last, to what will actually be sent, so no sampling
policy (``override`` with a rollout ``max_tokens``, say) can lift the cap again.

The token budget is exact: a call that could take the rollout past ``max_total_tokens``
is capped (``max_tokens`` lowered to what remains after its prompt) or refused before it
is sent, never discovered after. Its prompt's length matters only when the budget is
tight. ``prompt_upper_bound`` (the UTF-8 bytes of everything a chat template can render,
plus allowances: a byte-level BPE token is at least one byte) plus ``max_tokens`` fitting
what remains needs no count, and the call goes as asked. Otherwise ``admit`` answers
``count``: the handler asks the serving replica's ``/tokenize`` (I/O, not here) and admits
again with the count, or with the bound when the replica cannot count (``fallback``).

``reserved`` is what the rollout's calls in flight may still spend. A call that fits only
if they spend less than that is not capped or refused on their account: ``admit`` answers
``wait``, and the handler admits it again once they have ended.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from arena_core.errors import BudgetExhausted, InvalidRequest, WallClockExceeded
from arena_core.schemas import PromptCount, RolloutRecord, SamplingParams

from arena_rollout.proxy.policy import Api, apply_sampling
from arena_rollout.state import agent_started

#: What an OpenAI-compatible ``/v1/completions`` generates when ``max_tokens`` is not
#: sent (OpenAI, vLLM and SGLang alike); chat has no such default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

#: Allowances of ``prompt_upper_bound`` for what a chat template adds around the text:
#: per message (role markers, begin/end tokens), per request (BOS, the generation prompt,
#: a template's own preamble such as a default system prompt or date lines) and, when tools
#: are offered, a template's tool-use instructions on top of the tools' JSON.
PER_MESSAGE_TOKENS = 16
TEMPLATE_TOKENS = 256
TOOLS_TOKENS = 512

#: Content parts whose tokens are their text; any other part (an image, audio, a file)
#: has a length only the backend knows.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})
#: Request fields a chat template renders besides the messages.
_RENDERED = ("tools", "functions", "documents", "chat_template_kwargs")

Verdict = Literal["send", "count", "wait"]


class Admission(msgspec.Struct, frozen=True, kw_only=True):
    """What ``admit`` decided about one call.

    ``send``: send ``body`` (capped when it had to be); ``count``: the prompt's exact length
    decides, admit again with it; ``wait``: the call fits only if the rollout's calls in
    flight spend less than they may, admit again once they have ended.
    """

    verdict: Verdict
    body: dict[str, Any]
    applied: SamplingParams = SamplingParams()
    #: How the prompt was counted (``send`` under a token budget), for the step.
    prompt: PromptCount | None = None
    #: The most tokens this call can add to the rollout (prompt + ``max_tokens`` as sent);
    #: 0 without a token budget.
    reserve: int = 0


def known_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens the proxy knows exactly before sending: a completions prompt given as
    token ids. Anything else is text only the backend's tokenizer can count (0 here)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)
    return 0


def _nbytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8"))
    if value is None:
        return 0
    return len(msgspec.json.encode(value))


def _content_bytes(content: Any) -> int | None:
    if content is None or isinstance(content, str):
        return _nbytes(content)
    if not isinstance(content, list):
        return _nbytes(content)
    total = 0
    for part in content:
        if isinstance(part, str):
            total += _nbytes(part)
        elif isinstance(part, dict) and part.get("type", "text") in _TEXT_PARTS:
            total += _nbytes(part.get("text")) + _nbytes(part.get("refusal"))
        else:
            return None
    return total


def prompt_upper_bound(body: dict[str, Any], api: Api) -> int | None:
    """An upper bound of the prompt's tokens without tokenizing, or None when there is none
    (non-text content, an agent's own chat template): only the backend can count those.

    Byte-level BPE (GPT-2 style, Llama 3, Qwen) and SentencePiece with byte fallback never
    make more tokens than the text has UTF-8 bytes, so the bound is the bytes of everything
    a chat template renders (every message field, tools, documents) plus the allowances
    above for the template's own tokens.
    """
    if api == "openai.completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return _nbytes(prompt) + PER_MESSAGE_TOKENS  # BOS / EOS and the like
        if isinstance(prompt, list):
            return known_prompt_tokens(body) or None
        return None
    if body.get("chat_template") is not None:
        return None
    total = TEMPLATE_TOKENS
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            return None
        total += PER_MESSAGE_TOKENS
        for key, value in message.items():
            if key == "content":
                n = _content_bytes(value)
                if n is None:
                    return None
                total += n
            else:  # role, name, tool_calls, tool_call_id, reasoning...: a template may render any
                total += _nbytes(value)
    for key in _RENDERED:
        value = body.get(key)
        if value:
            total += _nbytes(value)
    if body.get("tools") or body.get("functions"):
        total += TOOLS_TOKENS
    return total


def _asked(body: dict[str, Any], default_max_tokens: int | None) -> int | None:
    asked = body.get("max_tokens") or body.get("max_completion_tokens") or default_max_tokens
    if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool)):
        raise InvalidRequest(f"'max_tokens' must be an integer, got {asked!r}")
    return asked


def check_budget(record: RolloutRecord, body: dict[str, Any], *, now: float, api: Api = "openai.chat",
                 default_max_tokens: int | None = None, prompt: PromptCount | None = None,
                 reserved: int = 0, off_clock_s: float = 0.0) -> Admission:
    """Refuse a call the budget cannot afford; cap ``max_tokens`` to what remains.

    Raises ``WallClockExceeded`` once ``wall_clock_s`` has passed since the rollout's agent
    started (its ``running`` transition; its creation if none), ``BudgetExhausted`` when turns are spent, when no token remains, or when the
    prompt alone leaves no token to generate. ``max_tokens`` (or, when the agent asked for
    nothing, ``default_max_tokens``: the API's own default) is lowered to what remains
    after the prompt when the call would not fit as asked. ``prompt``: the prompt's count
    when known (from ``/tokenize``, or the bound as a fallback); a prompt of token ids is
    counted here. Without it a tight call answers ``count``. ``reserved``: the most the
    rollout's calls in flight may still spend. ``off_clock_s``: the time the rollout's calls
    waited in the proxy's queue for a backend slot (parallel waits once), which the wall
    clock leaves out.
    """
    budget = record.task.budget
    started = agent_started(record)
    elapsed = now - (record.created_at if started is None else started) - max(0.0, off_clock_s)
    if elapsed > budget.wall_clock_s:
        raise WallClockExceeded(f"wall-clock budget exhausted: {elapsed:.1f} s of {budget.wall_clock_s:g} s used")
    turns = record.steps - record.abandoned_steps
    if budget.max_turns is not None and turns >= budget.max_turns:
        raise BudgetExhausted(f"turn budget exhausted: {turns} of {budget.max_turns} LLM calls used")
    limit = budget.max_total_tokens
    if limit is None:
        return Admission(verdict="send", body=body)
    remaining = limit - record.total_tokens
    if remaining <= 0:
        raise BudgetExhausted(f"token budget exhausted: {record.total_tokens} of {limit} tokens used")
    asked = _asked(body, default_max_tokens)
    free = remaining - max(0, reserved)
    if prompt is None and (ids := known_prompt_tokens(body)):
        prompt = PromptCount(tokens=ids, source="ids")
    if prompt is None:
        bound = prompt_upper_bound(body, api)
        if bound is not None and asked is not None and bound + asked <= free:  # roomy: no count needed
            return Admission(verdict="send", body=body, reserve=bound + asked,
                             prompt=PromptCount(tokens=bound, source="bound", remaining=remaining))
        return Admission(verdict="wait" if reserved > 0 else "count", body=body)
    prompt = msgspec.structs.replace(prompt, remaining=remaining)
    if asked is not None and prompt.tokens + asked <= free:
        return Admission(verdict="send", body=body, prompt=prompt, reserve=prompt.tokens + asked)
    if reserved > 0:  # it may fit once the calls in flight have spent what they really spend
        return Admission(verdict="wait", body=body)
    room = remaining - prompt.tokens
    if room <= 0:
        counted = "at most " if prompt.source == "fallback" else ""
        raise BudgetExhausted(
            f"token budget exhausted: a prompt of {counted}{prompt.tokens} tokens does not fit in the {remaining} "
            f"of {limit} tokens left" + (f" ({prompt.note})" if prompt.note else "")
        )
    body = dict(body)
    body["max_tokens"] = room
    body.pop("max_completion_tokens", None)
    return Admission(verdict="send", body=body, prompt=prompt, reserve=remaining)


def admit(record: RolloutRecord, body: dict[str, Any], *, api: Api, now: float,
          prompt: PromptCount | None = None, reserved: int = 0, off_clock_s: float = 0.0) -> Admission:
    """The rollout's sampling injected per its policy, then the budgets checked and
    ``max_tokens`` capped on the result (the applied ``max_tokens`` says what was sent).
    Raises like ``check_budget``; nothing is sent."""
    sent, applied = apply_sampling(body, record.sampling, api=api)
    default = COMPLETIONS_DEFAULT_MAX_TOKENS if api == "openai.completions" else None
    decided = check_budget(record, sent, now=now, api=api, default_max_tokens=default, prompt=prompt,
                           reserved=reserved, off_clock_s=off_clock_s)
    if decided.body.get("max_tokens") != applied.max_tokens:
        applied = msgspec.structs.replace(applied, max_tokens=decided.body.get("max_tokens"))
    return msgspec.structs.replace(decided, applied=applied)
