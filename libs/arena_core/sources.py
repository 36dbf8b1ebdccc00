"""Task sources: where a task's repository comes from, and how any worker gets its files.

A bundle in JetStream's object store, a git URL + commit, an image, or (embedded only) a host
directory; :class:`SourceCache` makes one a directory tree on this worker, :func:`prepare_workspace`
commits a tree as a fresh repository's only commit. See docs/tasks.md (Sources).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import gzip
import hashlib
import io
import ipaddress
import logging
import os
import posixpath
import re
import stat
import shutil
import socket
import subprocess
import tarfile
import tempfile
import uuid
import time
import zlib
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from arena_core.errors import ArenaError
from arena_core.schemas import DEFAULT_PROJECT, BundleSource, GitSource, ImageSource, PathSource, Source

log = logging.getLogger("arena_core.sources")

#: Objects in the ``arena_artifacts`` store: ``bundles/sha256:<hex>``.
BUNDLE_PREFIX = "bundles/"
#: Git identity and dates of every base commit: the same tree gives the same sha anywhere.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "arena",
    "GIT_AUTHOR_EMAIL": "arena@localhost",
    "GIT_COMMITTER_NAME": "arena",
    "GIT_COMMITTER_EMAIL": "arena@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
GIT_TIMEOUT_S = 600.0
#: Transports a git source may ever use (``ARENA_GIT_ALLOWED_SCHEMES`` picks among them);
#: ``file`` only where host paths are allowed.
GIT_SCHEMES = frozenset({"https", "http", "ssh", "git"})
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
#: What one source may unpack to, by default (``ARENA_MAX_BUNDLE_UNPACKED_BYTES``,
#: ``ARENA_MAX_BUNDLE_FILES``): a decompression bomb is refused on upload, and never unpacked
#: past it by a worker.
MAX_UNPACKED_BYTES = 512 * 1024**2
MAX_MEMBERS = 50_000


@dataclasses.dataclass(frozen=True)
class UnpackLimits:
    """The most one archive may unpack to: bytes (the members' declared sizes, which are what
    tarfile writes) and members."""

    max_bytes: int = MAX_UNPACKED_BYTES
    max_files: int = MAX_MEMBERS


@dataclasses.dataclass(frozen=True)
class GitPolicy:
    """Where a git source may be fetched from (``ARENA_GIT_ALLOWED_SCHEMES``,
    ``ARENA_GIT_ALLOWED_HOSTS``, ``ARENA_GIT_ALLOW_PRIVATE_HOSTS``; docs/tasks.md): its scheme,
    its host (an empty ``hosts``: any; else exact names or ``*.suffix``), and every address
    the host resolves to public unless ``allow_private`` (loopback, link-local, private,
    shared and reserved ranges are refused: a task must not reach what listens on the
    worker's machine or network)."""

    schemes: frozenset[str] = frozenset({"https"})
    hosts: tuple[str, ...] = ()
    allow_private: bool = False


def unpack_limits(settings) -> UnpackLimits:
    """:class:`UnpackLimits` of ``settings`` (an ``arena_core.settings.Settings``)."""
    return UnpackLimits(max_bytes=settings.max_bundle_unpacked_bytes, max_files=settings.max_bundle_files)


def git_policy(settings) -> GitPolicy:
    """:class:`GitPolicy` of ``settings`` (an ``arena_core.settings.Settings``)."""
    return GitPolicy(
        schemes=frozenset(s.strip().lower() for s in settings.git_allowed_schemes.split(",") if s.strip()),
        hosts=tuple(h.strip() for h in settings.git_allowed_hosts.split(",") if h.strip()),
        allow_private=settings.git_allow_private_hosts,
    )


class SourceError(ArenaError):
    """A task's source cannot be had here (missing bundle, unreachable repository, bad archive)."""

    code = "invalid_source"
    status = 400


class BundleTooLarge(SourceError):
    """An archive unpacks to more than its :class:`UnpackLimits`."""

    code = "payload_too_large"
    status = 413


class GitError(RuntimeError):
    """A git step on a workspace failed; the message carries git's output."""


class DiffTooLarge(GitError):
    """The agent's diff is larger than the limit (``ARENA_MAX_DIFF_BYTES``): its size in bytes
    and its first ``limit`` bytes (kept as the artifact ``diff.truncated``)."""

    def __init__(self, size: int, limit: int, head: bytes):
        super().__init__(f"the agent's diff is {_mib(size)}, over the {_mib(limit)} limit (ARENA_MAX_DIFF_BYTES)")
        self.size, self.limit, self.head = size, limit, head


class BoundedBytes:
    """A command's output as it streams: the first ``limit`` bytes kept (``None``: all), the
    rest only counted, so memory stays bounded however much the command writes."""

    def __init__(self, limit: int | None = None):
        self.limit, self.size, self._kept = limit, 0, 0
        self._parts: list[bytes] = []

    def __call__(self, chunk: bytes) -> None:
        self.size += len(chunk)
        room = len(chunk) if self.limit is None else self.limit - self._kept
        if room > 0:
            part = chunk[:room]
            self._parts.append(part)
            self._kept += len(part)

    def data(self) -> bytes:
        return b"".join(self._parts)

    def diff(self) -> str:
        """The output as a diff's text (not UTF-8 text files are the one lossy case: a diff is a
        str on the wire); :class:`DiffTooLarge` if it was over the limit."""
        if self.limit is not None and self.size > self.limit:
            raise DiffTooLarge(self.size, self.limit, self.data())
        return self.data().decode("utf-8", errors="replace")


_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s'\"]*@")
_SECRET_PARAM = re.compile(r"(?i)([?&;](?:access_token|private_token|oauth_token|token|password|passwd|secret|"
                           r"api_key|apikey|key|auth|sig|signature)=)[^&;\s'\"#]*")


def redact(text: str) -> str:
    """``text`` with the credentials of any URL in it hidden: user info (``user:password@``,
    ``token@``) and secret-looking query parameters become ``***``. Every message about a git
    source goes through it: a reason or a log line is read by more people than the task."""
    return _SECRET_PARAM.sub(r"\1***", _URL_USERINFO.sub(r"\1***@", text))


# --------------------------------------------------------------------------- bundles


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def bundle_object(digest: str) -> str:
    return BUNDLE_PREFIX + digest


def pack_dir(path: Path) -> bytes:
    """``path`` as a gzipped tar, byte-for-byte reproducible (sorted, no times or owners,
    no ``.git``): the same directory always has the same digest. Every name of a
    hard-linked file is stored as a file of its own."""
    path = Path(path)
    if not path.is_dir():
        raise SourceError(f"{path} is not a directory")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            rel_dir = Path(dirpath).relative_to(path)
            for name in sorted([*dirnames, *filenames]):
                full = Path(dirpath) / name
                st = full.lstat()
                info = tarfile.TarInfo(str(rel_dir / name))
                if stat.S_ISLNK(st.st_mode):
                    info.type, info.linkname, info.mode = tarfile.SYMTYPE, os.readlink(full), 0o777
                    tar.addfile(info)
                elif stat.S_ISDIR(st.st_mode):
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                elif stat.S_ISREG(st.st_mode):
                    info.size, info.mode = st.st_size, 0o755 if st.st_mode & 0o111 else 0o644
                    with open(full, "rb") as fh:
                        tar.addfile(info, fh)
                # sockets, fifos, devices: not part of a source tree
    return gzip.compress(raw.getvalue(), compresslevel=6, mtime=0)


def check_bundle(data: bytes, limits: UnpackLimits = UnpackLimits()) -> int:
    """Refuse what is not a tar (gzipped or not) of safe members within ``limits``
    (:class:`BundleTooLarge`, as soon as the headers read so far pass them: a bomb is not
    decompressed further); the number of members."""
    bounds = _Bounds(limits, "the bundle")
    links: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for member in tar:
                bounds.add(member)
                problem = unsafe_member(member, links)
                if problem:
                    raise SourceError(f"the bundle holds an unsafe member: {problem}")
                if member.issym():
                    links[posixpath.normpath(member.name)] = member.linkname
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise SourceError(f"the bundle is not a valid tar archive: {exc}") from exc
    return bounds.files


def _mib(n: int) -> str:
    return f"{n / 1024**2:,.1f} MiB" if n < 1024**3 else f"{n / 1024**3:,.2f} GiB"


class _Bounds:
    """Running totals of an archive's members against :class:`UnpackLimits`."""

    def __init__(self, limits: UnpackLimits, what: str):
        self.limits, self.what, self.files, self.bytes = limits, what, 0, 0

    def add(self, member: tarfile.TarInfo) -> None:
        self.files += 1
        self.bytes += max(member.size, 0)
        if self.files > self.limits.max_files:
            raise BundleTooLarge(f"{self.what} holds more than {self.limits.max_files:,} files, over this "
                                 "server's limit (ARENA_MAX_BUNDLE_FILES)")
        if self.bytes > self.limits.max_bytes:
            raise BundleTooLarge(f"{self.what} unpacks to more than {_mib(self.limits.max_bytes)} (at least "
                                 f"{_mib(self.bytes)} so far), over this server's limit "
                                 "(ARENA_MAX_BUNDLE_UNPACKED_BYTES)")


def unsafe_member(member: tarfile.TarInfo, links: dict[str, str]) -> str:
    """Why ``member`` may not be unpacked ("" if it may): an absolute name, a name or a link
    that leads out of the tree (following the links seen before it), a device."""
    name = member.name
    if name.startswith("/") or ".." in PurePosixPath(name).parts:
        return f"{name!r} is not a path inside the bundle"
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        return f"{name!r} is not a file, directory or link"
    if resolve_inside(posixpath.dirname(posixpath.normpath(name)), links) is None:
        return f"{name!r} lies behind a link out of the bundle"
    if member.issym() or member.islnk():
        target = member.linkname
        if target.startswith("/"):
            return f"{name!r} links to an absolute path"
        base = posixpath.dirname(posixpath.normpath(name)) if member.issym() else ""
        if resolve_inside(posixpath.join(base, target), links) is None:
            return f"{name!r} links out of the bundle"
    return ""


def resolve_inside(path: str, links: dict[str, str], depth: int = 0) -> str | None:
    """``path`` (relative to the tree) with the tree's links followed, or ``None`` if it
    leaves the tree (or the links loop)."""
    if depth > 40:
        return None
    done: list[str] = []
    parts = [p for p in path.split("/") if p not in ("", ".")]
    while parts:
        part = parts.pop(0)
        if part == "..":
            if not done:
                return None
            done.pop()
            continue
        here = "/".join([*done, part])
        if here in links:
            target = links[here]
            if target.startswith("/"):
                return None
            resolved = resolve_inside("/".join([*done, target]), links, depth + 1)
            if resolved is None:
                return None
            done = [p for p in resolved.split("/") if p]
            continue
        done.append(part)
    return "/".join(done)


def safe_extractall(tar: tarfile.TarFile, dest: Path, members: list[tarfile.TarInfo] | None = None,
                    limits: UnpackLimits | None = None, what: str = "the archive") -> None:
    """Extract with tarfile's ``data`` filter (Python >= 3.11.4); on an older 3.11 (Debian 12's
    3.11.2) the same rules checked here: regular files, directories and links only, nothing
    outside ``dest``, no setuid / setgid / sticky bits.

    With ``limits``, every member's header is read (the archive decompressed, nothing written)
    and the totals checked before the first byte lands: :class:`BundleTooLarge`, and nothing
    of a bomb is on the disk."""
    chosen = members if members is not None else tar.getmembers()
    if limits is not None:
        bounds = _Bounds(limits, what)
        for member in chosen:
            bounds.add(member)
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=chosen, filter="data")
        return
    root = Path(dest).resolve()

    def inside(path: Path) -> bool:
        return path == root or root in path.parents

    for member in chosen:
        member.name = member.name.lstrip("/")  # as the data filter: absolute names land inside
        target = (root / member.name).resolve()
        if not inside(target):
            raise tarfile.TarError(f"{member.name!r} would land outside the destination")
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise tarfile.TarError(f"{member.name!r} is not a file, directory or link")
        if member.issym() and not inside((target.parent / member.linkname).resolve()):
            raise tarfile.TarError(f"{member.name!r} links outside the destination")
        if member.islnk() and not inside((root / member.linkname).resolve()):
            raise tarfile.TarError(f"{member.name!r} links outside the destination")
        if member.isfile() or member.isdir():
            member.mode &= 0o755
    tar.extractall(dest, members=chosen)


