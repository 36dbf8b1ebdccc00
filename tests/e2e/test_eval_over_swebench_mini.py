"""Issue 39's evaluation test: ``arena eval`` over the swebench-mini dataset through the real stack.

Two of examples/swebench-mini's instances are imported as a user would (``arena tasks import
swebench`` from the local mirrors with the spec table; the repositories uploaded as bundles, the
services on data directories of their own that accept no host path), then ``arena eval run`` plays
them with two scripted "models", k = 2 attempts each. The agent is a trivial program: one LLM call,
and if the model's answer says to apply the fix it ``git apply``-s the instance's gold patch (placed
in the agent's files by the test), else it changes nothing. So the model's answer alone decides each
attempt, and the task's own hidden tests (the verification service running the instance's
FAIL_TO_PASS / PASS_TO_PASS) grade it.

Each scripted model answers "apply the fix" with its solve rate, drawn by the attempt's seed
(``runner.seed_of``: the same seeds for both models, and the scripted backend draws its answer from
the seed), so every attempt's reward is known before the job runs, and with it every figure of the
report: pass@1, pass@2, pass^2 and mean reward per model, and the paired comparison (difference,
better / worse / same, the exact sign-flip p-value) computed here by hand.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from arena.evaluation import records, runner
from arena.sdk import ArenaClient
from arena_core import apikeys
from arena_stack.natsserver import free_port
from arena_stack.scripted_llm import ScriptedLLM, load_script
from arena_stack.stack import Stack, free_port_settings
from tests.duel_backends import register, replica, start_scripted_llm, stop

DATASET = Path(__file__).resolve().parents[2] / "examples" / "swebench-mini"
STRONG, WEAK = "model-strong", "model-weak"
RATES = {STRONG: 0.8, WEAK: 0.1}  # the share of seeds answered "apply the fix"
INSTANCES = ["jpvanhal__inflection-1", "benjaminp__six-1"]
K = 2
FIX, GIVE_UP = "VERDICT: apply the fix", "VERDICT: give up"

#: The agent: ask the model once; apply the gold patch only if its answer says so.
AGENT = f'''\
import json, os, subprocess, sys, urllib.request
from pathlib import Path

root = Path(os.environ.get("ARENA_SANDBOX_ROOT", "/sandbox"))
task = json.loads((root / ".arena" / "task.json").read_text())["task"]
body = {{"model": os.environ.get("ARENA_MODEL", "default"), "max_tokens": 256, "messages": [
    {{"role": "user", "content": task["instructions"] + "\\n\\nAnswer {FIX!r} or {GIVE_UP!r}."}}]}}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={{"Content-Type": "application/json",
                                          "Authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", "")}})
with urllib.request.urlopen(request, timeout=300) as response:
    answer = json.loads(response.read())["choices"][0]["message"]["content"] or ""
apply = {FIX!r} in answer
if apply:
    patch = Path(__file__).resolve().parent / "gold" / (task["id"] + ".patch")
    subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch)], cwd=root / "workspace", check=True,
                   env={{**os.environ, "HOME": os.environ.get("HOME", "/tmp")}})
print(f"agent: answer={{answer!r}} applied={{apply}}", file=sys.stderr)
(root / ".arena" / "result.json").write_text(json.dumps({{"answer": answer, "applied": apply}}))
(root / ".arena" / "done").write_text("")
'''

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def model_script(tmp_path: Path, model: str) -> Path:
    rate = RATES[model]
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps({"responses": [
        {"label": "fix", "weight": rate, "content": f"{FIX}: the bug is where the issue says."},
        {"label": "give-up", "weight": 1 - rate, "content": f"{GIVE_UP}: I could not find the bug."}]}))
    return path


def expected_rewards(script: Path, task_id: str) -> list[float]:
    """The rewards of the task's attempts as the scripted model's seeded draws decide them."""
    llm = ScriptedLLM(load_script(str(script)))
    return [1.0 if llm.choose(runner.seed_of(0, task_id, i)).label == "fix" else 0.0 for i in range(K)]


def arena(stack: Stack, *args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "arena.cli", "--url", stack.settings.rollout_url, *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=env or {**os.environ, "ARENA_API_KEY": stack.api_key})
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def import_instances(stack: Stack, tmp_path: Path) -> Path:
    """``arena tasks import swebench`` of INSTANCES, each task's agent the program above with the gold
    patches in its files (uploaded as a bundle by ``arena eval``: the stack takes no host path)."""
    rows = {r["instance_id"]: r for r in map(json.loads, (DATASET / "dataset.jsonl").read_text().splitlines())}
    subset = tmp_path / "subset.jsonl"
    subset.write_text("".join(json.dumps(rows[i]) + "\n" for i in INSTANCES))
    out = tmp_path / "swebench-mini"
    arena(stack, "tasks", "import", "swebench", str(subset), "--mirrors", str(DATASET / "repos"),
          "--specs", str(DATASET / "specs.json"), "--out", str(out),
          "--agent-command", "python3 /sandbox/agent/agent.py")
    agent = tmp_path / "agent"
    (agent / "gold").mkdir(parents=True)
    (agent / "agent.py").write_text(AGENT)
    for instance in INSTANCES:
        path = out / f"{instance}.json"
        task = json.loads(path.read_text())
        assert task["source"]["type"] == "bundle" and task["verifier"]["fail_to_pass"]
        (agent / "gold" / f"{task['id']}.patch").write_text((out / "gold" / f"{instance}.patch").read_text())
        task["agent"] = {**task["agent"], "path": str(agent)}
        path.write_text(json.dumps(task))
    return out


async def wait_until_routed(stack: Stack, model: str) -> None:
    """Until the rollout service follows ``arena_backends`` to a replica serving ``model``: a submission
    for it with a bundle no one uploaded is refused for the bundle, not the model (nothing runs)."""
    probe = {"task": {"id": "probe", "instructions": "-", "source": {"type": "bundle", "digest": "sha256:" + "0" * 64},
                      "agent": {"command": ["true"]}, "verifier": {"type": "tests", "command": "true", "fail_to_pass": ["t"]}},
             "model": model}
    async with httpx.AsyncClient(base_url=stack.settings.rollout_url, headers=apikeys.auth_headers(stack.api_key),
                                 timeout=30) as http:
        for _ in range(300):
            answer = (await http.post("/v1/rollouts", json=probe)).text
            if "no backend replica serves" not in answer:
                assert "is not in Arena's object store" in answer, answer
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the rollout service never routed {model}: {answer}")


def sign_flip_p(differences: list[float]) -> float:
    """The exact two-sided paired sign-flip p-value, by enumeration (zero differences left out)."""
    d = [x for x in differences if x != 0]
    if not d:
        return 1.0
    sums = [abs(sum(s * x for s, x in zip(signs, d))) for signs in itertools.product((1, -1), repeat=len(d))]
    return sum(s >= abs(sum(d)) - 1e-9 for s in sums) / len(sums)


@pytest.mark.timeout(1500)
async def test_an_eval_job_over_swebench_mini_reports_each_models_known_solve_rate(tmp_path):
    started = time.monotonic()
    scripts = {m: model_script(tmp_path, m) for m in RATES}
    settings = free_port_settings(tmp_path / "arena", sandbox_concurrency=4, verify_concurrency=4,
                                  allow_host_paths=False)
    stack = Stack(settings, llm_script=scripts[STRONG], nats_sync="1s", log=lambda m: None, separate_data_dirs=True)
    weak = None
    await stack.start()
    try:
        weak_port = free_port()
        weak = await asyncio.to_thread(start_scripted_llm, scripts[WEAK], weak_port, tmp_path / "weak-llm.log")
        await register(stack.settings.nats_url, replica("weak", f"http://127.0.0.1:{weak_port}/v1", WEAK),
                       replica("default", stack.settings.backend_url, STRONG))
        dataset = await asyncio.to_thread(import_instances, stack, tmp_path)
        await wait_until_routed(stack, WEAK)

        # what each attempt must score: the seeded draws of each model's script
        expected = {m: {t: expected_rewards(scripts[m], t) for t in INSTANCES} for m in RATES}
        assert expected == {STRONG: {INSTANCES[0]: [1.0, 0.0], INSTANCES[1]: [1.0, 1.0]},
                            WEAK: {INSTANCES[0]: [0.0, 0.0], INSTANCES[1]: [1.0, 0.0]}}

        env = {**os.environ, "ARENA_DATA_DIR": str(tmp_path / "cli"), "ARENA_API_KEY": stack.api_key}
        base = ["--trajectory-url", stack.settings.trajectory_url, "eval"]
        ran_at = time.monotonic()
        run = await asyncio.to_thread(arena, stack, *base, "run", "--dataset", str(dataset), "--agent", "task",
                                      "--model", STRONG, "--model", WEAK, "--k", str(K), "--concurrency", "8",
                                      "--timeout", "1200", env=env, timeout=1300)
        ran = time.monotonic() - ran_at
        (job,) = (tmp_path / "cli" / "evals").glob("ev-*")

        # every attempt ran once, verified, with the reward its seed's draw decides
        final = records.final_results(records.read_log(job))
        assert sorted(final) == sorted(runner.plan(records.read_spec(job)))
        for (task_id, model, attempt), r in final.items():
            assert r.outcome == "completed", (task_id, model, attempt, r)  # a retried infrastructure try is no failure
            assert r.reward == expected[model][task_id][attempt], (task_id, model, attempt, r)
            assert r.cost.llm_calls == 1 and r.cost.agent_s > 0 and r.cost.verify_s > 0, r
        # graded by the instance's hidden tests: every FAIL_TO_PASS test passes with the gold patch
        # applied and fails without it, PASS_TO_PASS passing either way
        client = ArenaClient(stack.settings.rollout_url, stack.settings.trajectory_url, timeout=60,
                             api_key=stack.api_key)
        try:
            for task_id in INSTANCES:
                task = json.loads((dataset / f"{task_id}.json").read_text())
                f2p, p2p = len(task["verifier"]["fail_to_pass"]), len(task["verifier"]["pass_to_pass"])
                for reward in (1.0, 0.0):
                    r = next(r for (t, _, _), r in final.items() if t == task_id and r.reward == reward)
                    counts = (await asyncio.to_thread(client.wait_trajectory, r.rollout_id)).verification.counts
                    assert (counts.f2p_passed, counts.f2p_failed, counts.p2p_failed) == \
                        ((f2p, 0, 0) if reward else (0, f2p, 0)), (task_id, reward, counts)
                    assert counts.p2p_passed == p2p
        finally:
            client.close()

        await asyncio.to_thread(arena, stack, *base, "report", job.name, env=env, timeout=120)
        report = json.loads((job / "report.json").read_text())
        assert (job / "report.md").is_file() and (job / "report.html").is_file()
        models = {m["model"]: m for m in report["models"]}
        # by hand: n = 2 attempts a task, c solved; pass@1 = c/2, pass@2 = [c >= 1], pass^2 = [c == 2]
        hand = {}
        for model, by_task in expected.items():
            c = [sum(by_task[t]) for t in INSTANCES]
            hand[model] = {"pass@1": [x / 2 for x in c], "pass@2": [float(x >= 1) for x in c],
                           "pass^2": [float(x == 2) for x in c], "mean reward": [x / 2 for x in c]}
            m = models[model]
            assert (m["attempts"], m["completed"], m["failed"], m["infrastructure"], m["unsettled"]) == \
                (len(INSTANCES) * K, len(INSTANCES) * K, 0, 0, 0)
            figures = {"pass@1": m["pass_at"]["1"], "pass@2": m["pass_at"]["2"], "pass^2": m["pass_hat"]["2"],
                       "mean reward": m["mean_reward"]}
            for name, estimate in figures.items():
                want = sum(hand[model][name]) / len(INSTANCES)
                assert estimate["value"] == pytest.approx(want, abs=1e-12), (model, name, estimate, want)
                assert estimate["tasks"] == len(INSTANCES)
                assert estimate["ci_low"] <= want <= estimate["ci_high"], (model, name, estimate)
            assert re.search(rf"^{model} +{m['pass_at']['1']['value']:.3f} \[", run.stdout, re.M), run.stdout
        # the figures themselves, from the draws above: pass@1, pass@2, pass^2 strong 3/4, 1, 1/2; weak 1/4, 1/2, 0
        assert [models[STRONG]["pass_at"]["1"]["value"], models[WEAK]["pass_at"]["1"]["value"]] == \
            pytest.approx([3 / 4, 1 / 4])
        assert [models[STRONG]["pass_at"]["2"]["value"], models[WEAK]["pass_at"]["2"]["value"]] == \
            pytest.approx([1.0, 1 / 2])
        assert [models[STRONG]["pass_hat"]["2"]["value"], models[WEAK]["pass_hat"]["2"]["value"]] == \
            pytest.approx([1 / 2, 0.0])

        # the paired comparison, strong minus weak over the same tasks, favours strong
        compared = {c["metric"]: c for c in report["comparisons"] if (c["a"], c["b"]) == (STRONG, WEAK)}
        assert set(compared) == {"mean reward", "pass@1", "pass@2"}
        for metric, c in compared.items():
            d = [a - b for a, b in zip(hand[STRONG][metric], hand[WEAK][metric])]
            assert c["difference"] == pytest.approx(sum(d) / len(d)) and c["difference"] > 0, (metric, c)
            assert (c["better"], c["worse"], c["same"], c["tasks"]) == \
                (sum(x > 0 for x in d), sum(x < 0 for x in d), sum(x == 0 for x in d), len(INSTANCES)), (metric, c)
            assert c["exact"] and c["p_value"] == pytest.approx(sign_flip_p(d)), (metric, c)
            assert 0 <= c["ci_low"] <= c["difference"] <= c["ci_high"], (metric, c)  # no task where weak did better
        # strong better by 1/2 on both tasks at pass@1: only the all-plus and all-minus flips reach it, p = 2/4
        assert compared["pass@1"]["difference"] == pytest.approx(1 / 2) and compared["pass@1"]["p_value"] == 0.5
        # duels (attempt i against attempt i): strong wins 2, loses none, 2 draws; rated above weak
        ratings = {r["policy"]: r for r in report["ratings"]}
        assert (ratings[STRONG]["wins"], ratings[STRONG]["losses"], ratings[STRONG]["draws"]) == (2, 0, 2)
        assert ratings[STRONG]["rating"] > ratings[WEAK]["rating"]
        print(f"eval over swebench-mini: {len(final)} attempts, eval run {ran:.1f} s, "
              f"whole test {time.monotonic() - started:.1f} s")
    finally:
        stop(weak)
        stack.stop()
