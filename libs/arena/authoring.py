"""Writing a task: ``arena tasks init`` (a skeleton), ``arena tasks shell`` (the agent's sandbox,
interactive), and ``arena submit --scaffold/--model`` (another agent for a task). ``arena tasks
check`` runs the skeleton's oracle and an empty attempt through the stack (``arena.cli``).

The skeleton (docs/tasks.md, "Write your own task")::

    NAME/task.json            the task: instructions, agent, a tests verifier
    NAME/repo/                what the agent starts from: greet.py (a bug) and tests/test_greet.py
    NAME/gold/NAME.patch      the oracle solution (a diff of repo/), as `arena tasks import` lays it out
    NAME/agent/agent.py       the quickstart's agent (one LLM call, one diff), when this checkout has it
    NAME/README.md            these files and the loop
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import msgspec

from arena_core.errors import InvalidRequest
from arena_core.schemas import (ID_PATTERN, AgentSpec, BundleSource, GitSource, ImageSource, PathSource, ScaffoldName,
                                ScaffoldSpec, Task)
from arena_core.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART_AGENT = REPO_ROOT / "examples" / "quickstart" / "agent" / "agent.py"
SCAFFOLDS: tuple[str, ...] = get_args(ScaffoldName)

_BUGGY = '''"""Greetings."""


def greeting(name: str) -> str:
    """``Hello, <name>!``; an empty name greets the world."""
    return f"Hello {name}"


def farewell(name: str) -> str:
    return f"Goodbye, {name}!"
'''

_FIXED = _BUGGY.replace('    return f"Hello {name}"\n', '''    return f"Hello, {name or 'world'}!"\n''')

_TESTS = '''from greet import farewell, greeting


def test_greeting():
    assert greeting("Ada") == "Hello, Ada!"


def test_greeting_the_world():
    assert greeting("") == "Hello, world!"


def test_farewell():
    assert farewell("Ada") == "Goodbye, Ada!"
'''

_README = """# Task {name}