def extract_bundle(data: bytes, dest: Path, limits: UnpackLimits = UnpackLimits()) -> None:
    """Unpack a bundle into ``dest``: regular files, directories and links inside it only
    (tarfile's ``data`` filter: no absolute paths, no ``..``, no devices, no links out), within
    ``limits`` (a bundle stored before them is refused here, before anything is written)."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            safe_extractall(tar, dest, limits=limits, what="the bundle")
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise SourceError(f"the bundle is not a valid archive: {exc}") from exc


#: A bundle belongs to the projects that uploaded it: a marker object per project
#: (``bundle-projects/{project}/{digest}``). A bundle object stored before projects existed has
#: no :data:`MARKED` description and belongs to the ``default`` project (docs/projects.md).
BUNDLE_PROJECTS = "bundle-projects/"
MARKED = "arena bundle; its projects are marked"


def project_marker(project: str, digest: str) -> str:
    return f"{BUNDLE_PROJECTS}{project}/{digest}"


async def _info(store, name: str):
    try:
        info = await store.get_info(name)
    except Exception:  # noqa: BLE001 - nats raises ObjectNotFoundError / NotFoundError by version
        return None
    return None if info is None or getattr(info, "deleted", False) else info


async def bundle_exists(bus, digest: str, project: str | None = None) -> bool:
    """Whether the bundle is stored; with ``project``, stored for that project (one that did not
    upload it does not see it)."""
    store = await bus.artifacts()
    info = await _info(store, bundle_object(digest))
    if info is None or project is None:
        return info is not None
    if info.description != MARKED and project == DEFAULT_PROJECT:
        return True  # stored before projects: the default project's
    return await _info(store, project_marker(project, digest)) is not None


async def push_bundle(bus, data: bytes, project: str = DEFAULT_PROJECT) -> str:
    """Store ``data`` under its digest (once), marked as ``project``'s; returns the digest."""
    from nats.js.api import ObjectMeta

    digest = digest_of(data)
    store = await bus.artifacts()
    if await _info(store, bundle_object(digest)) is None:
        await store.put(bundle_object(digest), data, meta=ObjectMeta(name=bundle_object(digest), description=MARKED))
    marker = project_marker(project, digest)
    if await _info(store, marker) is None:
        await store.put(marker, b"")
    return digest


