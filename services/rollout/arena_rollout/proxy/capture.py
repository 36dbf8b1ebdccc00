"""Token-exact capture: what the backend sent, accumulated into a ``Step``. Pure.

One ``Capture`` collects a call's tokens whether the answer came whole (``add_chat``,
``add_completion``) or in stream chunks (``add_chat_chunk``, ``add_completion_chunk``).
Token ids are taken only from the backend (vLLM/SGLang ``prompt_token_ids`` and
``choices[0].token_ids``); when a backend sends none the step says ``unavailable`` and
carries none: nothing is ever re-tokenized.
"""

from __future__ import annotations

from typing import Any

from arena_core.errors import UpstreamError
from arena_core.schemas import (
    Failover,
    PolicySpan,
    PromptCount,
    SamplingParams,
    Step,
    Timings,
    ToolCall,
    TopLogprob,
    Usage,
)

from arena_rollout.proxy.policy import Api


class Capture:
    """Mutable accumulator of one call's answer."""

    def __init__(self) -> None:
        self.model = ""
        #: top-level ``policy_version`` of the answer (Arena's policy server sets it): the
        #: version that actually served the call, preferred over the registry's.
        self.served_version: str | None = None
        self.spans: list[PolicySpan] = []  # the answer's ``policy_versions`` (a partial rollout)
        self.prompt_ids: list[int] | None = None
        self.completion_ids: list[int] = []
        self.ids_missing = False  # some content arrived without its token ids
        self.logprobs: list[float] = []
        self.top: list[list[TopLogprob]] = []
        self.has_top = False
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.chunks = 0

    # ---------------------------------------------------------------- pieces

    def _ids(self, ids: Any, has_content: bool) -> None:
        if isinstance(ids, list):
            self.completion_ids.extend(ids)
        elif has_content:
            self.ids_missing = True

    def _chat_logprobs(self, lp: Any) -> None:
        for item in (lp or {}).get("content") or []:
            self.logprobs.append(float(item["logprob"]))
            alts = item.get("top_logprobs") or []
            self.has_top = self.has_top or bool(alts)
            self.top.append([TopLogprob(token=a["token"], logprob=float(a["logprob"])) for a in alts])

    def _completion_logprobs(self, lp: Any) -> None:
        if not lp:
            return
        self.logprobs.extend(float(x) for x in lp.get("token_logprobs") or [])
        for alts in lp.get("top_logprobs") or []:
            alts = alts or {}
            self.has_top = self.has_top or bool(alts)
            self.top.append([TopLogprob(token=t, logprob=float(v)) for t, v in alts.items()])

    def _tool_call_deltas(self, deltas: list[dict[str, Any]]) -> None:
        for i, d in enumerate(deltas):
            slot = self.calls.setdefault(int(d.get("index", i)), {"id": "", "name": "", "arguments": ""})
            fn = d.get("function") or {}
            slot["id"] = d.get("id") or slot["id"]
            slot["name"] = fn.get("name") or slot["name"]
            slot["arguments"] += fn.get("arguments") or ""

    def _finish(self, choice: dict[str, Any]) -> None:
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    # ---------------------------------------------------------------- whole answers

    @staticmethod
    def _first_choice(response: Any) -> dict[str, Any]:
        if not isinstance(response, dict) or not isinstance(response.get("choices"), list) or not response["choices"]:
            raise UpstreamError("backend response has no choices")
        choice = response["choices"][0]
        if not isinstance(choice, dict):
            raise UpstreamError("backend response choice is not an object")
        return choice

    def add_chat(self, response: Any) -> None:
        choice = self._first_choice(response)
        self.model = str(response.get("model") or "")
        self.served_version = _served_version(response)
        self.spans = _spans(response)
        self.prompt_ids = response.get("prompt_token_ids")
        message = choice.get("message") or {}
        content = message.get("content") or ""
        self.text.append(content)
        self._tool_call_deltas(message.get("tool_calls") or [])
        self._ids(choice.get("token_ids"), True)
        self._chat_logprobs(choice.get("logprobs"))
        self._finish(choice)
        self.usage = response.get("usage")

    def add_completion(self, response: Any) -> None:
        choice = self._first_choice(response)
        self.model = str(response.get("model") or "")
        self.served_version = _served_version(response)
        self.spans = _spans(response)
        self.prompt_ids = choice.get("prompt_token_ids", response.get("prompt_token_ids"))
        self.text.append(choice.get("text") or "")
        self._ids(choice.get("token_ids"), True)
        self._completion_logprobs(choice.get("logprobs"))
        self._finish(choice)
        self.usage = response.get("usage")

    # ---------------------------------------------------------------- stream chunks

    def add_chat_chunk(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        self.model = self.model or str(chunk.get("model") or "")
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        self._chunk_versions(chunk)
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            content = delta.get("content") or ""
            self.text.append(content)
            self._tool_call_deltas(delta.get("tool_calls") or [])
            self._ids(choice.get("token_ids"), bool(content or delta.get("tool_calls")))
            self._chat_logprobs(choice.get("logprobs"))
            self._finish(choice)

    def add_completion_chunk(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        self.model = self.model or str(chunk.get("model") or "")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        self._chunk_versions(chunk)
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if choice.get("prompt_token_ids") is not None:
                self.prompt_ids = choice["prompt_token_ids"]
            text = choice.get("text") or ""
            self.text.append(text)
            self._ids(choice.get("token_ids"), bool(text))
            self._completion_logprobs(choice.get("logprobs"))
            self._finish(choice)

    def _chunk_versions(self, chunk: dict[str, Any]) -> None:
        """A stream's version is the last chunk's that names one (a partial rollout's changes)."""
        self.served_version = _served_version(chunk) or self.served_version
        self.spans = _spans(chunk) or self.spans

    # ---------------------------------------------------------------- results

    @property
    def completion_text(self) -> str:
        return "".join(self.text)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"])
                for _, c in sorted(self.calls.items())]

    def usage_totals(self) -> Usage:
        raw = self.usage or {}
        prompt = int(raw.get("prompt_tokens") or (len(self.prompt_ids) if self.prompt_ids else 0))
        completion = int(raw.get("completion_tokens") or len(self.completion_ids))
        total = int(raw.get("total_tokens") or 0) or prompt + completion
        # the backend speaks chat completions whatever API the agent used (the translated APIs
        # report this same figure in their own fields: anthropic.py, responses.py, gemini.py)
        cached = int((raw.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total,
                     cached_tokens=min(cached, prompt))

    def to_step(self, *, rollout_id: str, step_index: int, api: Api, request: dict[str, Any],
                applied: SamplingParams, backend: str, replica: str | None, policy_version: str | None,
                timings: Timings, started_at: float, stream: bool, incomplete: bool = False,
                error: str | None = None, failovers: list[Failover] | None = None,
                prompt_count: PromptCount | None = None) -> Step:
        ids_ok = self.prompt_ids is not None and not self.ids_missing and (
            bool(self.completion_ids) or not self.completion_text)
        source = "backend" if ids_ok else "unavailable"
        return Step(
            rollout_id=rollout_id,
            step_index=step_index,
            api=api,
            model=self.model or str(request.get("model") or ""),
            backend=backend,
            backend_replica=replica,
            policy_version=self.served_version or policy_version,
            policy_spans=list(self.spans),
            request_messages=list(request.get("messages") or []),
            request_prompt=request.get("prompt"),
            tools=request.get("tools"),
            sampling=applied,
            prompt_token_ids=list(self.prompt_ids) if ids_ok and self.prompt_ids is not None else None,
            completion_token_ids=list(self.completion_ids) if ids_ok else None,
            logprobs=list(self.logprobs) or None,
            top_logprobs=list(self.top) if self.has_top else None,
            token_ids_source=source,
            completion_text=self.completion_text,
            tool_calls=self.tool_calls,
            finish_reason=self.finish,
            usage=self.usage_totals(),
            timings=timings,
            started_at=started_at,
            stream=stream,
            incomplete=incomplete,
            error=error,
            failovers=list(failovers or []),
            prompt_count=prompt_count,
        )


def _served_version(response: dict[str, Any]) -> str | None:
    version = response.get("policy_version")
    return str(version) if isinstance(version, (str, int)) and not isinstance(version, bool) and version != "" else None


def _spans(response: dict[str, Any]) -> list[PolicySpan]:
    """``policy_versions`` of an answer: ``[{"version", "from_token"}, ...]`` when more than one
    policy sampled it (Arena's policy server, partial rollouts); malformed entries are ignored."""
    raw = response.get("policy_versions")
    if not isinstance(raw, list) or len(raw) < 2:
        return []
    spans = []
    for item in raw:
        if isinstance(item, dict) and isinstance(item.get("from_token"), int) and _served_version(
                {"policy_version": item.get("version")}) is not None:
            spans.append(PolicySpan(version=str(item["version"]), start=item["from_token"]))
    return spans if len(spans) == len(raw) else []


def capture(*, rollout_id: str, step_index: int, request: dict[str, Any], response: Any,
            applied: SamplingParams, backend: str, policy_version: str | None, timings: Timings,
            started_at: float, api: Api = "openai.chat", replica: str | None = None) -> Step:
    """The ``Step`` of one whole (non-streamed) chat or completions answer."""
    cap = Capture()
    if api == "openai.completions":
        cap.add_completion(response)
    else:
        cap.add_chat(response)
    return cap.to_step(rollout_id=rollout_id, step_index=step_index, api=api, request=request, applied=applied,
                       backend=backend, replica=replica, policy_version=policy_version, timings=timings,
                       started_at=started_at, stream=False)
