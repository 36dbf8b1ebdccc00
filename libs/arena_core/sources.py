"""Task sources: where a task's repository comes from, and how any worker gets its files.

A bundle in JetStream's object store, a git URL + commit, an image, or (embedded only) a host
directory; :class:`SourceCache` makes one a directory tree on this worker, :func:`prepare_workspace`
commits a tree as a fresh repository's only commit. See docs/tasks.md (Sources).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import logging
import os
import posixpath
import re
import stat
import shutil
import subprocess
import tarfile
import tempfile
import uuid
import zlib
from pathlib import Path, PurePosixPath

from arena_core.errors import ArenaError
from arena_core.schemas import BundleSource, GitSource, ImageSource, PathSource, Source

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
#: Transports a git source may use; ``file`` only where host paths are allowed.
GIT_PROTOCOLS = "http:https:git:ssh"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
#: A bundle's unpacked size and member count are bounded (a zip bomb is refused on upload).
MAX_UNPACKED_BYTES = 2 * 1024**3
MAX_MEMBERS = 200_000


class SourceError(ArenaError):
    """A task's source cannot be had here (missing bundle, unreachable repository, bad archive)."""

    code = "invalid_source"
    status = 400


class GitError(RuntimeError):
    """A git step on a workspace failed; the message carries git's output."""


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


def check_bundle(data: bytes) -> int:
    """Refuse what is not a tar (gzipped or not) of safe members within the bounds; the
    number of members."""
    total = count = 0
    links: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for member in tar:
                count += 1
                total += max(member.size, 0)
                if count > MAX_MEMBERS or total > MAX_UNPACKED_BYTES:
                    raise SourceError(f"the bundle unpacks to more than {MAX_MEMBERS} files or "
                                      f"{MAX_UNPACKED_BYTES} bytes")
                problem = unsafe_member(member, links)
                if problem:
                    raise SourceError(f"the bundle holds an unsafe member: {problem}")
                if member.issym():
                    links[posixpath.normpath(member.name)] = member.linkname
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise SourceError(f"the bundle is not a valid tar archive: {exc}") from exc
    return count


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


