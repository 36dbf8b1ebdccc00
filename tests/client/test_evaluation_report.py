"""Evaluation reports (libs/arena/evaluation/report.py) from a job run against an in-memory client
with known rewards: the figures against hand-computed ones, infrastructure outcomes left out of the
statistics, and the Markdown, JSON and self-contained HTML files."""

from __future__ import annotations

import io
import json
import re

import pytest

from arena.evaluation import report, runner
from arena_core.schemas import RolloutState
from tests.client.test_evaluation_job import FakeClient, dataset

# model "a" solves t0 on every attempt and t1 on attempts 0 and 1 of 3; model "b" solves t0 on attempt 0 only
SOLVED = {("a", "t0"): {0, 1, 2}, ("a", "t1"): {0, 1}, ("b", "t0"): {0}, ("b", "t1"): set()}


@pytest.fixture
def job(tmp_path):
    directory = runner.create_job(dataset(tmp_path, 2), agent="task", models=["a", "b"], k=3, concurrency=4,
                                  root=tmp_path / "evals")
    attempt_of = {runner.seed_of(0, t, i): i for t in ("t0", "t1") for i in range(3)}

    def decide(task, model, seed, try_):
        i = attempt_of[seed]
        if (model, task, i) == ("b", "t1", 2):  # Arena could not run it, ever: left out, not a failure
            return RolloutState.FAILED, None, True
        return RolloutState.COMPLETED, 1.0 if i in SOLVED[(model, task)] else 0.0, False

    runner.run_job(FakeClient(decide), directory, stream=io.StringIO(), tty=False)
    return directory


def test_report_figures_match_the_hand_computed_ones(job, tmp_path):
    prices = tmp_path / "prices.toml"
    prices.write_text('sandbox_per_hour = 0.36\n[models.a]\ninput_per_mtok = 1.0\noutput_per_mtok = 2.0\n'
                      '[models.b]\ninput_per_mtok = 10.0\noutput_per_mtok = 20.0\n')
    r = report.build(job, str(prices))
    a, b = r.models
    assert a.pass_at[1].value == pytest.approx((1 + 2 / 3) / 2)
    assert a.pass_at[3].value == pytest.approx(1.0) and a.pass_at[3].tasks == 2
    assert a.pass_hat[3].value == pytest.approx(0.5)  # t0 all three, t1 not
    assert a.pass_hat[2].value == pytest.approx((1 + 1 / 3) / 2)  # t1: C(2,2)/C(3,2)
    # b on t1 has 2 attempts with a verdict (the third never ran): in pass@1 and pass@2, not pass@3
    assert b.infrastructure == 1 and b.failed == 0
    assert b.pass_at[1].value == pytest.approx((1 / 3 + 0) / 2)
    assert b.pass_at[3].tasks == 1 and b.pass_at[3].value == pytest.approx(1.0)
    assert a.mean_reward.ci_low <= a.mean_reward.value <= a.mean_reward.ci_high
    first = next(c for c in r.comparisons if c.metric == "pass@1")
    assert (first.a, first.b, first.tasks, first.better) == ("a", "b", 2, 2)
    assert first.difference == pytest.approx(((1 - 1 / 3) + (2 / 3 - 0)) / 2)
    assert first.p_value == 0.5 and first.exact  # 2 tasks, both for a: 2 of 4 flips as extreme
    assert [x.policy for x in r.ratings] == ["a", "b"]
    # cost: 12 attempts, the infrastructure one tried 3 times (1 + 2 retries, each counted, none with a
    # trajectory); the 11 others 100 prompt + 20 completion tokens and 7 s of sandbox each
    assert r.cost.tries == 14 and r.cost.prompt_tokens == 1100
    assert r.cost.missing_trajectories == 3
    assert a.cost.agent_usd == pytest.approx(6 * (100 * 1 + 20 * 2) / 1e6)
    assert r.cost.sandbox_usd == pytest.approx(11 * 7 / 3600 * 0.36)
    cell = next(t for t in r.tasks if (t.model, t.task_id) == ("b", "t1"))
    assert (cell.n, cell.successes, cell.infrastructure, cell.rewards) == (2, 0, 1, [0.0, 0.0, None])


def test_report_files_are_written_and_the_html_fetches_nothing(job, tmp_path):
    r = report.build(job)
    lines = report.text_lines(r)
    assert any(re.match(r"^a\s+0\.833 \[", line) for line in lines), lines
    assert any("no price for a, b" in line for line in lines)
    md, js, page = report.write_files(r, tmp_path / "out")
    assert "| a | b | pass@1 | 0.667 |" in md.read_text()
    data = json.loads(js.read_text())
    assert data["models"][0]["pass_at"]["3"]["value"] == 1.0
    text = page.read_text()
    assert text.count("<svg") == 2 and "<polyline" in text and text.count("<rect") >= 4
    assert not re.search(r"(src|href)=|@import|url\(", text)  # self-contained: no script, stylesheet or font fetched
    assert "b on t1: 0/2 solved, 1 infrastructure" in text
