"""Unified git diffs: the reverse of a patch (SWE-smith's gold fix is its bug patch reversed),
applying one to a tree without a repository. Pure text work, checked against git itself."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from arena_core.errors import InvalidRequest

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")
_DIFF_GIT = re.compile(r"^diff --git a/(.+) b/(.+)$")


def _side(path_line: str, prefix: str) -> str:
    """``--- a/x`` / ``+++ b/x`` -> ``x`` (``/dev/null`` kept)."""
    name = path_line[4:].rstrip("\n").split("\t")[0]
    if name == "/dev/null":
        return name
    return name[2:] if name[:2] in ("a/", "b/") else name


def _range(start: str, count: str | None) -> str:
    return start if count is None else f"{start},{count}"


def reverse_patch(diff: str) -> str:
    """The patch that undoes ``diff`` (as ``git apply --reverse`` reads it): sides, modes,
    renames and hunks swapped, each run of changed lines with its removals first."""
    lines = diff.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        body = line.rstrip("\n")
        if body.startswith("GIT binary patch") or body.startswith("Binary files "):
            raise InvalidRequest("a binary patch cannot be reversed here")
        if body.startswith("copy from ") or body.startswith("copy to "):
            raise InvalidRequest("a patch that copies files cannot be reversed")
        if m := _DIFF_GIT.match(body):
            out.append(f"diff --git a/{m.group(2)} b/{m.group(1)}\n")
        elif body.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _side(line, "a/"), _side(lines[i + 1], "b/")
            out.append(f"--- {new if new == '/dev/null' else 'a/' + new}\n")
            out.append(f"+++ {old if old == '/dev/null' else 'b/' + old}\n")
            i += 1
        elif body.startswith("new file mode "):
            out.append("deleted file mode " + body[len("new file mode "):] + "\n")
        elif body.startswith("deleted file mode "):
            out.append("new file mode " + body[len("deleted file mode "):] + "\n")
        elif body.startswith("old mode ") and i + 1 < len(lines) and lines[i + 1].startswith("new mode "):
            out.append("old mode " + lines[i + 1].rstrip("\n")[len("new mode "):] + "\n")
            out.append("new mode " + body[len("old mode "):] + "\n")
            i += 1
        elif body.startswith("rename from ") and i + 1 < len(lines) and lines[i + 1].startswith("rename to "):
            out.append("rename from " + lines[i + 1].rstrip("\n")[len("rename to "):] + "\n")
            out.append("rename to " + body[len("rename from "):] + "\n")
            i += 1
        elif body.startswith("index ") and ".." in body:
            ids, _, mode = body[len("index "):].partition(" ")
            a, _, b = ids.partition("..")
            out.append(f"index {b}..{a}{' ' + mode if mode else ''}\n")
        elif m := _HUNK.match(body):
            old_n = 1 if m.group(2) is None else int(m.group(2))
            new_n = 1 if m.group(4) is None else int(m.group(4))
            out.append(f"@@ -{_range(m.group(3), m.group(4))} +{_range(m.group(1), m.group(2))} @@{m.group(5)}\n")
            i = _reverse_hunk(lines, i + 1, old_n, new_n, out)
            continue
        else:
            out.append(line)
        i += 1
    return "".join(out)


def _reverse_hunk(lines: list[str], i: int, old_n: int, new_n: int, out: list[str]) -> int:
    """Swap the hunk body starting at ``lines[i]``; the index after it."""
    removed: list[str] = []  # the reversed run: what was added, now removed
    added: list[str] = []

    def flush() -> None:
        out.extend(removed)
        out.extend(added)
        removed.clear()
        added.clear()

    last: list[str] | None = None
    while i < len(lines) and (old_n > 0 or new_n > 0 or lines[i].startswith("\\")):
        line = lines[i]
        tag = line[:1]
        if tag == "\\":  # "\ No newline at end of file" follows the line it is about
            (last if last is not None else out).append(line)
        elif tag == "+":
            added_line = "-" + line[1:]
            removed.append(added_line)
            last = removed
            new_n -= 1
        elif tag == "-":
            added.append("+" + line[1:])
            last = added
            old_n -= 1
        elif tag in (" ", "\n", ""):
            flush()
            out.append(line if tag != "\n" else " \n")
            last = out
            old_n -= 1
            new_n -= 1
        else:
            raise InvalidRequest(f"malformed hunk line {line[:60]!r}")
        i += 1
    flush()
    return i


def apply_patch(tree: Path, diff: str, *, reverse: bool = False, what: str = "patch") -> None:
    """``git apply`` ``diff`` to the directory ``tree`` (no repository needed); a one-line error."""
    if not diff.strip():
        return
    args = ["git", "apply", "--whitespace=nowarn", *(["--reverse"] if reverse else []), "-"]
    proc = subprocess.run(args, cwd=tree, input=diff.encode(), capture_output=True,
                          env={"PATH": "/usr/bin:/bin:/usr/local/bin", "GIT_CONFIG_NOSYSTEM": "1",
                               "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": str(tree),
                               # never the repository some parent directory is in
                               "GIT_CEILING_DIRECTORIES": str(Path(tree).resolve().parent)})
    if proc.returncode != 0:
        raise InvalidRequest(f"the {what} does not apply: {proc.stderr.decode(errors='replace').strip()[-300:]}")
