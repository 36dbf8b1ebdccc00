"""arena_rl.art_adapter: Arena groups to ART's TrajectoryGroup and back (field by field: what
survives exactly, what does not), and group_judge against a real scripted OpenAI-compatible judge."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import msgspec
import pytest

art = pytest.importorskip("art")

from openai.types.chat.chat_completion import Choice  # noqa: E402

from arena_core.grpo import group_advantages  # noqa: E402
from arena_core.schemas import (  # noqa: E402
    GroupCompleted,
    RolloutState,
    SamplingParams,
    SandboxDone,
    SandboxOutcome,
    Step,
    Timings,
    ToolCall,
    TopLogprob,
    Trajectory,
    Usage,
    VerificationResult,
)
from arena_rl.art_adapter import (  # noqa: E402
    GroupJudgement,
    GroupJudgeError,
    apply_judgement,
    apply_judgement_to_art,
    from_art_group,
    group_judge,
    judge_messages,
    to_art_group,
)
from arena_stack.natsserver import free_port  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2+2"}'}}


def step(rid: str, i: int, request: list[dict], text: str, *, ids: list[int] | None, version: str = "7",
         calls: list[ToolCall] = (), top: bool = True, **kw) -> Step:
    lps = None if ids is None else [-0.5 / (k + 1) for k in range(len(ids))]
    tops = None if ids is None or not top else [[TopLogprob(token=chr(97 + k), logprob=lp, token_id=t),
                                                 TopLogprob(token="zz", logprob=lp - 1.0)]
                                                for k, (t, lp) in enumerate(zip(ids, lps))]
    return Step(rollout_id=rid, step_index=i, model="policy", backend="http://replica/v1", policy_version=version,
                request_messages=request, completion_text=text, tool_calls=list(calls), tools=TOOLS,
                prompt_token_ids=None if ids is None else [1, 2, 3], completion_token_ids=ids, logprobs=lps,
                top_logprobs=tops, token_ids_source="backend" if ids is not None else "unavailable",
                finish_reason="tool_calls" if calls else "stop", usage=Usage(prompt_tokens=3, completion_tokens=2),
                timings=Timings(total_ms=12.5), started_at=1000.0 + i, sampling=SamplingParams(temperature=1.0), **kw)


def member(rid: str, index: int, prompt: str, answer: str, reward: float | None, *, tool: bool) -> Trajectory:
    system = {"role": "system", "content": "You are a careful calculator."}
    user = {"role": "user", "content": prompt}
    if tool:
        steps = [step(rid, 0, [system, user], "", ids=[40, 41], calls=[ToolCall(id="call_1", name="calc",
                                                                                 arguments='{"expr": "2+2"}')]),
                 step(rid, 1, [system, user, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                               {"role": "tool", "tool_call_id": "call_1", "content": "4"}],
                      answer, ids=[50, 51, 2], version="8")]
    else:
        steps = [step(rid, 0, [system, user], answer, ids=[60, 2], top=False)]
    verification = None if reward is None else VerificationResult(
        rollout_id=rid, verifier="exact", reward=reward, passed=reward == 1.0, started_at=5.0, finished_at=6.0,
        components={"exact": reward}, flags=["none"], reason="compared")
    return Trajectory(rollout_id=rid, task_id="sum", group_id="g1", group_index=index, group_size=3,
                      final_state=RolloutState.COMPLETED if reward is not None else RolloutState.FAILED,
                      reason="" if reward is not None else "sandbox provider down", reward=reward, steps=steps,
                      verification=verification, infrastructure=reward is None,
                      policy_versions=list(dict.fromkeys(s.policy_version for s in steps)), completed_at=99.5,
                      metadata={"experiment": "art"},
                      sandbox=SandboxDone(rollout_id=rid, sandbox_id="s", provider="local",
                                          outcome=SandboxOutcome.COMPLETED, reason="", started_at=1.0,
                                          finished_at=2.0, result={"answer": answer}, diff=""))


def group(prompt: str = "What is 2+2? Use the tool.") -> GroupCompleted:
    members = [member("r0", 0, prompt, "The answer is 4.", 1.0, tool=True),
               member("r1", 1, prompt, "5", 0.0, tool=False),
               member("r2", 2, prompt, "", None, tool=False)]
    rewards = [t.reward for t in members]
    return GroupCompleted(group_id="g1", task_id="sum", size=3, trajectories=members, rewards=rewards,
                          advantages=[*group_advantages([1.0, 0.0]), 0.0], completed_at=100.0, excluded_indexes=[2])


#: Step fields ART has no place for: rebuilt as their defaults.
LOST = dict(prompt_token_ids=None, usage=Usage(), timings=Timings(), started_at=0.0, sampling=SamplingParams())


def test_an_arena_group_becomes_an_art_group_with_choices_logprobs_and_metadata():
    g = group()
    ag = to_art_group(g)
    assert isinstance(ag, art.TrajectoryGroup) and len(ag) == 2  # r2 has no reward
    assert [e.message for e in ag.exceptions] == ["rollout r2 (member 2): no reward: sandbox provider down"]
    assert "InfrastructureOutcome" in ag.exceptions[0].type
    assert ag.metadata == {"arena_group_id": "g1", "arena_task_id": "sum", "arena_size": 3, "arena_partial": False,
                           "arena_completed_at": 100.0}
    t0, t1 = ag.trajectories
    assert isinstance(t0, art.Trajectory)
    system, user, call, tool, final = t0.messages_and_choices
    assert system == g.trajectories[0].steps[1].request_messages[0] and user["role"] == "user"
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": "4"}
    assert isinstance(call, Choice) and isinstance(final, Choice)
    assert call.finish_reason == "tool_calls" and call.message.content is None
    assert call.message.tool_calls[0].function.name == "calc" and call.message.tool_calls[0].id == "call_1"
    assert final.message.content == "The answer is 4." and final.finish_reason == "stop"
    assert [lp.token for lp in final.logprobs.content] == ["token_id:50", "token_id:51", "token_id:2"]
    assert [lp.logprob for lp in final.logprobs.content] == g.trajectories[0].steps[1].logprobs
    alt = final.logprobs.content[1].top_logprobs
    assert (alt[0].token, alt[0].model_extra, alt[1].token, alt[1].model_extra) == ("b", {"token_id": 51}, "zz", {})
    assert t0.reward == 1.0 and t1.reward == 0.0
    assert t0.metrics == {"verifier/exact": 1.0, "passed": True} and t1.metrics["passed"] is False
    assert (t0.initial_policy_version, t0.final_policy_version) == (7, 8)
    assert t0.tools == TOOLS and t0.additional_histories == []
    assert t0.metadata == {
        "arena_rollout_id": "r0", "arena_task_id": "sum", "arena_group_id": "g1", "arena_group_index": 0,
        "arena_group_size": 3, "arena_final_state": "completed", "arena_reason": "", "arena_completed_at": 99.5,
        "arena_policy_versions": "7,8", "arena_model": "policy", "arena_backend": "http://replica/v1",
        "arena_step_indexes": "0,1", "arena_step_policy_versions": "7,8", "arena_verifier": "exact",
        "label/experiment": "art"}
    # ART's own readers accept it: the chat messages ART tokenizes, and its logging form
    assert [m["role"] for m in t0.messages()] == ["system", "user", "assistant", "tool", "assistant"]
    assert [m["trainable"] for m in t0.for_logging()["messages"]] == [False, False, True, False, True]


def test_back_from_art_every_field_art_can_hold_survives_exactly():
    g = group()
    back = from_art_group(to_art_group(g), task_id="sum")
    assert [t.rollout_id for t in back] == ["r0", "r1"]  # r2 (no reward) is an ART exception: not rebuilt
    for orig, t in zip(g.trajectories, back):
        assert (t.task_id, t.group_id, t.group_index, t.group_size) == (orig.task_id, "g1", orig.group_index, 3)
        assert (t.reward, t.final_state, t.reason, t.completed_at) == (orig.reward, orig.final_state, orig.reason,
                                                                       orig.completed_at)
        assert t.policy_versions == orig.policy_versions and t.metadata == orig.metadata
        # every step: request, answer, tool calls, token ids, logprobs, top logprobs, version, index, model,
        # backend, tools, finish reason exact; ART has no place for the prompt ids, usage, timings, sampling
        assert t.steps == [msgspec.structs.replace(s, **LOST) for s in orig.steps]
        v, ov = t.verification, orig.verification
        assert (v.verifier, v.reward, v.passed, v.components) == (ov.verifier, ov.reward, ov.passed, ov.components)
        assert (v.flags, v.reason, v.started_at) == ([], "", 0.0)  # not carried: ART has no place for them
        assert t.sandbox is None and t.history == [] and t.sequences == []
    # a second trip changes nothing more: the conversion is a fixed point after the first
    again = from_art_group(to_art_group(msgspec.structs.replace(g, trajectories=back, size=2, rewards=[1.0, 0.0],
                                                                advantages=[1.0, -1.0])), task_id="sum")
    assert [msgspec.structs.replace(t, verification=None) for t in again] == \
           [msgspec.structs.replace(t, verification=None) for t in back]


def test_calls_outside_the_final_conversation_travel_as_additional_histories_and_abandoned_calls_do_not():
    t = member("r0", 0, "What is 2+2?", "4", 1.0, tool=False)
    system, user = t.steps[0].request_messages
    lost = step("r0", 1, [system, user], "abandoned answer", ids=[70], abandoned=True)
    cut = step("r0", 3, [system, user], "cut sh", ids=[71], incomplete=True, error="replica died")
    # the scaffold rewrote its history: call 2's request no longer holds call 0's answer
    rewritten = step("r0", 2, [system, {"role": "user", "content": "Summary so far: 4. Answer."}], "4", ids=[80],
                     version="9")
    t = msgspec.structs.replace(t, steps=[t.steps[0], lost, rewritten, cut], policy_versions=["7", "9"])
    g = GroupCompleted(group_id="g1", task_id="sum", size=1, trajectories=[t], rewards=[1.0], advantages=[0.0],
                       completed_at=1.0)
    [at] = to_art_group(g).trajectories
    assert [m if isinstance(m, dict) else m.message.content for m in at.messages_and_choices] == \
           [system, {"role": "user", "content": "Summary so far: 4. Answer."}, "4"]
    [history] = at.additional_histories
    assert history.messages_and_choices[:2] == [system, user] and history.messages_and_choices[2].message.content == "4"
    assert at.metadata["arena_step_indexes"] == "2,0" and at.metadata["arena_step_policy_versions"] == "9,7"
    [back] = from_art_group(to_art_group(g), task_id="sum")
    # the abandoned call 1 never reached the agent, the incomplete call 3 was cut short: not trained on, dropped
    assert [s.step_index for s in back.steps] == [0, 2]
    assert back.steps == [msgspec.structs.replace(s, **LOST) for s in (t.steps[0], rewritten)]


def test_an_art_native_group_becomes_arena_trajectories():
    native = art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[
            {"role": "user", "content": "hi"},
            Choice(index=0, finish_reason="stop", message={"role": "assistant", "content": "hello"})],
            reward=0.25, initial_policy_version=3, final_policy_version=3),
        art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=0.0)])
    a, b = from_art_group(native, task_id="greet", group_id="grp")
    assert (a.rollout_id, a.group_id, a.group_index, a.group_size, a.reward) == ("grp-0", "grp", 0, 2, 0.25)
    [s] = a.steps
    assert (s.request_messages, s.completion_text, s.policy_version, s.token_ids_source) == \
           ([{"role": "user", "content": "hi"}], "hello", "3", "unavailable")
    assert s.completion_token_ids is None and s.logprobs is None and a.verification is None
    assert a.policy_versions == ["3"] and b.steps == [] and b.final_state == RolloutState.COMPLETED


# --------------------------------------------------------------------------- group_judge, real HTTP

JUDGE_ANSWERS = {
    "JUDGE-OK": json.dumps({"scores": [
        {"id": "1", "explanation": "Used the tool and answered 4.", "score": 0.9},
        {"id": "2", "explanation": "Answered 5: wrong.", "score": 0.1}]}),
    "JUDGE-FENCED": "Here is my grading:\n```json\n" + json.dumps({"scores": [
        {"id": 2, "score": 0, "explanation": "wrong"}, {"id": 1, "score": 1, "explanation": "right"}]}) + "\n```",
    "JUDGE-PROSE": "Attempt 1 is better. SCORE: 0.8",
    "JUDGE-MISSING": json.dumps({"scores": [{"id": "1", "score": 0.7, "explanation": "ok"}]}),
    "JUDGE-RANGE": json.dumps({"scores": [{"id": "1", "score": 1.5}, {"id": "2", "score": 0.2}]}),
    "JUDGE-SHAPE": json.dumps({"scores": {"1": 0.5, "2": 0.5}}),
}


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    script = tmp_path_factory.mktemp("group-judge") / "script.json"
    script.write_text(json.dumps({"plays": [{"label": key, "match": key, "turns": [{"content": answer}]}
                                            for key, answer in JUDGE_ANSWERS.items()]}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "arena_stack.scripted_llm", "--script", str(script),
                             "--port", str(port), "--model", "judge-model"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "scripted judge did not start"
            time.sleep(0.1)
        yield f"{url}/v1"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_group_judge_scores_the_members_in_one_call_recorded_apart_from_the_steps(judge_url):
    g = group("What is 2+2? JUDGE-OK")
    j = await group_judge(g, base_url=judge_url, model="judge-model", api_key="k")
    assert isinstance(j, GroupJudgement) and (j.group_id, j.task_id, j.model) == ("g1", "sum", "judge-model")
    assert j.scores == {"r0": 0.9, "r1": 0.1} and j.order == ["r0", "r1"]  # r2 (no reward) is not judged
    assert j.explanations["r1"] == "Answered 5: wrong."
    assert j.completion_text == JUDGE_ANSWERS["JUDGE-OK"] and j.finish_reason == "stop"
    assert j.usage.completion_tokens == len(JUDGE_ANSWERS["JUDGE-OK"].encode()) and j.latency_ms > 0
    system, user = j.request_messages
    assert system["role"] == "system" and '{"scores"' in system["content"]
    assert user["content"].count("JUDGE-OK") == 1  # the shared system + user prompt is shown once
    assert '<attempt id="1">' in user["content"] and '<attempt id="2">' in user["content"]
    assert '<attempt id="3">' not in user["content"] and '"final_answer": "5"' in user["content"]
    assert user["content"].startswith("<tools>\n" + json.dumps(TOOLS))
    assert j.request_messages == judge_messages(g.trajectories[:2])
    assert msgspec.json.decode(msgspec.json.encode(j), type=GroupJudgement) == j

    # applied to the Arena group: rewards and advantages change, steps and verification do not
    judged = apply_judgement(g, j)
    assert judged.rewards == [0.9, 0.1, None] and judged.advantages == [*group_advantages([0.9, 0.1]), 0.0]
    assert [t.steps for t in judged.trajectories] == [t.steps for t in g.trajectories]
    assert [t.verification for t in judged.trajectories] == [t.verification for t in g.trajectories]
    assert g.rewards == [1.0, 0.0, None]  # the input is untouched
    # applied to the ART group, RULER's way: the old reward kept as a metric, the reason logged
    ag = to_art_group(g)
    jag = apply_judgement_to_art(ag, j)
    assert [t.reward for t in jag.trajectories] == [0.9, 0.1] and [t.reward for t in ag.trajectories] == [1.0, 0.0]
    assert jag.trajectories[0].metrics["independent_reward"] == 1.0
    assert jag.trajectories[0].metrics["group_judge_score"] == 0.9
    assert jag.trajectories[1].logs == ["group_judge (judge-model): Answered 5: wrong."]
    assert jag.trajectories[0].messages_and_choices == ag.trajectories[0].messages_and_choices
    with pytest.raises(ValueError, match="for group g1, not g2"):
        apply_judgement(msgspec.structs.replace(g, group_id="g2"), j)


async def test_a_fenced_answer_with_numeric_ids_is_read(judge_url):
    j = await group_judge(group("What is 2+2? JUDGE-FENCED"), base_url=judge_url, model="judge-model")
    assert j.scores == {"r0": 1.0, "r1": 0.0} and j.explanations == {"r0": "right", "r1": "wrong"}


@pytest.mark.parametrize("case, message", [
    ("JUDGE-PROSE", "holds no JSON object"),
    ("JUDGE-MISSING", r"expected one score for each attempt 1..2; missing \['2'\]"),
    ("JUDGE-RANGE", "score 1.5 is not between 0 and 1"),
    ("JUDGE-SHAPE", r'is not \{"scores": \[...\]\}'),
])
async def test_a_malformed_judge_answer_is_a_clear_error(judge_url, case, message):
    with pytest.raises(GroupJudgeError, match=message) as err:
        await group_judge(group(f"What is 2+2? {case}"), base_url=judge_url, model="judge-model")
    assert err.value.answer == JUDGE_ANSWERS[case]  # the raw answer is kept for the record
    # no library exception chained under it: the message is the whole story
    assert err.value.__cause__ is None and (err.value.__context__ is None or err.value.__suppress_context__)


async def test_an_unreachable_judge_is_an_error():
    with pytest.raises(GroupJudgeError, match="unreachable"):
        await group_judge(group(), base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", timeout_s=5)
    empty = msgspec.structs.replace(group(), trajectories=[group().trajectories[2]], rewards=[None])
    with pytest.raises(GroupJudgeError, match="no member with a reward"):
        await group_judge(empty, base_url="http://127.0.0.1:1/v1", model="m")
