"""The exact token budget with real clients: the ``openai`` SDK through the real proxy
(uvicorn, nats-server) in front of the scripted vLLM-shaped backend, and the policy
server. A rollout never spends one token more than ``max_total_tokens``: a tight call's
prompt is counted by the serving replica's ``/tokenize`` before it is sent and its
``max_tokens`` capped to what remains, a prompt that does not fit is refused before any
generation request, and a replica without ``/tokenize`` is capped on an upper bound."""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec
import openai
import pytest

from arena_core import subjects
from arena_core.schemas import BackendReplica, RolloutState
from arena_stack.scripted_llm import Faults
from arena_core.settings import Settings
from arena_rollout.app import create_app
from arena_rollout.proxy.budget import prompt_upper_bound
from arena_rollout.proxy.upstream import UpstreamClient
from arena_rollout.proxy.routing import Router
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore

from tests.rollout.test_proxy_with_sdks import Stack, start, stack  # noqa: F401 - the fixture

SYSTEM = {"role": "system", "content": "You fix bugs."}
TASK = {"role": "user", "content": "Fix the off-by-one in search.py"}


def generation_requests(s, replica: str = "default") -> list[dict]:
    return [msgspec.json.decode(r) for r in s.backends[replica].requests]


async def agent_turn(client: openai.AsyncOpenAI, messages: list[dict], *, max_tokens: int, stream: bool = False):
    """One turn; returns (answer text, usage, finish reason)."""
    if not stream:
        out = await client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens)
        return out.choices[0].message.content, out.usage, out.choices[0].finish_reason
    text, usage, finish = "", None, None
    async for chunk in await client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens,
                                                             stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, usage, finish


async def test_a_multi_turn_rollout_never_overshoots_and_its_last_call_is_capped_exactly(stack, tmp_path):
    s = await stack()
    limit = 1150
    rid, key = await s.rollout(tmp_path, max_total_tokens=limit)
    client = s.openai(rid, key)
    messages, spent, turns = [SYSTEM, TASK], 0, []
    while True:
        try:
            text, usage, finish = await agent_turn(client, messages, max_tokens=300, stream=len(turns) == 2)
        except openai.PermissionDeniedError as exc:
            refused = exc
            break
        sent = generation_requests(s)[-1]
        turns.append((limit - spent, usage.prompt_tokens, sent["max_tokens"], finish))
        spent += usage.total_tokens
        assert spent <= limit  # never, not even by one token
        messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]

    # two roomy turns (no count), one tight turn counted and sent as asked, the last capped exactly
    assert [t[2] for t in turns[:3]] == [300, 300, 300] and turns[3][2] < 300
    left, prompt, capped, finish = turns[3]
    assert prompt + capped == left and finish == "length"
    assert spent == limit  # the budget used to the last token, not past it
    assert len(s.backends["default"].tokenized) == 2  # /tokenize only for the two tight turns
    assert refused.body["code"] == "budget_exhausted"
    assert f"token budget exhausted: {limit} of {limit} tokens used" in refused.body["message"]
    assert len(generation_requests(s)) == 4  # the refused call never reached the backend
    record, _ = await s.service.store.get(rid)
    assert record.state == RolloutState.BUDGET_EXHAUSTED and record.total_tokens == limit

    steps = await s.steps(rid, 4)
    assert [st.prompt_count.source for st in steps] == ["bound", "bound", "tokenize", "tokenize"]
    for st, (left, prompt, capped, _) in zip(steps, turns, strict=True):
        pc = st.prompt_count
        assert pc.remaining == left and st.sampling.max_tokens == capped
        assert pc.tokens >= st.usage.prompt_tokens == len(st.prompt_token_ids) == prompt
        if pc.source == "tokenize":  # the replica's count is the prompt the backend then rendered
            assert pc.tokens == st.usage.prompt_tokens and pc.replica == "default" and not pc.note
    # what /tokenize was asked is the chat as it was sent
    counted = msgspec.json.decode(s.backends["default"].tokenized[-1])
    assert counted["messages"] == steps[3].request_messages and "max_tokens" not in counted


