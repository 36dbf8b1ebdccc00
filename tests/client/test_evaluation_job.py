"""The evaluation job's runner (libs/arena/evaluation/runner.py) against an in-memory client: every
task × model × attempt submitted once, infrastructure outcomes retried a bounded number of times and
never counted as failures, and a resume after a kill that runs no attempt twice and misses none
(tries logged as submitted are waited for; tries the server has but the log lost are adopted)."""

from __future__ import annotations

import io
import itertools
import json
import threading
from pathlib import Path

import msgspec
import pytest

from arena.evaluation import records, runner
from arena.evaluation.cost import PriceTable, ModelPrice, summarize_cost
from arena_core.errors import NotFound
from arena_core.schemas import (
    RolloutState,
    RolloutView,
    SandboxDone,
    SandboxOutcome,
    StateTransition,
    Step,
    Trajectory,
    Usage,
)

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


def dataset(tmp_path: Path, n: int = 2) -> Path:
    """``n`` copies of the quickstart task (ids t0, t1, ...) as an import's output directory."""
    task = json.loads((QUICKSTART / "task.json").read_text())
    out = tmp_path / "dataset"
    out.mkdir(parents=True)
    for i in range(n):
        copy = {**task, "id": f"t{i}", "repo": str(QUICKSTART / "repo"),
                "agent": {**task["agent"], "path": str(QUICKSTART / "agent")}}
        (out / f"t{i}.json").write_text(json.dumps(copy))
    return out


class FakeClient:
    """Rollouts that end at once: ``decide(task_id, model, seed, try_)`` gives (state, reward, infrastructure)."""

    def __init__(self, decide):
        self.decide = decide
        self.views: dict[str, RolloutView] = {}
        self.submissions: list[tuple[str, str, int]] = []
        self.tries: dict[tuple[str, str, str], int] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.die_after: int | None = None  # raise on this submission (a killed client)

    def prepare(self, task):
        return task

    def submit(self, task, *, sampling=None, model="default", metadata=None, provider="local"):
        with self.lock:
            if self.die_after is not None and len(self.submissions) >= self.die_after:
                raise KeyboardInterrupt
            rid = f"r-{next(self.ids):04d}"
            self.submissions.append((task.id, model, sampling.seed))
            state, reward, infra = self.decide(task.id, model, sampling.seed, int(metadata["eval.try"]))
            self.views[rid] = RolloutView(rollout_id=rid, task_id=task.id, state=state, reason="test", created_at=1.0,
                                          updated_at=2.0, reward=reward, infrastructure=infra, metadata=metadata)
        return RolloutView(rollout_id=rid, task_id=task.id, state=RolloutState.PENDING, reason="", created_at=1.0,
                           updated_at=1.0, metadata=metadata)

    def wait(self, rollout_id, *, timeout=600.0):
        return self.views[rollout_id]

    def wait_trajectory(self, rollout_id, *, timeout=60.0):
        view = self.views[rollout_id]
        if view.infrastructure:
            raise NotFound("none")
        return Trajectory(rollout_id=rollout_id, task_id=view.task_id, final_state=view.state, reward=view.reward,
                          completed_at=13.0,
                          history=[StateTransition(from_state=None, to_state=RolloutState.PENDING, at=1.0)],
                          steps=[Step(rollout_id=rollout_id, step_index=0, model="m", backend="b",
                                      usage=Usage(prompt_tokens=100, completion_tokens=20, total_tokens=120))],
                          sandbox=SandboxDone(rollout_id=rollout_id, sandbox_id="s", provider="mock",
                                              outcome=SandboxOutcome.COMPLETED, reason="", started_at=3.0,
                                              finished_at=10.0))

    def list(self, *, state=None, group_id=None, limit=None):
        return list(self.views.values())


def completed(reward):
    return RolloutState.COMPLETED, reward, False


def test_every_attempt_submitted_once_with_the_same_seeds_for_every_model(tmp_path):
    job = runner.create_job(dataset(tmp_path), agent="task", models=["a", "b"], k=3, concurrency=4,
                            root=tmp_path / "evals")
    client = FakeClient(lambda task, model, seed, try_: completed(1.0 if model == "a" else 0.0))
    result = runner.run_job(client, job, stream=io.StringIO(), tty=False)
    assert result.settled == {"completed": 12, "failed": 0, "infrastructure": 0}
    assert len(client.submissions) == 12 == len(set(client.submissions))
    seeds = {m: sorted(s for _, mm, s in client.submissions if mm == m) for m in ("a", "b")}
    assert seeds["a"] == seeds["b"] and len(set(seeds["a"])) == 6
    final = records.final_results(records.read_log(job))
    assert len(final) == 12
    assert {r.reward for (t, m, i), r in final.items() if m == "a"} == {1.0}
    assert all(r.cost.prompt_tokens == 100 and r.cost.agent_s == 7.0 and r.cost.queue_s == 2.0
               and r.cost.wall_s == 12.0 for r in final.values())


