"""What goes back to the agent: the backend's answer less what the proxy asked for itself.

The proxy asks every backend for logprobs and token ids (they are captured in the step);
an agent that did not ask for them does not get them, as from the real API.
"""

from __future__ import annotations

from typing import Any

import msgspec


def unasked(api: str, payload: Any) -> tuple[bool, bool]:
    """(logprobs, token ids) to strip from the answers to ``payload``. The Messages API's
    answers are translated and never carry either."""
    if api == "anthropic.messages" or not isinstance(payload, dict):
        return False, False
    logprobs = payload.get("logprobs")
    asked_logprobs = logprobs is not None and logprobs is not False
    return not asked_logprobs, not payload.get("return_token_ids")


def stripped(data: bytes, logprobs: bool, ids: bool) -> bytes:
    """A whole answer or a stream chunk (JSON) without the fields the client did not ask for."""
    try:
        answer = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return data
    if not isinstance(answer, dict):
        return data
    changed = ids and answer.pop("prompt_token_ids", None) is not None
    for choice in answer.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None  # OpenAI's own answers say null when not asked
            changed = True
        if ids and ("token_ids" in choice or "prompt_token_ids" in choice):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            changed = True
    return msgspec.json.encode(answer) if changed else data
