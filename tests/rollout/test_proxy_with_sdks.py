"""The LLM proxy with real clients: the ``openai`` and ``anthropic`` SDKs against the real
rollout app under uvicorn, in front of real scripted vLLM-shaped backends under uvicorn,
with a real nats-server. What the backends sent is recorded at the wire and compared
with the captured steps byte for byte."""

from __future__ import annotations

import asyncio
import socket

import anthropic
import httpx
import msgspec
import openai
import pytest

from arena_core import subjects
from arena_core.runtime import serve
from arena_core.schemas import AgentSpec, BackendReplica, Budget, RolloutState, SamplingParams, Step, \
    SubmitRolloutRequest, Task, TestsVerifier
from arena_stack.scripted_llm import Faults, Script, ScriptedLLM, ScriptedResponse, ScriptedToolCall
from arena_stack.scripted_llm import create_app as create_llm_app
from arena_core.settings import Settings
from arena_core.tokens import single_sequence
from arena_rollout.app import create_app
from arena_rollout.proxy.routing import Router
from arena_rollout.proxy.upstream import UpstreamClient
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore
from tests.steps_reader import read_steps

SCRIPT = Script(responses=[
    ScriptedResponse(label="text", content="The fix: use ordered[mid - 1] — naïve ✓ indexing was off by one."),
    ScriptedResponse(label="tool", tool_calls=[ScriptedToolCall(name="read_file", arguments='{"path": "a.py"}')]),
])
OPENAI_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
ANTHROPIC_TOOLS = [{"name": "read_file", "description": "read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


class Recorder:
    """ASGI wrapper keeping every request and response body of the backend's completions
    (``bodies`` / ``requests``: generation calls only), as bytes on the wire, its
    ``/tokenize`` requests apart (``tokenized``), and the most calls it ever had in flight."""

    def __init__(self, app):
        self.app = app
        self.bodies: list[bytes] = []
        self.requests: list[bytes] = []
        self.tokenized: list[bytes] = []
        self.active = self.peak = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if scope["path"] == "/tokenize":  # recorded on arrival: an app may answer without reading it
            slot = len(self.tokenized)
            self.tokenized.append(b"")

            async def counted():
                message = await receive()
                self.tokenized[slot] += message.get("body", b"")
                return message

            return await self.app(scope, counted, send)
        buf, request = bytearray(), bytearray()

        async def incoming():
            message = await receive()
            if message["type"] == "http.request":
                request.extend(message.get("body", b""))
                if not message.get("more_body", False):
                    self.requests.append(bytes(request))
            return message

        async def record(message):
            if message["type"] == "http.response.body":
                buf.extend(message.get("body", b""))
            await send(message)

        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await self.app(scope, incoming, record)
        finally:
            self.active -= 1
            self.bodies.append(bytes(buf))


def sent_tokens(raw: bytes) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, completion ids, logprobs) as the backend put them on the wire."""
    if raw.startswith(b"data:"):
        docs = [msgspec.json.decode(e[5:]) for e in raw.split(b"\n\n") if e.startswith(b"data:")
                and e[5:].strip() != b"[DONE]"]
    else:
        docs = [msgspec.json.decode(raw)]
    prompt, completion, lps = [], [], []
    for d in docs:
        prompt += d.get("prompt_token_ids") or []
        for c in d.get("choices") or []:
            prompt += c.get("prompt_token_ids") or []
            completion += c.get("token_ids") or []
            lp = c.get("logprobs") or {}
            lps += [x["logprob"] for x in lp.get("content") or []] + list(lp.get("token_logprobs") or [])
    return prompt, completion, lps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start(app, stops: list) -> str:
    port, stop = free_port(), asyncio.Event()
    task = asyncio.create_task(serve(stop, app=app, port=port))
    stops.append((stop, task))
    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return f"http://127.0.0.1:{port}"
        except OSError:
            await asyncio.sleep(0.02)
    raise RuntimeError("server did not start")


class Stack:
    def __init__(self, bus, service, url, backends):
        self.bus, self.service, self.url, self.backends = bus, service, url, backends

    async def rollout(self, tmp_path, *, sampling: SamplingParams | None = None, model: str = "default",
                      **budget) -> tuple[str, str]:
        repo = tmp_path / "repo"
        repo.mkdir(exist_ok=True)
        task = Task(id="t", repo=str(repo), instructions="fix", agent=AgentSpec(command=["true"]),
                    verifier=TestsVerifier(fail_to_pass=["t::x"]), budget=Budget(**budget))
        record = await self.service.submit(SubmitRolloutRequest(task=task, sampling=sampling or SamplingParams(),
                                                                model=model))
        await self.service.transition(record.rollout_id, RolloutState.RUNNING, reason="test")
        return record.rollout_id, record.api_key

    def openai(self, rid: str, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/proxy/{rid}/v1", api_key=key, max_retries=0)

    def anthropic(self, rid: str, key: str) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=f"{self.url}/proxy/{rid}", api_key=key, max_retries=0)

    async def steps(self, rid: str, n: int) -> list[Step]:
        await self.service.proxy.drain()
        return await read_steps(self.bus, rid, n, within=10)


@pytest.fixture
async def stack(bus, tmp_path):
    stops: list = []
    pools: list[UpstreamClient] = []
    http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0))

    async def build(*, prefix_cache_block: int = 0, **faults_by_replica: Faults) -> Stack:
        replicas, backends = [], {}
        for name, faults in (faults_by_replica or {"default": Faults()}).items():
            rec = Recorder(create_llm_app(ScriptedLLM(SCRIPT, policy_version=f"v-{name}", faults=faults,
                                                      prefix_cache_block=prefix_cache_block)))
            url = await start(rec, stops) if faults is not None else f"http://127.0.0.1:{free_port()}"
            replicas.append(BackendReplica(replica_id=name, url=url + "/v1", policy_version=f"v-{name}"))
            backends[name] = rec
        settings = Settings(
        allow_host_paths=True, nats_url="nats://127.0.0.1:1", backend_url=replicas[0].url, max_body_bytes=64 * 1024)
        kv = await bus.kv(subjects.KV_ROLLOUTS)
        store = RolloutStore(kv)
        pool = UpstreamClient(connect_timeout=2.0, read_timeout=30.0)
        pools.append(pool)
        service = RolloutService(bus=bus, store=store, settings=settings, http=http, router=Router(replicas),
                                 upstream=pool)
        stop = asyncio.Event()  # the record cache watches the bucket, as in production
        stops.append((stop, asyncio.create_task(store.cache.watch(kv, stop))))
        for _ in range(200):
            if store.cache.watching:
                break
            await asyncio.sleep(0.01)
        assert store.cache.watching
        url = await start(create_app(service), stops)
        return Stack(bus, service, url, backends)

    try:
        yield build
    finally:
        for stop, _ in stops:
            stop.set()
        await asyncio.gather(*(t for _, t in stops), return_exceptions=True)
        for pool in pools:
            await pool.aclose()
        await http.aclose()


def assert_exact(step: Step, raw: bytes) -> None:
    prompt, completion, lps = sent_tokens(raw)
    assert step.token_ids_source == "backend"
    assert msgspec.json.encode(step.prompt_token_ids) == msgspec.json.encode(prompt)
    assert msgspec.json.encode(step.completion_token_ids) == msgspec.json.encode(completion)
    assert msgspec.json.encode(step.logprobs) == msgspec.json.encode(lps)


async def test_openai_sdk_chat_and_completions_streamed_and_whole_with_tools(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    client = s.openai(rid, key)
    models = await client.models.list()
    assert models.data[0].id == "default"
    msgs = [{"role": "user", "content": "fix the median"}]

    tool = await client.chat.completions.create(model="default", messages=msgs, tools=OPENAI_TOOLS, seed=1)
    call = tool.choices[0].message.tool_calls[0]
    assert call.function.name == "read_file" and call.function.arguments == '{"path": "a.py"}'

    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "def median(): ..."}]
    stream = await client.chat.completions.create(model="default", messages=msgs, tools=OPENAI_TOOLS, stream=True,
                                                  temperature=0.3, top_logprobs=2)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == SCRIPT.responses[0].content

    done = await client.completions.create(model="default", prompt="def median(values):", max_tokens=12)
    streamed = await client.completions.create(model="default", prompt=[1, 80, 81], max_tokens=5, stream=True)
    pieces = [c.choices[0].text async for c in streamed]
    assert done.choices[0].finish_reason == "length" and len(pieces) == 5

    steps = await s.steps(rid, 4)
    assert [st.api for st in steps] == ["openai.chat", "openai.chat", "openai.completions", "openai.completions"]
    assert [st.stream for st in steps] == [False, True, False, True]
    for st, raw in zip(steps, s.backends["default"].bodies):
        assert_exact(st, raw)
        assert st.backend_replica == "default" and st.policy_version == "v-default" and not st.incomplete
    assert steps[0].tool_calls[0].name == "read_file" and steps[0].finish_reason == "tool_calls"
    assert steps[0].tools == OPENAI_TOOLS
    assert steps[1].completion_text == text and steps[1].sampling.temperature == 0.3
    assert all(len(alts) == 2 for alts in steps[1].top_logprobs)
    assert steps[1].timings.first_token_ms <= steps[1].timings.total_ms
    assert steps[3].prompt_token_ids == [1, 80, 81]
    # the two chat turns read as one token sequence, sampled tokens masked in
    seq = single_sequence(steps[:2])
    assert [t for t, m in zip(seq.ids, seq.loss_mask) if m] == \
        steps[0].completion_token_ids + steps[1].completion_token_ids
    record, _ = await s.service.store.get(rid)
    assert record.steps == 4 and record.total_tokens == sum(st.usage.total_tokens for st in steps)


async def test_anthropic_sdk_messages_whole_and_streamed_with_tools(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    client = s.anthropic(rid, key)
    first = await client.messages.create(model="claude-arena", max_tokens=300, tools=ANTHROPIC_TOOLS,
                                         system="You fix bugs.",
                                         messages=[{"role": "user", "content": "fix the median"}])
    assert first.stop_reason == "tool_use" and first.content[0].type == "tool_use"
    assert first.content[0].input == {"path": "a.py"} and first.usage.output_tokens > 0
    history = [{"role": "user", "content": "fix the median"},
               {"role": "assistant", "content": [b.model_dump() for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[0].id,
                                             "content": "def median(): ..."}]}]
    async with client.messages.stream(model="claude-arena", max_tokens=300, tools=ANTHROPIC_TOOLS,
                                      messages=history) as stream:
        chunks = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(chunks) == SCRIPT.responses[0].content == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(final.content[0].text.encode())

    tooled = await client.messages.create(model="claude-arena", max_tokens=300, tools=ANTHROPIC_TOOLS, stream=True,
                                          messages=[{"role": "user", "content": "again"}])
    events = [e async for e in tooled]
    assert any(e.type == "content_block_start" and e.content_block.type == "tool_use" for e in events)

    steps = await s.steps(rid, 3)
    assert [st.api for st in steps] == ["anthropic.messages"] * 3 and [st.stream for st in steps] == [False, True, True]
    for st, raw in zip(steps, s.backends["default"].bodies):
        assert_exact(st, raw)
    assert steps[0].request_messages[0] == {"role": "system", "content": "You fix bugs."}
    assert steps[1].request_messages[-1]["role"] == "tool"
    assert steps[2].tool_calls[0].arguments == '{"path": "a.py"}'


def wire_cached(raw: bytes) -> int:
    """The backend's ``usage.prompt_tokens_details.cached_tokens`` as it put it on the wire."""
    docs = ([msgspec.json.decode(e[5:]) for e in raw.split(b"\n\n") if e.startswith(b"data:")
             and e[5:].strip() != b"[DONE]"] if raw.startswith(b"data:") else [msgspec.json.decode(raw)])
    [usage] = [d["usage"] for d in docs if d.get("usage")]
    return usage["prompt_tokens_details"]["cached_tokens"]


async def test_prefix_cache_hits_reach_every_sdk_in_its_own_field_and_the_captured_steps(stack, tmp_path):
    """A backend reporting prefix-cache hits (vLLM's ``prompt_tokens_details.cached_tokens``):
    each call after the first shares the long system prompt, so hits; the OpenAI SDK (chat, whole
    and streamed; Responses ``input_tokens_details``), the Anthropic SDK (``cache_read_input_tokens``,
    ``input_tokens`` the rest, whole and streamed) and google-genai (``cached_content_token_count``)
    each read the backend's figure, and every captured step holds it as ``usage.cached_tokens``."""
    from google import genai
    from google.genai import types as genai_types

    s = await stack(prefix_cache_block=16)
    rid, key = await s.rollout(tmp_path)
    system = "You fix bugs in Python repositories. " * 12
    oa, an = s.openai(rid, key), s.anthropic(rid, key)
    gem = genai.Client(api_key=key, http_options=genai_types.HttpOptions(
        base_url=f"{s.url}/proxy/{rid}", retry_options=genai_types.HttpRetryOptions(attempts=1)))
    first = await oa.chat.completions.create(model="m", messages=[{"role": "system", "content": system},
                                                                  {"role": "user", "content": "fix the median"}])
    streamed = await oa.chat.completions.create(model="m", stream=True, stream_options={"include_usage": True},
                                                messages=[{"role": "system", "content": system},
                                                          {"role": "user", "content": "fix the mean"}])
    chat_usage = [c.usage async for c in streamed if c.usage][-1]
    whole = await an.messages.create(model="claude-arena", max_tokens=300, system=system,
                                     messages=[{"role": "user", "content": "fix the mode"}])
    async with an.messages.stream(model="claude-arena", max_tokens=300, system=system,
                                  messages=[{"role": "user", "content": "fix the range"}]) as stream:
        final = await stream.get_final_message()
    resp = await oa.responses.create(model="m", instructions=system, input="fix the variance")
    gen = await gem.aio.models.generate_content(model="gemini-2.5-pro", contents="fix the sum",
                                                config=genai_types.GenerateContentConfig(system_instruction=system))

    steps = await s.steps(rid, 6)
    wire = [wire_cached(raw) for raw in s.backends["default"].bodies]
    assert [st.usage.cached_tokens for st in steps] == wire
    assert wire[0] == 0 and all(n >= 16 * 20 for n in wire[1:])  # the shared system prompt, in whole blocks
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert chat_usage.prompt_tokens_details.cached_tokens == wire[1]
    assert (whole.usage.cache_read_input_tokens, whole.usage.input_tokens) == (
        wire[2], steps[2].usage.prompt_tokens - wire[2])
    assert (final.usage.cache_read_input_tokens, final.usage.input_tokens) == (
        wire[3], steps[3].usage.prompt_tokens - wire[3])
    assert resp.usage.input_tokens_details.cached_tokens == wire[4]
    assert resp.usage.input_tokens == steps[4].usage.prompt_tokens
    assert gen.usage_metadata.cached_content_token_count == wire[5]
    assert gen.usage_metadata.prompt_token_count == steps[5].usage.prompt_tokens


async def test_budgets_cap_then_refuse_and_end_the_rollout(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path, max_turns=3, max_total_tokens=120)
    client = s.openai(rid, key)
    msgs = [{"role": "user", "content": "q"}]
    a = await client.chat.completions.create(model="default", messages=msgs, max_tokens=40)
    spent = a.usage.total_tokens
    b = await client.chat.completions.create(model="default", messages=msgs, max_tokens=1000)
    # capped to what remains after its prompt (counted before sending), not refused
    assert b.usage.completion_tokens == 120 - spent - b.usage.prompt_tokens and b.choices[0].finish_reason == "length"
    assert spent + b.usage.total_tokens == 120
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await client.chat.completions.create(model="default", messages=msgs)
    assert refused.value.body["code"] == "budget_exhausted" and "token budget exhausted" in refused.value.body["message"]
    record, _ = await s.service.store.get(rid)
    assert record.state == RolloutState.BUDGET_EXHAUSTED and "of 120 tokens used" in record.reason
    with pytest.raises(openai.AuthenticationError):  # the key died with the rollout
        await client.chat.completions.create(model="default", messages=msgs)
    assert len(s.backends["default"].bodies) == 2  # the refused calls never reached the backend

    rid, key = await s.rollout(tmp_path, wall_clock_s=30)
    # 31 s since its agent started (the wall clock counts from there, not from the submission)
    await s.service.store.update(rid, lambda r: msgspec.structs.replace(
        r, created_at=r.created_at - 31, history=[msgspec.structs.replace(h, at=h.at - 31) for h in r.history]))
    with pytest.raises(openai.PermissionDeniedError) as late:
        await s.openai(rid, key).chat.completions.create(model="default", messages=msgs)
    assert late.value.body["code"] == "wall_clock_exceeded"
    assert (await s.service.store.get(rid))[0].state == RolloutState.TIMED_OUT


async def test_budgets_stay_exact_while_earlier_steps_are_still_being_recorded(stack, tmp_path):
    """Recording (two fsynced JetStream writes) runs off the answer's path; the next call
    must still see the turns and tokens of calls whose recordings have not landed."""
    s = await stack()
    rid, key = await s.rollout(tmp_path, max_turns=5, max_total_tokens=120)
    store = s.service.store
    real_update = store.update

    async def slow_update(*args, **kwargs):  # the real store, only later: recordings pile up
        await asyncio.sleep(0.5)
        return await real_update(*args, **kwargs)

    store.update = slow_update
    client = s.openai(rid, key)
    msgs = [{"role": "user", "content": "q"}]
    a = await client.chat.completions.create(model="default", messages=msgs, max_tokens=40)
    b = await client.chat.completions.create(model="default", messages=msgs, max_tokens=1000, stream=True,
                                             stream_options={"include_usage": True})
    usage = [chunk.usage async for chunk in b if chunk.usage][-1]
    # capped by a's tokens, not yet recorded, and b's own prompt
    assert usage.completion_tokens == 120 - a.usage.total_tokens - usage.prompt_tokens
    assert (await store.get(rid))[0].steps == 0  # neither recording has landed yet
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await client.chat.completions.create(model="default", messages=msgs)
    spent = a.usage.total_tokens + usage.total_tokens
    assert f"token budget exhausted: {spent} of 120 tokens used" in refused.value.body["message"]
    record, _ = await store.get(rid)
    assert record.state == RolloutState.BUDGET_EXHAUSTED  # ended only once both steps were recorded:
    assert record.steps == 2 and record.total_tokens == spent  # its final event counts them
    store.update = real_update
    steps = await s.steps(rid, 2)
    assert [st.step_index for st in steps] == [0, 1]
    assert sum(st.usage.total_tokens for st in steps) == spent == (await store.get(rid))[0].total_tokens
    assert len(s.backends["default"].bodies) == 2


async def test_replica_dying_mid_stream_and_a_dead_replica_fail_over(stack, tmp_path):
    s = await stack(dying=Faults(die_after_chunks=4), healthy=Faults(), dead=None)
    rid, key = await s.rollout(tmp_path)
    client = s.openai(rid, key)
    s.service.router.stick(rid, "dying")
    stream = await client.chat.completions.create(model="default", stream=True,
                                                  messages=[{"role": "user", "content": "q"}])
    got = []
    with pytest.raises(openai.APIError, match="died mid-stream"):
        async for chunk in stream:
            got.append(chunk.choices[0].delta.content or "")
    assert "".join(got) == SCRIPT.responses[0].content[:3]
    again = await client.chat.completions.create(model="default", messages=[{"role": "user", "content": "q"}])
    assert again.choices[0].message.content == SCRIPT.responses[0].content

    rid2, key2 = await s.rollout(tmp_path)
    s.service.router.stick(rid2, "dead")
    s.service.router.mark_up("dead")
    ok = await s.openai(rid2, key2).chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}])
    assert ok.choices[0].finish_reason == "stop"

    broken, after = await s.steps(rid, 2)
    assert broken.incomplete and "died mid-stream" in broken.error and broken.backend_replica == "dying"
    assert_exact(broken, s.backends["dying"].bodies[0])  # what arrived before it died, exactly
    assert after.backend_replica == "healthy" and after.policy_version == "v-healthy" and not after.incomplete
    assert after.failovers[0].replica == "dying" and "died mid-stream" in after.failovers[0].error
    (moved,) = await s.steps(rid2, 1)
    assert moved.backend_replica == "healthy"
    assert moved.failovers[0].replica == "dead" and "ClientConnectorError" in moved.failovers[0].error