def safe_extractall(tar: tarfile.TarFile, dest: Path, members: list[tarfile.TarInfo] | None = None) -> None:
    """Extract with tarfile's ``data`` filter (Python >= 3.11.4); on an older 3.11 (Debian 12's
    3.11.2) the same rules checked here: regular files, directories and links only, nothing
    outside ``dest``, no setuid / setgid / sticky bits."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
        return
    root = Path(dest).resolve()
    chosen = members if members is not None else tar.getmembers()

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


def extract_bundle(data: bytes, dest: Path) -> None:
    """Unpack a bundle into ``dest``: regular files, directories and links inside it only
    (tarfile's ``data`` filter: no absolute paths, no ``..``, no devices, no links out)."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            safe_extractall(tar, dest)
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as exc:
        raise SourceError(f"the bundle is not a valid archive: {exc}") from exc


async def bundle_exists(bus, digest: str) -> bool:
    store = await bus.artifacts()
    try:
        info = await store.get_info(bundle_object(digest))
    except Exception:  # noqa: BLE001 - nats raises ObjectNotFoundError / NotFoundError by version
        return False
    return info is not None and not getattr(info, "deleted", False)


async def push_bundle(bus, data: bytes) -> str:
    """Store ``data`` under its digest (once); returns the digest."""
    digest = digest_of(data)
    if not await bundle_exists(bus, digest):
        store = await bus.artifacts()
        await store.put(bundle_object(digest), data)
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


class SourceCache:
    """Source trees on this worker, under ``<dir>/<key>/``: fetched once, read by many jobs.

    ``bus`` reads bundles (``None``: bundles cannot be had); ``allow_paths`` admits
    :class:`PathSource` and ``file://`` git URLs (embedded mode); ``docker_url`` is the
    engine image sources are read from.
    """

    def __init__(self, directory: Path, *, bus=None, allow_paths: bool = False, docker_url: str = ""):
        self.dir = Path(directory)
        self.bus = bus
        self.allow_paths = allow_paths
        self.docker_url = docker_url
        self._locks: dict[str, asyncio.Lock] = {}

    async def tree(self, source: Source | None) -> Path:
        """The source's files as a directory (never modify it). Raises :class:`SourceError`."""
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
        return target

    async def workspace(self, source: Source | None) -> tuple[Path, str] | None:
        """The source committed as a base repository (:func:`prepare_workspace`), made once per
        source on this worker and copied into each sandbox: ``(directory, base sha)``; ``None``
        for a host path (it may change between jobs) or no source. Never modify it."""
        if source is None or isinstance(source, PathSource):
            return None
        key = source_key(source)
        target, base_file = self.dir / f"{key}.workspace", self.dir / f"{key}.base"
        if base_file.is_file() and target.is_dir():
            return target, base_file.read_text()
        tree = await self.tree(source)
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
        return target, base_file.read_text()

    async def bundle_tree(self, digest: str) -> Path:
        return await self.tree(BundleSource(digest=digest))

    async def _fill(self, source: Source, dest: Path) -> None:
        if isinstance(source, BundleSource):
            if self.bus is None:
                raise SourceError("bundles cannot be read here (no connection to Arena's object store)")
            data = await fetch_bundle(self.bus, source.digest)
            await asyncio.to_thread(extract_bundle, data, dest)
        elif isinstance(source, GitSource):
            await asyncio.to_thread(fetch_git, source, dest, allow_file=self.allow_paths)
        elif isinstance(source, ImageSource):
            await asyncio.to_thread(extract_image, source, dest, self.docker_url)
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


def check_git_url(url: str, *, allow_file: bool) -> None:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    allowed = {"http", "https", "git", "ssh"} | ({"file"} if allow_file else set())
    if scheme not in allowed:
        hint = " (file:// needs ARENA_ALLOW_HOST_PATHS)" if scheme == "file" else ""
        raise SourceError(f"git source url {url!r}: scheme must be one of {', '.join(sorted(allowed))}{hint}")


def fetch_git(source: GitSource, dest: Path, *, allow_file: bool = False) -> None:
    """The tree of ``source.commit`` from ``source.url`` into ``dest`` (no ``.git``)."""
    check_git_url(source.url, allow_file=allow_file)
    protocols = GIT_PROTOCOLS + (":file" if allow_file else "")
    env = {"GIT_ALLOW_PROTOCOL": protocols}
    with tempfile.TemporaryDirectory(prefix="arena-git-") as tmp:
        work = Path(tmp)
        try:
            host_git(["init", "-q", "--bare"], work, env=env)
            try:  # one commit, shallow: servers allow a reachable sha (protocol v2)
                host_git(["fetch", "-q", "--depth", "1", "--no-tags", source.url, source.commit], work, env=env)
                commit = "FETCH_HEAD"
            except GitError:  # older servers, or an abbreviated sha: everything, then resolve
                host_git(["fetch", "-q", "--no-tags", source.url, "+refs/*:refs/fetched/*"], work, env=env)
                commit = source.commit
            sha = host_git(["rev-parse", "--verify", "--end-of-options", f"{commit}^{{commit}}"], work).strip()
            if not sha.startswith(source.commit):
                raise SourceError(f"git source: fetched {sha}, not commit {source.commit}")
            archive = work / "tree.tar"
            # --worktree-attributes in a bare repository: the tree's own .gitattributes
            # (export-ignore, export-subst) do not change what is archived
            host_git(["archive", "--worktree-attributes", "--format=tar", "-o", str(archive), sha], work)
        except GitError as exc:
            raise SourceError(f"git source {source.url} @ {source.commit}: {exc}") from exc
        _extract(archive, dest, what=f"git source {source.url} @ {source.commit}")


def _extract(archive: Path, dest: Path, *, what: str) -> None:
    try:
        with tarfile.open(archive) as tar:
            safe_extractall(tar, dest)
    except (tarfile.TarError, OSError) as exc:
        raise SourceError(f"{what}: cannot unpack it here: {exc}") from exc


def extract_image(source: ImageSource, dest: Path, docker_url: str) -> None:
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
        with tempfile.TemporaryFile() as fh:
            for chunk in stream:
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
                    safe_extractall(tar, dest, members)
                except (tarfile.TarError, OSError) as exc:
                    raise SourceError(f"image source {source.image}:{source.path}: {exc}") from exc
    finally:
        if container is not None:
            try:
                container.remove(force=True)
            except Exception:  # noqa: BLE001 - best effort
                pass
        client.close()
