"""Pristine files of the task repository: snapshot them, put them back, scrub bytecode.

``restore`` never follows a path the diff controls. Also the task's path checks (``repo_path``,
``check_workdir``) and ``InvalidTask``. See docs/verification.md ("Reading the diff; pristine files").
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path, PurePosixPath

import msgspec

from arena_core.errors import VerificationError


class InvalidTask(VerificationError):
    """The task itself is unusable (bad paths, missing repository): retrying cannot help."""

    code = "invalid_task"


class SavedFile(msgspec.Struct, frozen=True):
    """One pristine test file: its bytes and mode, or a symlink's target."""

    data: bytes = b""
    mode: int = 0o644
    link: str | None = None


def repo_path(workdir: str, rel: str) -> PurePosixPath:
    """``workdir/rel`` as a normalized path inside the repository; rejects escapes."""
    joined = PurePosixPath(os.path.normpath(os.path.join(workdir or ".", rel)))
    if joined.is_absolute() or not joined.parts or joined.parts[0] in ("..", ".") or ".." in joined.parts:
        raise InvalidTask(f"test file {rel!r} (workdir {workdir!r}) is not a path inside the repository")
    return joined


def check_workdir(workdir: str) -> None:
    """The task's working directory must be inside the repository."""
    norm = os.path.normpath(workdir or ".")
    if os.path.isabs(norm) or norm == ".." or norm.startswith("../"):
        raise InvalidTask(f"workdir {workdir!r} is not a directory inside the repository")


def snapshot(workspace: Path, paths: list[PurePosixPath]) -> dict[PurePosixPath, SavedFile | None]:
    """Read the pristine test files (``None``: absent from the pristine repository)."""
    saved: dict[PurePosixPath, SavedFile | None] = {}
    for rel in paths:
        path = workspace / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            saved[rel] = None
            continue
        if stat.S_ISLNK(st.st_mode):
            saved[rel] = SavedFile(link=os.readlink(path))
        elif stat.S_ISREG(st.st_mode):
            saved[rel] = SavedFile(data=path.read_bytes(), mode=stat.S_IMODE(st.st_mode))
        else:
            raise InvalidTask(f"test file {rel} is not a regular file in the task repository")
    return saved


def _real_dir(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        os.mkdir(path)
        return
    if stat.S_ISDIR(st.st_mode):
        return
    os.unlink(path)  # a file or a symlink where a directory belongs
    os.mkdir(path)


def _remove(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # rmtree does not follow symlinks inside
    else:
        os.unlink(path)


def restore(workspace: Path, saved: dict[PurePosixPath, SavedFile | None]) -> None:
    """Make every saved path in ``workspace`` exactly its pristine self again."""
    for rel, pristine in saved.items():
        current = workspace
        for part in rel.parts[:-1]:
            current = current / part
            _real_dir(current)
        target = current / rel.parts[-1]
        _remove(target)
        if pristine is None:
            continue
        if pristine.link is not None:
            os.symlink(pristine.link, target)
            continue
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, pristine.mode)
        os.fchmod(fd, pristine.mode)  # O_CREAT's mode is masked by the umask
        with os.fdopen(fd, "wb") as fh:
            fh.write(pristine.data)


def scrub_bytecode(workspace: Path) -> int:
    """Remove every ``__pycache__`` directory and ``.pyc`` file under ``workspace``.

    The tests then run with Python's normal bytecode cache (fast: the interpreter's own
    library is already compiled), so no compiled file from the diff -- an *unchecked*
    hash-based ``.pyc`` is loaded without looking at its source -- may stand in for a
    restored test file. Symlinks are removed, never followed. Returns how many went.
    """
    removed = 0
    for top, dirs, files in os.walk(workspace, followlinks=False):
        if top == str(workspace):
            dirs[:] = [d for d in dirs if d != ".git"]
        for name in list(dirs):
            if name == "__pycache__":
                _remove(Path(top) / name)
                dirs.remove(name)
                removed += 1
        for name in files:
            if name.endswith((".pyc", ".pyo")):
                _remove(Path(top) / name)
                removed += 1
    return removed