async def test_a_prompt_that_alone_exceeds_what_remains_is_refused_before_it_is_sent(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path, max_total_tokens=400)
    client = s.openai(rid, key)
    _, first, _ = await agent_turn(client, [SYSTEM, TASK], max_tokens=50)
    left = 400 - first.total_tokens
    long = {"role": "user", "content": "Here is the whole file:\n" + "x = search(ordered, key)\n" * 12}
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await agent_turn(client, [SYSTEM, TASK, long], max_tokens=10)
    message = refused.value.body["message"]
    assert refused.value.body["code"] == "budget_exhausted"
    assert f"does not fit in the {left} of 400 tokens left" in message and "a prompt of " in message
    assert len(generation_requests(s)) == 1  # the backend never saw the refused generation request
    assert len(s.backends["default"].tokenized) == 1  # only its prompt was counted
    prompt = int(message.split("a prompt of ")[1].split(" ")[0])
    assert prompt > left  # the count, exact: the scripted tokenizer is one token per byte (+ BOS)
    record, _ = await s.service.store.get(rid)
    assert record.state == RolloutState.BUDGET_EXHAUSTED and record.reason == message
    assert record.total_tokens == first.total_tokens == (await s.steps(rid, 1))[0].usage.total_tokens


async def test_a_replica_without_tokenize_caps_on_the_upper_bound_and_never_overshoots(stack, tmp_path, caplog):
    s = await stack(default=Faults(no_tokenize=True, no_token_ids=True))  # like Ollama
    limit = 1150
    rid, key = await s.rollout(tmp_path, max_total_tokens=limit)
    client = s.openai(rid, key)
    messages, spent, turns = [SYSTEM, TASK], 0, []
    with caplog.at_level(logging.INFO, logger="arena.rollout.proxy"):
        while True:
            try:
                text, usage, finish = await agent_turn(client, messages, max_tokens=300)
            except openai.PermissionDeniedError as exc:
                refused = exc
                break
            turns.append((limit - spent, generation_requests(s)[-1]["max_tokens"], messages))
            spent += usage.total_tokens
            assert spent <= limit
            messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    assert "replica default has no /tokenize (404)" in caplog.text  # said, not silently guessed
    assert len(s.backends["default"].tokenized) == 1  # asked once; the answer is remembered a while
    steps = await s.steps(rid, len(turns))
    fallbacks = [st for st in steps if st.prompt_count.source == "fallback"]
    assert fallbacks and all(st.prompt_count.source == "bound" for st in steps[:-len(fallbacks)])
    for st, (left, sent, msgs) in zip(steps, turns, strict=True):
        pc = st.prompt_count
        assert pc.tokens >= st.usage.prompt_tokens  # a bound, never short
        if pc.source == "fallback":
            assert "replica default has no /tokenize (404)" in pc.note and pc.replica == "default"
            bound = prompt_upper_bound({"messages": msgs}, "openai.chat")
            assert pc.tokens == bound and sent == min(300, left - bound)  # capped on the bound
    assert any(sent < 300 for _, sent, _ in turns[-len(fallbacks):])  # and one really was capped
    message = refused.body["message"]
    assert "a prompt of at most " in message and "no /tokenize (404)" in message
    assert len(generation_requests(s)) == len(turns)
    assert (await s.service.store.get(rid))[0].total_tokens == spent <= limit


async def test_calls_in_flight_at_once_never_overshoot_together(stack, tmp_path):
    s = await stack(default=Faults(latency_s=0.2))
    limit = 600
    rid, key = await s.rollout(tmp_path, max_total_tokens=limit)
    client = s.openai(rid, key)
    results = await asyncio.gather(*(agent_turn(client, [SYSTEM, TASK], max_tokens=300) for _ in range(6)),
                                   return_exceptions=True)
    usages = [r[1] for r in results if not isinstance(r, BaseException)]
    assert sum(u.total_tokens for u in usages) <= limit
    # the rest were refused once nothing remained (or found the rollout ended while they waited)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors and all(isinstance(r, (openai.PermissionDeniedError, openai.AuthenticationError)) for r in errors)
    # each call could spend more than half the budget: they went one after another, not together
    assert s.backends["default"].peak == 1
    await s.service.proxy.drain()
    assert (await s.service.store.get(rid))[0].total_tokens == sum(u.total_tokens for u in usages) <= limit

    roomy, roomy_key = await s.rollout(tmp_path, max_total_tokens=100_000)  # roomy: calls are not serialized
    roomy_client = s.openai(roomy, roomy_key)
    before = len(s.backends["default"].tokenized)
    await asyncio.gather(*(agent_turn(roomy_client, [SYSTEM, TASK], max_tokens=300) for _ in range(4)))
    assert s.backends["default"].peak >= 2 and len(s.backends["default"].tokenized) == before


