"""Generate ``proto/`` from the msgspec schemas: one JSON Schema per message and the
subject catalog. ``python -m arena_core.proto`` writes it; ``--check`` fails on drift.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

import msgspec

from arena_core import step_gate, subjects
from arena_core.schemas import MESSAGES, SCHEMA_VERSION

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "proto"


def _clean_descriptions(node):
    """Docstrings as ``inspect.cleandoc`` leaves them (indentation removed), whichever msgspec made
    the schema: 0.23 dedents them itself, 0.22 kept the indentation, and ``proto/`` must not
    depend on which one is installed."""
    if isinstance(node, dict):
        return {k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _clean_descriptions(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_clean_descriptions(v) for v in node]
    return node


def render() -> dict[str, str]:
    """File name -> content, for every generated file."""
    files: dict[str, str] = {}
    for name, cls in sorted({**MESSAGES, **step_gate.MESSAGES}.items()):
        schema = _clean_descriptions(msgspec.json.schema(cls))
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"arena/{name}.json"
        files[f"schemas/{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    catalog = subjects.catalog()
    catalog["schema_version"] = SCHEMA_VERSION
    files["subjects.json"] = json.dumps(catalog, indent=2, sort_keys=True) + "\n"
    return files


def drift(directory: Path = DEFAULT_DIR) -> list[str]:
    """Names of generated files that are missing, stale, or no longer generated."""
    expected = render()
    problems = []
    for rel, content in expected.items():
        path = directory / rel
        if not path.exists():
            problems.append(f"missing {rel}")
        elif path.read_text() != content:
            problems.append(f"stale {rel}")
    schemas_dir = directory / "schemas"
    if schemas_dir.exists():
        for path in schemas_dir.glob("*.json"):
            if f"schemas/{path.name}" not in expected:
                problems.append(f"extra {path.relative_to(directory)}")
    return problems


def write(directory: Path = DEFAULT_DIR) -> None:
    for path in (directory / "schemas").glob("*.json") if (directory / "schemas").exists() else []:
        path.unlink()
    for rel, content in render().items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arena_core.proto")
    parser.add_argument("--check", action="store_true", help="exit 1 if proto/ is out of date")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    if args.check:
        problems = drift(args.dir)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("proto/ is out of date: run `make proto`", file=sys.stderr)
            return 1
        return 0
    write(args.dir)
    print(f"wrote {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
