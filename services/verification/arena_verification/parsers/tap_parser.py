"""Generic TAP (Test Anything Protocol) -> per-test results. Pure.

Parser ``tap``, for runners other than node's (mocha, vitest, tape, ``prove``). Ids and
completeness: docs/verification.md (Parsers, "The other parsers, runner by runner").
"""

from __future__ import annotations

import re

import msgspec

from arena_core.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, merge, strip_ansi

SEP = " > "

_POINT = re.compile(r"^(?P<indent>\s*)(?P<not>not )?ok\b(?: (?P<num>\d+))?(?: -)?(?: (?P<desc>.*?))?\s*$")
_PLAN = re.compile(r"^(?P<indent>\s*)1\.\.(?P<n>\d+)(?:\s*#.*)?$")
_DIRECTIVE = re.compile(r"\s*#\s*(?P<word>SKIP|TODO|time=)", re.IGNORECASE)
_ESCAPE = re.compile(r"\\([\\#])")
_BAIL = re.compile(r"^\s*Bail out!")


def _split(desc: str) -> tuple[str, str | None, bool]:
    """(name, ``SKIP``/``TODO`` or ``None``, whether the point opens a ``{`` block)."""
    opens = desc.endswith("{")
    if opens:
        desc = desc[:-1].rstrip()
    for i, ch in enumerate(desc):
        if ch == "\\":
            continue
        if ch == "#" and not _escaped(desc, i) and i > 0 and desc[i - 1].isspace():
            m = _DIRECTIVE.match(desc, i - 1)
            if m is not None:
                word = m.group("word").upper()
                return _ESCAPE.sub(r"\1", desc[: i - 1].rstrip()), None if word == "TIME=" else word, opens
    return _ESCAPE.sub(r"\1", desc), None, opens


def _escaped(text: str, at: int) -> bool:
    slashes = 0
    while at - slashes - 1 >= 0 and text[at - slashes - 1] == "\\":
        slashes += 1
    return slashes % 2 == 1


def parse_tap(text: str) -> ParsedOutput:
    found: dict[str, TestStatus] = {}
    blocks: list[str] = []  # descriptions of the open "{" blocks
    top_points = 0
    plan: int | None = None
    bailed = False
    for line in strip_ansi(text).splitlines():
        if _BAIL.match(line):
            bailed = True
            continue
        if line.strip() == "}":
            if blocks:
                blocks.pop()
            continue
        if m := _PLAN.match(line):
            if not blocks and not m.group("indent"):
                plan = int(m.group("n"))
            continue
        m = _POINT.match(line)
        if m is None or m.group("num") is None:
            continue
        if m.group("indent") and not blocks:
            continue  # an indented point outside a block: not at this TAP's top level
        name, directive, opens = _split(m.group("desc") or "")
        if not blocks:
            top_points += 1
        if opens:
            blocks.append(name)
            continue
        if directive in ("SKIP", "TODO"):
            status = TestStatus.SKIPPED
        else:
            status = TestStatus.FAILED if m.group("not") else TestStatus.PASSED
        merge(found, SEP.join([*blocks, name]), status)
    complete = plan is not None and top_points >= plan and not bailed
    notes = [f"{top_points} top-level test points but the plan is 1..{plan}"] if plan is not None and top_points > plan else []
    parsed = build(found, complete=complete, reported_total=None, source="tap", notes=notes,
                   totals={"planned": plan} if plan is not None else None)
    if notes:
        parsed = msgspec.structs.replace(parsed, suspect=True)
    return parsed
