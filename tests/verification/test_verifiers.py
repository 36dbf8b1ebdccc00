"""llm_judge against a real scripted OpenAI-compatible server, and a composite verifier
(tests in a real sandbox + exact + rubric + judge) on the quickstart task."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import msgspec
import pytest

from arena_core.errors import VerificationError
from arena_stack.natsserver import free_port
from arena_core.schemas import (
    CompositeVerifier,
    ExactVerifier,
    LlmJudgeVerifier,
    RubricItem,
    RubricVerifier,
    VerifyJob,
    WeightedVerifier,
)
from arena_sandbox_providers import local
from arena_verification.runner import verify

from .test_runner import TASK, scripted_diff


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    script = tmp_path_factory.mktemp("judge") / "script.json"
    script.write_text(json.dumps({"responses": [
        {"label": "grade", "content": "The answer is correct and explained.\nSCORE: 0.75"}]}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "arena_stack.scripted_llm", "--script", str(script), "--port", str(port),
                             "--model", "judge-model"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def job(verifier, *, diff: str = "", result=None, name: str = "") -> VerifyJob:
    return VerifyJob(rollout_id="r1", task=msgspec.structs.replace(TASK, verifier=verifier), diff=diff,
                     result=result, name=name)


async def test_llm_judge_records_its_own_call(judge_url):
    spec = LlmJudgeVerifier(rubric="The median of [4,1,3,2] must be 2.5.", model="judge-model", base_url=judge_url)
    r = await verify(job(spec, result={"answer": "2.5, the mean of 2 and 3"}))
    assert (r.verifier, r.reward, r.passed, r.components) == ("llm_judge", 0.75, False, {"judge": 0.75})
    assert r.tests == [] and len(r.judge_calls) == 1
    call = r.judge_calls[0]
    assert call.model == "judge-model" and call.base_url == judge_url
    assert call.completion_text.endswith("SCORE: 0.75") and call.usage.completion_tokens > 0
    assert "2.5, the mean of 2 and 3" in call.request_messages[1]["content"]
    msgspec.json.encode(r)


async def test_an_unreachable_judge_is_an_error_not_a_zero():
    spec = LlmJudgeVerifier(rubric="x", base_url=f"http://127.0.0.1:{free_port()}/v1", timeout_s=5)
    with pytest.raises(VerificationError, match="unreachable"):
        await verify(job(spec, result={"answer": "a"}))


@pytest.mark.skipif(local.available() is not None, reason=f"no sandbox: {local.available()}")
async def test_composite_of_tests_exact_rubric_and_judge(judge_url, tmp_path):
    spec = CompositeVerifier(verifiers=[
        WeightedVerifier(name="tests", weight=6, verifier=TASK.verifier),
        WeightedVerifier(name="answer", weight=2, verifier=ExactVerifier(answers=["2.5"])),
        WeightedVerifier(name="diff_style", weight=1, verifier=RubricVerifier(source="diff", items=[
            RubricItem(pattern="print(", forbidden=True, name="no_print"),
            RubricItem(pattern=r"ordered\[mid - 1\]", regex=True, name="uses_mid_minus_1")])),
        WeightedVerifier(name="judge", weight=1, verifier=LlmJudgeVerifier(rubric="Explain the fix.",
                                                                          base_url=judge_url)),
    ])
    r = await verify(job(spec, diff=scripted_diff("correct"), result={"answer": "2.50"}, name="combo-v1"),
                     scratch_dir=tmp_path)
    assert r.verifier == "combo-v1"  # a named (replayed) verification keeps its name
    assert r.reward == pytest.approx((6 * 1 + 2 * 1 + 1 * 1 + 1 * 0.75) / 10)
    assert not r.passed  # the judge gave 0.75
    assert {k: r.components[k] for k in ("tests", "answer", "diff_style", "judge")} == {
        "tests": 1.0, "answer": 1.0, "diff_style": 1.0, "judge": 0.75}
    assert r.components["tests.partial"] == 1.0 and r.components["diff_style.no_print"] == 1.0
    assert r.counts.f2p_passed == 2 and r.parser == "pytest" and len(r.tests) == 7
    assert len(r.judge_calls) == 1 and r.flags == []
