"""``arena tasks import harbor SOURCE``: Harbor tasks (schema 1.4: ``task.toml``, ``instruction.md``,
``environment/``, ``tests/test.sh``, ``solution/solve.sh``, multi-step ``steps/<name>/``) as Arena
tasks. SOURCE is one task directory, a directory of them, or a ``dataset.toml`` (each task's
sha256 digest checked). docs/tasks.md ("Harbor tasks").

Each task becomes ``<out>/<id>.json`` (the instruction public; ``tests/`` in its ``reward_file``
verifier, private), ``<out>/environments/<id>/`` (the build context ``arena images build``
builds) and ``<out>/solutions/<id>/`` (the oracle, read by ``arena tasks validate`` only).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import re
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

SUMMARY = ("Harbor task directories (task.toml, instruction.md, environment/, tests/test.sh, solution/solve.sh), "
           "a directory of them, or a dataset.toml")

#: What Harbor's packager leaves out of a task's digest without a ``.gitignore`` of its own.
DEFAULT_IGNORES = ["__pycache__/", "*.pyc", ".DS_Store", "*.swp", "*.swo", "*~"]
_CANARY_LINE = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
_STEP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
#: Verifier files carried in the task (its private part); above this, the import refuses.
MAX_TESTS_BYTES = 4 * 1024 * 1024
DEFAULT_WORKDIR = "/app"


class HarborError(ValueError):
    """A task (or manifest) this importer refuses; the message says which and why."""


def add_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("source", help="a Harbor task directory, a directory of tasks, or a dataset.toml")
    q.add_argument("--out", required=True, help="directory for <id>.json, environments/<id>/ and solutions/<id>/")
    q.add_argument("--agent-command", help="the agent (sh -c) every task runs; default: none yet")


def run(args: argparse.Namespace, connect) -> int:
    return write_all(import_source(Path(args.source), agent_command=args.agent_command), Path(args.out), "harbor")


# --------------------------------------------------------------------------- reading


def strip_canary(text: str) -> str:
    """The instruction without its leading canary comment lines (and blank lines after them),
    as Harbor shows it to the agent."""
    lines = text.split("\n")
    i = 0
    while i < len(lines) and _CANARY_LINE.match(lines[i].strip()):
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Gitignore-style matching of the patterns Harbor's packager applies (names, ``dir/``,
    anchored ``/path``, globs); negations are not supported and are ignored."""
    parts = rel.split("/")
    for pattern in patterns:
        pattern = pattern.strip()
        if not pattern or pattern.startswith(("#", "!")):
            continue
        directory = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        if pattern.startswith("/") or "/" in pattern:
            pattern = pattern.lstrip("/")
            if directory:
                if any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts))):
                    return True
            elif fnmatch.fnmatchcase(rel, pattern) or any(
                    fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts))):
                return True
            continue
        names = parts[:-1] if directory else parts
        if any(fnmatch.fnmatchcase(name, pattern) for name in names):
            return True
    return False


def task_files(task_dir: Path) -> list[Path]:
    """The files Harbor's packager hashes: task.toml, instruction.md, README.md, trajectory.json,
    and environment/, tests/, solution/, steps/ (no ``.harborignore``), less the ignored ones."""
    files = [task_dir / name for name in ("task.toml", "instruction.md", "README.md", "trajectory.json")
             if (task_dir / name).is_file()]
    for sub in ("environment", "tests", "solution", "steps"):
        top = task_dir / sub
        if top.is_dir():
            files += [p for p in top.rglob("*") if p.is_file() and p.name != ".harborignore"]
    gitignore = task_dir / ".gitignore"
    patterns = gitignore.read_text().splitlines() if gitignore.is_file() else DEFAULT_IGNORES
    files = [p for p in files if not _ignored(p.relative_to(task_dir).as_posix(), patterns)]
    return sorted(files, key=lambda p: p.relative_to(task_dir).as_posix())


