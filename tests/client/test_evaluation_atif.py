"""Each attempt's trajectory in Harbor's trajectory format (ATIF; libs/arena/evaluation/atif.py and
interchange.py): the mapping of a multi-turn tool-calling rollout checked field by field, and a job's
export checked with Harbor's own pydantic models (PyPI ``harbor`` in .arena/harbor-venv, Python 3.12;
skipped when it cannot be built)."""

from __future__ import annotations

import io
import json
import subprocess

from arena.evaluation import interchange, records, runner
from arena.evaluation.atif import to_atif
from arena_core.schemas import (
    RolloutState,
    StateTransition,
    Step,
    ToolCall,
    Trajectory,
    Usage,
    VerificationResult,
)
from tests.client.test_evaluation_job import FakeClient, completed, dataset
from tests.client.test_harbor_terminal_bench_import import harbor_python

SYSTEM = {"role": "system", "content": "You fix bugs."}
USER = {"role": "user", "content": [{"type": "text", "text": "fix the median"}]}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]


def conversation(rid: str, task_id: str = "t0") -> Trajectory:
    """Three LLM calls: a tool call, its result; a malformed tool call, its result and a user nudge; the answer."""
    first = [SYSTEM, USER]
    a1 = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "read_file", "arguments": '{"path": "a.py"}'}}]}
    second = [*first, a1, {"role": "tool", "tool_call_id": "c1", "content": "def median(): ..."}]
    a2 = {"role": "assistant", "content": "", "tool_calls": [{"id": "c2", "type": "function", "function": {
        "name": "read_file", "arguments": "{not json"}}]}
    third = [*second, a2, {"role": "tool", "tool_call_id": "c2", "content": "error: bad arguments"},
             {"role": "user", "content": "keep going"}]

    def step(i, messages, text, calls, prompt, cached):
        return Step(rollout_id=rid, step_index=i, model="m-1", backend="http://b", policy_version="7",
                    request_messages=messages, tools=TOOLS, completion_text=text, tool_calls=calls,
                    prompt_token_ids=list(range(prompt)), completion_token_ids=[5, 6], logprobs=[-0.1, -0.2],
                    finish_reason="tool_calls" if calls else "stop", started_at=1_700_000_000.0 + i,
                    usage=Usage(prompt_tokens=prompt, completion_tokens=2, total_tokens=prompt + 2,
                                cached_tokens=cached))

    steps = [step(0, first, "", [ToolCall(id="c1", name="read_file", arguments='{"path": "a.py"}')], 10, 0),
             step(1, second, "", [ToolCall(id="c2", name="read_file", arguments="{not json")], 20, 16),
             step(2, third, "Fixed: use ordered[mid - 1].", [], 30, 16)]
    return Trajectory(rollout_id=rid, task_id=task_id, final_state=RolloutState.COMPLETED, reward=1.0,
                      completed_at=1_700_000_010.0, steps=steps,
                      history=[StateTransition(from_state=None, to_state=RolloutState.PENDING, at=1_699_999_999.0)],
                      verification=VerificationResult(rollout_id=rid, verifier="tests", reward=1.0, passed=True,
                                                      started_at=1_700_000_008.0, finished_at=1_700_000_009.0))


