"""Harbor and Terminal-Bench tasks as Arena tasks, without a stack: what the import writes (the
instruction public; tests in the private verifier; the oracle and build context beside the task),
dataset.toml digests as Harbor computes them (a mismatch refuses the task), what is refused and why,
the image inputs' digest, and `arena tasks export harbor` read back by Harbor's own loader
(PyPI ``harbor``, which needs Python >= 3.12: its own virtualenv, made once under .arena/).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import msgspec
import pytest

from arena.cli import main
from arena.formats import harbor, terminal_bench
from arena import images
from arena.tasks import load_task
from arena_core.errors import InvalidRequest
from arena_core.schemas import RewardFileVerifier, Task

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "datasets"
HARBOR_VERSION = "0.26.0"


def run_cli(*args: str) -> int:
    return main([*args])


@pytest.fixture()
def harbor_out(tmp_path):
    out = tmp_path / "harbor"
    assert run_cli("tasks", "import", "harbor", str(FIXTURES / "harbor" / "dataset.toml"), "--out", str(out)) == 0
    return out


@pytest.fixture()
def tbench_out(tmp_path):
    out = tmp_path / "tbench"
    assert run_cli("tasks", "import", "terminal-bench", str(FIXTURES / "terminal-bench"), "--out", str(out)) == 0
    return out


def test_a_harbor_task_becomes_a_public_instruction_and_a_private_reward_file_verifier(harbor_out):
    task = load_task(harbor_out / "arena-fixtures.hello-file.json")
    source = FIXTURES / "harbor" / "hello-file"
    # the canary line is stripped as Harbor strips it; the rest is the prompt
    assert task.instructions.startswith("Create a file named `hello.txt`")
    assert "canary" not in task.instructions
    assert isinstance(task.verifier, RewardFileVerifier)
    assert task.verifier.files == {p.name: p.read_bytes() for p in (source / "tests").iterdir()}
    assert task.verifier.timeout_s == 120.0 and task.budget.wall_clock_s == 300.0
    assert task.source.path == "/app" and task.image == task.source.image
    # nothing of the tests or the solution is in the public part
    public = msgspec.json.encode(task.public()).decode()
    assert "test_outputs" not in public and "reward.txt" not in public and "Hello, world!\\n" not in public
    assert (harbor_out / "solutions" / task.id / "solve.sh").read_bytes() == (source / "solution" / "solve.sh").read_bytes()
    assert (harbor_out / "environments" / task.id / "Dockerfile").is_file()
    assert task.metadata["digest"] == harbor.task_digest(source)


def test_dataset_toml_digests_are_harbors_and_a_mismatch_refuses_the_task(tmp_path):
    manifest = tomllib.loads((FIXTURES / "harbor" / "dataset.toml").read_text())  # written by `harbor sync`
    for ref in manifest["tasks"]:
        assert harbor.task_digest(FIXTURES / "harbor" / ref["name"].split("/")[1]) == ref["digest"]
    copy = tmp_path / "harbor"
    shutil.copytree(FIXTURES / "harbor", copy)
    (copy / "fix-mean" / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    with pytest.raises(InvalidRequest, match=r"task arena-fixtures/fix-mean: digest mismatch: dataset.toml pins "
                                             r"sha256:2d18ca.*refused"):
        harbor.import_source(copy / "dataset.toml")
    # ignored files (Harbor's packager's defaults) change nothing
    (copy / "hello-file" / "tests" / "__pycache__").mkdir()
    (copy / "hello-file" / "tests" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert harbor.task_digest(copy / "hello-file") == manifest["tasks"][0]["digest"]


def test_a_multi_step_task_keeps_each_steps_instruction_tests_and_minimum(harbor_out):
    task = load_task(harbor_out / "arena-fixtures.csv-pipeline.json")
    verifier = task.verifier
    assert [s.name for s in verifier.steps] == ["write-csv", "summarize"]
    assert [s.min_reward for s in verifier.steps] == [1.0, 1.0]
    assert verifier.strategy == "mean" and verifier.files == {}
    assert all("test.sh" in s.files for s in verifier.steps)
    assert "## Step 1: write-csv" in task.instructions and "## Step 2: summarize" in task.instructions
    assert harbor.step_instructions(task.instructions, ["write-csv", "summarize"])["summarize"].startswith(
        "Write the sum of the `amount` column")
    assert sorted(p.relative_to(harbor_out / "solutions" / task.id).as_posix()
                  for p in (harbor_out / "solutions" / task.id).rglob("*.sh")) == [
        "steps/summarize/solve.sh", "steps/write-csv/solve.sh"]
    # the public part: a turn per step, each with its own instruction and the task's agent timeout
    assert [(t.name, t.wall_clock_s) for t in task.steps] == [("write-csv", 300.0), ("summarize", 300.0)]
    assert task.steps[1].instructions.startswith("Write the sum of the `amount` column")
    assert task.budget.wall_clock_s == 600.0 and task.public().steps == task.steps


def test_a_terminal_bench_task_is_graded_as_harbors_mapper_grades_it(tbench_out):
    task = load_task(tbench_out / "hello-world.json")
    source = FIXTURES / "terminal-bench" / "hello-world"
    test_sh = task.verifier.files["test.sh"].decode()
    assert test_sh.startswith((source / "run-tests.sh").read_text().replace("$TEST_DIR", "/tests"))
    assert test_sh.endswith(terminal_bench.REWARD_LOGGING_SUFFIX)
    assert task.verifier.files["test_outputs.py"] == (source / "tests" / "test_outputs.py").read_bytes()
    assert task.verifier.timeout_s == 60.0 and task.budget.wall_clock_s == 360.0
    assert task.verifier.pytest_summary  # and Terminal-Bench's own rule: every test in pytest's summary passed
    assert task.instructions.startswith("Create a file called hello.txt")
    assert (tbench_out / "solutions" / task.id / "solve.sh").read_bytes() == (source / "solution.sh").read_bytes()
    dockerfile = (tbench_out / "environments" / task.id / "Dockerfile").read_text()
    assert dockerfile.endswith("ENV TEST_DIR=/tests\n")
    assert task.metadata["dataset"] == "terminal-bench"


def test_sidecar_services_become_the_tasks_services_and_a_built_sidecar_is_refused(tmp_path):
    task = tmp_path / "with-sidecar"
    shutil.copytree(FIXTURES / "terminal-bench" / "hello-world", task)
    text = (task / "docker-compose.yaml").read_text() + (
        "  redis:\n    image: redis:7\n    command: redis-server --save ''\n    environment:\n      - MODE=test\n")
    (task / "docker-compose.yaml").write_text(text)
    [imported] = terminal_bench.import_source(task, tmp_path / "staging")
    [redis] = imported.task.services
    assert (redis.name, redis.image, redis.command, redis.env) == ("redis", "redis:7", ["redis-server", "--save", ""],
                                                                   {"MODE": "test"})
    htask = tmp_path / "harbor-sidecar"
    shutil.copytree(FIXTURES / "harbor" / "hello-file", htask)
    compose = htask / "environment" / "docker-compose.yaml"
    compose.write_text("services:\n  main:\n    build: .\n  db:\n    image: postgres:16\n"
                       "    environment: {POSTGRES_PASSWORD: x}\n")
    [imported] = harbor.import_source(htask)
    assert [(s.name, s.image, s.env) for s in imported.task.services] == [("db", "postgres:16",
                                                                          {"POSTGRES_PASSWORD": "x"})]
    compose.write_text("services:\n  main:\n    build: .\n  db:\n    build: ./db\n")
    with pytest.raises(InvalidRequest, match="sidecar service db must name an image"):
        harbor.import_source(htask)


def test_a_dockerfile_copying_tests_into_the_image_is_refused(tmp_path):
    task = tmp_path / "leaky"
    shutil.copytree(FIXTURES / "terminal-bench" / "hello-world", task)
    (task / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY tests /app/tests\n")
    with pytest.raises(InvalidRequest, match="copies tests into the image, where the agent would read it"):
        terminal_bench.import_source(task, tmp_path / "staging")


def test_bad_sources_fail_in_one_line(tmp_path, capsys):
    assert run_cli("tasks", "import", "harbor", str(tmp_path / "nope"), "--out", str(tmp_path / "o")) == 2
    assert run_cli("tasks", "import", "terminal-bench", str(tmp_path), "--out", str(tmp_path / "o")) == 2
    (tmp_path / "dataset.toml").write_text("[dataset]\nname = \"a/b\"\n[[tasks]]\nname = \"a/c\"\ndigest = \"x\"\n")
    assert run_cli("tasks", "import", "harbor", str(tmp_path / "dataset.toml"), "--out", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("arena: invalid_request: ") for line in err)
    assert "not found" in err[0] and "no Terminal-Bench task" in err[1] and "is not sha256:<64 hex>" in err[2]


def test_the_image_tag_is_the_digest_of_the_build_inputs(tmp_path):
    context = tmp_path / "env"
    shutil.copytree(FIXTURES / "harbor" / "word-count" / "environment", context)
    first = images.inputs_digest(context, "/app")
    assert images.inputs_digest(context, "/app") == first
    assert images.inputs_digest(context, "/work") != first  # the layer is an input
    (context / "input.txt").write_text("changed\n")
    assert images.inputs_digest(context, "/app") != first
    assert images.image_tag(first) == f"localhost/arena-task:{first[:32]}"
    mapped, bases = images.map_bases("FROM ubuntu:24.04 AS b\nRUN true\nFROM b\nFROM scratch\n",
                                     {"ubuntu:24.04": "localhost/arena/quickstart:latest"})
    assert mapped.splitlines()[:2] == ["FROM localhost/arena/quickstart:latest AS b", "USER 0:0"]
    assert bases == ["localhost/arena/quickstart:latest"]
    assert images.parse_base_map("a:1=localhost/b:2, c=d") == {"a:1": "localhost/b:2", "c": "d"}
    with pytest.raises(InvalidRequest, match="expected IMAGE=LOCAL_IMAGE"):
        images.parse_base_map("ubuntu:24.04")


# --------------------------------------------------------------------------- Harbor's own loader


def harbor_python() -> str:
    """An interpreter with PyPI ``harbor`` (Python >= 3.12): ``$ARENA_HARBOR_PYTHON``, else
    .arena/harbor-venv, made here once (``make harbor-venv``); a skip when it cannot be had."""
    if os.environ.get("ARENA_HARBOR_PYTHON"):
        return os.environ["ARENA_HARBOR_PYTHON"]
    venv = ROOT / ".arena" / "harbor-venv"
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import harbor"], capture_output=True).returncode == 0:
        return str(python)
    done = subprocess.run(["make", "-s", "harbor-venv"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        pytest.skip(f"harbor (PyPI, Python >= 3.12) cannot be installed here: {done.stderr.strip()[-300:]}")
    return str(python)


CHECK = r"""
import json, sys
from pathlib import Path
from harbor.models.dataset.manifest import DatasetManifest
from harbor.models.task.task import Task
from harbor.publisher.packager import Packager

