"""One proxied LLM call, end to end: validate, budget, inject, route, relay, capture, record.

``ProxyHandler.call`` returns a whole answer or a ``Relay`` of SSE pieces. The captured
``Step`` is recorded off the answer's path, in order per rollout, while the budgets stay
exact in memory; a stream that ends early is recorded ``incomplete``. docs/rollout.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
import msgspec

from arena_core import metrics, subjects, telemetry
from arena_core.bus import Bus
from arena_core.errors import (
    ArenaError,
    BudgetExhausted,
    InvalidRequest,
    NotFound,
    Unauthorized,
    UpstreamError,
    WallClockExceeded,
)
from arena_core.schemas import (
    Failover,
    PromptCount,
    RolloutRecord,
    RolloutState,
    SamplingParams,
    Step,
    Timings,
    ToolCall,
)

from arena_rollout.proxy import answers
from arena_rollout.proxy.budget import Admission, admit, prompt_upper_bound
from arena_rollout.proxy.capture import Capture
from arena_rollout.proxy.delivery import Delivery, Orphans
from arena_rollout.proxy.flavours import FLAVOURS, Translation, Translator
from arena_rollout.proxy.openai_api import validate_chat_body, validate_completions_body
from arena_rollout.proxy.policy import Api, apply_sampling
from arena_rollout.proxy.routing import Router
from arena_rollout.proxy.upstream import (
    TRANSPORT_ERRORS,
    Upstream,
    UpstreamClient,
    count_prompt,
    describe,
    tokenize_url,
    open_call,
    sse_events,
)
from arena_rollout.store import RolloutStore

log = logging.getLogger("arena.rollout.proxy")

_SIDE_TIMEOUT = aiohttp.ClientTimeout(total=30.0)
_SAMPLED_PER_ROLLOUT = 1024
_SSE = b"text/event-stream; charset=utf-8"


def _path(api: str) -> str:
    """The backend's route for ``api``: every API but completions is sent as chat."""
    return "/completions" if api == "openai.completions" else "/chat/completions"


class Lifecycle(Protocol):
    async def transition(self, rollout_id: str, target: RolloutState, *, reason: str) -> Any: ...


class _Broken(Exception):
    def __init__(self, message: str, replica_down: bool):
        super().__init__(message)
        self.message = message
        self.replica_down = replica_down


class _AnswerShape(msgspec.Struct):
    """What a whole answer must have before it is relayed (the rest is captured later)."""

    choices: list[msgspec.Raw]
    usage: Any = None


_answer_shape = msgspec.json.Decoder(_AnswerShape)


class _ChunkShape(msgspec.Struct):
    """What the relay reads of a stream chunk (the rest is captured while recording)."""

    choices: list[msgspec.Raw] = []
    usage: Any = None
    error: Any = msgspec.UNSET


_chunk_shape = msgspec.json.Decoder(_ChunkShape)


class _Call(msgspec.Struct, kw_only=True):
    """What recording a call needs besides the captured answer."""

    rollout_id: str
    api: str
    sent: dict[str, Any]
    applied: SamplingParams
    started_at: float
    t0: float
    stream: bool
    counted: tuple[int, int]  # the rollout's (steps, total_tokens) when the call was admitted
    prompt_count: PromptCount | None = None  # how the token budget counted the prompt
    counting_failovers: list[Failover] = []  # replicas left while counting the prompt
    reserve: int = 0  # tokens held in the rollout's flight until the call's usage is known
    released: bool = False
    delivery: Delivery | None = None  # a whole answer's: settled by the server
    abandoned: bool = False  # the client left before any of the answer reached it
    strip: tuple[bool, bool] = (False, False)  # (logprobs, token ids) the client did not ask for
    translation: Any = None  # a translated API's call (flavours.Translation); None: OpenAI's own


class _Flight:
    """A rollout's admitted calls whose usage is not known yet, and the most they may spend."""

    __slots__ = ("calls", "reserved", "idle")

    def __init__(self) -> None:
        self.calls = 0
        self.reserved = 0
        self.idle = asyncio.Event()


