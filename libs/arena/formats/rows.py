"""What the row formats share (SWE-smith, R2E-Gym, SWE-Gym): reading rows from JSONL, JSON or
Parquet files, moving files between trees, and writing an import's task files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import msgspec

from arena_core.errors import InvalidRequest
from arena_core.schemas import Task, encode

T = TypeVar("T")


def read_records(path: str | Path) -> list[Any]:
    """The records of a JSONL, JSON (a list) or Parquet file (no hub access: files only)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"dataset file {path} not found")
    try:
        if path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise InvalidRequest("reading Parquet needs pyarrow (pip install 'arena[export]')") from None
            return pq.read_table(path).to_pylist()
        if path.suffix == ".json":
            records = json.loads(path.read_text())
            if not isinstance(records, list):
                raise InvalidRequest(f"{path}: a JSON dataset is a list of rows")
            return records
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{path}: not JSON rows: {exc}") from None


def read_rows(path: str | Path, row_type: type[T]) -> list[T]:
    """The rows of ``path`` as ``row_type``; a row that does not fit is a one-line error."""
    rows = []
    for i, record in enumerate(read_records(path)):
        try:
            rows.append(msgspec.convert(record, row_type))
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"{path} row {i + 1}: {exc}") from None
    if not rows:
        raise InvalidRequest(f"{path}: no rows")
    return rows


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def task_id(text: str) -> str:
    """An id Arena accepts made from a dataset's name for an instance (at most 128 characters)."""
    cleaned = _UNSAFE.sub("-", text).strip("-.")
    return cleaned[:128] or "task"


def repo_path(rel: str) -> PurePosixPath:
    """``rel`` as a relative path inside a repository; a one-line error if it is not one."""
    path = PurePosixPath(rel)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise InvalidRequest(f"{rel!r} is not a path inside the repository")
    return path


def move_out(tree: Path, rels: list[str], dest: Path) -> list[str]:
    """Move the files (or directories) ``rels`` of ``tree`` to the same paths under ``dest``;
    the ones that existed."""
    moved = []
    for rel in rels:
        src = tree / repo_path(rel)
        if not (src.exists() or src.is_symlink()):
            continue
        target = dest / repo_path(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(target))
        moved.append(rel)
    return moved


def write_task(out: Path, task: Task, gold: str | None) -> None:
    """``<out>/<id>.json`` and, for an oracle, ``<out>/gold/<id>.patch``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{task.id}.json").write_bytes(msgspec.json.format(encode(task)) + b"\n")
    if gold is not None:
        (out / "gold").mkdir(exist_ok=True)
        (out / "gold" / f"{task.id}.patch").write_text(gold)
