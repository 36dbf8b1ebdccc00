"""Issue 3's proxy contract, point by point, with the real ``openai`` and ``anthropic`` SDKs
against the real rollout app over HTTP, in front of real vLLM-shaped backends: the
scripted LLM, and a lockstep backend that sends each stream chunk only when the test
lets it. Streams relayed unbuffered; the rollout's sampling as the backend received it;
top-k, usage, model and finish reason exactly as sent; a backend without token ids;
in-flight bounds and queueing; sticky routing, weight syncs and failover; upstream error
mapping; body limits and keys."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import msgspec
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from arena_core import subjects
from arena_core.schemas import BackendReplica, RolloutState, SamplingParams
from arena_stack.scripted_llm import Faults, ScriptedLLM
from arena_core.tokens import MissingTokenIds, sequences
from arena_rollout.proxy.backends import BackendRegistry, register

from tests.rollout.test_proxy_with_sdks import SCRIPT, Recorder, assert_exact, sent_tokens, start
from tests.rollout.test_proxy_with_sdks import stack  # noqa: F401 - the fixture

MSGS = [{"role": "user", "content": "fix the median"}]


def wire_docs(raw: bytes) -> list[dict]:
    """The JSON documents a backend sent: one whole answer, or every stream chunk."""
    if raw.startswith(b"data:"):
        return [msgspec.json.decode(e[5:]) for e in raw.split(b"\n\n")
                if e.startswith(b"data:") and e[5:].strip() != b"[DONE]"]
    return [msgspec.json.decode(raw)]


def wire_top(raw: bytes) -> list[list[tuple[str, float]]]:
    """Per sampled token, the top-k alternatives the backend sent (chat and completions)."""
    out: list[list[tuple[str, float]]] = []
    for doc in wire_docs(raw):
        for choice in doc.get("choices") or []:
            lp = choice.get("logprobs") or {}
            out += [[(a["token"], a["logprob"]) for a in item.get("top_logprobs") or []]
                    for item in lp.get("content") or []]
            out += [list((alts or {}).items()) for alts in lp.get("top_logprobs") or []]
    return out


def wire_meta(raw: bytes) -> tuple[dict, str, str]:
    """(usage, model, finish reason) as the backend sent them."""
    docs = wire_docs(raw)
    usage = [d["usage"] for d in docs if d.get("usage")][-1]
    finish = [c["finish_reason"] for d in docs for c in d.get("choices") or [] if c.get("finish_reason")][-1]
    return usage, docs[0]["model"], finish


async def test_top_k_usage_model_and_finish_reason_are_what_the_backend_sent(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path, sampling=SamplingParams(top_logprobs=3))
    client = s.openai(rid, key)
    await client.chat.completions.create(model="default", messages=MSGS)
    _ = [c async for c in await client.chat.completions.create(model="default", messages=MSGS, stream=True)]
    await client.completions.create(model="default", prompt="def median(values):", max_tokens=8)
    _ = [c async for c in await client.completions.create(model="default", prompt=[1, 70, 71], max_tokens=8,
                                                          stream=True)]
    steps = await s.steps(rid, 4)
    assert [(st.api, st.stream) for st in steps] == [("openai.chat", False), ("openai.chat", True),
                                                     ("openai.completions", False), ("openai.completions", True)]
    for st, raw in zip(steps, s.backends["default"].bodies, strict=True):
        assert_exact(st, raw)
        top = wire_top(raw)
        assert len(top) == len(st.completion_token_ids) and all(len(alts) == 3 for alts in top)
        assert [[(t.token, t.logprob) for t in alts] for alts in st.top_logprobs] == top
        usage, model, finish = wire_meta(raw)
        assert (st.usage.prompt_tokens, st.usage.completion_tokens, st.usage.total_tokens) == \
            (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
        assert st.model == model and st.finish_reason == finish and st.sampling.top_logprobs == 3
    assert [st.finish_reason for st in steps] == ["stop", "stop", "length", "length"]


# ------------------------------------------------------------------ streams are not buffered


class Gate:
    """Lets a lockstep backend send one more chunk per permit."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.permits = asyncio.Semaphore(0)
        self.sent = 0

    def allow(self, n: int) -> None:
        for _ in range(n):
            self.permits.release()


