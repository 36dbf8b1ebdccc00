"""The exact token budget's pure arithmetic: the prompt's upper bound, when a count is
needed, the cap, the refusal, and calls in flight (``admit`` / ``check_budget``)."""

from __future__ import annotations

import msgspec
import pytest

from arena_core.errors import BudgetExhausted, InvalidRequest
from arena_core.schemas import AgentSpec, Budget, PromptCount, RolloutRecord, RolloutState, SamplingParams, Task, \
    TestsVerifier
from arena_stack.scripted_llm import Script, ScriptedLLM, ScriptedResponse
from arena_rollout.proxy.budget import PER_MESSAGE_TOKENS, TEMPLATE_TOKENS, TOOLS_TOKENS, admit, check_budget, \
    prompt_upper_bound

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]


def record(limit: int | None, spent: int = 0, sampling: SamplingParams = SamplingParams()) -> RolloutRecord:
    task = Task(id="t", repo="/r", instructions="i", agent=AgentSpec(command=["a"]),
                verifier=TestsVerifier(fail_to_pass=["x"]), budget=Budget(max_total_tokens=limit))
    return RolloutRecord(rollout_id="r1", task=task, sampling=sampling, model="m", provider="local", api_key="k",
                         state=RolloutState.RUNNING, created_at=0.0, updated_at=0.0, total_tokens=spent)


def chat(text: str = "fix it", **extra) -> dict:
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}], **extra}


def counted(n: int, source: str = "tokenize", note: str = "") -> PromptCount:
    return PromptCount(tokens=n, source=source, replica="default", note=note)


def test_the_upper_bound_is_the_rendered_bytes_plus_allowances():
    body = chat("naïve ✓")  # 'ï' is 2 bytes, '✓' 3: bytes, not characters
    text = len("system") + len("be brief") + len("user") + len("naïve ✓".encode())
    assert prompt_upper_bound(body, "openai.chat") == TEMPLATE_TOKENS + 2 * PER_MESSAGE_TOKENS + text
    with_tools = prompt_upper_bound({**body, "tools": TOOLS}, "openai.chat")
    assert with_tools == prompt_upper_bound(body, "openai.chat") + len(msgspec.json.encode(TOOLS)) + TOOLS_TOKENS
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}
    assert prompt_upper_bound(parts, "openai.chat") == TEMPLATE_TOKENS + PER_MESSAGE_TOKENS + 4 + 3
    called = {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x = 1"}]}
    assert prompt_upper_bound(called, "openai.chat") > len(msgspec.json.encode(called["messages"]))
    assert prompt_upper_bound({"prompt": "def f():"}, "openai.completions") == 8 + PER_MESSAGE_TOKENS
    assert prompt_upper_bound({"prompt": [5, 6, 7]}, "openai.completions") == 3
    # no bound without the backend: an image, a chat template of the agent's own
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}
    assert prompt_upper_bound(image, "openai.chat") is None
    assert prompt_upper_bound(chat(chat_template="{{ messages }}"), "openai.chat") is None


def test_the_bound_is_never_below_the_scripted_backends_real_count():
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="ok")]))
    bodies = [chat(""), chat("x" * 5000), chat("日本語のテキスト" * 50), chat("a", tools=TOOLS),
              {"messages": [{"role": "assistant", "content": "", "tool_calls": [
                  {"id": "c", "type": "function", "function": {"name": "n", "arguments": "{}"}}]}]}]
    for body in bodies:
        assert prompt_upper_bound(body, "openai.chat") >= llm.tokenize(body)["count"]
    text = {"prompt": "é" * 100}
    assert prompt_upper_bound(text, "openai.completions") >= llm.tokenize(text)["count"]


def test_a_roomy_call_needs_no_count_and_holds_its_bound():
    body = chat(max_tokens=100)
    bound = prompt_upper_bound(body, "openai.chat")
    a = admit(record(limit=bound + 100), body, api="openai.chat", now=1.0)
    assert a.verdict == "send" and a.body["max_tokens"] == 100 and a.applied.max_tokens == 100
    assert a.prompt == PromptCount(tokens=bound, source="bound", remaining=bound + 100)
    assert a.reserve == bound + 100  # the most it can spend, held while in flight
    # one token less and the prompt's real length decides: count it first
    assert admit(record(limit=bound + 99), body, api="openai.chat", now=1.0).verdict == "count"
    # a chat without max_tokens could generate up to whatever remains: always counted
    assert admit(record(limit=10**9), chat(), api="openai.chat", now=1.0).verdict == "count"
    # no token budget: nothing counted, nothing held
    free = admit(record(limit=None), chat(), api="openai.chat", now=1.0)
    assert free.verdict == "send" and free.prompt is None and free.reserve == 0 and "max_tokens" not in free.body