async def fetch_bundle(bus, digest: str) -> bytes:
    store = await bus.artifacts()
    try:
        result = await store.get(bundle_object(digest))
    except Exception as exc:  # noqa: BLE001 - not found, or the store is unreachable
        raise SourceError(f"bundle {digest} is not in Arena's object store ({type(exc).__name__})") from exc
    data = bytes(result.data or b"")
    if digest_of(data) != digest:
        raise SourceError(f"bundle {digest}: the stored bytes do not match their digest")
    return data


# --------------------------------------------------------------------------- workspaces


def host_git(args: list[str], cwd: Path, *, env: dict[str, str] | None = None, timeout: float = GIT_TIMEOUT_S) -> str:
    """git on the host with no user or system config (only on trees no agent touched)."""
    full_env = {
        "PATH": "/usr/bin:/bin:/usr/local/bin",
        "HOME": str(cwd),
        "LANG": "C.UTF-8",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        **GIT_IDENTITY,
        **(env or {}),
    }
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, env=full_env, capture_output=True, check=False,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise GitError(f"git {' '.join(args[:2])} timed out after {timeout:g}s") from exc
    if proc.returncode != 0:
        raise GitError(f"git {' '.join(args)} failed: {proc.stderr.decode(errors='replace').strip()[-2000:]}")
    return proc.stdout.decode()


