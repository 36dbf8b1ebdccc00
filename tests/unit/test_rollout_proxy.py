"""The proxy's pure logic: sampling injection, budgets, token-level capture."""

from __future__ import annotations

import msgspec
import pytest

from arena.errors import BudgetExhausted, InvalidRequest, UpstreamError
from arena.schemas import AgentSpec, Budget, RolloutRecord, RolloutState, SamplingParams, Task, TestsVerifier, Timings
from arena.scripted_llm import Script, ScriptedLLM, ScriptedResponse, decode_ids
from arena_rollout import proxy


def record(budget: Budget, steps: int = 0, tokens: int = 0) -> RolloutRecord:
    task = Task(id="t", repo="/r", instructions="i", agent=AgentSpec(command=["a"]),
                verifier=TestsVerifier(fail_to_pass=["x"]), budget=budget)
    return RolloutRecord(rollout_id="r1", task=task, sampling=SamplingParams(), model="m", provider="local",
                         api_key="k", state=RolloutState.RUNNING, created_at=0.0, updated_at=0.0,
                         steps=steps, total_tokens=tokens)


def test_rollout_sampling_overrides_the_agent_and_capture_is_forced():
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "top_p": 0.5, "stream": False}
    sent, applied = proxy.apply_sampling(body, SamplingParams(temperature=1.0, seed=7, top_k=20))
    assert sent["temperature"] == 1.0 and sent["seed"] == 7 and sent["top_k"] == 20
    assert sent["top_p"] == 0.5  # not set by the rollout: the agent's value stays
    assert sent["logprobs"] is True and sent["return_token_ids"] is True
    assert applied == SamplingParams(temperature=1.0, top_p=0.5, top_k=20, seed=7)
    assert body["temperature"] == 0.0  # the caller's dict is not mutated


def test_turn_budget_refuses_before_sending():
    with pytest.raises(BudgetExhausted, match="turn budget exhausted: 2 of 2"):
        proxy.check_budget(record(Budget(max_turns=2), steps=2), {"messages": []})


def test_token_budget_caps_max_tokens_then_refuses():
    capped = proxy.check_budget(record(Budget(max_total_tokens=100), tokens=70), {"max_tokens": 500})
    assert capped["max_tokens"] == 30
    untouched = proxy.check_budget(record(Budget(max_total_tokens=100), tokens=70), {"max_tokens": 10})
    assert untouched["max_tokens"] == 10
    with pytest.raises(BudgetExhausted, match="token budget exhausted"):
        proxy.check_budget(record(Budget(max_total_tokens=100), tokens=100), {})


def test_bad_bodies_are_refused_with_a_reason():
    with pytest.raises(InvalidRequest, match="messages"):
        proxy.validate_chat_body({"messages": []})
    with pytest.raises(InvalidRequest, match="streaming"):
        proxy.validate_chat_body({"messages": [{"role": "user", "content": "x"}], "stream": True})
    with pytest.raises(InvalidRequest, match="JSON object"):
        proxy.validate_chat_body([1, 2])


def test_capture_keeps_the_backend_tokens_exactly():
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="héllo ```diff\n```")]))
    body, applied = proxy.apply_sampling({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
                                         SamplingParams(seed=3))
    answer = llm.complete(body)
    step = proxy.capture(rollout_id="r1", step_index=4, request=body, response=answer, applied=applied,
                         backend="http://b/v1", policy_version="7", timings=Timings(total_ms=1.0), started_at=5.0)
    assert step.prompt_token_ids == answer["prompt_token_ids"]
    assert step.completion_token_ids == answer["choices"][0]["token_ids"]
    assert step.logprobs == [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
    assert all(len(alts) == 3 for alts in step.top_logprobs)
    assert decode_ids(step.completion_token_ids) == step.completion_text == "héllo ```diff\n```"
    assert step.token_ids_source == "backend" and step.step_index == 4 and step.policy_version == "7"
    assert step.usage.total_tokens == len(step.prompt_token_ids) + len(step.completion_token_ids)
    # round-trips on the wire unchanged
    assert msgspec.json.decode(msgspec.json.encode(step), type=type(step)) == step


def test_capture_without_token_ids_says_so_instead_of_guessing():
    answer = {"model": "m", "choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    step = proxy.capture(rollout_id="r", step_index=0, request={"messages": []}, response=answer,
                         applied=SamplingParams(), backend="b", policy_version=None, timings=Timings(), started_at=0)
    assert step.token_ids_source == "unavailable"
    assert step.prompt_token_ids is None and step.completion_token_ids is None and step.logprobs is None
    assert step.usage.total_tokens == 4


def test_capture_rejects_a_response_without_choices():
    with pytest.raises(UpstreamError, match="no choices"):
        proxy.capture(rollout_id="r", step_index=0, request={}, response={"oops": 1}, applied=SamplingParams(),
                      backend="b", policy_version=None, timings=Timings(), started_at=0)
