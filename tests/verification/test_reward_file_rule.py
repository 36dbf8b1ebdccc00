"""Harbor's grading rule as the ``reward_file`` verifier applies it, on reward files written by the
fixture tasks' own test scripts (run here with bash, ``/app``, ``/tests`` and ``/logs`` moved to a
temporary directory): reward.json wins over reward.txt, every named number is kept, the scalar is
``reward`` (else the only number), what Harbor rejects gives no reward; a multi-step task's steps
gated by their minimums and combined by its strategy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arena_verification.reward_file import (
    RewardFileError,
    below_minimum,
    combine_steps,
    grading_plan,
    parse_rewards,
    pytest_summary_failure,
    scalar_reward,
    time_budget_s,
)
from arena_core.schemas import AgentSpec, RewardFileStep, RewardFileVerifier, StepTurn, Task, VerifyJob

HARBOR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "datasets" / "harbor"


def run_test_script(script: Path, tmp: Path, app: dict[str, str]) -> tuple[bytes | None, bytes | None]:
    """Run a task's test script with its paths moved under ``tmp``; the reward files it wrote."""
    root = tmp / "root"
    shutil.rmtree(root, ignore_errors=True)
    for sub in ("app", "tests", "logs/verifier"):
        (root / sub).mkdir(parents=True)
    for name, text in app.items():
        (root / "app" / name).write_text(text)
    for path in script.parent.iterdir():
        text = path.read_text()
        for old in ("/logs", "/tests", "/app"):
            text = text.replace(old, f"{root}{old}")
        (root / "tests" / path.name).write_text(text.replace("python3", sys.executable))
    subprocess.run(["bash", str(root / "tests" / script.name)], cwd=root / "app", capture_output=True, timeout=120)
    verifier = root / "logs" / "verifier"
    read = lambda name: (verifier / name).read_bytes() if (verifier / name).exists() else None  # noqa: E731
    return read("reward.txt"), read("reward.json")


def test_a_reward_txt_is_one_number_named_reward(tmp_path):
    script = HARBOR / "hello-file" / "tests" / "test.sh"
    assert parse_rewards(*run_test_script(script, tmp_path, {})) == {"reward": 0.0}
    assert parse_rewards(*run_test_script(script, tmp_path, {"hello.txt": "Hello, world!\n"})) == {"reward": 1.0}


def test_reward_json_keeps_every_named_number_and_the_scalar_is_reward(tmp_path):
    script = HARBOR / "fix-mean" / "tests" / "test.sh"
    buggy = (HARBOR / "fix-mean" / "environment" / "stats.py").read_text()
    rewards = parse_rewards(*run_test_script(script, tmp_path, {"stats.py": buggy}))
    assert rewards == {"reward": 0.0, "checks_passed": 0.0, "share": 0.0}
    fixed = buggy.replace("(len(values) + 1)", "len(values)")
    rewards = parse_rewards(*run_test_script(script, tmp_path, {"stats.py": fixed}))
    assert rewards == {"reward": 1.0, "checks_passed": 3.0, "share": 1.0}
    assert scalar_reward(rewards) == 1.0


def test_harbors_reading_rules():
    assert parse_rewards(b"0.0\n", b'{"reward": 0.75, "style": 1}') == {"reward": 0.75, "style": 1.0}  # json wins
    assert parse_rewards(None, b"0.5") == {"reward": 0.5}
    assert scalar_reward({"accuracy": 0.25}) == 0.25  # the only number
    assert scalar_reward({"accuracy": 0.25, "style": 1.0}) is None  # several, none named reward
    for txt, js, why in [(None, None, "wrote neither"), (b"", None, "reward.txt is empty"),
                         (b"  \n", None, "reward.txt is empty"), (b"yes", None, "not a number"),
                         (b"nan", None, "not finite"), (None, b'{"reward": NaN}', "not finite"),
                         (None, b'{"reward": "1"}', "not a number"), (None, b'{"reward": true}', "not a number"),
                         (None, b"{", "not JSON"), (None, b"", "reward.json is empty")]:
        with pytest.raises(RewardFileError, match=why):
            parse_rewards(txt, js)