def prepare_workspace(repo: Path, dest: Path) -> str:
    """Copy the tree ``repo`` to ``dest`` and commit it as the only commit of a new repository.

    Any ``.git`` in ``repo`` is left out, so the agent's copy has no history, refs, tags,
    remotes, reflog or replace objects beyond the base. Returns the base commit sha
    (deterministic: fixed identity and dates).
    """
    repo = Path(repo)
    if not repo.is_dir():
        raise FileNotFoundError(f"task repository {repo} is not a directory")
    shutil.copytree(repo, dest, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    # no template: its sample hooks and description would be copied into, and removed from, every sandbox
    host_git(["-c", "init.defaultBranch=main", "init", "-q", "--template="], dest)
    (dest / ".git" / "hooks").mkdir()
    host_git(["add", "-A"], dest)
    host_git(["-c", "commit.gpgsign=false", "-c", "core.logAllRefUpdates=false", "commit", "-q", "--no-verify",
              "--allow-empty", "-m", "base"], dest)
    (dest / ".git" / "COMMIT_EDITMSG").unlink(missing_ok=True)
    return host_git(["rev-parse", "HEAD"], dest).strip()


# --------------------------------------------------------------------------- the cache


class Lease:
    """The cached sources one job uses: none of them is evicted while it is held. A shared
    ``flock`` on ``<key>.lock`` per source (so other processes sharing the directory see it
    too); taking it marks the source used now (the lock file's mtime orders eviction).
    Release it (or leave its ``async with``) once nothing reads the trees any more."""

    def __init__(self, directory: Path):
        self.dir = directory
        self._fds: dict[str, int] = {}

    async def hold(self, key: str) -> None:
        if key in self._fds:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            # an eviction holds it exclusively only while it renames the trees away: short
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_SH)
            os.utime(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fds[key] = fd

    def held(self) -> set[str]:
        return set(self._fds)

    def release(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)  # closing it drops the lock

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()


class SourceCache:
    """Source trees on this worker, under ``<dir>/<key>/``: fetched once, read by many jobs.

    ``bus`` reads bundles (``None``: bundles cannot be had); ``allow_paths`` admits
    :class:`PathSource` and ``file://`` git URLs (embedded mode); ``docker_url`` is the
    engine image sources are read from; ``limits`` bound what one source unpacks to;
    ``git`` says where git sources may come from. ``budget_bytes`` bounds the disk the cache
    takes (``ARENA_SOURCE_CACHE_BYTES``): after each fill, the sources used least recently
    are evicted until it fits, never one a :class:`Lease` holds (0: no bound).
    """

    def __init__(self, directory: Path, *, bus=None, allow_paths: bool = False, docker_url: str = "",
                 limits: UnpackLimits = UnpackLimits(), git: GitPolicy = GitPolicy(), budget_bytes: int = 0):
        self.dir = Path(directory)
        self.bus = bus
        self.allow_paths = allow_paths
        self.docker_url = docker_url
        self.limits = limits
        self.git = git
        self.budget_bytes = budget_bytes
        self._locks: dict[str, asyncio.Lock] = {}
        self._sizes: dict[tuple[str, ...], int] = {}  # an entry's paths -> its bytes on disk
        self._evicting = asyncio.Lock()

    def lease(self) -> Lease:
        """Hold the sources a job asks for (pass it to :meth:`tree`, :meth:`workspace`)."""
        return Lease(self.dir)

    async def tree(self, source: Source | None, lease: Lease | None = None) -> Path:
        """The source's files as a directory (never modify it); held by ``lease`` (without
        one it may be evicted as soon as this returns). Raises :class:`SourceError`."""
        if source is None:
            raise SourceError("the task has no source (set task.source)")
        if isinstance(source, PathSource):
            if not self.allow_paths:
                raise SourceError("host paths are not accepted here (ARENA_ALLOW_HOST_PATHS is off); "
                                  "push the directory as a bundle (arena tasks push)")
            path = Path(source.path)
            if not path.is_dir():
                raise SourceError(f"task repository {path} is not a directory")
            return path
        key = source_key(source)
        if lease is not None:
            await lease.hold(key)
        target = self.dir / key
        if target.is_dir():
            return target
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if target.is_dir():
                return target
            tmp = self.dir / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir(parents=True)
            try:
                await self._fill(source, tmp)
                _into_place(tmp, target)
            finally:
                await asyncio.to_thread(shutil.rmtree, tmp, True)
        await self.evict(keep={key})
        return target

    async def workspace(self, source: Source | None, lease: Lease | None = None) -> tuple[Path, str] | None:
        """The source committed as a base repository (:func:`prepare_workspace`), made once per
        source on this worker and copied into each sandbox: ``(directory, base sha)``; ``None``
        for a host path (it may change between jobs) or no source. Never modify it; held by
        ``lease`` as :meth:`tree`."""
        if source is None or isinstance(source, PathSource):
            return None
        key = source_key(source)
        if lease is not None:
            await lease.hold(key)
        target, base_file = self.dir / f"{key}.workspace", self.dir / f"{key}.base"
        if base_file.is_file() and target.is_dir():
            return target, base_file.read_text()
        tree = await self.tree(source, lease)
        async with self._locks.setdefault(f"{key}.workspace", asyncio.Lock()):
            if not (base_file.is_file() and target.is_dir()):
                tmp = self.dir / f".tmp-{key}-ws-{uuid.uuid4().hex[:8]}"
                try:
                    base = await asyncio.to_thread(prepare_workspace, tree, tmp)
                    # the base commit is deterministic: whoever writes it first writes the same sha
                    staged = base_file.with_name(f".tmp-{uuid.uuid4().hex[:8]}.base")
                    staged.write_text(base)
                    staged.replace(base_file)
                    _into_place(tmp, target)
                finally:
                    await asyncio.to_thread(shutil.rmtree, tmp, True)
        await self.evict(keep={key})
        return target, base_file.read_text()

    async def bundle_tree(self, digest: str, lease: Lease | None = None) -> Path:
        return await self.tree(BundleSource(digest=digest), lease)

    async def evict(self, keep: set[str] = frozenset()) -> list[str]:
        """Evict the least recently used sources until the cache fits its budget; never one in
        ``keep`` or held by a lease (of any process). The keys evicted."""
        if self.budget_bytes <= 0:
            return []
        async with self._evicting:
            return await asyncio.to_thread(self._evict, set(keep))

    def usage(self) -> int:
        """Bytes on disk of the cached sources (as the budget counts them)."""
        return sum(self._size(paths) for paths in self._entries().values())

    def _entries(self) -> dict[str, tuple[str, ...]]:
        entries: dict[str, list[str]] = {}
        if not self.dir.is_dir():
            return {}
        for path in self.dir.iterdir():
            name = path.name
            if name.startswith(".tmp-") or name.endswith(".lock"):
                continue
            key = name.removesuffix(".workspace").removesuffix(".base")
            entries.setdefault(key, []).append(name)
        return {key: tuple(sorted(names)) for key, names in entries.items()}

    def _size(self, names: tuple[str, ...]) -> int:
        if names not in self._sizes:
            self._sizes[names] = sum(_disk_usage(self.dir / name) for name in names)
        return self._sizes[names]

    def _last_used(self, key: str) -> float:
        try:
            return (self.dir / f"{key}.lock").stat().st_mtime
        except OSError:
            return 0.0

    def _evict(self, keep: set[str]) -> list[str]:
        entries = self._entries()
        total = sum(self._size(names) for names in entries.values())
        evicted: list[str] = []
        for key in sorted(entries, key=self._last_used):
            if total <= self.budget_bytes:
                break
            if key in keep:
                continue
            fd = os.open(self.dir / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # in use by a job (here or in another process)
                doomed = []
                for name in entries[key]:
                    away = self.dir / f".tmp-evict-{uuid.uuid4().hex[:8]}"
                    try:
                        (self.dir / name).rename(away)
                        doomed.append(away)
                    except FileNotFoundError:
                        pass
            finally:
                os.close(fd)
            for away in doomed:
                if away.is_dir():
                    shutil.rmtree(away, ignore_errors=True)
                else:
                    away.unlink(missing_ok=True)
            total -= self._sizes.pop(entries[key], 0)
            evicted.append(key)
            log.info("evicted source %s from the cache (now %s of %s)", key, _mib(total), _mib(self.budget_bytes))
        return evicted

    async def _fill(self, source: Source, dest: Path) -> None:
        if isinstance(source, BundleSource):
            if self.bus is None:
                raise SourceError("bundles cannot be read here (no connection to Arena's object store)")
            data = await fetch_bundle(self.bus, source.digest)
            await asyncio.to_thread(extract_bundle, data, dest, self.limits)
        elif isinstance(source, GitSource):
            await asyncio.to_thread(fetch_git, source, dest, allow_file=self.allow_paths, policy=self.git,
                                    limits=self.limits)
        elif isinstance(source, ImageSource):
            await asyncio.to_thread(extract_image, source, dest, self.docker_url, self.limits)
        else:
            raise SourceError(f"unsupported source {type(source).__name__}")

    def reap(self) -> None:
        """Remove half-filled trees a crash left behind."""
        if self.dir.is_dir():
            for path in self.dir.glob(".tmp-*"):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)


def _disk_usage(path: Path) -> int:
    """Bytes ``path`` takes on disk (allocated blocks; links not followed)."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    total = st.st_blocks * 512
    if stat.S_ISDIR(st.st_mode):
        for dirpath, dirnames, filenames in os.walk(path):
            for name in [*dirnames, *filenames]:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    pass
    return total


def _into_place(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``, unless another process of this worker made it first."""
    try:
        tmp.rename(target)
    except OSError:
        if not target.is_dir():
            raise


def source_key(source: Source) -> str:
    if isinstance(source, BundleSource):
        return "bundle-" + source.digest.split(":", 1)[1]
    if isinstance(source, GitSource):
        return "git-" + hashlib.sha256(f"{source.url}\0{source.commit}".encode()).hexdigest()
    if isinstance(source, ImageSource):
        return "image-" + hashlib.sha256(f"{source.image}\0{source.path}".encode()).hexdigest()
    raise SourceError(f"no cache key for {type(source).__name__}")


_DEFAULT_PORTS = {"https": 443, "http": 80, "ssh": 22, "git": 9418}


def _host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if entry.startswith("*.") and host.endswith(entry[1:]) and host != entry[2:]:
            return True
        if host == entry:
            return True
    return False


def check_git_url(url: str, *, allow_file: bool, policy: GitPolicy = GitPolicy(),
                  resolve: bool = True) -> list[str]:
    """Refuse a git URL outside ``policy`` (its scheme, its host, and, with ``resolve``, every
    address the host resolves to); the addresses (``[]`` for ``file://`` or without
    ``resolve``). Messages never hold the URL's credentials."""
    shown = redact(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "file":
        if not allow_file:
            raise SourceError(f"git source url {shown!r}: file:// needs ARENA_ALLOW_HOST_PATHS")
        return []
    if scheme not in policy.schemes or scheme not in GIT_SCHEMES:
        raise SourceError(f"git source url {shown!r}: scheme must be one of {', '.join(sorted(policy.schemes))} "
                          "(ARENA_GIT_ALLOWED_SCHEMES)")
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or _DEFAULT_PORTS[scheme]
    except ValueError as exc:
        raise SourceError(f"git source url {shown!r} is not a valid URL ({redact(str(exc))})") from None
    if not host:
        raise SourceError(f"git source url {shown!r} names no host")
    if policy.hosts and not _host_allowed(host, policy.hosts):
        raise SourceError(f"git source url {shown!r}: host {host} is not one this server fetches from "
                          "(ARENA_GIT_ALLOWED_HOSTS)")
    if not resolve:  # an address written in the URL is checked all the same
        try:
            literal = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return []
        _check_public(str(literal), host, shown, policy)
        return []
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise SourceError(f"git source url {shown!r}: cannot resolve host {host} ({exc})") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    for address in addresses:
        _check_public(address, host, shown, policy)
    return addresses


def _check_public(address: str, host: str, shown: str, policy: GitPolicy) -> None:
    if policy.allow_private:
        return
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    ip = getattr(ip, "ipv4_mapped", None) or ip
    if not ip.is_global:
        raise SourceError(f"git source url {shown!r}: host {host} is at {ip}, not a public address "
                          "(loopback, link-local and private hosts are refused: ARENA_GIT_ALLOW_PRIVATE_HOSTS)")


def fetch_git(source: GitSource, dest: Path, *, allow_file: bool = False, policy: GitPolicy = GitPolicy(),
              limits: UnpackLimits = UnpackLimits()) -> None:
    """The tree of ``source.commit`` from ``source.url`` into ``dest`` (no ``.git``), from
    where ``policy`` allows only (over http(s) git connects to the addresses checked, no
    redirects followed), within ``limits``. Errors never hold the URL's credentials."""
    shown = redact(source.url)
    addresses = check_git_url(source.url, allow_file=allow_file, policy=policy)
    schemes = sorted(policy.schemes & GIT_SCHEMES) + (["file"] if allow_file else [])
    env = {"GIT_ALLOW_PROTOCOL": ":".join(schemes)}
    pin = ["-c", "http.followRedirects=false"]
    parts = urlsplit(source.url)
    if addresses and parts.scheme.lower() in ("http", "https"):
        port = parts.port or _DEFAULT_PORTS[parts.scheme.lower()]
        shown_addresses = ",".join(f"[{a}]" if ":" in a else a for a in addresses)
        pin += ["-c", f"http.curloptResolve={parts.hostname}:{port}:{shown_addresses}"]
    with tempfile.TemporaryDirectory(prefix="arena-git-") as tmp:
        work = Path(tmp)
        try:
            host_git(["init", "-q", "--bare"], work, env=env)
            try:  # one commit, shallow: servers allow a reachable sha (protocol v2)
                host_git([*pin, "fetch", "-q", "--depth", "1", "--no-tags", source.url, source.commit], work, env=env)
                commit = "FETCH_HEAD"
            except GitError:  # older servers, or an abbreviated sha: everything, then resolve
                host_git([*pin, "fetch", "-q", "--no-tags", source.url, "+refs/*:refs/fetched/*"], work, env=env)
                commit = source.commit
            sha = host_git(["rev-parse", "--verify", "--end-of-options", f"{commit}^{{commit}}"], work).strip()
            if not sha.startswith(source.commit):
                raise SourceError(f"git source: fetched {sha}, not commit {source.commit}")
            _check_git_tree(work, sha, limits, what=f"git source {shown} @ {source.commit}")
            archive = work / "tree.tar"
            # --worktree-attributes in a bare repository: the tree's own .gitattributes
            # (export-ignore, export-subst) do not change what is archived
            host_git(["archive", "--worktree-attributes", "--format=tar", "-o", str(archive), sha], work)
        except GitError as exc:
            raise SourceError(redact(f"git source {shown} @ {source.commit}: {exc}")) from exc
        _extract(archive, dest, what=f"git source {shown} @ {source.commit}", limits=limits)


def _check_git_tree(work: Path, sha: str, limits: UnpackLimits, *, what: str) -> None:
    """Refuse a commit whose tree is over ``limits`` before it is archived (its blobs' sizes,
    from git's objects: nothing is written)."""
    bounds = _Bounds(limits, what)
    listing = host_git(["ls-tree", "-r", "-l", "-z", "--full-tree", sha], work)
    for entry in listing.split("\0"):
        if not entry:
            continue
        size = entry.split("\t", 1)[0].split()[-1]
        member = tarfile.TarInfo()
        member.size = int(size) if size.isdigit() else 0
        bounds.add(member)


def _extract(archive: Path, dest: Path, *, what: str, limits: UnpackLimits | None = None) -> None:
    try:
        with tarfile.open(archive) as tar:
            safe_extractall(tar, dest, limits=limits, what=what)
    except (tarfile.TarError, OSError) as exc:
        raise SourceError(f"{what}: cannot unpack it here: {exc}") from exc


def extract_image(source: ImageSource, dest: Path, docker_url: str, limits: UnpackLimits | None = None) -> None:
    """The directory ``source.path`` of ``source.image`` into ``dest`` (its ``.git`` dropped),
    read from a created, never started, container."""
    try:
        import docker  # the docker SDK; any Docker-API engine (Podman's too)
    except ImportError as exc:  # pragma: no cover - a dependency of arena
        raise SourceError("image sources need the docker SDK") from exc
    try:
        client = docker.DockerClient(base_url=docker_url) if docker_url else docker.from_env()
    except docker.errors.DockerException as exc:
        raise SourceError(f"image source {source.image}: no container engine ({exc})") from exc
    container = None
    try:
        try:
            container = client.containers.create(source.image, command=["true"], network_disabled=True)
            stream, _ = container.get_archive(source.path)
        except docker.errors.ImageNotFound as exc:
            raise SourceError(f"image source: image {source.image} is not present on this engine") from exc
        except docker.errors.APIError as exc:
            raise SourceError(f"image source {source.image}:{source.path}: {exc.explanation or exc}") from exc
        # the tar's own framing (headers, padding) over the members' bytes: at most ~1 KiB each
        cap = None if limits is None else limits.max_bytes + 1024 * limits.max_files + 1024**2
        with tempfile.TemporaryFile() as fh:
            written = 0
            for chunk in stream:
                written += len(chunk)
                if cap is not None and written > cap:
                    raise BundleTooLarge(f"image source {source.image}:{source.path} is larger than "
                                         f"{_mib(limits.max_bytes)} (ARENA_MAX_BUNDLE_UNPACKED_BYTES)")
                fh.write(chunk)
            fh.seek(0)
            with tarfile.open(fileobj=fh) as tar:
                top = Path(source.path.rstrip("/")).name
                members = []
                for member in tar.getmembers():
                    parts = Path(member.name).parts
                    if not parts or parts[0] != top or len(parts) == 1 or parts[1] == ".git":
                        continue
                    member.name = str(Path(*parts[1:]))
                    members.append(member)
                try:
                    safe_extractall(tar, dest, members, limits=limits, what=f"image source {source.image}")
                except (tarfile.TarError, OSError) as exc:
                    raise SourceError(f"image source {source.image}:{source.path}: {exc}") from exc
    finally:
        if container is not None:
            try:
                container.remove(force=True)
            except Exception:  # noqa: BLE001 - best effort
                pass
        client.close()
