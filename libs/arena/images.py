"""Per-task images: ``arena images build`` builds an imported task's own Dockerfile (Harbor's
``environment/``, Terminal-Bench's) with Podman, offline, tagged with the digest of its inputs.

Base images are mapped to local ones (``--base-map`` / ``ARENA_IMAGE_BASE_MAP``: no registry is
reached); a build whose tag exists with the same base kept as it is. A failed build is an
infrastructure outcome with its log, never a reward. docs/tasks.md ("Per-task images").
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from arena_core.errors import InvalidRequest

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The repository of every task image; the tag is the digest of the build's inputs.
IMAGE_REPOSITORY = "localhost/arena-task"
#: Every build container's limits (an engine without them may refuse to start one here).
ULIMITS = ("nofile=1024:1024", "nproc=4096:4096")
DOCKERFILE = "Dockerfile"
#: Changing the layer changes every digest: bump this with it.
LAYER_VERSION = "1"


def arena_layer(workdir: str) -> str:
    """What Arena appends to a task's Dockerfile: ``/logs`` and ``/tests`` (Harbor's paths) as
    links into ``/sandbox/.arena/harbor``, the one place of a read-only sandbox that both a test
    script and the verifier reach; ``/solution`` as a link to the agent's files (the oracle's
    solution in validation); the working directory made and kept."""
    return (f"\n# arena layer {LAYER_VERSION} (arena images build, docs/tasks.md)\nUSER 0:0\n"
            f"RUN mkdir -p /sandbox/.arena {workdir} && rm -rf /logs /tests /solution && "
            "ln -s /sandbox/.arena/harbor/logs /logs && ln -s /sandbox/.arena/harbor/tests /tests && "
            f"ln -s /sandbox/agent /solution\nWORKDIR {workdir}\n")


def context_files(context: Path) -> list[Path]:
    """The files of a build context, sorted (symbolic links as links)."""
    if not context.is_dir():
        raise InvalidRequest(f"build context {context} is not a directory")
    return sorted((p for p in context.rglob("*") if p.is_file() or p.is_symlink()),
                  key=lambda p: p.relative_to(context).as_posix())


def inputs_digest(context: Path, workdir: str) -> str:
    """sha256 of what defines the image as written: each file's path and content (a link's
    target), and Arena's layer. The bases are resolved at build time (:func:`build`)."""
    if not (context / DOCKERFILE).is_file():
        raise InvalidRequest(f"no {DOCKERFILE} in {context}")
    outer = hashlib.sha256()
    for path in context_files(context):
        rel = path.relative_to(context).as_posix()
        data = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
        outer.update(f"{rel}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    outer.update(arena_layer(workdir).encode())
    return outer.hexdigest()


def inputs_digest_of(context: Path, workdir: str, dockerfile: str = "") -> str:
    """:func:`inputs_digest` of ``context``, or of a context holding only ``dockerfile`` when given
    (a task that names a prebuilt image: ``FROM`` it)."""
    if not dockerfile:
        return inputs_digest(context, workdir)
    outer = hashlib.sha256()
    outer.update(f"{DOCKERFILE}\0{hashlib.sha256(dockerfile.encode()).hexdigest()}\n".encode())
    outer.update(arena_layer(workdir).encode())
    return outer.hexdigest()


def image_tag(digest: str) -> str:
    return f"{IMAGE_REPOSITORY}:{digest[:32]}"


def parse_base_map(spec: str | None) -> dict[str, str]:
    """``"ubuntu:24.04=localhost/arena-base:latest,python:3.12-slim=..."`` as a map."""
    mapping: dict[str, str] = {}
    for item in (spec or "").replace("\n", ",").split(","):
        item = item.strip()
        if not item:
            continue
        base, sep, local = item.partition("=")
        if not sep or not base.strip() or not local.strip():
            raise InvalidRequest(f"base image map entry {item!r}: expected IMAGE=LOCAL_IMAGE")
        mapping[base.strip()] = local.strip()
    return mapping


_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)


def map_bases(dockerfile: str, mapping: dict[str, str]) -> tuple[str, list[str]]:
    """The Dockerfile with each ``FROM`` base replaced by its local image, and the bases it
    then names (build stages excluded)."""
    stages: set[str] = set()
    bases: list[str] = []
    lines = []
    for line in dockerfile.splitlines():
        m = _FROM.match(line)
        if m:
            image = m.group(3)
            mapped = False
            if image.lower() not in stages and image != "scratch":
                mapped = image in mapping
                image = mapping.get(image, image)
                bases.append(image)
            alias = re.search(r"\bAS\s+(\S+)", m.group(4), re.IGNORECASE)
            if alias:
                stages.add(alias.group(1).lower())
            line = f"{m.group(1)}{m.group(2)}{image}{m.group(4)}"
            if mapped:  # the task's instructions run as root, as on the official image it stands for
                line += "\nUSER 0:0"
        lines.append(line)
    return "\n".join(lines) + "\n", bases


