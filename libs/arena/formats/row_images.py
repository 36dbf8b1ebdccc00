"""Rows that name an image (SWE-smith's ``image_name``, R2E-Gym's ``docker_image``): the image's files
read from the local store, and the agent's image derived from it with Podman, offline.

The derived image is what the agent and the verifier run in: the dataset's image with the agent's
tree at ``/testbed`` (SWE-smith: the bug in, the F2P test files out) or without what the agent
must not see (R2E-Gym: ``/r2e_tests``, ``run_tests.sh``). Its tag is the digest of its inputs (the
base image's id, the Containerfile, the files copied in): built once, kept after.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from arena_core.errors import InvalidRequest


def _podman(args: list[str], *, timeout: float = 300.0) -> subprocess.CompletedProcess:
    from arena import images

    return subprocess.run([*images.podman_command(), *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def image_id(image: str) -> str:
    done = _podman(["image", "inspect", "--format", "{{.Id}}", image])
    if done.returncode != 0:
        raise InvalidRequest(f"image {image} is not in the local store (no registry is reached here: build or "
                             "load it first)")
    return done.stdout.strip()


def read_paths(image: str, paths: list[str], dest: Path) -> Path:
    """The directories ``paths`` of ``image`` (those it has) copied under ``dest`` at the same
    paths (``/testbed`` -> ``dest/testbed``), links kept; ``dest``."""
    image_id(image)
    name = f"arena-read-{uuid.uuid4().hex[:12]}"
    made = _podman(["create", "--name", name, "--network=none", image, "true"])
    if made.returncode != 0:
        raise InvalidRequest(f"cannot read image {image}: {made.stderr.strip()[-300:]}")
    try:
        for path in paths:
            target = dest / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            done = _podman(["cp", f"{name}:{path}", str(target)])
            if done.returncode != 0 and target.exists():
                shutil.rmtree(target, ignore_errors=True)
    finally:
        _podman(["rm", "-f", name])
    return dest


def derive(base: str, steps: list[str], *, context: Path | None = None, label: str = "") -> str:
    """``base`` with ``steps`` (Containerfile lines, run as root; ``context`` their build context),
    its user kept; the tag (``localhost/arena-task:<digest of the inputs>``), built unless present."""
    from arena import images
    from arena_core import sources

    base_id = image_id(base)
    user = _podman(["image", "inspect", "--format", "{{.Config.User}}", base]).stdout.strip()
    containerfile = f"FROM {base}\nUSER 0:0\n" + "".join(f"{s}\n" for s in steps) + (f"USER {user}\n" if user else "")
    digest = hashlib.sha256()
    digest.update(f"{base_id}\0{containerfile}\0".encode())
    if context is not None:
        digest.update(sources.digest_of(sources.pack_dir(context)).encode())
    tag = images.image_tag(digest.hexdigest())
    if images.exists(tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="arena-derive-") as tmp:
        ctx = Path(tmp) / "context"
        if context is not None:
            shutil.copytree(context, ctx, symlinks=True)
        else:
            ctx.mkdir()
        (Path(tmp) / "Containerfile").write_text(containerfile)
        args = ["build", "--pull=never", "--network=none", *(f"--ulimit={u}" for u in images.ULIMITS),
                "-f", str(Path(tmp) / "Containerfile"), "-t", tag, "--label", f"arena.derived={label or base}",
                str(ctx)]
        done = _podman(args, timeout=1800.0)
    if done.returncode != 0:
        last = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
        raise InvalidRequest(f"building the agent's image from {base} failed: {last[0][:300]}")
    return tag