def test_a_multi_step_task_stops_at_the_first_step_under_its_minimum(tmp_path):
    steps = HARBOR / "csv-pipeline" / "steps"
    data = "name,amount\na,1\nb,2\nc,4\n"
    write = parse_rewards(*run_test_script(steps / "write-csv" / "tests" / "test.sh", tmp_path, {"data.csv": data}))
    wrong_total = parse_rewards(*run_test_script(steps / "summarize" / "tests" / "test.sh", tmp_path,
                                                 {"data.csv": data, "total.txt": "6\n"}))
    assert write == {"reward": 1.0} and wrong_total == {"reward": 0.0, "total_ok": 0.0}
    assert below_minimum(write, 1.0) == ""
    assert below_minimum(wrong_total, 1.0) == "reward=0 below min_reward 1"
    assert below_minimum(wrong_total, {"total_ok": 0.5}) == "total_ok=0 below min_reward 0.5"
    assert below_minimum({"reward": 1.0}, {"total_ok": 0.5}).startswith("total_ok=-inf")  # a missing key
    assert below_minimum(wrong_total, None) == ""
    # mean: per key over the steps graded, a key a step lacks counted 0; final: the last step's
    assert combine_steps([write, wrong_total], "mean") == {"reward": 0.5, "total_ok": 0.0}
    assert combine_steps([write, wrong_total], "final") == wrong_total
    assert combine_steps([], "mean") == {}


def test_the_verification_budget_covers_every_step():
    spec = RewardFileVerifier(timeout_s=100.0, steps=[RewardFileStep(name="a"), RewardFileStep(name="b", timeout_s=30)])
    assert time_budget_s(spec) == 100.0 + 30.0 + 2 * 60.0 + 150.0
    assert time_budget_s(RewardFileVerifier(timeout_s=60.0)) == 210.0


def test_each_step_is_graded_on_the_diff_its_own_turn_left():
    spec = RewardFileVerifier(files={"shared.sh": b"s"}, steps=[
        RewardFileStep(name="a", files={"test.sh": b"a"}, min_reward=1.0), RewardFileStep(name="b"),
        RewardFileStep(name="c", timeout_s=5)])
    task = Task(id="t", instructions="x", agent=AgentSpec(command=["true"]), verifier=spec)
    turns = [StepTurn(name="a", diff="A", completed=True), StepTurn(name="b", diff="AB", completed=False)]
    groups, skipped = grading_plan(VerifyJob(rollout_id="r", task=task, diff="AB", step_turns=turns), spec)
    assert [(diff, [step[0] for step in steps]) for diff, steps in groups] == [("A", ["a"]), ("AB", ["b"])]
    assert groups[0][1][0][1] == {"shared.sh": b"s", "test.sh": b"a"} and groups[0][1][0][3] == 1.0
    assert skipped == ["steps c: no agent turn, not graded"]
    # no turns (a replay, a task whose steps had one turn): every step on the final diff, in one sandbox
    groups, skipped = grading_plan(VerifyJob(rollout_id="r", task=task, diff="F"), spec)
    assert [(diff, [step[0] for step in steps]) for diff, steps in groups] == [("F", ["a", "b", "c"])]
    assert skipped == []


def pytest_output(tmp_path: Path, body: str) -> tuple[int, str]:
    test = tmp_path / "test_outputs.py"
    test.write_text(body)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", str(test)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    return done.returncode, done.stdout + done.stderr


def test_terminal_bench_passes_only_when_every_test_in_the_summary_passed(tmp_path):
    code, log = pytest_output(tmp_path, "import pytest\n\ndef test_a():\n    pass\n\n"
                                        "@pytest.mark.skip\ndef test_b():\n    pass\n")
    assert code == 0 and pytest_summary_failure(log) == ""
    code, log = pytest_output(tmp_path, "def test_a():\n    pass\n\ndef test_b():\n    assert 1 == 2, 'a - b'\n")
    # (a message holding " - " keeps its head in the name, as Terminal-Bench's parser cuts only the last part)
    assert code == 1 and pytest_summary_failure(log).startswith("1 of 2 test(s) did not pass: test_b")
    # code under test that ends the run "successfully" before any test: Harbor's exit-code rule
    # would write 1; Terminal-Bench's own rule finds no summary
    code, log = pytest_output(tmp_path, "import os\nos._exit(0)\n\ndef test_a():\n    assert False\n")
    assert code == 0 and "no pytest short test summary" in pytest_summary_failure(log)
