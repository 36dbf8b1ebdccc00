"""A SWE-bench-style task whose repository lives in its image (``/testbed``), verified in that
image with the docker provider: the workspace is mounted where the image expects the
repository, so the tests run the agent's code, not the image's pristine copy."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import msgspec
import pytest

from arena_core.schemas import ImageSource, VerifyJob
from arena_core.settings import Settings
from arena_core.sources import SourceCache
from arena.tasks import load_task
from arena_sandbox_providers.testing import built_image
from arena_verification.runner import verify
from arena_verification.sandboxes import ProviderSandboxes

from .test_runner import scripted_diff

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


@pytest.fixture(scope="module")
def swe_image(docker_url):
    """FROM arena/quickstart, the quickstart repository (with its bug and a .git) at /testbed."""
    docker = pytest.importorskip("docker")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        body = b"FROM arena/quickstart:latest\nCOPY testbed /testbed\n"
        info = tarfile.TarInfo("Containerfile")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
        tar.add(QUICKSTART / "repo", arcname="testbed")
        head = b"ref: refs/heads/main\n"
        info = tarfile.TarInfo("testbed/.git/HEAD")
        info.size = len(head)
        tar.addfile(info, io.BytesIO(head))
    try:
        with built_image(docker_url, raw.getvalue(), "arena-test-testbed") as tag:
            yield tag
    except docker.errors.DockerException as exc:
        pytest.skip(f"cannot build a test image on the engine: {exc}")


async def test_an_image_source_is_verified_in_its_image_at_its_path(swe_image, docker_url, tmp_path):
    quickstart = load_task(QUICKSTART)
    task = msgspec.structs.replace(quickstart, repo="", source=ImageSource(image=swe_image, path="/testbed"))
    # the command runs where SWE-bench's harness runs it: in the repository's directory in the image
    task = msgspec.structs.replace(task, verifier=msgspec.structs.replace(
        task.verifier, command="test \"$(pwd)\" = /testbed && python -m pytest -rA -p no:cacheprovider tests"))
    settings = Settings(data_dir=str(tmp_path / "data"), docker_url=docker_url, sandbox_provider="docker")
    sandboxes = ProviderSandboxes.from_settings(settings)
    sources = SourceCache(tmp_path / "sources", docker_url=docker_url)
    try:
        gold = await verify(VerifyJob(rollout_id="g", task=task, diff=scripted_diff("correct")),
                            scratch_dir=tmp_path / "scratch", sandboxes=sandboxes, sources=sources)
        empty = await verify(VerifyJob(rollout_id="e", task=task, diff=""), scratch_dir=tmp_path / "scratch",
                             sandboxes=sandboxes, sources=sources)
    finally:
        await sandboxes.close()
    # the gold patch is what ran at /testbed (the image's own copy there still has the bug)
    assert (gold.reward, gold.flags) == (1.0, []), gold.reason + gold.log_tail
    assert (empty.reward, empty.counts.f2p_failed) == (0.0, 2)
    # the source came out of the image without its .git
    [tree] = [p for p in (tmp_path / "sources").iterdir() if p.name.startswith("image-") and p.is_dir()]
    assert (tree / "textstats" / "core.py").is_file() and not (tree / ".git").exists()