def podman_command() -> list[str]:
    """Podman on the store the docker provider's engine uses: as root, through
    ``deploy/docker-engine.sh podman`` (the engine's own store); else the user's Podman."""
    if os.environ.get("ARENA_PODMAN"):
        return os.environ["ARENA_PODMAN"].split()
    script = REPO_ROOT / "deploy" / "docker-engine.sh"
    if os.geteuid() == 0 and script.is_file():
        return ["bash", str(script), "podman"]
    return ["podman"]


@dataclass
class BuildResult:
    task_id: str
    tag: str
    #: ``built``, ``cached`` or ``failed``
    status: str
    seconds: float = 0.0
    log: Path | None = None
    reason: str = ""


def _podman(args: list[str], *, timeout: float = 120.0) -> subprocess.CompletedProcess:
    command = podman_command()
    try:
        return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise InvalidRequest(f"{command[0]} is not installed here: task images are built and found with Podman "
                             "(apt-get install podman)") from None


def image_label(tag: str, label: str) -> str | None:
    """``label`` of image ``tag`` in the store ("" without it), ``None`` when there is no such image."""
    done = _podman(["image", "inspect", "--format", f'{{{{index .Labels "{label}"}}}}', tag])
    if done.returncode != 0:
        return None
    value = done.stdout.strip()
    return "" if value == "<no value>" else value


def build(task_id: str, context: Path, tag: str, workdir: str, *, base_map: dict[str, str], log_dir: Path,
          rebuild: bool = False, timeout_s: float = 1800.0) -> BuildResult:
    """Build one task's image (``context`` holds its Dockerfile) as ``tag``; kept when an image
    of that tag exists built on the same bases. Never raises for a failed build: the result
    says so, with its log."""
    started = time.monotonic()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{task_id}.log"
    dockerfile, bases = map_bases((context / DOCKERFILE).read_text(), base_map)
    base_ids = []
    for base in bases:
        found = _podman(["image", "inspect", "--format", "{{.Id}}", base])
        if found.returncode != 0:
            reason = (f"base image {base} is not in the local store (no registry is reached: build it, or map "
                      f"it to a local image with --base-map / ARENA_IMAGE_BASE_MAP)")
            log.write_text(reason + "\n" + found.stderr)
            return BuildResult(task_id, tag, "failed", time.monotonic() - started, log, reason)
        base_ids.append(found.stdout.strip())
    bases_label = ",".join(base_ids)
    if not rebuild and image_label(tag, "arena.bases") == bases_label:
        return BuildResult(task_id, tag, "cached", time.monotonic() - started, None)
    with tempfile.TemporaryDirectory(prefix="arena-build-") as tmp:
        ctx = Path(tmp) / "context"
        shutil.copytree(context, ctx, symlinks=True)
        (ctx / "Containerfile.arena").write_text(dockerfile + arena_layer(workdir))
        args = ["build", "--pull=never", "--network=none", *(f"--ulimit={u}" for u in ULIMITS),
                "-f", str(ctx / "Containerfile.arena"), "-t", tag, "--label", f"arena.bases={bases_label}",
                "--label", f"arena.task={task_id}", str(ctx)]
        try:
            done = subprocess.run([*podman_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout_s, check=False)
            output, code = done.stdout, done.returncode
        except subprocess.TimeoutExpired as exc:
            output, code = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (
                exc.stdout or ""), None
    log.write_text(output)
    seconds = time.monotonic() - started
    if code != 0:
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
        why = f"timed out after {timeout_s:g}s" if code is None else f"podman build exited {code}: {last[0][:300]}"
        return BuildResult(task_id, tag, "failed", seconds, log, why)
    return BuildResult(task_id, tag, "built", seconds, log)


def exists(tag: str) -> bool:
    return _podman(["image", "exists", tag]).returncode == 0


def task_builds(path: Path) -> list[tuple[Path, object]]:
    """(task file, task) of each imported task under ``path`` (an import's output directory or one
    task file) that has a build context (``metadata.environment``)."""
    from arena import datasets
    from arena.tasks import load_task

    out = []
    for task_file in datasets.iter_task_files(path):
        task = load_task(task_file)
        if task.metadata.get("environment"):
            out.append((task_file, task))
    return out


def build_task(task_file: Path, task, *, base_map: dict[str, str], rebuild: bool = False,
               log_dir: Path | None = None) -> BuildResult:
    """Build the image of one imported task from the context beside its file; refused (a failed
    result) when the context no longer hashes to the digest the task's image is tagged with."""
    context = (task_file.parent / task.metadata["environment"]).resolve()
    workdir = task.metadata.get("workdir") or "/"
    log_dir = log_dir or task_file.parent / "build-logs"
    if not (context / DOCKERFILE).is_file():
        return BuildResult(task.id, task.image or "", "failed", reason=f"no {DOCKERFILE} in {context}")
    digest = inputs_digest(context, workdir)
    if task.image != image_tag(digest):
        return BuildResult(task.id, task.image or "", "failed", reason=(
            f"{context} changed since the import (its inputs hash to {digest[:32]}, the task names "
            f"{task.image}): import the task again"))
    return build(task.id, context, task.image, workdir, base_map=base_map, log_dir=log_dir, rebuild=rebuild)
