"""An Arena trajectory in Harbor's Agent Trajectory Interchange Format (ATIF v1.8: Harbor's
``harbor.models.trajectories.Trajectory``), and a job's attempts exported in it beside Arena's own
JSON (docs/evaluation.md, Interchange).

The mapping. Each Arena step is one LLM call whose ``request_messages`` hold the whole prompt, so:
the first call's system and user messages are ATIF's ``system`` and ``user`` steps; each call is an
``agent`` step (its completion, tool calls with their arguments as objects, and ``metrics``:
prompt, completion and cached tokens, the token ids and logprobs as the backend sent them); the
messages the next call adds after that answer (tool results, later user turns) are that agent
step's ``observation``, a tool result tied to its call by ``source_call_id``. A rollout without an
LLM call is one ``user`` step, the task's instructions. The rollout, its reward, verdict and
attempt ride in ``extra``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from arena_core.schemas import Step, Trajectory

SCHEMA_VERSION = "ATIF-v1.8"


def _iso(t: float) -> str | None:
    return datetime.fromtimestamp(t, UTC).isoformat() if t > 0 else None


def _text(content: Any) -> str:
    """A chat message's content as text (the text parts of a list, in order)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content)


def _arguments(text: str) -> dict[str, Any]:
    """ATIF's arguments are an object: the call's JSON object, else the text kept whole under ``_raw``."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {"_raw": text}
    return value if isinstance(value, dict) else {"_value": value}


def _none_empty(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _agent_step(step: Step, step_id: int) -> dict[str, Any]:
    metrics = _none_empty({
        "prompt_tokens": step.usage.prompt_tokens, "completion_tokens": step.usage.completion_tokens,
        "cached_tokens": step.usage.cached_tokens, "prompt_token_ids": step.prompt_token_ids,
        "completion_token_ids": step.completion_token_ids, "logprobs": step.logprobs,
    })
    extra = _none_empty({"api": step.api, "finish_reason": step.finish_reason, "policy_version": step.policy_version,
                         "backend_replica": step.backend_replica, "incomplete": step.incomplete or None,
                         "abandoned": step.abandoned or None, "error": step.error})
    out: dict[str, Any] = {"step_id": step_id, "timestamp": _iso(step.started_at), "source": "agent",
                           "model_name": step.model or None, "message": step.completion_text, "metrics": metrics,
                           "llm_call_count": 1, "extra": extra}
    if step.tool_calls:
        out["tool_calls"] = [{"tool_call_id": c.id, "function_name": c.name, "arguments": _arguments(c.arguments)}
                             for c in step.tool_calls]
    return _none_empty(out)


def _observation(added: list[dict[str, Any]], call_ids: set[str]) -> dict[str, Any] | None:
    results = []
    for m in added:
        if m.get("role") == "assistant":
            continue  # the agent's own answer, already its step
        result: dict[str, Any] = {"content": _text(m.get("content"))}
        call = m.get("tool_call_id")
        if m.get("role") == "tool" and call in call_ids:
            result["source_call_id"] = call
        elif m.get("role") != "tool":
            result["extra"] = {"role": m.get("role")}
        results.append(result)
    return {"results": results} if results else None


def to_atif(traj: Trajectory, *, agent_name: str, agent_version: str, model: str,
            instructions: str = "", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``traj`` as an ATIF trajectory (a JSON object Harbor's ``Trajectory`` model accepts)."""
    steps: list[dict[str, Any]] = []
    calls = [s for s in traj.steps if not s.abandoned] or list(traj.steps)
    first_at = _iso(calls[0].started_at) if calls else _iso(traj.history[0].at if traj.history else 0.0)
    if calls:
        for m in calls[0].request_messages:
            if m.get("role") in ("system", "developer"):
                steps.append({"source": "system", "message": _text(m.get("content"))})
            elif m.get("role") == "user":
                steps.append({"source": "user", "message": _text(m.get("content"))})
        if calls[0].request_prompt is not None and not calls[0].request_messages:  # /v1/completions
            prompt = calls[0].request_prompt
            steps.append({"source": "user", "message": prompt if isinstance(prompt, str) else json.dumps(prompt)})
    if not steps:
        steps.append({"source": "user", "message": instructions})
    for s in steps:
        if first_at:
            s["timestamp"] = first_at
    for i, call in enumerate(calls):
        step = _agent_step(call, 0)
        nxt = calls[i + 1] if i + 1 < len(calls) else None
        if nxt is not None and len(nxt.request_messages) > len(call.request_messages) + 1:
            obs = _observation(nxt.request_messages[len(call.request_messages) + 1:], {c.id for c in call.tool_calls})
            if obs:
                step["observation"] = obs
        steps.append(step)
    for n, s in enumerate(steps, start=1):
        s["step_id"] = n
    usage = [c.usage for c in calls]
    return _none_empty({
        "schema_version": SCHEMA_VERSION,
        "session_id": traj.rollout_id,
        "trajectory_id": traj.rollout_id,
        "agent": _none_empty({"name": agent_name, "version": agent_version, "model_name": model or None,
                              "tool_definitions": next((c.tools for c in calls if c.tools), None)}),
        "steps": steps,
        "final_metrics": {"total_prompt_tokens": sum(u.prompt_tokens for u in usage),
                          "total_completion_tokens": sum(u.completion_tokens for u in usage),
                          "total_cached_tokens": sum(u.cached_tokens for u in usage), "total_steps": len(steps)},
        "notes": ("abandoned LLM calls (answers that never reached the agent) are left out"
                  if len(calls) < len(traj.steps) else None),
        "extra": _none_empty({"arena_rollout_id": traj.rollout_id, "task_id": traj.task_id,
                              "final_state": traj.final_state.value, "reward": traj.reward,
                              "passed": traj.verification.passed if traj.verification else None,
                              **(extra or {})}),
    })