| file | what it is |
|---|---|
| `task.json` | the task: its id, the instructions the agent reads, the agent, the verifier (the tests that must pass) and budgets |
| `repo/` | what the agent starts from (a plain directory; each sandbox gets a git repository of it with one base commit) |
| `gold/{name}.patch` | the oracle solution: a diff of `repo/` that solves the task (`git apply`) |
| `agent/` | the agent (the quickstart's: one LLM call, one diff), mounted read-only at `/sandbox/agent` |

The loop (docs/tasks.md, "Write your own task"):

    arena tasks shell {name}     # the agent's sandbox: look around, run the tests (exit leaves)
    arena tasks check {name}     # through the running stack: the oracle scores 1, doing nothing 0
    arena submit {name} --wait   # one rollout of the agent
    arena submit {name} --scaffold mini-swe-agent --model MODEL --wait   # another agent
"""


def _patch(path: str, before: str, after: str) -> str:
    """A ``git apply``-able diff of one file."""
    body = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                f"a/{path}", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


def init_task(directory: Path) -> Task:
    """Write the skeleton task into ``directory`` (named after the task id; it must not exist or be
    empty) and return the task as ``arena.tasks.load_task`` reads it."""
    from arena.tasks import load_task

    name = directory.name
    if not re.fullmatch(ID_PATTERN, name) or len(name) > 128:
        raise InvalidRequest(f"{name!r} cannot be a task id: letters, digits, '-', '_' and '.' between "
                             "them, starting with a letter or digit")
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise InvalidRequest(f"{directory} exists and is not an empty directory: nothing written")
    if QUICKSTART_AGENT.is_file():
        agent = {"command": ["python3", "/sandbox/agent/agent.py"], "path": "agent"}
    else:  # an installed package without the examples: a scaffold preset (docs/agents.md)
        agent = {"scaffold": {"name": "mini-swe-agent", "model": "default"}}
    task = {
        "id": name,
        "repo": "repo",
        "instructions": "`greeting(name)` in greet.py should return 'Hello, <name>!' (and 'Hello, world!' for "
                        "an empty name) but returns 'Hello <name>'. Fix `greeting`. Do not change the tests.",
        "agent": agent,
        "verifier": {
            "type": "tests",
            "command": "python -m pytest -rA -p no:cacheprovider tests",
            "fail_to_pass": ["tests/test_greet.py::test_greeting", "tests/test_greet.py::test_greeting_the_world"],
            "pass_to_pass": ["tests/test_greet.py::test_farewell"],
            "test_files": ["tests/test_greet.py"],
            "timeout_s": 60,
        },
        "budget": {"max_turns": 4, "max_total_tokens": 8192, "wall_clock_s": 120},
    }
    (directory / "repo" / "tests").mkdir(parents=True, exist_ok=True)
    (directory / "gold").mkdir()
    (directory / "task.json").write_bytes(msgspec.json.format(msgspec.json.encode(task), indent=2) + b"\n")
    (directory / "repo" / "greet.py").write_text(_BUGGY)
    (directory / "repo" / "tests" / "test_greet.py").write_text(_TESTS)
    (directory / "gold" / f"{name}.patch").write_text(_patch("greet.py", _BUGGY, _FIXED))
    (directory / "README.md").write_text(_README.format(name=name))
    if "command" in agent:
        (directory / "agent").mkdir()
        shutil.copyfile(QUICKSTART_AGENT, directory / "agent" / "agent.py")
    return load_task(directory)


def oracle_patch(task_file: Path, task: Task) -> Path:
    """The task's oracle solution, ``gold/<id>.patch`` beside its task file."""
    path = task_file.parent / "gold" / f"{task.id}.patch"
    if not path.is_file():
        raise InvalidRequest(f"no oracle solution for task {task.id}: {path} (a diff of the repository that "
                             "solves it; `arena tasks init` writes one)")
    return path


def with_agent(task: Task, *, scaffold: str | None, model: str | None) -> Task:
    """``task`` with the agent the command line asks for: ``scaffold`` (a preset; with ``model``, or
    the model of the task's own scaffold) replaces its agent, keeping ``agent.env``; ``model`` alone
    changes the model of the task's scaffold (a command agent keeps its command: the rollout's
    model is what the proxy sends to the backend)."""
    agent = task.agent
    if scaffold is not None:
        if scaffold not in SCAFFOLDS:
            raise InvalidRequest(f"--scaffold {scaffold}: one of {', '.join(SCAFFOLDS)}")
        own = agent.scaffold
        model = model or (own.model if own is not None else None)
        if model is None:
            raise InvalidRequest(f"--scaffold {scaffold} needs --model (the model name the scaffold sends)")
        config = own.config if own is not None and own.name == scaffold else {}
        agent = AgentSpec(scaffold=ScaffoldSpec(name=scaffold, model=model, config=config), env=agent.env)
    elif model is not None and agent.scaffold is not None:
        agent = msgspec.structs.replace(agent, scaffold=msgspec.structs.replace(agent.scaffold, model=model))
    return msgspec.structs.replace(task, agent=agent)


def shell(task: Task, command: list[str] | None = None, *, interactive: bool = False,
          fetch_bundle: Callable[[str], bytes] | None = None, settings: Settings | None = None) -> int:
    """Run ``command`` (default: a shell, ``-i`` when ``interactive``) in the task's sandbox as its
    agent would have it, with this process's stdin, stdout and stderr; its exit code. Nothing is
    kept: the workspace goes when the command exits.

    A task whose source is an image gets the ``docker`` provider's container (:func:`image_shell`);
    any other the ``local`` provider's bubblewrap sandbox (``arena_sandbox_providers.local``): the
    task's source as a git repository with one base commit at /sandbox/workspace, its public part
    at /sandbox/.arena/task.json, its agent's files at /sandbox/agent; no network (no rollout, no
    LLM proxy).

    The source is had as a worker has it (:func:`source_tree`): ``fetch_bundle`` reads a bundle
    (and the agent's ``bundle``) from the running stack; ``settings`` bound what it unpacks to
    and where a git source may come from."""
    from arena_core import sources
    from arena_sandbox_providers import local

    settings = settings or Settings.from_env()
    command = command or default_shell(interactive)
    if isinstance(task.source_of(), ImageSource):
        return image_shell(task, command, interactive=interactive, fetch_bundle=fetch_bundle, settings=settings)
    if (problem := local.available()) is not None:
        raise InvalidRequest(f"no local sandbox on this machine: {problem}")
    with tempfile.TemporaryDirectory(prefix="arena-shell-") as tmp:
        root = Path(tmp)
        workspace, arena_dir = root / "workspace", root / "arena"
        sources.prepare_workspace(source_tree(task, root / "source", fetch_bundle=fetch_bundle, settings=settings),
                                  workspace)
        arena_dir.mkdir()
        (arena_dir / "task.json").write_bytes(_task_json(task))
        spec = local.SandboxSpec(command=command, workspace=workspace, arena_dir=arena_dir,
                                 agent_dir=_agent_dir(task, root / "agent", fetch_bundle, settings),
                                 env=_shell_env(task), workdir=task.workdir, run_prefix="arena-shell-run-")
        return local.interactive(spec)


def default_shell(interactive: bool) -> list[str]:
    """bash where the sandbox has it, else sh; ``-i`` on a terminal (else it reads stdin)."""
    return ["/bin/sh", "-c", 'if command -v bash >/dev/null 2>&1; then exec bash "$@"; fi; exec sh "$@"', "sh",
            *(["-i"] if interactive else [])]


def image_shell(task: Task, command: list[str], *, interactive: bool = False,
                fetch_bundle: Callable[[str], bytes] | None = None, settings: Settings) -> int:
    """``command`` in a container of the task's image, the one the ``docker`` provider makes for its
    agent (``arena_sandbox_providers.docker_shell``, on the engine at ``ARENA_DOCKER_URL``): the
    image's directory at the source's path, as a git repository with one base commit, at
    /sandbox/workspace and at that path; the public task.json; the agent's files; uid 1000,
    read-only root, no capabilities, no network, the sandbox limits (nofile, nproc, pids, memory).
    Nothing of the verifier (its tests, a solution) is mounted: only what the image holds, as for
    the agent. An engine that does not answer or an image it lacks is an :class:`InvalidRequest`
    naming it (and ``arena images build``)."""
    from arena import images
    from arena_core import sources
    from arena_sandbox_providers import docker_shell

    source = task.source_of()
    if not isinstance(source, ImageSource):
        raise InvalidRequest(f"task {task.id}: its source is not an image")
    image = task.image_of() or settings.sandbox_image
    workdir = os.path.normpath(task.workdir)
    if os.path.isabs(workdir) or workdir.startswith(".."):
        raise InvalidRequest(f"task {task.id}: workdir {task.workdir!r} must be a path inside the repository")
    for name in dict.fromkeys((source.image, image)):
        try:
            docker_shell.check_image(settings.docker_url, name)
        except docker_shell.EngineUnreachable as exc:
            raise InvalidRequest(f"{exc}: an image task's shell runs on the docker provider's engine; start one "
                                 "(deploy/docker-engine.sh start SOCKET PIDFILE) and name it in ARENA_DOCKER_URL") \
                from None
        except docker_shell.ImageMissing as exc:
            how = ("build it with `arena images build TASK_FILE` (from the task's environment, as `arena tasks "
                   "import` wrote it)" if name.startswith(images.IMAGE_REPOSITORY + ":") else
                   "build it there (`arena images build` for an imported task's own image, `make images` for "
                   "Arena's)")
            raise InvalidRequest(f"{exc}: {how}") from None
    with tempfile.TemporaryDirectory(prefix="arena-shell-") as tmp:
        root = Path(tmp)
        sources.extract_image(source, root / "source", settings.docker_url, sources.unpack_limits(settings))
        workspace = root / "workspace"
        sources.prepare_workspace(root / "source", workspace)
        if not (workspace / workdir).is_dir():
            raise InvalidRequest(f"task {task.id}: workdir {task.workdir!r} is not a directory of {source.image}:"
                                 f"{source.path}")
        spec = docker_shell.ShellSpec(
            command=command, image=image, workspace=workspace, task_json=_task_json(task),
            agent_dir=_agent_dir(task, root / "agent", fetch_bundle, settings), env=_shell_env(task),
            workdir=os.path.normpath(os.path.join("/sandbox/workspace", workdir)),
            workspace_mount=task.workspace_mount(), tty=interactive)
        return docker_shell.interactive(spec, base_url=settings.docker_url, default_image=settings.sandbox_image,
                                        nice=settings.sandbox_nice)


def _task_json(task: Task) -> bytes:
    return msgspec.json.encode({"rollout_id": "shell", "task": task.public()})


def _shell_env(task: Task) -> dict[str, str]:
    return {"ARENA_ROLLOUT_ID": "shell", "PS1": f"[{task.id}] \\w $ ", **task.agent.env}


def _agent_dir(task: Task, dest: Path, fetch_bundle: Callable[[str], bytes] | None, settings: Settings) -> Path | None:
    """The agent's files: its directory, or its bundle unpacked into ``dest``; ``None`` without."""
    from arena_core import sources

    if task.agent.path:
        return Path(task.agent.path)
    if task.agent.bundle:
        sources.extract_bundle(_bundle(task.agent.bundle, fetch_bundle, "its agent"), dest,
                               sources.unpack_limits(settings))
        return dest
    return None


def source_tree(task: Task, dest: Path, *, fetch_bundle: Callable[[str], bytes] | None,
                settings: Settings) -> Path:
    """The files of ``task``'s source on this machine: a local directory as it is; a bundle read
    with ``fetch_bundle`` and unpacked into ``dest`` (``arena_core.sources.extract_bundle``, within
    the unpack limits); a git commit fetched into ``dest`` under the services' URL policy
    (``ARENA_GIT_ALLOWED_SCHEMES`` / ``_HOSTS`` / ``_ALLOW_PRIVATE_HOSTS``; ``file://`` too: this
    is the user's own machine, as a path source is). An image source is an ``InvalidRequest``:
    its sandbox is the image (:func:`image_shell`), not a tree on this machine."""
    from arena_core import sources

    source = task.source_of()
    if source is None:
        raise InvalidRequest(f"task {task.id} has no source (`repo`, or `source`: a path, bundle, git or image)")
    if isinstance(source, PathSource):
        return Path(source.path)
    if isinstance(source, BundleSource):
        sources.extract_bundle(_bundle(source.digest, fetch_bundle, "its source"), dest,
                               sources.unpack_limits(settings))
        return dest
    if isinstance(source, GitSource):
        sources.fetch_git(source, dest, allow_file=True, policy=sources.git_policy(settings),
                          limits=sources.unpack_limits(settings))
        return dest
    raise InvalidRequest(f"task {task.id}: its source is the image {source.image}, opened in a container of "
                         "its own (`arena tasks shell` does), not a tree on this machine")


def _bundle(digest: str, fetch_bundle: Callable[[str], bytes] | None, what: str) -> bytes:
    if fetch_bundle is None:
        raise InvalidRequest(f"{what} is the bundle {digest}: reading it needs the running stack")
    return fetch_bundle(digest)
