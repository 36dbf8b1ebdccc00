"""Sampling injection: the rollout's sampling parameters meet the agent's request.

Pure. ``override`` replaces the agent's values, ``default`` fills only what the agent
left unset, ``clamp`` keeps the agent's numeric values but never above the rollout's
(``seed`` and ``stop`` override). Logprobs are always requested, and token ids with
vLLM/SGLang's ``return_token_ids``; what was actually sent is returned as the applied
``SamplingParams`` for the step.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from arena_core.schemas import SamplingParams

Api = Literal["openai.chat", "openai.completions", "openai.responses", "anthropic.messages",
              "gemini.generate_content"]

#: The sampling fields a rollout may set (``policy`` says how, it is not a field to send).
SAMPLING_FIELDS = tuple(f.name for f in msgspec.structs.fields(SamplingParams) if f.name != "policy")
_CLAMPED = frozenset({"temperature", "top_p", "top_k", "min_p", "max_tokens", "presence_penalty",
                      "frequency_penalty", "top_logprobs"})


def merge(name: str, agent: Any, rollout: Any, policy: str) -> Any:
    """The value of one sampling field under ``policy``."""
    if rollout is None:
        return agent
    if agent is None or policy == "override":
        return rollout
    if policy == "default":
        return agent
    if name in _CLAMPED and isinstance(agent, (int, float)) and not isinstance(agent, bool):
        return min(agent, rollout)
    return rollout


def apply_sampling(body: dict[str, Any], sampling: SamplingParams, *,
                   api: Api = "openai.chat") -> tuple[dict[str, Any], SamplingParams]:
    """Return the body to send to an OpenAI-compatible backend and the sampling applied.

    ``body`` is an OpenAI chat or completions body (Anthropic requests are translated
    first); it is not mutated.
    """
    out = dict(body)
    if "max_tokens" not in out and out.get("max_completion_tokens") is not None:
        out["max_tokens"] = out["max_completion_tokens"]
    out.pop("max_completion_tokens", None)
    chat = api != "openai.completions"
    # the agent's own top-k request: chat ``top_logprobs``; completions ``logprobs`` (an int)
    agent_top = out.get("top_logprobs") if chat else out.get("logprobs")
    applied: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        agent = agent_top if name == "top_logprobs" else out.get(name)
        value = merge(name, agent, getattr(sampling, name), sampling.policy)
        applied[name] = value
        if name == "top_logprobs":
            continue
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    top = applied["top_logprobs"]
    if chat:
        out["logprobs"] = True
        if top:
            out["top_logprobs"] = top
        else:
            out.pop("top_logprobs", None)
    else:
        out["logprobs"] = int(top or 0)
    out["return_token_ids"] = True
    if out.get("stream"):
        out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    else:
        out["stream"] = False
        out.pop("stream_options", None)
    return out, SamplingParams(**applied, policy=sampling.policy)
