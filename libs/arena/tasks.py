"""Load a task file (JSON of ``arena_core.schemas.Task``) and resolve its relative paths.

In a task file, local paths (``repo``, a ``path`` source, ``agent.path``) are relative to the
file's directory; the SDK and CLI upload them as bundles when they submit (docs/tasks.md).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from arena_core.errors import InvalidRequest
from arena_core.schemas import PathSource, Task


def load_task(path: str | Path) -> Task:
    path = Path(path)
    if path.is_dir():
        path = path / "task.json"
    try:
        task = msgspec.json.decode(path.read_bytes(), type=Task)
    except FileNotFoundError:
        raise InvalidRequest(f"task file not found: {path}") from None
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid task file {path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"task file {path} is not valid JSON: {exc}") from None
    base = path.parent.resolve()
    agent = task.agent
    if agent.path is not None:
        agent = msgspec.structs.replace(agent, path=str((base / agent.path).resolve()))
    task = msgspec.structs.replace(task, agent=agent)
    if task.repo:
        task = msgspec.structs.replace(task, repo=str((base / task.repo).resolve()))
    if isinstance(task.source, PathSource):
        task = msgspec.structs.replace(task, source=PathSource(path=str((base / task.source.path).resolve())))
    return task
