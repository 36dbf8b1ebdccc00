"""SWE-smith and R2E-Gym rows whose tasks live in images, through the real stack on the docker
provider (Podman's engine): the fixture rows' images built here with Podman from a local base
(tests/fixtures/datasets/row_images.py), ``arena tasks import swe-smith|r2e-gym --from-images``
(each row's image read, the agent's image derived from it), ``arena tasks validate --runs 3``
(oracle 1, do-nothing 0, every run), ``arena tasks audit`` on every task (no hack above doing
nothing), and an R2E-Gym agent that finds neither ``/r2e_tests`` nor ``run_tests.sh`` in its image.

Needs the Docker-API engine (``docker_url``) and ``arena/quickstart`` (``make images``);
``make test-datasets`` runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.schemas import AgentSpec

from tests.e2e.scaffold_stacks import docker_stack, require_image

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "datasets"
SCRIPT = ROOT / "examples" / "quickstart" / "llm_script.json"
sys.path.insert(0, str(FIXTURES))

pytestmark = [pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def stack(docker_url, tmp_path_factory):
    engine = require_image(docker_url, "arena/quickstart:latest")
    import row_images

    row_images.swe_smith_images()
    row_images.r2e_images()
    data_dir = tmp_path_factory.mktemp("arena-row-images")
    with docker_stack(engine, data_dir, SCRIPT, "rows") as (stack, settings):
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=stack.api_key)


def arena(stack, *args: str, timeout: float = 3000) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "arena.cli", "--url", stack.settings.rollout_url, *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "ARENA_API_KEY": stack.api_key})
    print(done.stdout[-8000:], done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def imported(stack, tmp_path_factory) -> dict[str, Path]:
    stack_, _ = stack
    out = tmp_path_factory.mktemp("imported")
    import row_images

    extra = {"swe-smith": ["--profiles", str(FIXTURES / "swe-smith" / "profiles.json")], "r2e-gym": []}
    rows = {"swe-smith": FIXTURES / "swe-smith" / "dataset.jsonl",
            # R2E-Gym's expected statuses are the image's: computed in it, as R2E-Gym does
            "r2e-gym": row_images.r2e_rows_in_images(out / "r2e-rows.jsonl")}
    for fmt in ("swe-smith", "r2e-gym"):
        done = arena(stack_, "tasks", "import", fmt, str(rows[fmt]), "--from-images",
                     *extra[fmt], "--out", str(out / fmt))
        assert done.returncode == 0, done.stdout + done.stderr
    return {fmt: out / fmt for fmt in extra}


@pytest.mark.parametrize("fmt", ["swe-smith", "r2e-gym"])
def test_tasks_in_images_validate_on_every_run(stack, imported, fmt):
    stack_, _ = stack
    for path in sorted(imported[fmt].glob("*.json")):
        task = load_task(path)
        assert task.source.__struct_config__.tag == "image" and task.source.path == "/testbed"
        assert task.source.image.startswith("localhost/arena-task:")
    validated = arena(stack_, "tasks", "validate", str(imported[fmt]), "--runs", "3", "-v")
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert "3/3 valid (3 runs each)" in validated.stdout


@pytest.mark.parametrize("fmt", ["swe-smith", "r2e-gym"])
def test_audit_of_every_task_in_images_finds_no_hack_above_doing_nothing(stack, imported, fmt):
    stack_, _ = stack
    audited = arena(stack_, "tasks", "audit", str(imported[fmt]), "-v")
    assert audited.returncode == 0, audited.stdout + audited.stderr
    assert "hacks above a do-nothing agent: 0/27 (0.0%)" in audited.stdout


def test_the_r2e_agent_image_holds_no_hidden_tests(stack, imported):
    _, client = stack
    path = sorted(imported["r2e-gym"].glob("*inflection*.json"))[0]
    task = load_task(path)
    spy = ("A=r2e_; B=tests; C=run_tests; D=.sh; "
           "{ ls -la / /root /testbed 2>&1; find / -xdev \\( -name \"$A$B\" -o -name \"$C$D\" \\) 2>/dev/null; } "
           "> /tmp/found; python3 -c \"import json; print(json.dumps({'answer': open('/tmp/found').read()}))\""
           " > /sandbox/.arena/result.json; touch /sandbox/.arena/done")
    view = client.submit(msgspec.structs.replace(task, agent=AgentSpec(command=["sh", "-c", spy])),
                         provider="docker")
    view = client.wait(view.rollout_id, timeout=600)
    assert view.state.value == "completed", view.reason
    seen = client.wait_trajectory(view.rollout_id, timeout=60).sandbox.result["answer"]
    assert "r2e_tests" not in seen and "run_tests.sh" not in seen, seen
    assert "inflection" in seen  # the repository is there, at /testbed
    assert json.dumps(task.verifier.expected_statuses)  # and the verifier still has the expected statuses
