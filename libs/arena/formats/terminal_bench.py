"""``arena tasks import terminal-bench SOURCE``: Terminal-Bench v1 tasks (``task.yaml``, ``Dockerfile``,
``docker-compose.yaml``, ``run-tests.sh``, ``solution.sh``, ``tests/test_outputs.py``) as Arena tasks.

Each task is first mapped to a Harbor task as Harbor's own mapper maps it (``harbor/mappers/
terminal_bench.py``): ``run-tests.sh`` becomes ``tests/test.sh`` with ``$TEST_DIR`` read as ``/tests``
and a suffix writing ``/logs/verifier/reward.txt`` (1 when it exits 0 — pytest passing every test —
else 0); ``solution.sh`` the oracle; the compose file's main service its Dockerfile. Then it is
imported as a Harbor task (:mod:`arena.formats.harbor`). docs/tasks.md ("Terminal-Bench v1 tasks").
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from arena.formats import harbor

SUMMARY = ("Terminal-Bench v1 task directories (task.yaml, Dockerfile, docker-compose.yaml, run-tests.sh, "
           "solution.sh, tests/), or a directory of them")

#: Harbor's mapper appends this to run-tests.sh: the exit status becomes the reward.
REWARD_LOGGING_SUFFIX = """
_EXIT_CODE=$?
if [ $_EXIT_CODE -eq 0 ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
exit $_EXIT_CODE
"""
HANDLED = {"task.yaml", "solution.sh", "run-tests.sh", "tests", "docker-compose.yaml", "docker-compose.yml",
           "Dockerfile"}
_DEFAULT_ENV = {"TEST_DIR=${T_BENCH_TEST_DIR}"}


def add_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("source", help="a Terminal-Bench task directory (task.yaml) or a directory of them")
    q.add_argument("--out", required=True, help="directory for <id>.json, environments/<id>/ and solutions/<id>/")
    q.add_argument("--agent-command", help="the agent (sh -c) every task runs; default: none yet")


def run(args: argparse.Namespace, connect) -> int:
    with tempfile.TemporaryDirectory(prefix="arena-tbench-") as tmp:
        imported = import_source(Path(args.source), Path(tmp), agent_command=args.agent_command)
        return harbor.write_all(imported, Path(args.out), "terminal-bench")


def find_tasks(source: Path) -> list[Path]:
    if (source / "task.yaml").is_file():
        return [source]
    if not source.is_dir():
        raise harbor.HarborError(f"{source} not found")
    found = [p for p in sorted(source.iterdir()) if (p / "task.yaml").is_file()]
    if not found:
        raise harbor.HarborError(f"no Terminal-Bench task (a directory with task.yaml) in {source}")
    return found


def import_source(source: Path, staging: Path, *, agent_command: str | None = None) -> list[harbor.Imported]:
    """Every task of SOURCE, mapped to Harbor tasks under ``staging`` (kept until written) and imported."""
    import msgspec

    from arena_core.errors import InvalidRequest

    imported = []
    try:
        for task_dir in find_tasks(source):
            mapped = to_harbor(task_dir, staging / task_dir.name)
            item = harbor.import_task(harbor.Found(mapped, name=task_dir.name), agent_command=agent_command)
            item.task = msgspec.structs.replace(
                item.task, metadata={**item.task.metadata, "dataset": "terminal-bench",
                                     "digest": harbor.task_digest(mapped)},
                # Terminal-Bench's own rule besides Harbor's: every test in the pytest summary passed
                verifier=msgspec.structs.replace(item.task.verifier, pytest_summary=True))
            imported.append(item)
    except harbor.HarborError as exc:
        raise InvalidRequest(str(exc)) from None
    return imported


def _compose(task_dir: Path) -> dict[str, Any]:
    import yaml

    for name in ("docker-compose.yaml", "docker-compose.yml"):
        if (task_dir / name).is_file():
            try:
                return yaml.safe_load((task_dir / name).read_text()) or {}
            except yaml.YAMLError as exc:
                raise harbor.HarborError(f"task {task_dir.name}: {name} is not valid YAML: {exc}") from None
    return {}


def to_harbor(task_dir: Path, dest: Path) -> Path:
    """``task_dir`` as a Harbor task at ``dest`` (Harbor's mapper's layout)."""
    import yaml

    name = task_dir.name
    if (task_dir / "solution.yaml").is_file():
        raise harbor.HarborError(f"task {name}: solution.yaml is not supported (Harbor's mapper neither): "
                                 "convert it to solution.sh")
    try:
        config = yaml.safe_load((task_dir / "task.yaml").read_text()) or {}
    except yaml.YAMLError as exc:
        raise harbor.HarborError(f"task {name}: task.yaml is not valid YAML: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("instruction"), str):
        raise harbor.HarborError(f"task {name}: task.yaml has no instruction")
    if not (task_dir / "run-tests.sh").is_file():
        raise harbor.HarborError(f"task {name}: no run-tests.sh")
    compose = _compose(task_dir)
    services = compose.get("services") or {}
    main_name = "client" if "client" in services else next(iter(services), None)
    sidecars = {n: spec for n, spec in services.items() if n != main_name}
    main = services.get(main_name) or {}
    build = main.get("build", {})
    context = build if isinstance(build, str) else (build.get("context", ".") if isinstance(build, dict) else ".")
    environment = dest / "environment"
    environment.mkdir(parents=True)
    if context not in (".", "./"):
        src = (task_dir / context).resolve()
        if not src.is_dir() or not src.is_relative_to(task_dir.resolve()):
            raise harbor.HarborError(f"task {name}: build context {context!r} is not a directory of the task")
        shutil.copytree(src, environment, dirs_exist_ok=True)
    else:
        if not (task_dir / "Dockerfile").is_file():
            raise harbor.HarborError(f"task {name}: no Dockerfile")
        shutil.copy(task_dir / "Dockerfile", environment / "Dockerfile")
        for item in task_dir.iterdir():
            if item.name in HANDLED:
                continue
            target = environment / item.name
            shutil.copytree(item, target) if item.is_dir() else shutil.copy(item, target)
    if sidecars:  # as Harbor has them: the main service and its sidecars (harbor.compose_services)
        import yaml

        (environment / "docker-compose.yaml").write_text(yaml.safe_dump(
            {"services": {"main": {"build": {"context": "."}}, **sidecars}}, sort_keys=True))
    dockerfile = environment / "Dockerfile"
    text = dockerfile.read_text()
    for what in ("tests", "solution.sh", "run-tests.sh"):
        if any(f"{verb} {prefix}{what}" in text for verb in ("COPY", "ADD") for prefix in ("", "./")):
            raise harbor.HarborError(f"task {name}: its Dockerfile copies {what} into the image, where the agent "
                                     "would read it: Arena keeps tests and solutions out of the agent's sandbox")
    dockerfile.write_text((text if text.endswith("\n") else text + "\n") + "\n# Mapped from docker-compose.yaml\n"
                          + "".join(f"{line}\n" for line in _dockerfile_additions(main)))
    tests = dest / "tests"
    if (task_dir / "tests").is_dir():
        shutil.copytree(task_dir / "tests", tests)
    tests.mkdir(exist_ok=True)
    script = (task_dir / "run-tests.sh").read_text()
    script = script if script.endswith("\n") else script + "\n"
    (tests / "test.sh").write_text((script + REWARD_LOGGING_SUFFIX).replace("$TEST_DIR", "/tests"))
    if (task_dir / "solution.sh").is_file():
        (dest / "solution").mkdir()
        shutil.copy(task_dir / "solution.sh", dest / "solution" / "solve.sh")
    instruction = config["instruction"]
    (dest / "instruction.md").write_text(instruction if instruction.endswith("\n") else instruction + "\n")
    meta = {k: config[k] for k in ("author_name", "author_email", "difficulty", "category")
            if isinstance(config.get(k), str)}
    lines = ["[metadata]", *(f"{k} = {_toml_str(v)}" for k, v in meta.items()), "",
             "[verifier]", f"timeout_sec = {float(config.get('max_test_timeout_sec') or 60.0)}", "",
             "[agent]", f"timeout_sec = {float(config.get('max_agent_timeout_sec') or 360.0)}", ""]
    (dest / "task.toml").write_text("\n".join(lines))
    return dest


def _toml_str(value: str) -> str:
    import json

    return json.dumps(value)


def _dockerfile_additions(service: dict[str, Any]) -> list[str]:
    """What Harbor's mapper moves from the compose service into the Dockerfile
    (``extract_dockerfile_additions``): ``TEST_DIR``, the service's own environment, its working
    directory, exposed ports, entrypoint."""
    import json

    lines = ["ENV TEST_DIR=/tests"]
    env = service.get("environment")
    if isinstance(env, list):
        for item in env:
            if item in _DEFAULT_ENV:
                continue
            lines.append(f"ENV {item}")
    elif isinstance(env, dict):
        lines += [f"ENV {k}={v}" for k, v in env.items() if f"{k}={v}" not in _DEFAULT_ENV]
    if "working_dir" in service and "${" not in str(service["working_dir"]):
        lines.append(f"WORKDIR {service['working_dir']}")
    if "expose" in service:
        ports = service["expose"] if isinstance(service["expose"], list) else [service["expose"]]
        lines += [f"EXPOSE {port}" for port in ports]
    if "entrypoint" in service:
        entry = service["entrypoint"]
        lines.append(f"ENTRYPOINT {json.dumps(entry if isinstance(entry, list) else [entry])}")
    return lines