def test_a_multi_turn_tool_calling_rollout_maps_to_atif_steps_with_observations_tied_to_their_calls():
    doc = to_atif(conversation("r-1"), agent_name="mini-swe-agent", agent_version="0.1.0", model="m-1",
                  extra={"eval_attempt": 0})
    assert doc["schema_version"] == "ATIF-v1.8" and doc["session_id"] == doc["trajectory_id"] == "r-1"
    assert doc["agent"] == {"name": "mini-swe-agent", "version": "0.1.0", "model_name": "m-1", "tool_definitions": TOOLS}
    steps = doc["steps"]
    assert [s["step_id"] for s in steps] == [1, 2, 3, 4, 5]
    assert [s["source"] for s in steps] == ["system", "user", "agent", "agent", "agent"]
    assert steps[1]["message"] == "fix the median"  # content parts as text
    call = steps[2]
    assert call["tool_calls"] == [{"tool_call_id": "c1", "function_name": "read_file", "arguments": {"path": "a.py"}}]
    assert call["observation"] == {"results": [{"content": "def median(): ...", "source_call_id": "c1"}]}
    assert call["metrics"] == {"prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": 0,
                               "prompt_token_ids": list(range(10)), "completion_token_ids": [5, 6],
                               "logprobs": [-0.1, -0.2]}
    assert call["timestamp"] == "2023-11-14T22:13:20+00:00" and call["llm_call_count"] == 1
    malformed = steps[3]
    assert malformed["tool_calls"][0]["arguments"] == {"_raw": "{not json"}
    assert malformed["observation"]["results"] == [
        {"content": "error: bad arguments", "source_call_id": "c2"},
        {"content": "keep going", "extra": {"role": "user"}}]
    assert steps[4]["message"] == "Fixed: use ordered[mid - 1]." and "observation" not in steps[4]
    assert doc["final_metrics"] == {"total_prompt_tokens": 60, "total_completion_tokens": 6,
                                    "total_cached_tokens": 32, "total_steps": 5}
    assert doc["extra"] == {"arena_rollout_id": "r-1", "task_id": "t0", "final_state": "completed", "reward": 1.0,
                            "passed": True, "eval_attempt": 0}


class ConversationSource:
    """The trajectory plane of a finished job: every rollout a conversation, but ``silent`` made no LLM call."""

    def __init__(self, client: FakeClient, silent: str):
        self.client, self.silent = client, silent

    def trajectory(self, rollout_id):
        view = self.client.views[rollout_id]
        traj = conversation(rollout_id, view.task_id)
        return msgspec_replace(traj, steps=[]) if rollout_id == self.silent else traj


def msgspec_replace(traj, **changes):
    import msgspec

    return msgspec.structs.replace(traj, **changes)


CHECK = r"""
import json, sys
from pathlib import Path
from harbor.models.trajectories.trajectory import Trajectory

out = {}
for path in sorted(Path(sys.argv[1]).glob("*.atif.json")):
    t = Trajectory.model_validate_json(path.read_text())
    out[path.name] = {"steps": len(t.steps), "sources": [s.source for s in t.steps],
                      "cached": t.final_metrics.total_cached_tokens,
                      "linked": [r.source_call_id for s in t.steps if s.observation for r in s.observation.results]}
print(json.dumps(out))
"""


def test_an_exported_job_validates_with_harbors_own_trajectory_model(tmp_path):
    python = harbor_python()
    job = runner.create_job(dataset(tmp_path, 2), agent="task", models=["a"], k=2, concurrency=2,
                            root=tmp_path / "evals")
    client = FakeClient(lambda *a: completed(1.0))
    runner.run_job(client, job, stream=io.StringIO(), tty=False)
    final = records.final_results(records.read_log(job))
    silent = final[("t1", "a", 1)].rollout_id
    rows = interchange.export_job(job, ConversationSource(client, silent))
    out = job / "trajectories"
    assert len(rows) == 4 and all(r.atif and r.arena and not r.missing for r in rows)
    assert {json.loads(line)["rollout_id"] for line in (out / "index.jsonl").read_text().splitlines()} == \
        {r.rollout_id for r in final.values()}
    done = subprocess.run([python, "-c", CHECK, str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    checked = json.loads(done.stdout)
    assert sorted(checked) == sorted(f"{r.rollout_id}.atif.json" for r in final.values())
    for name, t in checked.items():
        if name.startswith(silent):  # no LLM call: the task's instructions as the one user step
            assert t["sources"] == ["user"] and t["cached"] == 0
        else:
            assert t["sources"] == ["system", "user", "agent", "agent", "agent"] and t["cached"] == 32
            assert t["linked"] == ["c1", "c2", None]
    silent_doc = json.loads((out / f"{silent}.atif.json").read_text())
    assert silent_doc["steps"][0]["message"].startswith("The `textstats` package has a bug")
