"""A local sandbox's workspace as an overlay of a read-only base (the kernel's overlayfs).

The base (a source's committed repository, cached once per worker) is the lower layer; what the
agent writes, creates, renames or deletes goes to a per-sandbox upper directory (deletions as
whiteouts), so the base is never copied into a sandbox nor modified by one, and removing the
sandbox removes only what it changed. The overlay is mounted in the sandbox's own mount namespace
(the gate's, before bwrap), never in the service's: the service's mount table stays the same size
however many sandboxes live, and :class:`Merged` is the service's own view of the workspace. Needs
CAP_SYS_ADMIN (a service run as root); where a mount is refused, the provider copies the base as
before. See docs/sandbox.md ("Performance").
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

_MNT_DETACH = 2
_MS_NOSUID = 2
_MS_NODEV = 4
#: A path the overlay's option string cannot carry as it is (its separators, escapes).
_UNSAFE = (",", ":", "\\", "\n")
_OCTAL = re.compile(r"\\([0-7]{3})")


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def usable_path(path: Path) -> bool:
    """Whether ``path`` can be a layer of a mount: absolute, none of the option string's separators."""
    text = str(path)
    return os.path.isabs(text) and not any(c in text for c in _UNSAFE)


def unmount(target: Path) -> None:
    """Detach the mount at ``target`` (lazily: a process still using it keeps its view); no error
    when nothing is mounted there."""
    if _libc().umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
            raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mounts() -> list[tuple[str, str]]:
    """This process's mounts (its mount namespace's), each as (mount point, file system type),
    from ``/proc/self/mountinfo``."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
        for line in fh:
            fields = line.split()
            # mount point is the 5th field; the type follows the "-" that ends the optional fields
            out.append((_unescape(fields[4]), fields[fields.index("-", 6) + 1]))
    return out


def mounts_under(top: Path) -> list[Path]:
    """Mount points at or below ``top`` in this process's mount namespace, deepest first."""
    prefix = os.path.realpath(top)
    found = [Path(point) for point, _ in mounts() if point == prefix or point.startswith(prefix.rstrip("/") + "/")]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in octal (``\\040``)."""
    return _OCTAL.sub(lambda m: chr(int(m[1], 8)), field)


# --------------------------------------------------------------------------- mounted per sandbox

#: The gate (the sandbox's first process, :mod:`.local`) given a layer triple: a mount namespace
#: of its own with the overlay mounted at the workspace, then bwrap. The service's own namespace
#: never holds a sandbox's mount, so each new sandbox copies (and detaches) a mount table of a
#: constant size, not one that grows with the live sandboxes. Exit 125 when the kernel refuses.
MOUNT_THEN_EXEC = ('mount -n -t overlay -o "$1" overlay "$2" || { echo "arena: cannot mount the workspace '
                   'overlay" >&2; exit 125; }; shift 2; exec "$@"')
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"


def options(lower: Path, upper: Path, work: Path) -> str:
    """The overlay's option string (``redirect_dir=on``: renaming a directory of the base works
    as on a plain file system, else rename(2) of one fails with EXDEV; ``nosuid,nodev`` as for
    any workspace). Raises ``OSError`` for a path the string cannot carry."""
    for path in (lower, upper, work):
        if not usable_path(path):
            raise OSError(f"cannot use {path} as an overlay layer (its characters)")
    return f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=on,nosuid,nodev"


def in_namespace_argv(layers: tuple[Path, Path, Path], target: Path, argv: list[str]) -> list[str]:
    """``argv`` run in a mount namespace of its own where ``layers`` (lower, upper, work) are
    mounted at ``target``."""
    return [UNSHARE, "--mount", "--propagation", "private", "/bin/sh", "-c", MOUNT_THEN_EXEC, "sh",
            options(*layers), str(target), *argv]


def probe(scratch: Path) -> str | None:
    """Why an overlay cannot be mounted in a namespace of its own here (no CAP_SYS_ADMIN, no
    overlayfs, an upper file system it cannot use), or ``None``: it can."""
    layers = tuple(scratch / name for name in ("lower", "upper", "work"))
    target = scratch / "merged"
    try:
        for path in (*layers, target):
            path.mkdir(parents=True, exist_ok=True)
        (layers[0] / "probe").write_text("1")
        argv = in_namespace_argv(layers, target, ["/bin/cat", str(target / "probe")])
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if done.returncode != 0 or done.stdout != b"1":
        return (done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}")[-300:]
    return None


class Merged:
    """The workspace as a sandbox sees it (``upper`` over ``lower``), for the service's own reads
    and writes while no mount of it exists on this side: a path is looked up in ``upper`` first;
    a whiteout there (a 0/0 character device) hides it, an opaque directory hides what ``lower``
    has below it; writes go to ``upper``, as the kernel's copy-up would put them."""

    _OPAQUE = "trusted.overlay.opaque"

    def __init__(self, lower: Path, upper: Path):
        self.lower = os.fspath(lower)
        self.upper = os.fspath(upper)

    @staticmethod
    def _whiteout(st: os.stat_result) -> bool:
        return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0

    def _opaque(self, path: str) -> bool:
        try:
            return os.getxattr(path, self._OPAQUE, follow_symlinks=False) == b"y"
        except OSError:
            return False

    def lookup(self, rel: str) -> str | None:
        """The host path holding ``rel`` (relative to the workspace) as the sandbox sees it, or
        ``None`` when it does not exist there."""
        parts = [p for p in rel.split("/") if p and p != "."]
        lower_visible = True
        for i in range(1, len(parts) + 1):
            up = os.path.join(self.upper, *parts[:i])
            try:
                st = os.lstat(up)
            except OSError:
                continue
            if self._whiteout(st):
                return None
            if i < len(parts) and stat.S_ISDIR(st.st_mode) and self._opaque(up):
                lower_visible = False
            elif not stat.S_ISDIR(st.st_mode) and i < len(parts):
                lower_visible = False  # a file or link in upper replaced the directory of lower
        up = os.path.join(self.upper, *parts)
        if os.path.lexists(up):
            return up
        low = os.path.join(self.lower, *parts)
        return low if lower_visible and os.path.lexists(low) else None

    def writable(self, rel: str) -> Path:
        """Where to write ``rel``: its path in ``upper``, its parent directories made there (each
        a whiteout replaced by an opaque directory) and a whiteout at it removed."""
        parts = [p for p in rel.split("/") if p and p != "."]
        for i in range(1, len(parts)):
            up = os.path.join(self.upper, *parts[:i])
            try:
                st = os.lstat(up)
            except FileNotFoundError:
                os.mkdir(up)
                low = os.path.join(self.lower, *parts[:i])
                with contextlib.suppress(OSError):
                    os.chmod(up, stat.S_IMODE(os.stat(low).st_mode))
                continue
            if self._whiteout(st):
                os.unlink(up)
                os.mkdir(up)
                os.setxattr(up, self._OPAQUE, b"y", follow_symlinks=False)
        target = os.path.join(self.upper, *parts)
        with contextlib.suppress(FileNotFoundError):
            if self._whiteout(os.lstat(target)):
                os.unlink(target)
        return Path(target)
