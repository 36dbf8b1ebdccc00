"""An evaluation job through the real stack: three copies of the quickstart task, two scripted models
of known solve rates (each attempt's answer drawn by its seed, so every outcome is known in advance),
``arena eval run`` (the CLI as a process) killed half-way, ``arena eval resume`` to the end: every
attempt run once, none missed, each reward the one its seed draws; then ``arena eval report``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from arena.evaluation import records, runner
from arena_core import apikeys
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.scripted_llm import ScriptedLLM, load_script
from arena_stack.stack import Stack
from tests.duel_backends import QUICKSTART, register, replica, start_scripted_llm, stop

ROOT = Path(__file__).resolve().parents[2]
STRONG, WEAK = "model-strong", "model-weak"
RATES = {STRONG: 0.8, WEAK: 0.3}  # the share of seeds answered with the right fix
TASKS, K = 2, 2

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def weighted_script(tmp_path: Path, model: str) -> Path:
    whole = json.loads((QUICKSTART / "llm_script.json").read_text())
    rate = RATES[model]
    responses = [{**r, "weight": rate if r["label"] == "correct" else 1 - rate} for r in whole["responses"]]
    path = tmp_path / f"{model}.json"
    path.write_text(json.dumps({"responses": responses}))
    return path


def expected_reward(script: Path, task_id: str, attempt: int) -> float:
    """What the scripted model answers attempt ``attempt`` of ``task_id`` (drawn by its seed), as a reward."""
    llm = ScriptedLLM(load_script(str(script)))
    return 1.0 if llm.choose(runner.seed_of(0, task_id, attempt)).label == "correct" else 0.0


def quickstart_copies(tmp_path: Path) -> Path:
    task = json.loads((QUICKSTART / "task.json").read_text())
    out = tmp_path / "dataset"
    out.mkdir()
    for i in range(TASKS):
        # budgets for a loaded host: an agent or a test run cut by its clock would be a failure, not the draw
        copy = {**task, "id": f"qs-{i}", "repo": str(QUICKSTART / "repo"),
                "agent": {**task["agent"], "path": str(QUICKSTART / "agent")},
                "budget": {**task["budget"], "wall_clock_s": 600}, "verifier": {**task["verifier"], "timeout_s": 600}}
        (out / f"qs-{i}.json").write_text(json.dumps(copy))
    return out


def finished_lines(job: Path) -> int:
    path = job / records.LOG_FILE
    return path.read_text().count('"type":"finished"') if path.is_file() else 0


@pytest.mark.timeout(1500)
async def test_an_eval_job_killed_half_way_resumes_without_running_an_attempt_twice(tmp_path):
    strong_url = f"http://127.0.0.1:{free_port()}/v1"
    weak_port = free_port()
    scripts = {m: weighted_script(tmp_path, m) for m in (STRONG, WEAK)}
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=strong_url, backend_policy_version="0",
                        sandbox_concurrency=4, verify_concurrency=2)
    stack = Stack(settings, llm_script=scripts[STRONG], nats_sync="1s", log=lambda m: None)
    weak = None
    await stack.start()
    settings = stack.settings
    try:
        weak = await asyncio.to_thread(start_scripted_llm, scripts[WEAK], weak_port, tmp_path / "weak-llm.log")
        await register(settings.nats_url, replica("weak", f"http://127.0.0.1:{weak_port}/v1", WEAK),
                       replica("default", strong_url, STRONG))
        data_dir = tmp_path / "cli"
        env = {**os.environ, "ARENA_DATA_DIR": str(data_dir), "ARENA_API_KEY": stack.api_key}
        base = [sys.executable, "-m", "arena.cli", "--url", settings.rollout_url, "--trajectory-url",
                settings.trajectory_url, "eval"]
        # the rollout service follows arena_backends: wait until it routes the weak model
        async with httpx.AsyncClient(base_url=settings.rollout_url, headers=apikeys.auth_headers(stack.api_key),
                                     timeout=30) as http:
            for _ in range(100):
                body = {"task": json.loads((QUICKSTART / "task.json").read_text()) | {"verifier": None},
                        "policies": [STRONG, WEAK], "n": 1}
                if "no backend replica serves" not in (await http.post("/v1/duels", json=body)).text:
                    break
                await asyncio.sleep(0.1)

        started = time.monotonic()
        run = subprocess.Popen(base + ["run", "--dataset", str(quickstart_copies(tmp_path)), "--agent", "task",
                                       "--model", STRONG, "--model", WEAK, "--k", str(K), "--concurrency", "4",
                                       "--timeout", "900"],
                               stdout=open(tmp_path / "run.out", "wb"), stderr=open(tmp_path / "run.err", "wb"),
                               env=env)
        try:
            evals = data_dir / "evals"
            for _ in range(6000):  # half-way: a quarter of the attempts logged as finished
                jobs = list(evals.glob("ev-*")) if evals.is_dir() else []
                if jobs and finished_lines(jobs[0]) >= TASKS * K * 2 // 4:
                    break
                assert run.poll() is None, (tmp_path / "run.err").read_text()
                await asyncio.sleep(0.1)
            os.kill(run.pid, signal.SIGKILL)  # no clean exit: tries in flight stay on the server
            run.wait(10)
            assert jobs and finished_lines(jobs[0]), ((tmp_path / "run.err").read_text(),
                                                     [p.read_text() for p in jobs[0].iterdir()] if jobs else None)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait(10)
        (job,) = jobs
        before = finished_lines(job)
        assert 0 < before < TASKS * K * 2

        resumed = await asyncio.to_thread(subprocess.run, base + ["resume", job.name], capture_output=True, text=True,
                                          env=env, timeout=1200)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        took = time.monotonic() - started

        final = records.final_results(records.read_log(job))
        spec = records.read_spec(job)
        assert sorted(final) == sorted(runner.plan(spec))  # none missed
        for (task_id, model, attempt), r in final.items():
            assert r.outcome == "completed", r
            assert r.reward == expected_reward(scripts[model], task_id, attempt), (task_id, model, attempt, r)
            assert r.cost.llm_calls == 1 and r.cost.prompt_tokens > 0 and r.cost.completion_tokens > 0
            assert r.cost.agent_s > 0 and r.cost.verify_s > 0
        # none run twice: the server holds one rollout per attempt (no infrastructure outcome here)
        async with httpx.AsyncClient(base_url=settings.rollout_url, headers=apikeys.auth_headers(stack.api_key),
                                     timeout=30) as http:
            listed = (await http.get("/v1/rollouts", params={"limit_": 1000})).json()["rollouts"]
        mine = [v for v in listed if v["metadata"].get(runner.META_JOB) == spec.job_id]
        attempts = [v["metadata"][runner.META_ATTEMPT] for v in mine]
        assert len(attempts) == len(set(attempts)) == TASKS * K * 2
        assert {r.rollout_id for r in final.values()} == {v["rollout_id"] for v in mine}

        prices = tmp_path / "prices.toml"
        prices.write_text(f'[models."{STRONG}"]\ninput_per_mtok = 3.0\noutput_per_mtok = 15.0\n'
                          f'[models."{WEAK}"]\ninput_per_mtok = 0.5\noutput_per_mtok = 1.5\n')
        shown = await asyncio.to_thread(subprocess.run, base + ["report", job.name, "--prices", str(prices)],
                                        capture_output=True, text=True, env=env, timeout=60)
        assert shown.returncode == 0, shown.stderr
        solved = {m: sum(r.reward for (t, mm, i), r in final.items() if mm == m) / (TASKS * K) for m in RATES}
        assert f"{STRONG}  {solved[STRONG]:.3f} [" in shown.stdout, shown.stdout
        assert (job / "report.html").is_file() and (job / "report.md").is_file()
        report = json.loads((job / "report.json").read_text())
        assert report["cost"]["agent_usd"] > 0 and report["cost"]["unpriced"] == []
        print(f"eval through the stack: {TASKS * K * 2} attempts, killed after {before}, {took:.1f} s")
    finally:
        stop(weak)
        stack.stop()


@contextlib.asynccontextmanager
async def one_model_stack(tmp_path: Path):
    """The stack with the strong scripted model as its backend; yields (stack, the CLI's ``arena eval``
    command line, its environment)."""
    strong_url = f"http://127.0.0.1:{free_port()}/v1"
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=strong_url, backend_policy_version="0",
                        sandbox_concurrency=4, verify_concurrency=2)
    stack = Stack(settings, llm_script=weighted_script(tmp_path, STRONG), nats_sync="1s", log=lambda m: None)
    await stack.start()
    try:
        env = {**os.environ, "ARENA_DATA_DIR": str(tmp_path / "cli"), "ARENA_API_KEY": stack.api_key}
        base = [sys.executable, "-m", "arena.cli", "--url", stack.settings.rollout_url, "--trajectory-url",
                stack.settings.trajectory_url, "eval"]
        yield stack, base, env
    finally:
        stack.stop()


async def cli(args: list[str], env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    done = await asyncio.to_thread(subprocess.run, args, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.timeout(1200)
async def test_a_finished_job_regraded_by_another_verifier_gets_report_v2_keeps_the_first_and_exports_atif(tmp_path):
    """``arena eval regrade JOB --verifier FILE`` through the stack: every attempt's stored diff
    verified again by the verification service (``arena verify``'s replay) with a verifier only the
    untouched word count decides, so every attempt passes in version 2; version 1 (the seeds' draws)
    and its report stay as they were, and no rollout runs again; then every attempt exported in ATIF beside Arena's JSON."""
    async with one_model_stack(tmp_path) as (stack, base, env):
        await cli(base + ["run", "--dataset", str(quickstart_copies(tmp_path)), "--agent", "task", "--model", STRONG,
                          "--k", str(K), "--concurrency", "4", "--timeout", "900"], env)
        (job,) = (tmp_path / "cli" / "evals").glob("ev-*")
        await cli(base + ["report", job.name], env, timeout=60)
        first = {p: (job / p).read_bytes() for p in ("report.md", "report.json", "report.html", records.LOG_FILE)}
        v1 = json.loads(first["report.json"])
        final = records.final_results(records.read_log(job))
        graded = {(c["task_id"], tuple(c["rewards"])) for c in v1["tasks"]}
        assert graded == {(t, tuple(final[(t, STRONG, i)].reward or 0.0 for i in range(K))) for t in ("qs-0", "qs-1")}
        # on a loaded host an agent may run out of its clock: a failure, which a regrade leaves a failure
        passes = {(t, i): final[(t, STRONG, i)].outcome == "completed" for t in ("qs-0", "qs-1") for i in range(K)}

        task = json.loads((QUICKSTART / "task.json").read_text())
        lenient = {**task["verifier"], "fail_to_pass": ["tests/test_textstats.py::test_word_count"],
                   "pass_to_pass": [], "timeout_s": 600}
        (tmp_path / "lenient.json").write_text(json.dumps(lenient))
        done = await cli(base + ["regrade", job.name, "--verifier", str(tmp_path / "lenient.json"),
                                 "--nats-url", stack.settings.nats_url], env)
        assert f"grading version 2: {sum(passes.values())} attempt(s) verified again (0 without a verdict)" \
            in done.stdout, done.stdout

        assert {p: (job / p).read_bytes() for p in first} == first  # the first version kept as it was
        v2 = json.loads((job / "report.v2.json").read_text())
        assert all(c["rewards"] == [1.0 if passes[(c["task_id"], i)] else 0.0 for i in range(K)] for c in v2["tasks"])
        assert v2["models"][0]["pass_at"]["1"]["value"] == sum(passes.values()) / len(passes)
        assert (job / "report.v2.html").is_file()
        listed = await cli(base + ["versions", job.name], env, timeout=60)
        assert "report.v2.*" in listed.stdout and "--verifier" in listed.stdout
        # the same rollouts graded again (none run again), each by the version's named verifier
        grades = [json.loads(line) for line in (job / "grades.v2.jsonl").read_text().splitlines()]
        ran = {r.rollout_id for r in final.values()}
        assert sorted(g["rollout_id"] for g in grades) == sorted(r.rollout_id for r in final.values()
                                                                 if r.outcome == "completed")
        assert records.final_results(records.read_log(job)) == final  # the log as it was: nothing ran again
        assert all(v2["grading"]["verifier"] in g["reason"] for g in grades)

        # both versions' reports are on the trajectory service, where the dashboard reads them
        async with httpx.AsyncClient(base_url=stack.settings.trajectory_url,
                                     headers=apikeys.auth_headers(stack.api_key), timeout=30) as http:
            [stored] = [j for j in (await http.get("/v1/evals")).json()["jobs"] if j["job_id"] == job.name]
            assert stored["versions"] == [1, 2] and stored["models"][0]["model"] == STRONG
            kept = (await http.get(f"/v1/evals/{job.name}", params={"version": 2})).json()
            assert kept["report"]["tasks"] == v2["tasks"]

        # each attempt's real trajectory in ATIF beside Arena's own, token ids as captured
        done = await cli(base + ["export", job.name], env, timeout=120)
        assert f"{TASKS * K} attempt(s) exported" in done.stdout, done.stdout
        index = [json.loads(line) for line in (job / "trajectories" / "index.jsonl").read_text().splitlines()]
        assert sorted(row["rollout_id"] for row in index) == sorted(ran)
        for row in index:
            ours = json.loads((job / "trajectories" / row["arena"]).read_text())
            atif = json.loads((job / "trajectories" / row["atif"]).read_text())
            agent = [s for s in atif["steps"] if s["source"] == "agent"]
            assert len(agent) == len(ours["steps"]) and atif["steps"][0]["source"] in ("system", "user")
            if agent:
                assert agent[0]["metrics"]["completion_token_ids"] == ours["steps"][0]["completion_token_ids"]
            assert atif["extra"]["reward"] == row["reward"] and atif["agent"]["model_name"] == STRONG
        harbor = ROOT / ".arena" / "harbor-venv" / "bin" / "python"
        if harbor.exists():  # made by `make harbor-venv`; tests/client/test_evaluation_atif.py builds it
            from tests.client.test_evaluation_atif import CHECK

            checked = await asyncio.to_thread(subprocess.run, [str(harbor), "-c", CHECK, str(job / "trajectories")],
                                              capture_output=True, text=True, timeout=300)
            assert checked.returncode == 0 and len(json.loads(checked.stdout)) == TASKS * K, checked.stderr


@pytest.mark.timeout(1500)
async def test_the_rollout_service_and_the_client_killed_half_way_then_resumed_run_no_attempt_twice(tmp_path):
    """The rollout service (restarted by the stack's supervisor, as ``arena up`` does) and the
    ``arena eval run`` process both SIGKILLed once a third of the attempts are logged, then
    ``arena eval resume``: every attempt settled, none missed; on the server every try of an
    attempt is one the log records, submitted or adopted (none submitted twice), and an attempt has a
    second try only after an infrastructure outcome (a kill may cause one: retried, never a failure)."""
    attempts = TASKS * 3
    async with one_model_stack(tmp_path) as (stack, base, env):
        stop_supervising = asyncio.Event()
        supervisor = asyncio.create_task(stack.supervise(stop_supervising, interval=0.5))
        try:
            run = subprocess.Popen(base + ["run", "--dataset", str(quickstart_copies(tmp_path)), "--agent", "task",
                                           "--model", STRONG, "--k", "3", "--concurrency", "2", "--timeout", "900"],
                                   stdout=open(tmp_path / "run.out", "wb"), stderr=open(tmp_path / "run.err", "wb"),
                                   env=env)
            evals = tmp_path / "cli" / "evals"
            try:
                for _ in range(6000):
                    jobs = list(evals.glob("ev-*")) if evals.is_dir() else []
                    if jobs and finished_lines(jobs[0]) >= attempts // 3:
                        break
                    assert run.poll() is None, (tmp_path / "run.err").read_text()
                    await asyncio.sleep(0.1)
                rollout_pid = next(c.pid for c in stack.children if c.name == "rollout")
                os.kill(rollout_pid, signal.SIGKILL)
                os.kill(run.pid, signal.SIGKILL)
                run.wait(10)
            finally:
                if run.poll() is None:
                    run.kill()
                    run.wait(10)
            (job,) = jobs
            before = finished_lines(job)
            assert 0 < before < attempts
            for _ in range(600):  # the supervisor brings the rollout service back
                new = next((c.pid for c in stack.children if c.name == "rollout"), None)
                if new not in (None, rollout_pid):
                    break
                await asyncio.sleep(0.1)
            assert new not in (None, rollout_pid), "the rollout service was not restarted"

            for _ in range(3):  # the restarted service may still be coming up: resume until settled
                resumed = await asyncio.to_thread(subprocess.run, base + ["resume", job.name], capture_output=True,
                                                  text=True, env=env, timeout=1200)
                if resumed.returncode == 0:
                    break
            assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        finally:
            stop_supervising.set()
            await supervisor

        spec = records.read_spec(job)
        log = records.read_log(job)
        final = records.final_results(log)
        assert sorted(final) == sorted(runner.plan(spec))  # none missed
        tries = records.finished_attempts(log)
        for key, done in tries.items():
            assert all(t.outcome == "infrastructure" for t in done[:-1]), (key, done)  # a retry only after one
            assert sum(t.outcome != "infrastructure" for t in done) <= 1, (key, done)  # never two verdicts
        # a try's rollout as the log knows it: submitted, or adopted by the resume (finished only)
        logged = {(r.task_id, r.model, r.attempt, r.try_): r.rollout_id for r in log}
        async with httpx.AsyncClient(base_url=stack.settings.rollout_url,
                                     headers=apikeys.auth_headers(stack.api_key), timeout=30) as http:
            listed = (await http.get("/v1/rollouts", params={"limit_": 1000})).json()["rollouts"]
        mine = [v for v in listed if v["metadata"].get(runner.META_JOB) == spec.job_id]
        on_server = {(*v["metadata"][runner.META_ATTEMPT].rsplit("|", 2), v["metadata"][runner.META_TRY]):
                     v["rollout_id"] for v in mine}
        assert len(on_server) == len(mine)  # one rollout per try
        assert {(t, m, int(i), int(n)): rid for (t, m, i, n), rid in on_server.items()} == logged
        print(f"eval with the rollout service killed: {attempts} attempts, killed after {before}, "
              f"{len(mine)} rollouts for them")