def lockstep_backend(llm: ScriptedLLM, gate: Gate) -> FastAPI:
    """vLLM-shaped streams (the scripted LLM's chunks) sent one chunk per permit: what a
    client has received before the test allows more cannot have been buffered whole."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        chunks = llm.chunks(msgspec.json.decode(await request.body()), chat=True)

        async def send():
            for chunk in chunks:
                await gate.permits.acquire()
                gate.sent += 1
                yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(send(), media_type="text/event-stream")

    return app


async def test_streams_reach_the_client_chunk_by_chunk_before_the_backend_has_finished(stack, tmp_path):
    s = await stack()
    gate = Gate()
    recorder = Recorder(lockstep_backend(ScriptedLLM(SCRIPT), gate))
    url = await start(recorder, [])
    s.service.router.upsert(BackendReplica(replica_id="default", url=url + "/v1", policy_version="v-lock"))
    rid, key = await s.rollout(tmp_path)

    gate.allow(2)  # the role chunk and the first token: nothing more exists yet
    stream = await s.openai(rid, key).chat.completions.create(model="default", messages=MSGS, stream=True)
    chunks = aiter(stream)
    first = ""
    while not first:
        chunk = await asyncio.wait_for(anext(chunks), 10)
        first = chunk.choices[0].delta.content if chunk.choices else ""
    assert first == SCRIPT.responses[0].content[0] and gate.sent == 2
    gate.allow(1)  # one more token reaches the client on its own
    nxt = ""
    while not nxt:
        chunk = await asyncio.wait_for(anext(chunks), 10)
        nxt = chunk.choices[0].delta.content if chunk.choices else ""
    assert nxt == SCRIPT.responses[0].content[1] and gate.sent == 3
    gate.allow(10_000)
    rest = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert first + nxt + rest == SCRIPT.responses[0].content

    gate.reset()
    gate.allow(2)  # the same through the Anthropic translation
    events = aiter(await s.anthropic(rid, key).messages.create(model="claude-arena", max_tokens=300, stream=True,
                                                                 messages=MSGS))
    while True:
        event = await asyncio.wait_for(anext(events), 10)
        if event.type == "content_block_delta":
            break
    assert event.delta.text == SCRIPT.responses[0].content[0] and gate.sent == 2
    gate.allow(10_000)
    kinds = [e.type async for e in events]
    assert kinds[-2:] == ["message_delta", "message_stop"]

    steps = await s.steps(rid, 2)
    for st, raw in zip(steps, recorder.bodies, strict=True):
        assert_exact(st, raw)
        assert not st.incomplete and st.completion_text == SCRIPT.responses[0].content


# ------------------------------------------------------------------ sampling injection


ROLLOUT = dict(temperature=0.9, top_p=0.8, top_k=40, min_p=0.05, seed=11, max_tokens=64, stop=["END"],
               presence_penalty=0.1, frequency_penalty=0.2, top_logprobs=2)
AGENT = dict(temperature=0.1, top_p=0.99, seed=1, max_tokens=500, stop=["x"], presence_penalty=1.5,
             frequency_penalty=-0.5)
AGENT_EXTRA = {"top_k": 5, "min_p": 0.5}  # vLLM's extra sampling fields, as an agent sends them
EXPECTED = {
    "override": ROLLOUT,
    "default": {**AGENT, **AGENT_EXTRA, "top_logprobs": 2},  # the agent's, the rest filled in
    "clamp": dict(temperature=0.1, top_p=0.8, top_k=5, min_p=0.05, seed=11, max_tokens=64, stop=["END"],
                  presence_penalty=0.1, frequency_penalty=-0.5, top_logprobs=2),  # never above; seed/stop set
}


async def test_the_rollout_sampling_reaches_the_backend_per_policy_and_is_recorded(stack, tmp_path):
    s = await stack()
    received = s.backends["default"].requests
    for policy, want in EXPECTED.items():
        rid, key = await s.rollout(tmp_path, sampling=SamplingParams(**ROLLOUT, policy=policy))
        await s.openai(rid, key).chat.completions.create(model="default", messages=MSGS, **AGENT,
                                                         extra_body=AGENT_EXTRA)
        sent = msgspec.json.decode(received[-1])
        assert {name: sent[name] for name in want} == want, policy
        assert sent["logprobs"] is True and sent["return_token_ids"] is True
        (step,) = await s.steps(rid, 1)
        assert step.sampling == SamplingParams(**want, policy=policy)
        assert all(len(alts) == 2 for alts in step.top_logprobs)  # top-k requested for the rollout

    # Anthropic clients' sampling is overridden the same way, after translation
    rid, key = await s.rollout(tmp_path, sampling=SamplingParams(**ROLLOUT))
    await s.anthropic(rid, key).messages.create(model="claude-arena", max_tokens=300, stop_sequences=["x"],
                                                extra_body={"temperature": 0.1, "top_k": 5}, messages=MSGS)
    sent = msgspec.json.decode(received[-1])
    assert (sent["temperature"], sent["top_k"], sent["stop"], sent["max_tokens"]) == (0.9, 40, ["END"], 64)
    (step,) = await s.steps(rid, 1)
    assert step.sampling == SamplingParams(**ROLLOUT)


async def test_a_rollout_max_tokens_never_lifts_the_token_budget_cap(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path, sampling=SamplingParams(max_tokens=4000), max_total_tokens=150)
    client = s.openai(rid, key)
    first = await client.chat.completions.create(model="default", messages=MSGS, max_tokens=10)
    # the rollout's 4000 overrides the agent's 10 and is capped to the 150 left after the prompt
    cap1 = 150 - first.usage.prompt_tokens
    assert msgspec.json.decode(s.backends["default"].requests[-1])["max_tokens"] == cap1
    assert first.usage.completion_tokens == len(SCRIPT.responses[0].content.encode()) > 10
    second = await client.chat.completions.create(model="default", messages=MSGS)
    cap2 = 150 - first.usage.total_tokens - second.usage.prompt_tokens
    assert msgspec.json.decode(s.backends["default"].requests[-1])["max_tokens"] == cap2
    assert second.usage.completion_tokens <= cap2
    steps = await s.steps(rid, 2)
    assert [st.sampling.max_tokens for st in steps] == [cap1, cap2]  # the step says what was sent


# ------------------------------------------------------------------ backends without token ids


async def test_a_backend_without_token_ids_gives_steps_that_say_so_and_nothing_retokenized(stack, tmp_path):
    s = await stack(default=Faults(no_token_ids=True))  # like Ollama
    rid, key = await s.rollout(tmp_path, max_total_tokens=10_000)
    client = s.openai(rid, key)
    await client.chat.completions.create(model="default", messages=MSGS)
    _ = [c async for c in await client.chat.completions.create(model="default", messages=MSGS, stream=True)]
    await client.completions.create(model="default", prompt="def f():", max_tokens=5)
    steps = await s.steps(rid, 3)
    for st, raw in zip(steps, s.backends["default"].bodies, strict=True):
        prompt, completion, lps = sent_tokens(raw)
        assert prompt == completion == []  # the backend really sent none
        assert st.token_ids_source == "unavailable" and st.prompt_token_ids is None
        assert st.completion_token_ids is None and st.logprobs == lps and st.completion_text
        usage, _, _ = wire_meta(raw)
        assert st.usage.total_tokens == usage["total_tokens"]
    record, _ = await s.service.store.get(rid)
    assert record.total_tokens == sum(st.usage.total_tokens for st in steps)  # budgets still count
    with pytest.raises(MissingTokenIds):
        sequences(steps)


# ------------------------------------------------------------------ routing


async def test_the_in_flight_bound_queues_calls_and_records_the_wait(stack, tmp_path):
    s = await stack(default=Faults(latency_s=0.3))
    url = s.service.router.replicas["default"].replica.url
    s.service.router.upsert(BackendReplica(replica_id="default", url=url, policy_version="v-default", max_inflight=1))
    rollouts = [await s.rollout(tmp_path) for _ in range(3)]
    await asyncio.gather(*(s.openai(rid, key).chat.completions.create(model="default", messages=MSGS)
                           for rid, key in rollouts))
    assert s.backends["default"].peak == 1  # never more than the bound at the replica
    steps = [(await s.steps(rid, 1))[0] for rid, _ in rollouts]
    queued = sorted(st.timings.queued_ms for st in steps)
    assert queued[0] < 150 and queued[1] >= 250 and queued[2] >= 550
    for st in steps:
        assert st.timings.total_ms >= st.timings.queued_ms + 290 and st.timings.first_token_ms <= st.timings.total_ms


async def test_sticky_routing_follows_weight_syncs_and_moves_off_an_unhealthy_replica(stack, tmp_path):
    s = await stack(default=Faults(), b=Faults(), c=Faults())
    router = s.service.router
    async with httpx.AsyncClient() as http:
        registry = BackendRegistry(router=router, settings=s.service.settings, http=http)
        kv = await s.bus.kv(subjects.KV_BACKENDS)
        stop = asyncio.Event()
        watch = asyncio.create_task(registry.watch(kv, stop))
        try:
            rollouts = [await s.rollout(tmp_path) for _ in range(10)]
            for rid, key in rollouts:
                for _ in range(3):
                    await s.openai(rid, key).chat.completions.create(model="default", messages=MSGS)
            served = []
            for rid, _ in rollouts:
                replicas = {st.backend_replica for st in await s.steps(rid, 3)}
                assert len(replicas) == 1, replicas  # every call of a rollout on one replica
                served += replicas
            assert len(set(served)) > 1  # rollouts spread over the replicas

            rid, key = rollouts[0]
            home = served[0]
            before = router.replicas[home].replica
            await register(kv, BackendReplica(replica_id=home, url=before.url, policy_version="step-2"))
            for _ in range(500):
                if router.replicas[home].replica.policy_version == "step-2":
                    break
                await asyncio.sleep(0.01)
            await s.openai(rid, key).chat.completions.create(model="default", messages=MSGS)
            router.mark_down(home, "health check failed: test")
            await s.openai(rid, key).chat.completions.create(model="default", messages=MSGS)
            steps = await s.steps(rid, 5)
            synced, moved = steps[3], steps[4]
            assert synced.backend_replica == home and synced.policy_version == "step-2"  # same replica, new weights
            assert steps[0].policy_version != "step-2"
            assert moved.backend_replica != home and moved.failovers[0].replica == home
            assert "not used: health check failed: test" in moved.failovers[0].error
        finally:
            stop.set()
            await watch


# ------------------------------------------------------------------ upstream errors


async def test_upstream_errors_reach_clients_as_clear_errors_and_no_step(stack, tmp_path):
    cases = [
        ({"default": Faults(error_status=400)}, 400, "upstream_rejected", "rejected the request (400)"),
        ({"default": Faults(error_status=429)}, 502, "upstream_error", "is overloaded (429)"),
        ({"a": Faults(error_status=503), "b": Faults(error_status=500)}, 502, "upstream_error",
         "every backend replica failed (2 tried)"),
    ]
    for faults, status, code, message in cases:
        s = await stack(**faults)
        rid, key = await s.rollout(tmp_path)
        with pytest.raises(openai.APIStatusError) as err:
            await s.openai(rid, key).chat.completions.create(model="default", messages=MSGS)
        assert err.value.status_code == status and err.value.body["code"] == code
        assert message in err.value.body["message"] and "scripted backend failure" in err.value.body["message"]
        with pytest.raises(anthropic.APIStatusError) as aerr:
            await s.anthropic(rid, key).messages.create(model="claude-arena", max_tokens=50, messages=MSGS)
        assert aerr.value.status_code == status
        record, _ = await s.service.store.get(rid)
        assert record.steps == 0 and record.state == RolloutState.RUNNING

    s = await stack()
    # submitted while a replica served any name; narrowed after (a submission for a model no
    # replica serves is refused before it runs: tests/rollout/test_submit_time_checks.py)
    rid, key = await s.rollout(tmp_path, model="llama")
    s.service.router.upsert(BackendReplica(replica_id="default", url=s.service.router.replicas["default"].replica.url,
                                           models=["qwen"]))
    with pytest.raises(openai.InternalServerError) as err:
        await s.openai(rid, key).chat.completions.create(model="llama", messages=MSGS)
    assert err.value.status_code == 503 and err.value.body["code"] == "unavailable"
    assert "no backend replica serves model 'llama'" in err.value.body["message"]
    assert s.backends["default"].requests == []


async def test_a_replica_dying_mid_anthropic_stream_ends_it_with_an_error_event_and_fails_over(stack, tmp_path):
    s = await stack(dying=Faults(die_after_chunks=4), healthy=Faults())
    rid, key = await s.rollout(tmp_path)
    s.service.router.stick(rid, "dying")
    client = s.anthropic(rid, key)
    texts = []
    with pytest.raises(anthropic.APIStatusError, match="died mid-stream"):
        async for event in await client.messages.create(model="claude-arena", max_tokens=300, stream=True,
                                                        messages=MSGS):
            if event.type == "content_block_delta":
                texts.append(event.delta.text)
    assert "".join(texts) == SCRIPT.responses[0].content[:3]
    again = await client.messages.create(model="claude-arena", max_tokens=300, messages=MSGS)
    assert again.content[0].text == SCRIPT.responses[0].content
    broken, after = await s.steps(rid, 2)
    assert broken.incomplete and broken.api == "anthropic.messages" and "died mid-stream" in broken.error
    assert_exact(broken, s.backends["dying"].bodies[0])
    assert after.backend_replica == "healthy" and after.failovers[0].replica == "dying"


# ------------------------------------------------------------------ keys and body limits


async def test_keys_are_per_rollout_and_bodies_over_the_limit_get_413(stack, tmp_path):
    s = await stack()  # ARENA_MAX_BODY_BYTES is 64 KiB here
    rid, key = await s.rollout(tmp_path)
    other, other_key = await s.rollout(tmp_path)
    assert (await s.openai(rid, key).models.list()).data[0].id == "default"
    assert [m.id async for m in s.anthropic(rid, key).models.list()] == ["default"]
    for bad_rid, bad_key in ((rid, other_key), (rid, "ak-guessed"), ("r-unknown", key)):
        with pytest.raises(openai.AuthenticationError):
            await s.openai(bad_rid, bad_key).chat.completions.create(model="default", messages=MSGS)
        with pytest.raises(anthropic.AuthenticationError):
            await s.anthropic(bad_rid, bad_key).messages.create(model="c", max_tokens=5, messages=MSGS)
        with pytest.raises(openai.AuthenticationError):
            await s.openai(bad_rid, bad_key).models.list()
    async with httpx.AsyncClient(base_url=f"{s.url}/proxy/{rid}/v1") as raw:
        missing = await raw.post("/chat/completions", json={"model": "default", "messages": MSGS})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "unauthorized"

        huge = [{"role": "user", "content": "x" * (65 * 1024)}]
        with pytest.raises(openai.APIStatusError) as big:
            await s.openai(rid, key).chat.completions.create(model="default", messages=huge)
        assert big.value.status_code == 413 and big.value.body["code"] == "payload_too_large"
        with pytest.raises(anthropic.APIStatusError) as abig:
            await s.anthropic(rid, key).messages.create(model="c", max_tokens=5, messages=huge)
        assert abig.value.status_code == 413

        async def chunked():  # no content-length: the limit holds while the body streams in
            yield b'{"model": "default", "messages": [{"role": "user", "content": "'
            for _ in range(70):
                yield b"x" * 1024
            yield b'"}]}'

        streamed = await raw.post("/chat/completions", content=chunked(),
                                  headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
        assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "payload_too_large"
    assert s.backends["default"].requests == []  # nothing refused ever reached the backend
    assert (await s.service.store.get(other))[0].steps == 0
