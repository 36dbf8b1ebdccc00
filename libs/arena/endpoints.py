"""Where the stack is and which API key to send: one resolution for the ``arena`` command, the
SDK (``ArenaClient()``) and the exports (``HttpSource``).

Each value, first found wins:

1. what the caller gives: the CLI's ``--url`` / ``--trajectory-url`` (anywhere on the command
   line), ``ArenaClient(url, trajectory_url, api_key=...)``; ``api_key=""`` sends no key;
2. the environment: ``ARENA_URL``, ``ARENA_TRAJECTORY_URL``, ``ARENA_API_KEY``;
3. the local stack: ``http://127.0.0.1:9090`` and ``:9092``, and the key ``arena up`` writes to
   ``$ARENA_DATA_DIR/api-key`` (``ARENA_DATA_DIR`` defaults to ``.arena``).

README.md ("From Python") and docs/deploy.md ("The arena command").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:9090"
DEFAULT_TRAJECTORY_URL = "http://127.0.0.1:9092"
#: Where ``arena up`` leaves the CLI's key, under the data directory.
LOCAL_KEY_FILE = "api-key"


@dataclass(frozen=True)
class Endpoints:
    url: str  # the rollout API
    trajectory_url: str  # the trajectory API
    api_key: str | None  # None: no key found, no header sent
    key_from: str  # "argument", "ARENA_API_KEY", the key file's path, or "" when there is no key


def data_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$ARENA_DATA_DIR``, else ``.arena`` (as ``arena up``)."""
    env = os.environ if env is None else env
    return Path(env.get("ARENA_DATA_DIR") or ".arena")


def local_key_file(env: Mapping[str, str] | None = None) -> Path:
    return data_dir(env) / LOCAL_KEY_FILE


def _read_key(path: Path) -> str | None:
    try:
        key = path.read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return key or None


def resolve(url: str | None = None, trajectory_url: str | None = None, api_key: str | None = None, *,
            env: Mapping[str, str] | None = None) -> Endpoints:
    """The rollout API, the trajectory API and the key, by the order in this module's docstring.
    A key file this user may not read raises ``PermissionError`` (naming the file)."""
    env = os.environ if env is None else env
    url = (url or env.get("ARENA_URL", "").strip() or DEFAULT_URL).rstrip("/")
    trajectory_url = (trajectory_url or env.get("ARENA_TRAJECTORY_URL", "").strip()
                      or DEFAULT_TRAJECTORY_URL).rstrip("/")
    if api_key is not None:
        return Endpoints(url, trajectory_url, api_key or None, "argument" if api_key else "")
    if key := env.get("ARENA_API_KEY", "").strip():
        return Endpoints(url, trajectory_url, key, "ARENA_API_KEY")
    path = local_key_file(env)
    key = _read_key(path)
    return Endpoints(url, trajectory_url, key, str(path) if key else "")


def not_running(url: str, exc: BaseException) -> str:
    """The message for a connection refused (or a name that does not resolve) at ``url``."""
    return (f"nothing answers at {url.rstrip('/')} ({exc}): is the stack running? `arena up` starts it; "
            "--url / --trajectory-url or ARENA_URL / ARENA_TRAJECTORY_URL name another")
