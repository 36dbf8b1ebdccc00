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
    """A stream chunk (JSON) without the fields the client did not ask for."""
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return data
    out = without(doc, logprobs, ids)
    return data if out is None else msgspec.json.encode(out)


def without(doc: Any, logprobs: bool, ids: bool) -> dict[str, Any] | None:
    """A decoded answer or chunk less the fields the client did not ask for, as a new
    (shallow) document: ``doc`` itself is left whole for capture. None: nothing to remove."""
    if not isinstance(doc, dict):
        return None
    out = doc
    if ids and "prompt_token_ids" in doc:
        out = {k: v for k, v in doc.items() if k != "prompt_token_ids"}
    choices = doc.get("choices")
    if isinstance(choices, list):
        trimmed = []
        for choice in choices:
            if isinstance(choice, dict) and ((logprobs and choice.get("logprobs") is not None) or (
                    ids and ("token_ids" in choice or "prompt_token_ids" in choice))):
                choice = {k: v for k, v in choice.items() if not (ids and k in ("token_ids", "prompt_token_ids"))}
                if logprobs and choice.get("logprobs") is not None:
                    choice["logprobs"] = None  # OpenAI's own answers say null when not asked
            trimmed.append(choice)
        if any(a is not b for a, b in zip(trimmed, choices)):
            out = {**out, "choices": trimmed} if out is not doc else {**doc, "choices": trimmed}
    return None if out is doc else out
