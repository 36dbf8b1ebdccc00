"""schemathesis against the running services: every operation of the rollout and trajectory
OpenAPI documents, generated requests valid and invalid, with no server error, no dropped
connection, and every answer matching its documented status and schema.

Bounded in ``make test``; ``make fuzz`` (``ARENA_FUZZ_SECONDS``) adds the stateful phase
(submit -> get -> wait -> cancel through the documents' links) and runs for that long."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

SECONDS = int(os.environ.get("ARENA_FUZZ_SECONDS", "0"))
#: Starlette answers 405 for a method a path lacks with the Allow header of one route only,
#: when a path has routes for two methods; the 405 itself is right.
EXCLUDED = ["allow_header_conformance"]
#: A submission valid by its schema may still be refused for what no schema says (a bundle that
#: is not stored, a task without the verifier it needs, a host path): a documented 422.
EXCLUDED_BY_SERVICE = {"rollout": ["positive_data_acceptance"], "trajectory": []}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("fuzz")
    rp = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data / "arena"), rollout_port=rp,
                        trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                        backend_url=f"http://127.0.0.1:{free_port()}/v1", sandbox_concurrency=2)
    stack = Stack(settings, nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    try:
        yield stack, data
    finally:
        stack.stop()


def schemathesis(url: str, report: Path, excluded: list[str], key: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("schemathesis")
    argv = [str(exe), "run", f"{url}/openapi.json", "--checks", "all", "--exclude-checks", ",".join(excluded),
            "--workers", "1", "--request-timeout", "30", "--header", f"Authorization: Bearer {key}"]
    if SECONDS:
        argv += ["--phases", "examples,coverage,fuzzing,stateful", "--max-time", str(SECONDS)]
    else:  # bounded and reproducible in CI
        argv += ["--phases", "examples,coverage,fuzzing", "--max-examples", "5", "--seed", "20261125"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=max(SECONDS * 2, 600))
    report.write_text(done.stdout + done.stderr)
    return done


@pytest.mark.parametrize("service", ["trajectory", "rollout"])
def test_every_operation_answers_as_documented_under_generated_requests(stack, service):
    s, data = stack
    url = s.settings.trajectory_url if service == "trajectory" else s.settings.rollout_url
    done = schemathesis(url, data / f"{service}-schemathesis.txt", EXCLUDED + EXCLUDED_BY_SERVICE[service],
                        s.api_key)
    tail = "\n".join(done.stdout.splitlines()[-60:])
    assert done.returncode == 0, f"schemathesis found failures on the {service} API:\n{tail}"
    assert " passed" in done.stdout and "failures" not in done.stdout.split("SUMMARY")[-1].lower(), tail
    assert all(c.alive() for c in s.children), "a service went down during the run"
