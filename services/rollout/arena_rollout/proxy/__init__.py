"""The LLM proxy: every LLM call an agent makes passes through here.

| module | what |
|---|---|
| ``openai_api`` | validation of OpenAI chat / completions bodies |
| ``flavours`` | what the handler asks of a translated client API; ``FLAVOURS``, one per API |
| ``anthropic`` | Anthropic Messages <-> OpenAI chat translation, streaming included |
| ``responses`` | OpenAI Responses <-> OpenAI chat translation, streaming included; stored responses |
| ``gemini`` | Gemini generateContent <-> OpenAI chat translation, streaming included |
| ``policy`` | sampling injection (override / default / clamp), capture forced on |
| ``budget`` | turns, wall clock, tokens: checked before a call is sent (``admit``: sampling, then budget; the prompt counted only when the budget is tight) |
| ``capture`` | the backend's token ids, logprobs, tool calls, usage -> ``Step`` |
| ``routing`` | replicas, sticky routing, health marks, in-flight bounds |
| ``backends`` | the ``arena_backends`` KV registry and health checks |
| ``upstream`` | sending to a replica with queueing, failover and error mapping; counting a prompt with its ``/tokenize`` |
| ``handler`` | one call end to end, relaying streams chunk by chunk |
"""

from arena_rollout.proxy.budget import Admission, admit, check_budget, prompt_upper_bound
from arena_rollout.proxy.capture import Capture, capture
from arena_rollout.proxy.openai_api import validate_chat_body, validate_completions_body
from arena_rollout.proxy.policy import SAMPLING_FIELDS, apply_sampling

__all__ = ["SAMPLING_FIELDS", "Admission", "Capture", "admit", "apply_sampling", "capture", "check_budget",
           "prompt_upper_bound", "validate_chat_body", "validate_completions_body"]
