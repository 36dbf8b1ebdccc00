"""The newest published release of each scaffold Arena already supports (Claude Code, OpenCode,
mini-swe-agent, OpenHands, harbor's Terminus-2) beside the pinned one that ``make images`` installs:
``deploy/images/releases.py`` resolves the newest (``npm view <package> version``, ``pip index
versions <package>``) and builds ``arena/<name>:newest`` where it differs from the pin (``make
images-newest``); here each such image runs its scaffold's quickstart plays (imported from the
pinned version's own test) through the real stack: the right play scores 1, the wrong one 0, each
rollout one training sequence whose loss mask is exactly the completions.

A scaffold whose newest release is the pinned one is skipped, saying so (its pinned test covers it).
The versions are those ``releases.py --build`` resolved (``.arena/scaffold-releases.json``; this test
asks no registry). Needs them, the images and a Docker-API engine; ``make test-agents`` resolves and
builds them and runs this file.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path

import docker
import msgspec
import pytest

from arena.tasks import load_task
from arena_core.schemas import SamplingParams, Task

from tests.e2e.scaffold_cases import QUICKSTART, check_sequences, client_of
from tests.e2e.scaffold_stacks import docker_stack, require_image

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(1200)]


def _releases_module():
    spec = importlib.util.spec_from_file_location("arena_image_releases", ROOT / "deploy" / "images" / "releases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quickstart(name: str) -> tuple[dict, Callable[[Task], Task], int, int]:
    """The scaffold's quickstart script (right and wrong plays), its task builder, its turns per
    rollout and its training sequences per rollout, from the pinned version's own test."""
    if name == "claude-code":
        from tests.e2e import test_agent_claude_code as t
        return t.SCRIPT, t.claude_task, t.TURNS, 1
    if name == "opencode":
        from tests.e2e import test_agent_opencode as t
        return t.SCRIPT, t.opencode_task, t.TURNS, 1
    if name == "mini-swe-agent":
        from tests.e2e import test_agent_mini_swe_agent as t
        return t.SCRIPT, t.mini_task, t.TURNS, 1
    if name == "openhands":
        from tests.e2e import test_agent_openhands as t
        return json.loads(t.PLAYS.read_text()), t.openhands_task, t.TURNS, 1
    if name == "terminus-2":
        from tests.e2e import test_agent_terminus2 as t
        return json.loads(t.PLAYS.read_text()), t.terminus_task, t.TURNS, 1
    raise AssertionError(name)


@pytest.fixture(scope="module")
def releases() -> dict[str, dict[str, str]]:
    resolved = _releases_module().RESOLVED
    if not resolved.is_file():
        pytest.skip(f"no {resolved.relative_to(ROOT)}: `make images-newest` resolves the newest releases")
    return json.loads(resolved.read_text())


@pytest.mark.parametrize("name", ["claude-code", "opencode", "mini-swe-agent", "openhands", "terminus-2"])
def test_the_newest_release_solves_the_quickstart_task_beside_the_pinned_one(name, releases, docker_url, tmp_path):
    release = releases[name]
    print(f"\n{name}: pinned {release['pinned']}, newest {release['newest']} ({release['package']})")
    if release["newest"] == release["pinned"]:
        pytest.skip(f"{name}: the newest release, {release['newest']}, is the pinned one (its own test runs it)")
    image = f"arena/{name}:newest"
    engine = require_image(docker_url, image)
    client = docker.DockerClient(base_url=engine)
    try:
        built = client.images.get(image).labels.get("arena.version")
    finally:
        client.close()
    assert built == release["newest"], f"{image} holds {name} {built}, not the newest {release['newest']}: " \
                                       f"`make images-newest` rebuilds it"

    script_body, task_of, turns, sequences = _quickstart(name)
    script = tmp_path / "script.json"
    script.write_text(json.dumps(script_body))
    with docker_stack(engine, tmp_path / "data", script, "nw") as (stack, settings):
        task = msgspec.structs.replace(task_of(load_task(QUICKSTART)), image=image)
        client_ = client_of(stack, settings)
        started = time.monotonic()
        # seed 1 draws the right play, seed 0 the wrong one
        rids = [client_.submit(task, sampling=SamplingParams(seed=seed), provider="docker").rollout_id
                for seed in (1, 0)]
        views = [client_.wait(rid, timeout=600) for rid in rids]
        elapsed = time.monotonic() - started
        assert [v.state.value for v in views] == ["completed", "completed"], [(v.state, v.reason) for v in views]
        assert [v.reward for v in views] == [1.0, 0.0]
        assert [v.steps for v in views] == [turns, turns]
        print(f"two quickstart rollouts with {name} {release['newest']} in {image}: {elapsed:.1f} s")
        for view in views:
            traj = client_.wait_trajectory(view.rollout_id, timeout=60)
            assert traj.sandbox.provider == "docker" and traj.sandbox.outcome.value == "completed"
            check_sequences(traj, turns)
            assert len(traj.sequences) == sequences and not traj.sequence_breaks, traj.sequence_breaks
