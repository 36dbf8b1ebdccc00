"""Which files does a diff touch? Pure: diff text in, repository paths out.

Reads the file headers ``git apply`` reads. See docs/verification.md ("Reading the diff; pristine files").
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator

_HUNK = re.compile(r"^@@ -\d+(?:,(?P<old>\d+))? \+\d+(?:,(?P<new>\d+))? @@")
_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}
DEV_NULL = "/dev/null"
#: every line boundary ``str.splitlines`` knows
_LINE_BREAK = re.compile("\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def lines(text: str) -> Iterator[str]:
    """``text.splitlines()`` one line at a time: a diff of up to ``ARENA_MAX_DIFF_BYTES`` is
    not turned into a list of all its lines (about twice its size again)."""
    start = 0
    for brk in _LINE_BREAK.finditer(text):
        yield text[start:brk.start()]
        start = brk.end()
    if start < len(text):
        yield text[start:]


def unquote(name: str) -> str:
    """Undo git's C-style quoting of a path (``core.quotePath``); plain names pass through."""
    if len(name) < 2 or not (name.startswith('"') and name.endswith('"')):
        return name
    body = name[1:-1]
    out = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch != "\\" or i + 1 == len(body):
            out += ch.encode()
            i += 1
            continue
        nxt = body[i + 1]
        if len(body) >= i + 4 and all(c in "01234567" for c in body[i + 1 : i + 4]):
            out.append(int(body[i + 1 : i + 4], 8) & 0xFF)
            i += 4
        elif nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            out += body[i : i + 2].encode()
            i += 2
    return out.decode("utf-8", errors="replace")


def _strip_one(path: str) -> str | None:
    """``-p1``: drop the first component (``a/x.py`` -> ``x.py``); ``None`` for /dev/null."""
    if path == DEV_NULL:
        return None
    parts = path.split("/", 1)
    return normalize(parts[1]) if len(parts) == 2 else None


def normalize(path: str) -> str:
    path = posixpath.normpath(path)
    return "" if path == "." else path


def _header_name(rest: str) -> str:
    """The file name of a ``---``/``+++`` line: quoted, or up to a tab (timestamp)."""
    rest = rest.rstrip("\n")
    if rest.startswith('"'):
        end = _closing_quote(rest)
        return unquote(rest[: end + 1]) if end > 0 else rest
    return rest.split("\t", 1)[0].rstrip()


def _closing_quote(text: str) -> int:
    i = 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i
        i += 1
    return -1


def _git_header_names(rest: str) -> list[str]:
    """Names in ``diff --git <a> <b>``; unquoted names with spaces are split in the middle."""
    names: list[str] = []
    if rest.startswith('"'):
        end = _closing_quote(rest)
        if end < 0:
            return names
        names.append(unquote(rest[: end + 1]))
        second = rest[end + 1 :].strip()
        if second:
            names.append(unquote(second))
        return names
    if rest.endswith('"'):
        start = rest.rfind(' "')
        if start > 0:
            return [rest[:start], unquote(rest[start + 1 :])]
    # "a/P b/P" with the same P (spaces allowed): split in the middle.
    if len(rest) % 2 == 1:
        half = len(rest) // 2
        left, right = rest[:half], rest[half + 1 :]
        if rest[half] == " " and left.split("/", 1)[-1] == right.split("/", 1)[-1]:
            return [left, right]
    first, sep, second = rest.partition(" b/")
    return [first, "b/" + second] if sep else [rest]


def touched_paths(diff: str) -> set[str]:
    """Every repository path (relative, normalized) the diff creates, changes or deletes."""
    paths: set[str] = set()
    old_left = new_left = 0
    for line in lines(diff):
        if old_left > 0 or new_left > 0:  # inside a hunk body
            tag = line[:1]
            if tag == "\\":
                continue  # "\ No newline at end of file"
            if tag == "-":
                old_left -= 1
                continue
            if tag == "+":
                new_left -= 1
                continue
            if tag in (" ", ""):
                old_left -= 1
                new_left -= 1
                continue
            old_left = new_left = 0  # malformed hunk: read the line as a header
        hunk = _HUNK.match(line)
        if hunk:
            old_left = int(hunk.group("old") or 1)
            new_left = int(hunk.group("new") or 1)
            continue
        if line.startswith("diff --git "):
            for name in _git_header_names(line[len("diff --git ") :]):
                if (p := _strip_one(name)) is not None:
                    paths.add(p)
        elif line.startswith(("--- ", "+++ ")):
            if (p := _strip_one(_header_name(line[4:]))) is not None:
                paths.add(p)
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            name = unquote(line.split(" ", 2)[2])
            paths.add(normalize(name))
    paths.discard("")
    return paths


def added_lines(diff: str) -> Iterator[tuple[str, str]]:
    """(path, text) of every line the diff adds, path as the new side names it (``-p1``)."""
    path = ""
    new_left = old_left = 0
    for line in lines(diff):
        if old_left > 0 or new_left > 0:
            tag = line[:1]
            if tag == "+":
                new_left -= 1
                if path:
                    yield path, line[1:]
                continue
            if tag == "-":
                old_left -= 1
                continue
            if tag in (" ", ""):
                old_left -= 1
                new_left -= 1
                continue
            if tag == "\\":
                continue
            old_left = new_left = 0
        hunk = _HUNK.match(line)
        if hunk:
            old_left = int(hunk.group("old") or 1)
            new_left = int(hunk.group("new") or 1)
        elif line.startswith("diff --git "):
            names = _git_header_names(line[len("diff --git ") :])
            path = (_strip_one(names[-1]) or "") if names else ""
        elif line.startswith("+++ "):
            path = _strip_one(_header_name(line[4:])) or ""


def touches(paths: set[str], target: str) -> bool:
    """Whether any of ``paths`` is ``target``, inside it, or one of its parent directories."""
    target = normalize(target)
    return any(p == target or p.startswith(target + "/") or target.startswith(p + "/") for p in paths)
