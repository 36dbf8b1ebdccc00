"""OpenAI request validation: what the proxy accepts on ``/v1/chat/completions`` and
``/v1/completions``. Pure."""

from __future__ import annotations

from typing import Any

from arena_core.errors import InvalidRequest


def _common(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    if body.get("n", 1) not in (1, None):
        raise InvalidRequest("only n=1 is supported: submit a rollout group for several samples")
    return body


def validate_chat_body(body: Any) -> dict[str, Any]:
    body = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a 'role'")
    return body


def validate_completions_body(body: Any) -> dict[str, Any]:
    body = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("'prompt' must not be empty")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
    else:
        raise InvalidRequest("'prompt' must be a non-empty string or one list of token ids "
                             "(batched prompts: submit a rollout group)")
    if body.get("echo"):
        raise InvalidRequest("'echo' is not supported: the step already records the prompt token ids")
    if body.get("best_of") not in (None, 1):
        raise InvalidRequest("only best_of=1 is supported")
    return body