def test_a_counted_prompt_caps_max_tokens_to_exactly_what_remains():
    rec = record(limit=1000, spent=900)  # 100 left
    a = admit(rec, chat(max_tokens=500), api="openai.chat", now=1.0, prompt=counted(37))
    assert a.verdict == "send" and a.body["max_tokens"] == 63 == a.applied.max_tokens
    assert 37 + a.body["max_tokens"] + 900 == 1000  # prompt + the most it may generate: the whole budget
    assert a.prompt == PromptCount(tokens=37, source="tokenize", remaining=100, replica="default")
    assert a.reserve == 100
    untouched = admit(rec, chat(max_tokens=63), api="openai.chat", now=1.0, prompt=counted(37))
    assert untouched.body["max_tokens"] == 63 and untouched.reserve == 100
    nothing_asked = admit(rec, chat(), api="openai.chat", now=1.0, prompt=counted(37))
    assert nothing_asked.body["max_tokens"] == 63
    agent_alias = admit(rec, chat(max_completion_tokens=500), api="openai.chat", now=1.0, prompt=counted(37))
    assert agent_alias.body["max_tokens"] == 63 and "max_completion_tokens" not in agent_alias.body
    # a rollout max_tokens under ``override`` cannot lift the cap
    rollout = record(limit=1000, spent=900, sampling=SamplingParams(max_tokens=4000))
    lifted = admit(rollout, chat(max_tokens=5), api="openai.chat", now=1.0, prompt=counted(37))
    assert lifted.body["max_tokens"] == 63 == lifted.applied.max_tokens
    one_left = admit(rec, chat(max_tokens=500), api="openai.chat", now=1.0, prompt=counted(99))
    assert one_left.body["max_tokens"] == 1


def test_a_prompt_that_leaves_nothing_to_generate_is_refused():
    rec = record(limit=1000, spent=900)
    with pytest.raises(BudgetExhausted, match="a prompt of 100 tokens does not fit in the 100 of 1000 tokens left"):
        admit(rec, chat(max_tokens=5), api="openai.chat", now=1.0, prompt=counted(100))
    fallback = counted(250, "fallback", note="replica default has no /tokenize (404)")
    with pytest.raises(BudgetExhausted, match=r"a prompt of at most 250 tokens does not fit in the 100 of 1000 "
                                              r"tokens left \(replica default has no /tokenize \(404\)\)"):
        admit(rec, chat(max_tokens=5), api="openai.chat", now=1.0, prompt=fallback)
    with pytest.raises(BudgetExhausted, match="token budget exhausted: 1000 of 1000 tokens used"):
        admit(record(limit=1000, spent=1000), chat(max_tokens=1), api="openai.chat", now=1.0, prompt=counted(1))
    with pytest.raises(InvalidRequest, match="'max_tokens' must be an integer"):
        admit(rec, chat(max_tokens="lots"), api="openai.chat", now=1.0, prompt=counted(1))


def test_a_fallback_bound_caps_conservatively():
    rec = record(limit=1000, spent=500)
    a = admit(rec, chat(max_tokens=400), api="openai.chat", now=1.0,
              prompt=counted(300, "fallback", note="replica default has no /tokenize (404)"))
    assert a.body["max_tokens"] == 200 and a.prompt.source == "fallback" and a.prompt.remaining == 500
    assert "no /tokenize" in a.prompt.note


def test_calls_in_flight_make_a_tight_call_wait_never_refuse():
    body = chat(max_tokens=100)
    bound = prompt_upper_bound(body, "openai.chat")
    rec = record(limit=2 * (bound + 100))
    # a roomy call fits beside what the calls in flight hold
    assert check_budget(rec, body, now=1.0, reserved=bound + 100).verdict == "send"
    # not beside more: the others may spend less than they hold, so wait for them (no count yet)
    assert check_budget(rec, body, now=1.0, reserved=bound + 101).verdict == "wait"
    # a counted prompt that does not fit beside them waits too; it is neither capped nor refused on their account
    tight = record(limit=150)
    assert check_budget(tight, body, now=1.0, reserved=100, prompt=counted(40)).verdict == "wait"
    assert check_budget(tight, body, now=1.0, reserved=10, prompt=counted(40)).verdict == "send"
    # once they have ended (reserved 0), the same call is capped
    capped = check_budget(tight, body, now=1.0, reserved=0, prompt=counted(60))
    assert capped.verdict == "send" and capped.body["max_tokens"] == 90
    # a prompt of token ids is counted here, exactly
    ids = check_budget(tight, {"prompt": list(range(3, 13)), "max_tokens": 500}, now=1.0, api="openai.completions")
    assert ids.body["max_tokens"] == 140 and ids.prompt.source == "ids" and ids.prompt.tokens == 10