out = Path(sys.argv[1])
manifest = DatasetManifest.from_toml_file(out / "dataset.toml")
report = {}
for ref in manifest.tasks:
    d = out / ref.short_name
    task = Task(d)
    steps = task.config.steps or []
    report[ref.name] = {
        "valid": Task.is_valid_dir(d),
        "digest": "sha256:" + Packager.compute_content_hash(d)[0] == ref.digest,
        "instruction": task.instruction,
        "steps": {s.name: [task.step_instruction(s.name), s.min_reward] for s in steps},
        "strategy": task.config.multi_step_reward_strategy.value if task.config.multi_step_reward_strategy else None,
        "verifier_timeout": task.config.verifier.timeout_sec,
        "tests": sorted(p.relative_to(d).as_posix() for p in d.rglob("test.sh")),
        "solutions": sorted(p.relative_to(d).as_posix() for p in d.rglob("solve.sh")),
    }
print(json.dumps(report))
"""


def test_exported_tasks_load_in_harbors_own_loader(harbor_out, tbench_out, tmp_path):
    python = harbor_python()
    for imported, name in ((harbor_out, "arena-fixtures/harbor-back"), (tbench_out, "arena/tbench-as-harbor")):
        out = tmp_path / name.replace("/", "_")
        assert run_cli("tasks", "export", "harbor", str(imported), "--out", str(out), "--dataset-name", name) == 0
        done = subprocess.run([python, "-c", CHECK, str(out)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert all(t["valid"] and t["digest"] for t in report.values()), report
        if imported is harbor_out:
            assert sorted(report) == ["arena-fixtures/csv-pipeline", "arena-fixtures/fix-mean",
                                      "arena-fixtures/hello-file", "arena-fixtures/word-count"]
            hello = report["arena-fixtures/hello-file"]
            assert hello["instruction"] == load_task(harbor_out / "arena-fixtures.hello-file.json").instructions
            assert hello["tests"] == ["tests/test.sh"] and hello["solutions"] == ["solution/solve.sh"]
            steps = report["arena-fixtures/csv-pipeline"]
            assert list(steps["steps"]) == ["write-csv", "summarize"] and steps["strategy"] == "mean"
            assert steps["steps"]["write-csv"][1] == 1.0
            assert steps["steps"]["write-csv"][0] == (FIXTURES / "harbor" / "csv-pipeline" / "steps" / "write-csv"
                                                      / "instruction.md").read_text()
        else:
            assert sorted(report) == ["arena/fix-fizzbuzz", "arena/hello-world", "arena/reverse-lines"]
            assert report["arena/hello-world"]["verifier_timeout"] == 60.0


def test_terminal_bench_mapping_matches_harbors_mapper(tmp_path):
    python = harbor_python()
    script = ("import sys; from pathlib import Path; from harbor.mappers.terminal_bench import TerminalBenchMapper;"
              "TerminalBenchMapper()._map_task(Path(sys.argv[1]), Path(sys.argv[2]))")
    for task_dir in sorted((FIXTURES / "terminal-bench").iterdir()):
        theirs, ours = tmp_path / "theirs" / task_dir.name, tmp_path / "ours" / task_dir.name
        done = subprocess.run([python, "-c", script, str(task_dir), str(theirs)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        terminal_bench.to_harbor(task_dir, ours)
        for rel in ("tests/test.sh", "tests/test_outputs.py", "solution/solve.sh", "instruction.md",
                    "environment/Dockerfile"):
            assert (ours / rel).read_text() == (theirs / rel).read_text(), (task_dir.name, rel)
        theirs_env = sorted(p.relative_to(theirs).as_posix() for p in (theirs / "environment").rglob("*"))
        assert sorted(p.relative_to(ours).as_posix() for p in (ours / "environment").rglob("*")) == theirs_env


def test_a_task_without_a_reward_file_verifier_is_not_exported(tmp_path, capsys):
    task = msgspec.convert({"id": "t1", "instructions": "x", "agent": {"command": ["true"]},
                            "verifier": {"type": "exact", "answers": ["1"]}}, Task)
    (tmp_path / "t1.json").write_bytes(msgspec.json.encode(task))
    assert run_cli("tasks", "export", "harbor", str(tmp_path), "--out", str(tmp_path / "o")) == 2
    assert "its verifier is exact; only reward_file tasks" in capsys.readouterr().err


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))


def test_validation_verdicts_name_what_failed():
    from arena.validate import Check

    task = msgspec.convert({"id": "t1", "instructions": "x", "agent": {"command": ["true"]}}, Task)
    ok = Check(task, rewards={"oracle": ["1", "1", "1"], "null": ["0", "0", "0"]})
    assert ok.verdict() == "ok"
    flaky = Check(task, rewards={"oracle": ["1", "0", "1"], "null": ["0", "0", "0"]})
    assert flaky.verdict() == "flaky: oracle scored 1, 0, 1 across 3 runs"
    wrong = Check(task, rewards={"oracle": ["0"], "null": ["1"]},
                  reasons={"oracle": ["tests failed"], "null": [""]})
    assert wrong.verdict() == "oracle: scored 0, not 1 (tests failed); null: scored 1, not 0"
    assert Check(task, problem="build: base image x is not in the local store").verdict().startswith("build: ")
    assert Check(task, rewards={"oracle": [], "null": ["0"]}).verdict().startswith("oracle: none")
    # a run Arena could not do says so; it is neither the task's failure nor flakiness
    infra = Check(task, rewards={"oracle": ["1", "1", "1"], "null": ["0", "failed (infra)", "0"]},
                  reasons={"oracle": ["", "", ""], "null": ["", "no container engine", ""]})
    assert infra.verdict() == ("infrastructure: 1 of 3 null run(s) ended without a reward (no container engine); "
                               "validate again")
