"""Sandboxes whose ``/sandbox`` is a directory on this host (``local`` and ``docker``).

``/sandbox/workspace``, ``/sandbox/.arena`` and ``/sandbox/agent`` map to
``<dir>/workspace``, ``<dir>/arena`` and ``<dir>/agent``; ``<dir>/run`` holds the
relay (shim, proxy socket) and is read-only inside. Host-side reads never follow links:
the agent wrote those directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

from arena_sandbox_providers.local import DIFF_EXCLUDES, SHIM
from arena_sandbox_providers.provider import OutputCallback, SandboxError

SANDBOX_UID = 1000
_MAP = {"workspace": "workspace", ".arena": "arena", "agent": "agent"}
#: A workspace with more entries than this is not marked (git's own stat pass is as quick).
MARK_MAX_ENTRIES = 5000


def tree_state(top: Path, max_entries: int = MARK_MAX_ENTRIES) -> dict[str, tuple[int, ...]] | None:
    """Every entry under ``top`` (``top`` too) -> its inode, mode, size, mtime and ctime, links
    never followed; ``None`` past ``max_entries``. Equal states mean nothing in the tree was
    written, created, removed, renamed or chmod'ed in between: the kernel sets ctime on each,
    and no process without CAP_SYS_TIME can set it back."""
    out: dict[str, tuple[int, ...]] = {}
    pending = [""]
    while pending:
        rel = pending.pop()
        path = os.path.join(top, rel) if rel else str(top)
        try:
            st = os.lstat(path)
            out[rel] = (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if not stat.S_ISDIR(st.st_mode):
                continue
            with os.scandir(path) as entries:
                for entry in entries:
                    if len(out) + len(pending) >= max_entries:
                        return None
                    child = os.path.join(rel, entry.name)
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(child)
                    else:
                        st = entry.stat(follow_symlinks=False)
                        out[child] = (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        except OSError:
            return None
    return out


def make_layout(root: Path, *, owner_uid: int | None, relay_files: bool = True, run_dir: Path | None = None) -> None:
    """Create ``root`` with its four directories (writable ones owned by ``owner_uid``; the run
    directory at ``run_dir`` instead of ``<root>/run`` when given), and with ``relay_files`` the
    shim and the diff's excludes in it (docker mounts it at /run/arena; a local run has a
    directory of its own for them)."""
    root.mkdir(parents=True)
    for name in ("workspace", "arena", "agent"):
        (root / name).mkdir()
    run = run_dir if run_dir is not None else root / "run"
    run.mkdir()
    if relay_files:
        shutil.copyfile(SHIM, run / "shim.py")
        (run / "excludes").write_text("".join(f"{p}\n" for p in DIFF_EXCLUDES))
    if owner_uid is not None:
        for name in ("workspace", "arena"):
            os.chown(root / name, owner_uid, owner_uid)


class HostDirSandbox:
    """File operations shared by sandboxes backed by a host directory."""

    root: Path
    owner_uid: int | None = None  # chown copied files to this uid (docker: 1000)
    #: The workspace as the ``put_dir`` into an empty workspace left it (:func:`tree_state`), until
    #: anything else is put into it; ``None`` otherwise.
    _workspace_mark: dict[str, tuple[int, ...]] | None = None

    def host_path(self, path: str) -> Path:
        return Path(self._host(path))

    def _host(self, path: str) -> str:
        """``host_path`` as a string: the checks (existence, reads) take one per file of the job,
        and pathlib's parsing was most of their cost."""
        parts = os.path.normpath(path).split("/")  # "/sandbox/x/y" -> ["", "sandbox", "x", "y"]
        if len(parts) < 3 or parts[0] != "" or parts[1] != "sandbox" or parts[2] not in _MAP or ".." in parts:
            raise SandboxError(f"{path!r} is not under /sandbox/{{workspace,.arena,agent}}")
        return os.path.join(os.fspath(self.root), _MAP[parts[2]], *parts[3:])

    def _chown_tree(self, top: Path) -> None:
        if self.owner_uid is None:
            return
        for dirpath, dirnames, filenames in os.walk(top):
            for name in [*dirnames, *filenames]:
                os.lchown(os.path.join(dirpath, name), self.owner_uid, self.owner_uid)
        os.lchown(top, self.owner_uid, self.owner_uid)

    async def put_dir(self, src: Path, dest: str, *, src_stable: bool = False) -> None:
        target = self.host_path(dest)
        workspace = self.root / "workspace"
        if target.is_relative_to(workspace):
            self._workspace_mark = None

        def copy() -> dict[str, tuple[int, ...]] | None:
            whole = target == workspace and not any(workspace.iterdir())
            shutil.copytree(src, target, symlinks=True, dirs_exist_ok=True)
            if not target.is_relative_to(self.root / "agent"):
                self._chown_tree(target)
            return tree_state(workspace) if whole else None

        mark = await asyncio.to_thread(copy)
        if mark is not None:
            self._workspace_mark = mark

    def workspace_unchanged(self) -> bool:
        """Whether the workspace is exactly as the ``put_dir`` that filled it left it (call it
        when no process of the sandbox runs)."""
        mark = self._workspace_mark
        return mark is not None and tree_state(self.root / "workspace") == mark

    async def put_files(self, files: Mapping[str, bytes]) -> None:
        for path, data in files.items():
            target = self.host_path(path)
            if target.is_relative_to(self.root / "workspace"):
                self._workspace_mark = None
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            if self.owner_uid is not None:
                os.chown(target, self.owner_uid, self.owner_uid)

    async def read_file(self, path: str, *, max_bytes: int) -> bytes | None:
        try:
            fd = os.open(self._host(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            return fh.read(max_bytes + 1)

    async def exists(self, path: str) -> bool:
        return os.path.lexists(self._host(path))


#: The longest a quiet log goes unread while its command runs (``tail_file``).
TAIL_MAX_INTERVAL_S = 10.0


async def tail_file(path: Path, on_output: OutputCallback, finished: asyncio.Event, interval_s: float = 0.1,
                    max_interval_s: float = TAIL_MAX_INTERVAL_S) -> None:
    """Stream what is appended to ``path`` to ``on_output`` until ``finished`` is set, then the
    rest at once (the caller does not wait out an interval). It looks every ``interval_s`` while
    output comes, and backs off to ``max_interval_s`` while none does: an agent waiting on its LLM
    prints nothing, and a thousand of them must not keep the service busy reading empty logs."""
    offset, wait = 0, interval_s
    while True:
        done = finished.is_set()
        before = offset
        with contextlib.suppress(FileNotFoundError):
            with open(path, "rb") as fh:
                fh.seek(offset)
                while chunk := fh.read(65536):
                    offset += len(chunk)
                    on_output(chunk)
        if done:
            return
        wait = interval_s if offset > before else min(wait * 2, max_interval_s)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(finished.wait(), wait)