class Relay:
    """A relayed stream; closing it before it started still runs ``on_unstarted`` (an
    async generator that never started would skip its ``finally``). ``final`` is set when
    the piece just returned is the stream's last: the server sends it together with the
    end of the response (one write, so the client is done one wake-up sooner)."""

    def __init__(self, gen: AsyncIterator[bytes], on_unstarted, content_type: bytes = _SSE):
        self._gen = gen
        self._on_unstarted = on_unstarted
        self._started = False
        self.final = False
        self.content_type = content_type

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        self._started = True
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        if not self._started:
            self._started = True
            self._on_unstarted()
        await self._gen.aclose()


class ProxyHandler:
    def __init__(self, *, bus: Bus, store: RolloutStore, lifecycle: Lifecycle, router: Router,
                 http: UpstreamClient):
        self.bus = bus
        self.store = store
        self.lifecycle = lifecycle
        self.router = router
        self.http = http
        self._background: set[asyncio.Task] = set()
        self._tail: dict[str, asyncio.Task] = {}  # the last step being recorded, per rollout
        #: per rollout with recordings pending: (steps, total_tokens) once they have landed
        self._ahead: dict[str, tuple[int, int]] = {}
        #: per rollout under a token budget with calls in flight: what they hold
        self._flights: dict[str, _Flight] = {}
        #: calls whose client left before the answer, for the retry that takes it
        self.orphans = Orphans()
        #: per rollout: tool call id -> the arguments text the backend sampled (restore_arguments)
        self._sampled: dict[str, dict[str, str]] = {}
        #: per rollout: seconds its calls waited for a backend slot (parallel waits once), left
        #: out of its wall clock (``off_clock_s``)
        self._off_clock: dict[str, float] = {}
        #: per rollout and translated API: what that API keeps between calls (the Responses
        #: API's stored responses), dropped when the rollout settles
        self._memory: dict[str, dict[str, Any]] = {}

    # ---------------------------------------------------------------- entry

    async def call(self, record: RolloutRecord, api: Api, payload: Any,
                   delivery: Delivery | None = None) -> bytes | dict | Relay:
        """``delivery``: for a whole answer, settled by the server once it knows whether the
        answer reached the agent; the step is recorded after (``abandoned`` if not)."""
        rid = record.rollout_id
        record = self._counted(record)
        flavour = FLAVOURS.get(api)
        translation: Translation | None = None
        if flavour is not None:
            translation = flavour.translate(payload, self._memory_of(rid, api))
            body = translation.body
        elif api == "openai.completions":
            body = validate_completions_body(payload)
        else:
            body = validate_chat_body(payload)
        if api != "openai.completions":
            self._restore_arguments(rid, body)
        stream = bool(body.get("stream"))
        client_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        counting_failovers: list[Failover] = []
        try:  # sampling injected, then the budgets checked and max_tokens capped on what will be sent
            if record.task.budget.max_total_tokens is None:
                admitted = admit(record, body, api=api, now=time.time(), off_clock_s=self.off_clock_s(rid))
            else:  # may count the prompt (/tokenize) or wait for the rollout's calls in flight
                record, admitted, counting_failovers = await self._admit_budgeted(record, body, api)
        except (WallClockExceeded, BudgetExhausted) as exc:
            target = RolloutState.TIMED_OUT if isinstance(exc, WallClockExceeded) else RolloutState.BUDGET_EXHAUSTED
            await self.lifecycle.transition(rid, target, reason=exc.message)
            raise
        sent = admitted.body  # a dict of its own (sampling injection copies the agent's)
        if record.model and record.model != "default":
            sent["model"] = record.model
        call = _Call(rollout_id=rid, api=api, sent=sent, applied=admitted.applied, started_at=time.time(),
                     t0=time.perf_counter(), stream=stream, counted=(record.steps, record.total_tokens),
                     prompt_count=admitted.prompt, reserve=admitted.reserve, counting_failovers=counting_failovers,
                     delivery=delivery, strip=answers.unasked(api, payload), translation=translation)
        try:
            up = await open_call(router=self.router, http=self.http, rollout_id=rid, model=record.model,
                                 path=_path(api), body=msgspec.json.encode(sent), whole=not stream)
        except BaseException:
            self._release(call)
            raise
        if up.off_clock_ms > 0:
            self._off_clock[rid] = self._off_clock.get(rid, 0.0) + up.off_clock_ms / 1000
        if not stream:
            try:
                return await self._whole(call, up)
            finally:
                self._release(call)  # a call that failed without a step frees what it held

        def unstarted() -> None:  # the client went away before the first byte: still free the slot, record
            call.abandoned = True
            total_ms = (time.perf_counter() - call.t0) * 1000
            self._spawn(call, up, Capture(), None, total_ms, "client disconnected before the stream started")

        translator = translation.stream() if translation is not None else None
        relay = Relay(self._relay(call, up, translator, client_usage=client_usage,
                                  mark_final=lambda: setattr(relay, "final", True)), unstarted,
                      _SSE if translator is None else translator.content_type)
        return relay

    def _memory_of(self, rollout_id: str, api: str) -> Any:
        """What ``api`` keeps for ``rollout_id`` between calls (made on first use)."""
        kept = self._memory.setdefault(rollout_id, {})
        if api not in kept:
            kept[api] = FLAVOURS[api].memory()
        return kept[api]

    # ---------------------------------------------------------------- budgets

    def off_clock_s(self, rollout_id: str) -> float:
        """Seconds the rollout's calls waited in this proxy's queue for a backend slot
        (parallel waits counted once): not the agent's time, left out of its wall clock."""
        return self._off_clock.get(rollout_id, 0.0) + self.router.waiting_s(rollout_id)

    async def _admit_budgeted(self, record: RolloutRecord, body: dict[str, Any],
                              api: Api) -> tuple[RolloutRecord, Admission, list[Failover]]:
        """Admit a call of a rollout with ``max_total_tokens``: sampling injected, then the
        budget capped on what will be sent. A tight call's prompt is counted first (the
        serving replica's ``/tokenize``, else an upper bound); a call that fits only if the
        rollout's calls in flight spend less than they hold waits for them. The admitted call
        holds its ``reserve`` until ``_release``. Returns the record it was admitted on, the
        admission, and the replicas left while counting (for the step's ``failovers``)."""
        rid = record.rollout_id
        prompt: PromptCount | None = None
        failovers: list[Failover] = []
        while True:
            flight = self._flights.get(rid)
            admitted = admit(record, body, api=api, now=time.time(), prompt=prompt,
                             reserved=flight.reserved if flight is not None else 0, off_clock_s=self.off_clock_s(rid))
            if admitted.verdict == "send":
                self._hold(rid, admitted.reserve)
                return record, admitted, failovers
            if admitted.verdict == "wait" and flight is not None:
                await flight.idle.wait()
                record = self._counted(await self.store.current(rid))
                if record.state not in (RolloutState.PROVISIONING, RolloutState.RUNNING):
                    raise Unauthorized(f"rollout {rid} is {record.state.value}; its key is no longer valid")
                continue
            prompt, failovers = await self._count_prompt(record, admitted.body, api)

    async def _count_prompt(self, record: RolloutRecord, sent: dict[str, Any],
                            api: Api) -> tuple[PromptCount, list[Failover]]:
        rid = record.rollout_id
        if record.model and record.model != "default":  # counted for the model the call will name
            sent = {**sent, "model": record.model}
        counted = await count_prompt(router=self.router, http=self.http, rollout_id=rid, model=record.model,
                                     body=sent, chat=api != "openai.completions")
        if counted.tokens is not None:
            return PromptCount(tokens=counted.tokens, source="tokenize", replica=counted.replica), counted.failovers
        bound = prompt_upper_bound(sent, api)
        if bound is None:
            raise InvalidRequest(f"this prompt (non-text content or a chat template of its own) has no upper "
                                 f"bound, and {counted.why}: it cannot be admitted under the rollout's token budget")
        log.info("prompt of rollout %s not counted (%s): max_tokens capped on an upper bound of %d tokens",
                 rid, counted.why, bound, extra={"rollout_id": rid})
        return PromptCount(tokens=bound, source="fallback", replica=counted.replica,
                           note=f"{counted.why}: the budget counted an upper bound of the prompt"), counted.failovers

    def _hold(self, rid: str, amount: int) -> None:
        if amount <= 0:
            return
        flight = self._flights.get(rid)
        if flight is None:
            flight = self._flights[rid] = _Flight()
        flight.calls += 1
        flight.reserved += amount

    def _release(self, call: _Call) -> None:
        """The call's usage is known (or it failed): what it held is free (once)."""
        if call.released or call.reserve <= 0:
            return
        call.released = True
        flight = self._flights.get(call.rollout_id)
        if flight is None:
            return
        flight.calls -= 1
        flight.reserved -= call.reserve
        if flight.calls <= 0:
            del self._flights[call.rollout_id]
            flight.idle.set()

    # ---------------------------------------------------------------- tool call arguments

    def _remember(self, rollout_id: str, calls: list[ToolCall]) -> None:
        sampled = self._sampled.setdefault(rollout_id, {})
        for tc in calls:
            if tc.id:
                sampled[tc.id] = tc.arguments
        while len(sampled) > _SAMPLED_PER_ROLLOUT:
            del sampled[next(iter(sampled))]

    def _restore_arguments(self, rollout_id: str, body: dict[str, Any]) -> None:
        """Tool calls the agent sends back re-serialized (another spacing or key order,
        Anthropic ``input`` objects) get the arguments text the backend sampled when both
        mean the same JSON: the conversation stays token-exact for training (docs/rollout.md)."""
        sampled = self._sampled.get(rollout_id)
        if not sampled:
            return
        for message in body.get("messages") or ():
            if not isinstance(message, dict) or message.get("role") != "assistant":
                continue
            for tc in message.get("tool_calls") or ():
                fn = tc.get("function") if isinstance(tc, dict) else None
                text = sampled.get(tc.get("id")) if fn is not None else None
                if text is None or not isinstance(fn, dict) or fn.get("arguments") == text:
                    continue
                try:
                    if json.loads(fn.get("arguments") or "null") == json.loads(text):
                        fn["arguments"] = text
                except (TypeError, ValueError):
                    continue

    # ---------------------------------------------------------------- side routes

    async def count_tokens(self, record: RolloutRecord, payload: Any, api: Api = "anthropic.messages") -> int:
        """A translated API's token count (Anthropic's ``count_tokens``, Gemini's
        ``countTokens``): the prompt of a request as the rollout's backend counts it (its
        ``/tokenize``), else the proxy's upper bound. Not a step."""
        body = FLAVOURS[api].count_body(payload)
        if record.model and record.model != "default":
            body["model"] = record.model
        counted = await count_prompt(router=self.router, http=self.http, rollout_id=record.rollout_id,
                                     model=record.model, body=body, chat=True)
        if counted.tokens is not None:
            return counted.tokens
        bound = prompt_upper_bound(body, api)
        if bound is None:
            raise UpstreamError(f"the backend cannot count tokens ({counted.why}) and the request has "
                                "parts the proxy cannot bound")
        return bound

    async def passthrough(self, record: RolloutRecord, what: str, payload: Any) -> tuple[int, bytes]:
        """vLLM's ``/tokenize`` or ``/detokenize`` at the backend serving the rollout: its
        answer as is, or a 404 saying it has none. Not a step."""
        if not isinstance(payload, dict):
            raise InvalidRequest("request body must be a JSON object")
        if record.model and record.model != "default":
            payload = {**payload, "model": record.model}
        state = self.router.candidates(record.rollout_id, record.model)[0]
        url = tokenize_url(state.replica.url)[: -len("tokenize")] + what
        try:
            response = await self.http.post(url, msgspec.json.encode(payload), timeout=_SIDE_TIMEOUT)
            try:
                data = await response.read()
            finally:
                response.close()
        except TRANSPORT_ERRORS as exc:
            raise UpstreamError(f"backend replica {state.id} failed on /{what}: {describe(exc)}") from None
        if response.status in (404, 405, 501):
            raise NotFound(f"the backend serving this rollout has no /{what} (replica {state.id} answered "
                           f"{response.status})")
        return response.status, data

    # ---------------------------------------------------------------- the judge

    async def judge(self, record: RolloutRecord, payload: Any) -> bytes:
        """A verifier's judge call about ``record``: routed like the agent's calls (replicas,
        health, failover; logprobs and token ids requested) but never recorded as a step,
        never counted against the rollout's budgets and never published. Whole answers only."""
        body = validate_chat_body(payload)
        if body.get("stream"):
            raise InvalidRequest("the judge route answers whole completions only; send \"stream\": false")
        sent, _ = apply_sampling(body, SamplingParams(), api="openai.chat")
        model = str(sent.get("model") or "")
        key = f"judge:{record.rollout_id}"  # a routing key of its own: never moves the rollout's sticky replica
        up = await open_call(router=self.router, http=self.http, rollout_id=key, model=model,
                             path=_path("openai.chat"), body=msgspec.json.encode(sent), whole=True)
        self.router.forget(key)
        up.close()
        return up.body  # read whole already (a replica failing mid-answer failed over)

    # ---------------------------------------------------------------- whole answers

    async def _whole(self, call: _Call, up: Upstream) -> bytes | dict:
        rid = up.replica.id
        data = up.body  # read whole already (a replica failing mid-answer failed over)
        up.close()
        total_ms = (time.perf_counter() - call.t0) * 1000
        try:
            shape = _answer_shape.decode(data)  # valid JSON with choices: checked on the answer's path
        except msgspec.ValidationError as exc:
            raise UpstreamError(f"backend replica {rid} answered without choices ({exc}): {data[:200]!r}") from None
        except msgspec.DecodeError as exc:
            raise UpstreamError(f"backend replica {rid} answered invalid JSON ({exc}): {data[:200]!r}") from None
        if not shape.choices:
            raise UpstreamError(f"backend replica {rid} answered an empty choices list: {data[:200]!r}")
        cap = Capture()
        if call.translation is None and isinstance(shape.usage, dict):
            # the answer goes back as the backend sent it (less what the client did not ask
            # for); its tokens are captured while recording
            cap.usage = shape.usage  # counted against the budget now
            if not any(call.strip):
                self._spawn(call, up, cap, total_ms, total_ms, None, answer=data)
                return data
            doc = msgspec.json.decode(data)  # decoded once: the client's copy, then the capture
            trimmed = answers.without(doc, *call.strip)
            self._spawn(call, up, cap, total_ms, total_ms, None, answer=doc)
            return data if trimmed is None else msgspec.json.encode(trimmed)
        answer = msgspec.json.decode(data)
        self._fill(call, cap, answer)
        self._spawn(call, up, cap, total_ms, total_ms, None)
        if call.translation is not None:
            return call.translation.answer(answer)
        trimmed = answers.without(answer, *call.strip) if any(call.strip) else None
        return data if trimmed is None else msgspec.json.encode(trimmed)

    @staticmethod
    def _fill_chunks(call: _Call, cap: Capture, chunks: list[bytes]) -> None:
        add = cap.add_completion_chunk if call.api == "openai.completions" else cap.add_chat_chunk
        usage = cap.usage
        for payload in chunks:
            add(msgspec.json.decode(payload))
        cap.usage = cap.usage or usage

    @staticmethod
    def _fill(call: _Call, cap: Capture, answer: Any) -> None:
        if call.api == "openai.completions":
            cap.add_completion(answer)
        else:
            cap.add_chat(answer)

    # ---------------------------------------------------------------- streams

    async def _relay(self, call: _Call, up: Upstream, translator: Translator | None, *, client_usage: bool,
                     mark_final=lambda: None) -> AsyncIterator[bytes]:
        """The client's stream, read by read. The step is spawned once the last piece was
        handed over (capturing it, when the backend reported no usage, is then off the
        client's path): the server writes that piece with the response's end and asks for
        more in the same loop step, so the call's tokens count in ``_ahead`` before the proxy
        can read the client's next request."""
        cap = Capture()
        add = cap.add_completion_chunk if call.api == "openai.completions" else cap.add_chat_chunk
        buffer = bytearray()
        chunks: list[bytes] = []  # OpenAI chunks relayed, not yet captured
        first_ms: float | None = None
        phase = "streaming"
        replica = up.replica.id
        out: list[bytes] = []  # what arrived in one read, relayed at once
        strip = any(call.strip)
        try:
            done = False
            try:
                async for data in up.chunks():
                    for payload in sse_events(buffer, data):
                        if payload == b"[DONE]":
                            done = True
                            break
                        try:
                            shape = _chunk_shape.decode(payload)
                        except msgspec.ValidationError:
                            raise _Broken(f"backend replica {replica} reported an error mid-stream: "
                                          f"{payload[:300]!r}", False) from None
                        except msgspec.DecodeError as exc:
                            raise _Broken(f"backend replica {replica} sent an invalid stream chunk ({exc}): "
                                          f"{payload[:200]!r}", False) from None
                        if shape.error is not msgspec.UNSET:
                            raise _Broken(f"backend replica {replica} reported an error mid-stream: "
                                          f"{payload[:300]!r}", False)
                        if first_ms is None and shape.choices:
                            first_ms = (time.perf_counter() - call.t0) * 1000
                        if translator is not None:
                            chunk = msgspec.json.decode(payload)
                            add(chunk)
                            out += translator.feed(chunk)
                            continue
                        if shape.usage:
                            cap.usage = shape.usage  # counted against the budget when the call ends
                        chunks.append(payload)  # captured while recording, off the relay's path
                        if shape.choices or client_usage:
                            if strip:
                                payload = answers.stripped(payload, *call.strip)
                            out.append(b"data: " + payload + b"\n\n")
                    if done:
                        break  # what this read brought goes out with the end
                    if out:
                        relay, out = b"".join(out), []
                        yield relay
            except TRANSPORT_ERRORS as exc:
                raise _Broken(f"backend replica {replica} died mid-stream: {describe(exc)}", True) from None
            if not done:
                raise _Broken(f"backend replica {replica} closed the stream before [DONE]", True)
            phase = "ending"
            total_ms = (time.perf_counter() - call.t0) * 1000
            mark_final()
            out += translator.end() if translator is not None else (b"data: [DONE]\n\n",)
            yield b"".join(out)
        except _Broken as exc:
            phase = "broken"
            log.warning("%s", exc.message, extra={"rollout_id": call.rollout_id})
            if exc.replica_down:
                self.router.mark_down(replica, exc.message)
            total_ms = (time.perf_counter() - call.t0) * 1000
            self._spawn(call, up, cap, first_ms, total_ms, exc.message, chunks=chunks)
            if translator is not None:
                out.append(translator.error(exc.message))
            else:
                out.append(b"data: " + msgspec.json.encode(
                    {"error": {"message": exc.message, "type": "upstream_error", "code": "upstream_error"}}) + b"\n\n")
            mark_final()
            yield b"".join(out)  # what was captured before the break reaches the client too
        finally:
            if phase == "ending":  # the whole stream was relayed (the last piece handed over)
                self._spawn(call, up, cap, first_ms, total_ms, None, chunks=chunks)
            elif phase == "streaming":  # the client went away (or the server is stopping)
                total_ms = (time.perf_counter() - call.t0) * 1000
                self._spawn(call, up, cap, first_ms, total_ms, "client disconnected mid-stream", chunks=chunks)

    def _counted(self, record: RolloutRecord) -> RolloutRecord:
        """``record`` with the steps and tokens of calls still being recorded counted in
        (counters only grow, so the larger of the stored and the pending view is exact)."""
        ahead = self._ahead.get(record.rollout_id)
        if ahead is None or (ahead[0] <= record.steps and ahead[1] <= record.total_tokens):
            return record
        return msgspec.structs.replace(record, steps=max(ahead[0], record.steps),
                                       total_tokens=max(ahead[1], record.total_tokens))

    def _spawn(self, call: _Call, up: Upstream, cap: Capture, first_ms: float | None, total_ms: float,
               error: str | None, *, answer: bytes | dict | None = None,
               chunks: list[bytes] | None = None) -> asyncio.Task:
        """Record a step in the background, after the rollout's previous one (steps keep their
        order); its turn and tokens count at once in ``_ahead``. ``answer`` / ``chunks``: a
        whole answer or stream chunks whose tokens are still to be captured into ``cap``
        (off the answer's path)."""
        rollout_id = call.rollout_id
        if chunks and cap.usage is None:  # no usage reported: the tokens are counted from the ids, now
            self._fill_chunks(call, cap, chunks)
            chunks = None
        steps, tokens = self._ahead.get(rollout_id, call.counted)
        steps, tokens = max(steps, call.counted[0]), max(tokens, call.counted[1])
        self._ahead[rollout_id] = (steps + 1, tokens + cap.usage_totals().total_tokens)
        self._release(call)  # its usage now counts in ``_ahead``: what it held is free
        coro = self._finish(call, up, cap, first_ms, total_ms, error, answer, chunks)
        previous = self._tail.get(rollout_id)

        async def ordered() -> None:
            # one loop turn later: the answer's bytes leave before this recording's work
            # (capturing, encoding) runs
            await asyncio.sleep(0)
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            await coro

        task = asyncio.get_running_loop().create_task(ordered())
        self._background.add(task)
        self._tail[rollout_id] = task

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if self._tail.get(rollout_id) is t:
                del self._tail[rollout_id]
                self._ahead.pop(rollout_id, None)  # every recording landed (or failed): the store knows

        task.add_done_callback(done)
        return task

    async def _finish(self, call: _Call, up: Upstream, cap: Capture, first_ms: float | None, total_ms: float,
                      error: str | None, answer: bytes | dict | None = None,
                      chunks: list[bytes] | None = None) -> None:
        up.close()
        if answer is not None or chunks:
            try:
                if answer is not None:
                    self._fill(call, cap, msgspec.json.decode(answer) if isinstance(answer, bytes) else answer)
                else:
                    self._fill_chunks(call, cap, chunks)
            except (UpstreamError, msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
                error = f"the answer could not be captured: {getattr(exc, 'message', exc)}"
                log.warning("%s", error, extra={"rollout_id": call.rollout_id})
        if cap.tool_calls:
            self._remember(call.rollout_id, cap.tool_calls)
        abandoned = call.abandoned
        if call.delivery is not None and not abandoned:
            try:  # settled by the server at once, or within the retry window for an orphan
                abandoned = not await asyncio.wait_for(call.delivery.delivered(), self.orphans.window_s + 10.0)
            except TimeoutError:  # never settled (a bug): record the step as delivered rather than wait on
                log.warning("rollout %s: no word on whether an answer reached the agent; recorded as delivered",
                            call.rollout_id, extra={"rollout_id": call.rollout_id})
        try:
            await self._record(call, up, cap, first_token_ms=first_ms or total_ms, total_ms=total_ms,
                               incomplete=error is not None, error=error, abandoned=abandoned)
        except (ArenaError, OSError) as exc:  # never lose the reason a step is missing
            log.error("step of rollout %s not recorded: %s", call.rollout_id, exc,
                      extra={"rollout_id": call.rollout_id})

    async def settle(self, rollout_id: str) -> None:
        """Wait until the steps of ``rollout_id`` being recorded here have landed (or failed);
        its orphaned answers are abandoned (the rollout ended: no retry will take them)."""
        self.orphans.abandon(rollout_id)
        self._sampled.pop(rollout_id, None)
        self._off_clock.pop(rollout_id, None)
        self._memory.pop(rollout_id, None)
        tail = self._tail.get(rollout_id)
        if tail is not None:
            await asyncio.gather(asyncio.shield(tail), return_exceptions=True)

    async def drain(self) -> None:
        """Wait for steps still being recorded (used at shutdown and by tests)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # ---------------------------------------------------------------- recording

    async def _record(self, call: _Call, up: Upstream, cap: Capture, *, first_token_ms: float, total_ms: float,
                      incomplete: bool = False, error: str | None = None, abandoned: bool = False) -> None:
        usage = cap.usage_totals()
        spent = usage.total_tokens
        prompt_count = call.prompt_count
        if prompt_count is not None and usage.prompt_tokens > prompt_count.tokens:
            # the count (or bound) was short: the backend rendered more than /tokenize did. Say so.
            why = (f"the backend reported {usage.prompt_tokens} prompt tokens, more than the "
                   f"{prompt_count.tokens} counted before sending")
            log.warning("rollout %s: %s (%s)", call.rollout_id, why, prompt_count.source,
                        extra={"rollout_id": call.rollout_id})
            prompt_count = msgspec.structs.replace(
                prompt_count, note=f"{prompt_count.note}; {why}" if prompt_count.note else why)

        def count(r: RolloutRecord) -> RolloutRecord:
            return msgspec.structs.replace(r, steps=r.steps + 1, total_tokens=r.total_tokens + spent,
                                           abandoned_steps=r.abandoned_steps + abandoned)

        before, _ = await self.store.update(call.rollout_id, count)
        replica = up.replica.replica
        step = cap.to_step(
            rollout_id=call.rollout_id, step_index=before.steps, api=call.api, request=call.sent,
            applied=call.applied, backend=replica.url, replica=replica.replica_id,
            policy_version=replica.policy_version or None,
            timings=Timings(queued_ms=up.queued_ms, first_token_ms=first_token_ms, total_ms=total_ms),
            started_at=call.started_at, stream=call.stream, incomplete=incomplete, error=error,
            failovers=[*call.counting_failovers, *up.failovers], prompt_count=prompt_count,
        )
        if abandoned:
            step = msgspec.structs.replace(step, abandoned=True)
        _measure(step, first_token_ms=first_token_ms, total_ms=total_ms)
        if not telemetry.enabled():
            await self.bus.publish(subjects.step(call.rollout_id), step,
                                   msg_id=subjects.msg_id(call.rollout_id, "step", step.step_index))
            return
        # the call's span, in the rollout's trace (the agent sends no trace context): the step
        # published in it carries it to the trajectory plane
        with telemetry.started_span("llm.call", parent=before.traceparent, start=call.started_at,
                                    end=call.started_at + total_ms / 1000, attributes=_call_attributes(step)):
            await self.bus.publish(subjects.step(call.rollout_id), step,
                                   msg_id=subjects.msg_id(call.rollout_id, "step", step.step_index))


def _measure(step: Step, *, first_token_ms: float, total_ms: float) -> None:
    """The call in the proxy's metrics (off the answer's path: while recording)."""
    metrics.proxy_call(step.api, incomplete=step.incomplete, total_s=total_ms / 1000,
                       first_token_s=first_token_ms / 1000, prompt_tokens=step.usage.prompt_tokens,
                       completion_tokens=step.usage.completion_tokens)


def _call_attributes(step: Step) -> dict[str, str | int | bool]:
    return {"arena.rollout_id": step.rollout_id, "arena.step_index": step.step_index, "arena.api": step.api,
            "gen_ai.request.model": step.model, "arena.backend_replica": step.backend_replica or step.backend,
            "gen_ai.usage.input_tokens": step.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": step.usage.completion_tokens, "arena.incomplete": step.incomplete}