def test_infrastructure_outcomes_are_retried_a_bounded_number_of_times_and_never_failures(tmp_path):
    job = runner.create_job(dataset(tmp_path, 1), agent="task", models=["a"], k=4, concurrency=2,
                            max_infra_retries=2, root=tmp_path / "evals")
    flaky_seed = runner.seed_of(0, "t0", 1)  # attempt 1: infrastructure once, then completes
    dead_seed = runner.seed_of(0, "t0", 2)  # attempt 2: infrastructure on every try
    agent_fails = runner.seed_of(0, "t0", 3)  # attempt 3: the agent fails (a failure, not retried)

    def decide(task, model, seed, try_):
        if seed == dead_seed or (seed == flaky_seed and try_ == 0):
            return RolloutState.FAILED, None, True
        if seed == agent_fails:
            return RolloutState.FAILED, None, False
        return completed(1.0)

    client = FakeClient(decide)
    result = runner.run_job(client, job, stream=io.StringIO(), tty=False)
    assert result.settled == {"completed": 2, "failed": 1, "infrastructure": 1}
    assert result.retried == 1 + 2
    assert [s for s in client.submissions if s[2] == dead_seed] == [("t0", "a", dead_seed)] * 3  # 1 + 2 retries
    final = records.final_results(records.read_log(job))
    assert final[("t0", "a", 1)].outcome == "completed" and final[("t0", "a", 1)].try_ == 1
    assert final[("t0", "a", 2)].outcome == "infrastructure"
    # a resume has nothing left to do: the retries are spent
    again = runner.run_job(client, job, stream=io.StringIO(), tty=False)
    assert again.already_done == 4 and sum(again.settled.values()) == 0 and len(client.submissions) == 1 + 2 + 3 + 1


def test_resume_after_a_kill_runs_no_attempt_twice_and_misses_none(tmp_path):
    job = runner.create_job(dataset(tmp_path, 3), agent="task", models=["a", "b"], k=4, concurrency=3,
                            root=tmp_path / "evals")
    client = FakeClient(lambda task, model, seed, try_: completed(float(seed % 2)))
    client.die_after = 10
    with pytest.raises(KeyboardInterrupt):
        runner.run_job(client, job, stream=io.StringIO(), tty=False)
    # the last try was submitted to the server but its line never reached the log
    logged = {r.rollout_id for r in records.read_log(job) if isinstance(r, records.AttemptSubmitted)}
    with client.lock:
        client.die_after = None
        lost = "r-9999"
        client.views[lost] = RolloutView(rollout_id=lost, task_id="t2", state=RolloutState.COMPLETED, reason="",
                                         created_at=1.0, updated_at=2.0, reward=1.0,
                                         metadata={"eval.job": job.name, "eval.attempt": "t2|b|3", "eval.try": "0"})
    # and a cut last line, as a kill mid-write leaves it
    with open(job / records.LOG_FILE, "ab") as f:
        f.write(b'{"type":"finished","task_id":"t')
    result = runner.run_job(client, job, stream=io.StringIO(), tty=False)
    assert result.adopted >= 1
    final = records.final_results(records.read_log(job))
    assert sorted(final) == sorted(runner.plan(records.read_spec(job)))  # none missed
    assert final[("t2", "b", 3)].rollout_id == lost
    submitted = [(t, m, s) for t, m, s in client.submissions]
    assert len(submitted) == len(set(submitted)) == 24 - 1  # none twice; the lost one adopted, not resubmitted
    assert logged <= {r.rollout_id for r in final.values()}


def test_job_id_or_directory_finds_the_job_and_garbage_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ARENA_DATA_DIR", str(tmp_path / "data"))
    job = runner.create_job(dataset(tmp_path, 1), agent="task", models=["a"], k=1, concurrency=1,
                            root=records.evals_dir())
    assert records.job_dir(job.name) == job
    assert records.job_dir(str(job)) == job
    with pytest.raises(Exception, match="neither a job id"):
        records.job_dir("../etc")
    with pytest.raises(Exception, match="each model once"):
        runner.create_job(dataset(tmp_path / "other", 1), agent="task", models=["a", "a"], k=1, concurrency=1,
                          root=tmp_path)