async def test_malformed_backend_json_is_a_clear_502_and_no_step(stack, tmp_path):
    s = await stack(default=Faults(malformed_json=True))
    rid, key = await s.rollout(tmp_path)
    with pytest.raises(openai.APIStatusError) as bad:
        await s.openai(rid, key).chat.completions.create(model="default", messages=[{"role": "user", "content": "q"}])
    assert bad.value.status_code == 502 and bad.value.body["code"] == "upstream_error"
    assert "answered invalid JSON" in bad.value.body["message"]
    record, _ = await s.service.store.get(rid)
    assert record.steps == 0 and record.state == RolloutState.RUNNING


async def test_client_disconnecting_mid_stream_still_records_an_incomplete_step(stack, tmp_path):
    s = await stack(default=Faults(chunk_delay_s=0.02))
    rid, key = await s.rollout(tmp_path)
    client = s.openai(rid, key)
    stream = await client.chat.completions.create(model="default", stream=True,
                                                  messages=[{"role": "user", "content": "q"}])
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 5:
            break
    await stream.close()
    (step,) = await s.steps(rid, 1)
    assert step.incomplete and step.error == "client disconnected mid-stream" and step.stream
    assert 4 <= len(step.completion_token_ids) < len(SCRIPT.responses[0].content.encode())
    prompt, completion, lps = sent_tokens(s.backends["default"].bodies[0])
    assert step.prompt_token_ids == prompt and step.completion_token_ids == completion[: len(step.completion_token_ids)]
    assert step.logprobs == lps[: len(step.logprobs)]
    record, _ = await s.service.store.get(rid)
    assert record.steps == 1 and record.state == RolloutState.RUNNING
