"""A local sandbox's workspace as an overlay of a read-only base (the kernel's overlayfs).

The base (a source's committed repository, cached once per worker) is the lower layer; what the
agent writes, creates, renames or deletes goes to a per-sandbox upper directory (deletions as
whiteouts), so the base is never copied into a sandbox nor modified by one, and removing the
sandbox removes only what it changed. Needs CAP_SYS_ADMIN (a service run as root); where a mount
is refused, the provider copies the base as before. See docs/sandbox.md ("Performance").
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
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


def mount(lower: Path, upper: Path, work: Path, target: Path) -> None:
    """Mount ``lower`` (read-only) under ``upper`` at ``target``; ``work`` is overlayfs's scratch
    directory, on ``upper``'s file system. Raises ``OSError`` when the kernel refuses.

    ``redirect_dir=on``: renaming a directory of the base works as on a plain file system (else
    rename(2) of one fails with EXDEV). ``nosuid,nodev`` as for any workspace."""
    for path in (lower, upper, work, target):
        if not usable_path(path):
            raise OSError(f"cannot use {path} as an overlay layer (its characters)")
    options = f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=on"
    if _libc().mount(b"overlay", os.fsencode(target), b"overlay", _MS_NOSUID | _MS_NODEV, options.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount overlay at {target}: {os.strerror(err)}")


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