def test_cost_sums_tries_and_prices_only_known_models(tmp_path):
    job = runner.create_job(dataset(tmp_path, 1), agent="task", models=["a", "b"], k=2, concurrency=2,
                            root=tmp_path / "evals")
    runner.run_job(FakeClient(lambda *a: completed(1.0)), job, stream=io.StringIO(), tty=False)
    tries = [r for r in records.read_log(job) if isinstance(r, records.AttemptFinished)]
    prices = PriceTable(models={"a": ModelPrice(input_per_mtok=3.0, output_per_mtok=15.0),
                                "b": ModelPrice(input_per_mtok=1.0, output_per_mtok=2.0)}, sandbox_per_hour=3.6)
    total = summarize_cost(tries, prices)
    assert (total.tries, total.prompt_tokens, total.completion_tokens) == (4, 400, 80)
    assert total.agent_usd == pytest.approx(2 * (100 * 3 + 20 * 15) / 1e6 + 2 * (100 * 1 + 20 * 2) / 1e6)
    assert total.sandbox_usd == pytest.approx(4 * 7.0 / 3600 * 3.6)
    assert total.judge_usd == 0.0 and total.verifier_usd == 0.0
    only_a = summarize_cost(tries, msgspec.structs.replace(prices, models={"a": prices.models["a"]}))
    assert only_a.agent_usd is None and only_a.total_usd is None and only_a.unpriced == ["b"]


def test_cached_prompt_tokens_are_counted_from_the_steps_and_priced_at_their_own_rate():
    """Prefix-cache hits (``Usage.cached_tokens``, part of the prompt) of the agent's steps and the
    judge's calls are summed per try; a model with ``cached_input_per_mtok`` prices them at it, the
    rest of the prompt at ``input_per_mtok``; a model without it prices the whole prompt as input."""
    from arena.evaluation.cost import attempt_cost
    from arena_core.schemas import JudgeCall, VerificationResult

    def step(i, prompt, cached):
        return Step(rollout_id="r", step_index=i, model="a", backend="b",
                    usage=Usage(prompt_tokens=prompt, completion_tokens=10, total_tokens=prompt + 10,
                                cached_tokens=cached))

    judge = JudgeCall(model="j", base_url="http://judge", usage=Usage(prompt_tokens=500, completion_tokens=5,
                                                                      total_tokens=505, cached_tokens=400))
    traj = Trajectory(rollout_id="r", task_id="t0", final_state=RolloutState.COMPLETED, completed_at=5.0,
                      steps=[step(0, 1000, 0), step(1, 1200, 960), step(2, 1400, 1152)],
                      verification=VerificationResult(rollout_id="r", verifier="llm_judge", reward=1.0, passed=True,
                                                      judge_calls=[judge], started_at=4.0, finished_at=4.5))
    cost = attempt_cost(traj)
    assert (cost.prompt_tokens, cost.cached_tokens, cost.completion_tokens) == (3600, 2112, 30)
    assert cost.judge_cached_tokens == {"j": 400}
    tries = [records.AttemptFinished(task_id="t0", model="a", attempt=0, try_=0, rollout_id="r",
                                     outcome="completed", state="completed", reward=1.0, cost=cost, at=5.0)]
    prices = PriceTable(models={"a": ModelPrice(input_per_mtok=2.0, output_per_mtok=8.0, cached_input_per_mtok=0.5),
                                "j": ModelPrice(input_per_mtok=3.0, output_per_mtok=15.0)})
    total = summarize_cost(tries, prices)
    assert (total.cached_tokens, total.judge_cached_tokens) == (2112, 400)
    assert total.agent_usd == pytest.approx(((3600 - 2112) * 2.0 + 2112 * 0.5 + 30 * 8.0) / 1e6)
    assert total.judge_usd == pytest.approx((500 * 3.0 + 5 * 15.0) / 1e6)  # no cached rate: all at input
    read = read_prices_from_text('[models.a]\ninput_per_mtok = 2.0\noutput_per_mtok = 8.0\n'
                                 'cached_input_per_mtok = 0.5\n')
    assert read.models["a"].cached_input_per_mtok == 0.5


def read_prices_from_text(text: str) -> PriceTable:
    import tempfile

    from arena.evaluation.cost import read_prices

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    return read_prices(f.name)
