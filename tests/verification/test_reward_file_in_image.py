"""The ``reward_file`` verifier in the task's own image (the docker provider on Podman's engine):
imported fixture tasks, their images built by ``arena.images`` with the base mapped to
``arena/quickstart``; the agent's diff graded by the task's own test script; an image without
Arena's layer is an infrastructure error, never a reward.

Needs the engine (``docker_url``) and ``arena/quickstart`` on it; ``make test-datasets`` runs it.
"""

from __future__ import annotations

import io
import tarfile
import tempfile
from pathlib import Path

import msgspec
import pytest

from arena import images
from arena.formats import harbor, terminal_bench
from arena_core.errors import VerificationError
from arena_core.schemas import VerifyJob
from arena_core.settings import Settings
from arena_core.sources import SourceCache
from arena_verification.runner import verify
from arena_verification.sandboxes import ProviderSandboxes
from arena_sandbox_providers.testing import built_image

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "datasets"
BASE_MAP = {"ubuntu:24.04": "localhost/arena/quickstart:latest"}

pytestmark = [pytest.mark.timeout(900)]


def new_file(name: str, text: str) -> str:
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return (f"diff --git a/{name} b/{name}\nnew file mode 100644\n--- /dev/null\n+++ b/{name}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n{body}")


@pytest.fixture(scope="module")
def tasks(docker_url, tmp_path_factory):
    from tests.e2e.scaffold_stacks import require_image

    require_image(docker_url, "arena/quickstart:latest")
    out = tmp_path_factory.mktemp("imported")
    harbor.write_all(harbor.import_source(FIXTURES / "harbor" / "dataset.toml"), out, "harbor")
    with tempfile.TemporaryDirectory() as staging:
        imported = terminal_bench.import_source(FIXTURES / "terminal-bench", Path(staging))
        harbor.write_all(imported, out, "terminal-bench")
    found = {task.id: task for _, task in images.task_builds(out)}
    for task_file, task in images.task_builds(out):
        result = images.build_task(task_file, task, base_map=BASE_MAP)
        assert result.status in ("built", "cached"), result.reason
    return found


@pytest.fixture()
def verifier(docker_url, tmp_path):
    settings = Settings(data_dir=str(tmp_path / "data"), docker_url=docker_url, sandbox_provider="docker")
    sandboxes = ProviderSandboxes.from_settings(settings)
    sources = SourceCache(tmp_path / "sources", docker_url=docker_url)

    async def run(task, diff: str):
        return await verify(VerifyJob(rollout_id="r1", task=task, diff=diff), scratch_dir=tmp_path / "scratch",
                            sandboxes=sandboxes, sources=sources)

    yield run


async def test_the_agents_diff_is_graded_by_the_tasks_own_script(tasks, verifier):
    task = tasks["arena-fixtures.hello-file"]
    solved = await verifier(task, new_file("hello.txt", "Hello, world!\n"))
    assert (solved.reward, solved.passed, solved.verifier) == (1.0, True, "reward_file")
    assert "2 passed" in solved.log_tail  # pytest's output, from /logs/verifier/test-stdout.txt
    nothing = await verifier(task, "")
    assert (nothing.reward, nothing.passed) == (0.0, False)


async def test_named_metrics_are_kept_and_the_scalar_is_reward(tasks, verifier):
    task = tasks["arena-fixtures.fix-mean"]
    fix = ("diff --git a/stats.py b/stats.py\n--- a/stats.py\n+++ b/stats.py\n@@ -1,3 +1,3 @@\n"
           " def mean(values):\n     \"\"\"The arithmetic mean of a non-empty list of numbers.\"\"\"\n"
           "-    return sum(values) / (len(values) + 1)\n+    return sum(values) / len(values)\n")
    result = await verifier(task, fix)
    assert result.reward == 1.0 and result.components == {"reward": 1.0, "checks_passed": 3.0, "share": 1.0}


async def test_steps_are_graded_in_order_and_stop_under_a_minimum(tasks, verifier):
    task = tasks["arena-fixtures.csv-pipeline"]
    csv = new_file("data.csv", "name,amount\na,1\nb,2\nc,4\n")
    total = new_file("total.txt", "7\n")
    both = await verifier(task, csv + total)
    assert both.reward == 1.0 and both.components["summarize.total_ok"] == 1.0
    first = await verifier(task, csv)
    assert first.reward == 0.5 and first.components == {"reward": 0.5, "total_ok": 0.0, "write-csv.reward": 1.0,
                                                         "summarize.reward": 0.0, "summarize.total_ok": 0.0}
    second = await verifier(task, total)
    assert second.reward == 0.0 and "stopped after step write-csv" in second.reason
    final = msgspec.structs.replace(task, verifier=msgspec.structs.replace(task.verifier, strategy="final"))
    assert (await verifier(final, csv)).reward == 0.0


