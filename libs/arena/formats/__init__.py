"""Dataset formats ``arena tasks import FORMAT SOURCE`` understands: one module per format.

Each module in :data:`FORMATS` provides

- ``SUMMARY``: one line, the help of ``arena tasks import FORMAT``;
- ``add_arguments(parser)``: its arguments (``SOURCE`` first, then its options);
- ``run(args, connect) -> int``: the import; ``connect()`` opens an ``ArenaClient`` (a context
  manager) on the running stack, for a format that pushes bundles; a format that does not need
  the stack never calls it.

A module is imported when the CLI builds its parser, so keep its top-level imports light
(msgspec, ``arena_core.schemas``); anything heavier is imported inside ``run``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: format name -> module. Add a format here and it is a choice of ``arena tasks import``.
FORMATS: dict[str, str] = {
    "swebench": "arena.formats.swebench",
    "harbor": "arena.formats.harbor",
    "terminal-bench": "arena.formats.terminal_bench",
    "swe-gym": "arena.formats.swe_gym",
    "swe-smith": "arena.formats.swe_smith",
    "r2e-gym": "arena.formats.r2e_gym",
}


def names() -> list[str]:
    return list(FORMATS)


def load(name: str) -> ModuleType:
    """The module of format ``name``; a ``KeyError`` names the known ones."""
    try:
        return importlib.import_module(FORMATS[name])
    except KeyError:
        raise KeyError(f"unknown task format {name!r} (known: {', '.join(FORMATS)})") from None
