"""The dashboard's own settings beside ``arena_core.settings.Settings``."""

from __future__ import annotations

import os
from collections.abc import Mapping

from arena_core.settings import Settings, SettingsError


def trajectory_url(settings: Settings, env: Mapping[str, str] | None = None) -> str:
    """Where the trajectory API is: ``ARENA_DASHBOARD_TRAJECTORY_URL`` (compose, Kubernetes:
    another host), else this host's ``ARENA_TRAJECTORY_PORT`` (``arena up``)."""
    env = os.environ if env is None else env
    url = env.get("ARENA_DASHBOARD_TRAJECTORY_URL", "").strip()
    if url:
        if not url.startswith(("http://", "https://")):
            raise SettingsError(f"ARENA_DASHBOARD_TRAJECTORY_URL={url!r} must be an http(s) URL")
        return url.rstrip("/")
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"http://{host}:{settings.trajectory_port}"
