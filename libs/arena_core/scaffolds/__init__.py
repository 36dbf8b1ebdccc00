"""Scaffold presets: how Arena launches a known agent scaffold (mini-swe-agent, Claude Code, ...)
under the sandbox contract. One module per scaffold; :data:`SCAFFOLDS` maps names to them.

Adding one (docs/agents.md, "Adding a scaffold"): write ``arena_core/scaffolds/<module>.py`` with
``launch(scaffold: ScaffoldSpec, context: Context) -> Launch``, and list it in :data:`SCAFFOLDS`
(and in ``arena_core.schemas.ScaffoldName``). A name whose module does not exist yet is refused at
submission (:func:`unavailable`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from arena_core.schemas import AgentSpec, ScaffoldSpec

#: Scaffold name -> the module holding its preset (relative to this package).
SCAFFOLDS: dict[str, str] = {
    "mini-swe-agent": "mini_swe_agent",
    "claude-code": "claude_code",
    "opencode": "opencode",
    "openhands": "openhands",
    "terminus-2": "terminus2",
    "qwen-code": "qwen_code",
    "codex": "codex",
    "gemini-cli": "gemini_cli",
}

#: Where Arena's own files for a scaffold go inside the sandbox (config, wrapper, trajectory).
SCAFFOLD_DIR = "/sandbox/.arena/scaffold"


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """What a preset needs to know about the run, as the sandbox sees it."""

    #: The task's instructions (what the scaffold is asked to do).
    instructions: str
    #: The proxy's OpenAI base URL inside the sandbox (ends in ``/v1``) and its Anthropic one.
    openai_base_url: str
    anthropic_base_url: str
    #: The per-rollout key (also in ``OPENAI_API_KEY`` / ``ANTHROPIC_API_KEY``).
    api_key: str
    #: The scaffold's working directory: ``/sandbox/workspace`` or the task's ``workdir`` in it.
    workdir: str = "/sandbox/workspace"
    #: Where the scaffold is installed inside the sandbox (a virtualenv or prefix whose ``bin/``
    #: holds its executables); "" = its executables are on ``PATH`` (an image that ships it).
    home: str = ""


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """How to start a scaffold in the sandbox."""

    command: list[str]
    #: Added to the sandbox contract's environment (the task's ``agent.env`` still wins).
    env: dict[str, str] = {}
    #: Written into the sandbox before the command starts: absolute path -> bytes.
    files: dict[str, bytes] = {}
    #: The scaffold's own records kept after the run: artifact name -> path in the sandbox,
    #: directly in ``/sandbox/.arena`` (read without following links: the agent owns the rest).
    #: Stored in the ``arena_artifacts`` object store as ``{rollout_id}/{name}``
    #: (``SandboxDone.artifacts``).
    artifacts: dict[str, str] = {}


class ScaffoldUnavailable(ValueError):
    """The scaffold is unknown or its preset is not written yet."""


def unavailable(name: str) -> str | None:
    """Why ``name`` cannot be launched (unknown, or no preset module yet), or ``None``."""
    module = SCAFFOLDS.get(name)
    if module is None:
        return f"unknown scaffold {name!r} (known: {', '.join(SCAFFOLDS)})"
    if not _has_preset(module):
        ready = ", ".join(n for n, m in SCAFFOLDS.items() if _has_preset(m))
        return f"scaffold {name!r} has no preset yet (available: {ready or 'none'})"
    return None


@functools.lru_cache(maxsize=None)
def _has_preset(module: str) -> bool:  # checked on every decoded AgentSpec: looked up once
    return importlib.util.find_spec(f"{__name__}.{module}") is not None


def preset(agent: AgentSpec, context: Context) -> Launch:
    """The launch of ``agent.scaffold`` in this run. Raises :class:`ScaffoldUnavailable`."""
    scaffold: ScaffoldSpec | None = agent.scaffold
    if scaffold is None:
        raise ScaffoldUnavailable("the agent names no scaffold (it has a command)")
    problem = unavailable(scaffold.name)
    if problem is not None:
        raise ScaffoldUnavailable(problem)
    module = importlib.import_module(f"{__name__}.{SCAFFOLDS[scaffold.name]}")
    return module.launch(scaffold, context)