def task_digest(task_dir: Path) -> str:
    """``sha256:<hex>`` of a task as ``dataset.toml`` pins it (Harbor's ``Packager.compute_content_hash``:
    each file's path and sha256, in path order)."""
    outer = hashlib.sha256()
    for path in task_files(task_dir):
        rel = path.relative_to(task_dir).as_posix()
        outer.update(f"{rel}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    return "sha256:" + outer.hexdigest()


def read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise HarborError(f"{path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise HarborError(f"{path} is not valid TOML: {exc}") from None


@dataclass
class Found:
    """A task directory to import, with the digest its manifest pins (if any)."""

    path: Path
    digest: str | None = None
    name: str | None = None


def find_tasks(source: Path) -> list[Found]:
    """The tasks of SOURCE: a ``dataset.toml`` (or a directory holding one), a task directory,
    or a directory of task directories."""
    if source.is_dir() and (source / "dataset.toml").is_file():
        source = source / "dataset.toml"
    if source.is_file():
        if source.name != "dataset.toml":
            raise HarborError(f"{source}: give a task directory, a directory of tasks or a dataset.toml")
        return manifest_tasks(source)
    if not source.is_dir():
        raise HarborError(f"{source} not found")
    if (source / "task.toml").is_file():
        return [Found(source)]
    found = [Found(p) for p in sorted(source.iterdir()) if (p / "task.toml").is_file()]
    if not found:
        raise HarborError(f"no Harbor task (a directory with task.toml) in {source}")
    return found


def manifest_tasks(manifest: Path) -> list[Found]:
    """The tasks a ``dataset.toml`` lists, found among the directories beside it by their
    ``[task].name`` (as ``harbor sync`` finds them)."""
    data = read_toml(manifest)
    if not isinstance(data.get("dataset"), dict) or not data["dataset"].get("name"):
        raise HarborError(f"{manifest}: no [dataset] name")
    local: dict[str, Path] = {}
    for child in sorted(manifest.parent.iterdir()):
        config = child / "task.toml"
        if config.is_file():
            name = (read_toml(config).get("task") or {}).get("name")
            if name:
                local[name] = child
    found = []
    for i, ref in enumerate(data.get("tasks") or [], 1):
        name, digest = ref.get("name"), ref.get("digest")
        if not name or not digest:
            raise HarborError(f"{manifest}: [[tasks]] entry {i} needs name and digest")
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise HarborError(f"{manifest}: task {name}: digest {digest!r} is not sha256:<64 hex>")
        if name not in local:
            raise HarborError(f"{manifest}: task {name} is not among the task directories beside it")
        found.append(Found(local[name], digest, name))
    if not found:
        raise HarborError(f"{manifest}: lists no [[tasks]]")
    return found


def task_id(name: str) -> str:
    """An Arena task id from a Harbor name (``org/name`` -> ``org.name``)."""
    parts = [re.sub(r"[^A-Za-z0-9_-]+", "-", part).strip("-_") or "x" for part in name.split("/") if part]
    ident = ".".join(parts)[:128]
    return ident if re.match(r"^[A-Za-z0-9]", ident) else "t" + ident[:127]


def read_tree(top: Path, what: str) -> dict[str, bytes]:
    """Every regular file under ``top`` by its path there (links inside it followed; none outside)."""
    files: dict[str, bytes] = {}
    if not top.is_dir():
        return files
    root = top.resolve()
    for path in sorted(top.rglob("*")):
        if path.is_dir() or path.name == ".harborignore":
            continue
        if not path.resolve().is_relative_to(root) or not path.is_file():
            raise HarborError(f"{what}: {path.relative_to(top)} is a link out of {top.name}/ or not a file")
        files[path.relative_to(top).as_posix()] = path.read_bytes()
    if sum(len(v) for v in files.values()) > MAX_TESTS_BYTES:
        raise HarborError(f"{what}: {top} holds more than {MAX_TESTS_BYTES >> 20} MiB")
    return files


def dockerfile_workdir(dockerfile: Path) -> str | None:
    """The last absolute ``WORKDIR`` of a Dockerfile's final stage."""
    workdir = None
    for line in dockerfile.read_text().splitlines():
        words = line.strip().split(None, 1)
        if words and words[0].upper() == "FROM":
            workdir = None
        elif len(words) == 2 and words[0].upper() == "WORKDIR" and words[1].strip().startswith("/"):
            workdir = words[1].strip().strip('"')
    return workdir


def compose_services(compose: Path, what: str) -> list[Any]:
    """The sidecar services of a compose environment (every service but ``main``/``client``, which
    is the task's own Dockerfile), as Arena runs them beside the agent: on the sandbox's private
    network, reached by name (docker provider). A sidecar must name its ``image`` (one in the local
    store, or pulled by a user with a registry); one that is built here is refused."""
    import shlex

    import yaml

    from arena_core.schemas import SidecarService

    try:
        data = yaml.safe_load(compose.read_text()) or {}
    except yaml.YAMLError as exc:
        raise HarborError(f"{what}: {compose.name} is not valid YAML: {exc}") from None
    services = data.get("services") or {}
    sidecars = []
    for name in sorted(n for n in services if n not in ("main", "client")):
        spec = services[name] or {}
        if not isinstance(spec, dict) or not isinstance(spec.get("image"), str) or spec.get("build"):
            raise HarborError(f"{what}: {compose.name}: sidecar service {name} must name an image (image:); "
                              "a sidecar built from a context is not supported: build it and name its tag")
        command = spec.get("command") or []
        command = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
        env = spec.get("environment") or {}
        if isinstance(env, list):
            env = dict(item.split("=", 1) if "=" in item else (item, "") for item in map(str, env))
        try:
            sidecars.append(SidecarService(name=name, image=spec["image"], command=command,
                                           env={str(k): "" if v is None else str(v) for k, v in env.items()}))
        except Exception as exc:  # noqa: BLE001 - msgspec's validation: the service's name or fields
            raise HarborError(f"{what}: {compose.name}: sidecar service {name}: {exc}") from None
    return sidecars


# --------------------------------------------------------------------------- the task


@dataclass
class Imported:
    """One task as Arena has it, and the private files that go beside it."""

    task: Any  # arena_core.schemas.Task
    environment: Path  # the build context (a directory holding a Dockerfile)
    solution: dict[str, bytes]  # the oracle's files, by path under /solution ("" = none)
    synthesized_dockerfile: str = ""  # [environment].docker_image without environment/: FROM it


def import_task(found: Found, *, agent_command: str | None = None) -> Imported:
    """One Harbor task directory as an Arena task (refused with a :class:`HarborError`)."""
    from arena.datasets import UNSET_AGENT
    from arena_core.schemas import AgentSpec, Budget, ImageSource, RewardFileStep, RewardFileVerifier, Task, TaskStep

    from arena import images

    path = found.path
    config = read_toml(path / "task.toml")
    name = found.name or (config.get("task") or {}).get("name") or path.name
    if found.digest is not None and (actual := task_digest(path)) != found.digest:
        raise HarborError(f"task {name}: digest mismatch: dataset.toml pins {found.digest}, the directory "
                          f"{path} hashes to {actual} (changed since the manifest was written): refused")
    env_cfg = config.get("environment") or {}
    if (env_cfg.get("os") or "linux") != "linux":
        raise HarborError(f"task {name}: [environment].os = {env_cfg['os']!r}: only linux tasks run here")
    env_dir = path / "environment"
    synthesized = ""
    services = []
    for compose_name in ("docker-compose.yaml", "docker-compose.yml"):
        if (env_dir / compose_name).is_file():
            services = compose_services(env_dir / compose_name, f"task {name}")
    if not (env_dir / "Dockerfile").is_file():
        if not env_cfg.get("docker_image"):
            raise HarborError(f"task {name}: no environment/Dockerfile and no [environment].docker_image")
        synthesized = f"FROM {env_cfg['docker_image']}\n"
    workdir = (env_cfg.get("workdir") or (dockerfile_workdir(env_dir / "Dockerfile") if not synthesized else None)
               or DEFAULT_WORKDIR)
    if not workdir.startswith("/") or workdir == "/" or ".." in PurePosixPath(workdir).parts:
        raise HarborError(f"task {name}: working directory {workdir!r} must be an absolute path below /")
    verifier_cfg = config.get("verifier") or {}
    agent_cfg = config.get("agent") or {}
    steps_cfg = config.get("steps") or []
    shared_tests = read_tree(path / "tests", f"task {name}")
    steps = []
    task_steps = []
    instructions = []
    wall = float(agent_cfg.get("timeout_sec") or 600.0)
    solution: dict[str, bytes] = {}
    if steps_cfg:
        for step in steps_cfg:
            step_name = step.get("name", "")
            if not _STEP_NAME.match(step_name) or ".." in step_name:
                raise HarborError(f"task {name}: step name {step_name!r} is not a directory name")
            step_dir = path / "steps" / step_name
            if not (step_dir / "instruction.md").is_file():
                raise HarborError(f"task {name}: step {step_name}: no steps/{step_name}/instruction.md")
            files = read_tree(step_dir / "tests", f"task {name} step {step_name}")
            if "test.sh" not in files and "test.sh" not in shared_tests:
                raise HarborError(f"task {name}: step {step_name}: no tests/test.sh (its own or the task's)")
            timeout = (step.get("verifier") or {}).get("timeout_sec")
            steps.append(RewardFileStep(name=step_name, files=files, min_reward=step.get("min_reward"),
                                        timeout_s=float(timeout) if timeout else None))
            text = strip_canary((step_dir / "instruction.md").read_text())
            turn = (step.get("agent") or {}).get("timeout_sec")
            task_steps.append(TaskStep(name=step_name, instructions=text,
                                       wall_clock_s=float(turn) if turn else wall))
            instructions.append(f"## Step {len(instructions) + 1}: {step_name}\n\n" + text.strip())
            for rel, data in read_tree(step_dir / "solution", f"task {name} step {step_name}").items():
                solution[f"steps/{step_name}/{rel}"] = data
        instruction = ("This task has steps; do them in order.\n\n" + "\n\n".join(instructions) + "\n")
    else:
        if not (path / "instruction.md").is_file():
            raise HarborError(f"task {name}: no instruction.md")
        if "test.sh" not in shared_tests:
            raise HarborError(f"task {name}: no tests/test.sh")
        instruction = strip_canary((path / "instruction.md").read_text())
    solution.update(read_tree(path / "solution", f"task {name}"))
    ident = task_id(name)
    context = env_dir
    digest = images.inputs_digest_of(context, workdir, synthesized)
    image = images.image_tag(digest)
    strategy = config.get("multi_step_reward_strategy") or "mean"
    if strategy not in ("mean", "final"):
        raise HarborError(f"task {name}: multi_step_reward_strategy {strategy!r} is not mean or final")
    verifier = RewardFileVerifier(files=shared_tests, timeout_s=float(verifier_cfg.get("timeout_sec") or 600.0),
                                  env={str(k): str(v) for k, v in (verifier_cfg.get("env") or {}).items()},
                                  steps=steps, strategy=strategy)
    agent = AgentSpec(command=["sh", "-c", agent_command]) if agent_command else UNSET_AGENT
    if task_steps:  # each turn has its own clock; the rollout's is their sum
        wall = sum(t.wall_clock_s or wall for t in task_steps)
    metadata = {"dataset": "harbor", "harbor_name": name, "digest": found.digest or task_digest(path),
                "environment": f"environments/{ident}", "workdir": workdir, "image_inputs": digest}
    for key, value in (config.get("metadata") or {}).items():
        if isinstance(value, (str, int, float, bool)):
            metadata.setdefault(f"harbor.{key}", str(value))
    task = Task(id=ident, instructions=instruction, agent=agent, source=ImageSource(image=image, path=workdir),
                image=image, verifier=verifier, budget=Budget(wall_clock_s=wall), metadata=metadata,
                steps=task_steps, services=services)
    return Imported(task=task, environment=context, solution=solution, synthesized_dockerfile=synthesized)


def import_source(source: Path, *, agent_command: str | None = None) -> list[Imported]:
    from arena_core.errors import InvalidRequest

    try:
        found = find_tasks(source)
        imported = [import_task(f, agent_command=agent_command) for f in found]
    except HarborError as exc:
        raise InvalidRequest(str(exc)) from None
    ids = [i.task.id for i in imported]
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"{source}: two tasks have the same id: {sorted({i for i in ids if ids.count(i) > 1})}")
    return imported


def write_all(imported: list[Imported], out: Path, label: str) -> int:
    """Each task's file, build context and oracle under ``out``."""
    import msgspec

    from arena_core.schemas import encode

    out.mkdir(parents=True, exist_ok=True)
    for i, item in enumerate(imported, 1):
        task = item.task
        env_out = out / "environments" / task.id
        shutil.rmtree(env_out, ignore_errors=True)
        if item.synthesized_dockerfile:
            env_out.mkdir(parents=True)
            (env_out / "Dockerfile").write_text(item.synthesized_dockerfile)
        else:
            shutil.copytree(item.environment, env_out, symlinks=True)
        sol_out = out / "solutions" / task.id
        shutil.rmtree(sol_out, ignore_errors=True)
        for rel, data in item.solution.items():
            (sol_out / rel).parent.mkdir(parents=True, exist_ok=True)
            (sol_out / rel).write_bytes(data)
        (out / f"{task.id}.json").write_bytes(msgspec.json.format(encode(task)) + b"\n")
        steps = len(task.verifier.steps)
        print(f"[{i}/{len(imported)}] {task.id}: image {task.image} (arena images build {out}), "
              f"{len(task.verifier.files)} test file(s)" + (f", {steps} steps" if steps else "")
              + (", oracle" if item.solution else ", no oracle"), flush=True)
    print(f"wrote {len(imported)} {label} task(s) to {out}")
    return 0


# --------------------------------------------------------------------------- export

_STEP_HEADING = re.compile(r"^## Step \d+: (\S+)\n\n", re.M)


def _toml_value(value: Any) -> str:
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(float(value)) if isinstance(value, float) else str(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


def step_instructions(instructions: str, names: list[str]) -> dict[str, str]:
    """Each step's instruction back out of the one prompt the import made of them."""
    parts = _STEP_HEADING.split(instructions)
    found = {parts[i]: parts[i + 1].strip() + "\n" for i in range(1, len(parts) - 1, 2)}
    return {name: found.get(name, f"Step {name}.\n") for name in names}


def export_task(task_file: Path, task, out: Path) -> Path:
    """An imported (or hand-written) Arena task with a ``reward_file`` verifier as a Harbor task
    directory under ``out``; returns it. Its environment is the build context beside the task
    file, else ``FROM`` the task's image."""
    from arena_core.schemas import RewardFileVerifier

    verifier = task.verifier
    if not isinstance(verifier, RewardFileVerifier):
        kind = type(verifier).__struct_config__.tag if verifier is not None else "none"
        raise HarborError(f"task {task.id}: its verifier is {kind}; only reward_file tasks (Harbor's rule) "
                          "export as Harbor tasks")
    name = task.metadata.get("harbor_name") or f"arena/{task.id}"
    if "/" not in name:
        name = f"arena/{name}"
    directory = out / task_id(name.split("/", 1)[1])
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    workdir = task.metadata.get("workdir") or task.workspace_mount() or DEFAULT_WORKDIR
    lines = ['schema_version = "1.4"']
    if verifier.steps:
        lines.append(f'multi_step_reward_strategy = "{verifier.strategy}"')
    lines += ["", "[task]", f"name = {_toml_value(name)}", ""]
    meta = {k.removeprefix("harbor."): v for k, v in task.metadata.items() if k.startswith("harbor.")}
    meta.update({"arena_task_id": task.id})
    lines += ["[metadata]", *(f"{_toml_value(k)} = {_toml_value(v)}" for k, v in sorted(meta.items())), ""]
    lines += ["[verifier]", f"timeout_sec = {float(verifier.timeout_s)}"]
    if verifier.env:
        lines += [f"env = {_toml_value(verifier.env)}"]
    lines += ["", "[agent]", f"timeout_sec = {float(task.budget.wall_clock_s)}", "",
              "[environment]", f"workdir = {_toml_value(workdir)}", ""]
    turns = {t.name: t.wall_clock_s for t in task.steps}
    for step in verifier.steps:
        lines += ["[[steps]]", f"name = {_toml_value(step.name)}"]
        if turns.get(step.name):
            lines += [f"agent = {{ timeout_sec = {float(turns[step.name])} }}"]
        if step.min_reward is not None:
            lines.append(f"min_reward = {_toml_value(step.min_reward)}")
        if step.timeout_s:
            lines += [f"verifier = {{ timeout_sec = {float(step.timeout_s)} }}"]
        lines.append("")
    (directory / "task.toml").write_text("\n".join(lines))
    context = task_file.parent / task.metadata["environment"] if task.metadata.get("environment") else None
    if context is not None and (context / "Dockerfile").is_file():
        shutil.copytree(context, directory / "environment", symlinks=True)
    else:
        if not task.image_of():
            raise HarborError(f"task {task.id}: no build context and no image to make its environment from")
        (directory / "environment").mkdir()
        (directory / "environment" / "Dockerfile").write_text(f"FROM {task.image_of()}\nWORKDIR {workdir}\n")

    def put(top: Path, files: dict[str, bytes], executable: str) -> None:
        for rel, data in files.items():
            path = top / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if rel == executable:
                path.chmod(0o755)

    put(directory / "tests", verifier.files, verifier.script)
    solutions = task_file.parent / "solutions" / task.id
    if verifier.steps:
        texts = {t.name: t.instructions for t in task.steps} or step_instructions(
            task.instructions, [s.name for s in verifier.steps])
        for step in verifier.steps:
            step_dir = directory / "steps" / step.name
            step_dir.mkdir(parents=True)
            (step_dir / "instruction.md").write_text(texts[step.name])
            put(step_dir / "tests", step.files, step.script)
            if (solutions / "steps" / step.name).is_dir():
                shutil.copytree(solutions / "steps" / step.name, step_dir / "solution")
    else:
        (directory / "instruction.md").write_text(task.instructions)
    if solutions.is_dir():
        for item in solutions.iterdir():
            if item.name == "steps" and verifier.steps:
                continue
            target = directory / "solution" / item.name
            target.parent.mkdir(exist_ok=True)
            shutil.copytree(item, target) if item.is_dir() else shutil.copy(item, target)
        if (directory / "solution" / "solve.sh").is_file():
            (directory / "solution" / "solve.sh").chmod(0o755)
    return directory


def export_dataset(paths: list[tuple[Path, Any]], out: Path, dataset_name: str) -> list[Path]:
    """Every task as a Harbor task under ``out``, and ``out/dataset.toml`` pinning each by its digest."""
    exported = []
    for task_file, task in paths:
        exported.append(export_task(task_file, task, out))
    lines = ["# written by arena tasks export harbor", "[dataset]", f"name = {_toml_value(dataset_name)}", ""]
    for directory in exported:
        name = read_toml(directory / "task.toml")["task"]["name"]
        lines += ["[[tasks]]", f"name = {_toml_value(name)}", f'digest = "{task_digest(directory)}"', ""]
    (out / "dataset.toml").write_text("\n".join(lines))
    return exported