async def test_the_policy_server_counts_its_prompts_for_the_budget(bus, tmp_path):
    pytest.importorskip("torch")
    from arena_rl.openai_api import CharEngine, Policy
    from arena_rl.model import new_policy
    from arena_rl.policy_server import PolicyServer
    from arena_rl.policy_server import create_app as create_policy_app
    from arena_rl.tokenizer import CharTokenizer

    tokenizer = CharTokenizer(alphabet="0123456789+=? ")
    model = new_policy(tokenizer, seed=0, d_model=16, n_layers=1, max_len=48).eval()
    server = PolicyServer(Policy(CharEngine(model, tokenizer), 3), model_name="policy")
    await server.start()
    stops: list = []
    http = httpx.AsyncClient(timeout=10)
    pool = UpstreamClient(connect_timeout=2.0, read_timeout=30.0)
    try:
        url = await start(create_policy_app(server), stops)
        body = {"model": "policy", "messages": [{"role": "user", "content": "12+30=?"}]}
        counted = (await http.post(f"{url}/tokenize", json=body)).json()
        answer = (await http.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 4,
                                                                     "return_token_ids": True})).json()
        assert counted["tokens"] == answer["prompt_token_ids"] and counted["count"] == len(counted["tokens"])
        assert counted["max_model_len"] == 48
        assert (await http.post(f"{url}/tokenize", json={"prompt": "1+1="})).json()["count"] == 5  # BOS + 4

        kv = await bus.kv(subjects.KV_ROLLOUTS)
        store = RolloutStore(kv)
        replica = BackendReplica(replica_id="policy", url=url + "/v1", policy_version="3")
        service = RolloutService(bus=bus, store=store, settings=Settings(allow_host_paths=True, nats_url="nats://127.0.0.1:1",
                                 backend_url=replica.url), http=http, router=Router([replica]), upstream=pool)
        stop = asyncio.Event()
        stops.append((stop, asyncio.create_task(store.cache.watch(kv, stop))))
        while not store.cache.watching:
            await asyncio.sleep(0.01)
        s = Stack(bus, service, await start(create_app(service), stops), {})
        rid, key = await s.rollout(tmp_path, max_total_tokens=20)
        out = await s.openai(rid, key).chat.completions.create(model="policy", messages=body["messages"],
                                                               max_tokens=40)
        (step,) = await s.steps(rid, 1)
        assert step.prompt_count.source == "tokenize" and step.prompt_count.tokens == counted["count"]
        assert step.sampling.max_tokens == 20 - counted["count"]  # capped to what remains after the prompt
        assert out.usage.total_tokens <= 20
    finally:
        for stop, _ in stops:
            stop.set()
        await asyncio.gather(*(t for _, t in stops), return_exceptions=True)
        await server.stop()
        await pool.aclose()
        await http.aclose()


async def test_the_prompt_is_counted_on_the_replica_that_serves_the_call(stack, tmp_path):
    s = await stack(one=Faults(), two=Faults(), dead=None)
    router = s.service.router
    router.mark_down("dead", "never started")
    rid, key = await s.rollout(tmp_path, max_total_tokens=100_000)
    client = s.openai(rid, key)
    await agent_turn(client, [SYSTEM, TASK], max_tokens=100)  # roomy: nothing counted; pins a replica
    first = router.sticky(rid)
    other = "two" if first == "one" else "one"
    assert first in ("one", "two") and not s.backends[first].tokenized
    await client.chat.completions.create(model="default", messages=[SYSTEM, TASK])  # no max_tokens: counted
    assert len(s.backends[first].tokenized) == 1 and not s.backends[other].tokenized
    router.mark_down(first, "probe failed")  # the sticky replica goes down: counted on, and served by, the other
    await client.chat.completions.create(model="default", messages=[SYSTEM, TASK])
    assert len(s.backends[other].tokenized) == 1
    router.mark_up("dead")
    router.stick(rid, "dead")  # a replica that fails its /tokenize is left like a failing call
    await client.chat.completions.create(model="default", messages=[SYSTEM, TASK])
    steps = await s.steps(rid, 4)
    assert steps[0].prompt_count.source == "bound" and steps[0].failovers == []
    assert steps[1].prompt_count.replica == steps[1].backend_replica == first
    assert steps[2].prompt_count.replica == steps[2].backend_replica == other
    assert [(f.replica, f.error) for f in steps[2].failovers] == [(first, "not used: probe failed")]
    assert steps[3].prompt_count.replica == steps[3].backend_replica == other
    assert [f.replica for f in steps[3].failovers] == ["dead"]
    assert steps[3].failovers[0].error.startswith("/tokenize: ClientConnectorError")
    assert not router.replicas["dead"].healthy