async def test_no_reward_file_is_no_reward_and_an_image_without_the_layer_is_an_error(tasks, verifier, docker_url):
    task = tasks["arena-fixtures.word-count"]
    silent = msgspec.structs.replace(task, verifier=msgspec.structs.replace(
        task.verifier, files={"test.sh": b"#!/bin/bash\necho checked\n"}))
    result = await verifier(silent, "")
    assert result.reward is None and "reward_missing" in result.flags
    assert "neither /logs/verifier/reward.txt nor reward.json" in result.error
    body = b"FROM arena/quickstart:latest\nUSER 0:0\nRUN mkdir -p /app\nWORKDIR /app\n"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("Containerfile")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    with built_image(docker_url, raw.getvalue(), "arena-test-no-layer") as tag:
        bare = msgspec.structs.replace(task, image=tag, source=msgspec.structs.replace(task.source, image=tag))
        with pytest.raises(VerificationError, match="not Arena's \\(build it with arena images build\\)"):
            await verifier(bare, "")


OLD_FIZZBUZZ = (FIXTURES / "terminal-bench" / "fix-fizzbuzz" / "fizzbuzz.py").read_text()


def rewrite(text: str) -> str:
    """A diff that makes fix-fizzbuzz's ``fizzbuzz.py`` ``text``."""
    minus = "".join(f"-{line}\n" for line in OLD_FIZZBUZZ.splitlines())
    plus = "".join(f"+{line}\n" for line in text.splitlines())
    return (f"diff --git a/fizzbuzz.py b/fizzbuzz.py\n--- a/fizzbuzz.py\n+++ b/fizzbuzz.py\n"
            f"@@ -1,{len(OLD_FIZZBUZZ.splitlines())} +1,{len(text.splitlines())} @@\n{minus}{plus}")


async def test_terminal_bench_code_that_ends_pytest_early_scores_zero(tasks, verifier):
    task = tasks["fix-fizzbuzz"]
    fixed = (FIXTURES / "terminal-bench" / "fix-fizzbuzz" / "solution.sh").read_text().split("<<'PY'\n")[1]
    fixed = fixed.split("PY\n")[0]

    solved = await verifier(task, rewrite(fixed))
    assert solved.reward == 1.0 and solved.flags == []
    # pytest imports the module and the module ends the process with 0: the mapped test.sh writes
    # reward 1 (Harbor's rule alone); the guard saw the session start and never end: 0
    hack = await verifier(task, rewrite("import os\nos._exit(0)\n"))
    assert hack.reward == 0.0 and hack.flags == ["runner_tampered"]
    assert "ended before pytest finished its session, yet the script rewarded the run" in hack.reason


async def test_terminal_bench_reports_rewritten_past_the_canaries_are_caught_by_the_guard(tasks, verifier):
    """``runner_targeted_by_name`` (every failing report but a canary's rewritten PASSED) passes the
    canaries; the guard loaded into run-tests.sh's pytest saw test_fizzbuzz fail."""
    from arena import hacks

    head = hacks.TARGET.replace("KIND", repr("name")).replace("PACKAGES", repr(("fizzbuzz",))).replace("FILES", "()")
    hack = await verifier(tasks["fix-fizzbuzz"], rewrite(OLD_FIZZBUZZ + head + hacks.TARGETED_REPORTS))
    assert hack.reward == 0.0 and "runner_tampered" in hack.flags, hack.reason
    assert "test_fizzbuzz was listed PASSED but failed" in hack.reason


async def test_a_script_whose_pytest_cannot_import_the_guard_is_run_again_without_it(tasks, verifier):
    """A test.sh that sets its own PYTHONPATH (and keeps PYTEST_PLUGINS): pytest cannot import the
    guard and stops; the honest answer still scores 1, and the reason says the run was not guarded."""
    task = tasks["arena-fixtures.hello-file"]
    script = (b"#!/bin/bash\nexport PYTHONPATH=/app\npython3 -m pytest -p no:cacheprovider -rA /tests/test_outputs.py\n"
              b"if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    own_path = msgspec.structs.replace(task, verifier=msgspec.structs.replace(
        task.verifier, files={**task.verifier.files, "test.sh": script}))
    solved = await verifier(own_path, new_file("hello.txt", "Hello, world!\n"))
    assert (solved.reward, solved.flags) == (1.0, []), solved.reason
    assert "could not import the runner guard: run again without it" in solved.reason
