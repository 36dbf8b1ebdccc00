"""Node's built-in test runner (``node --test``), spec and TAP reporters -> results. Pure.

Parsers ``node_spec`` and ``node_tap`` (prefer TAP: spec does not escape test output). Ids and
trusted lines: docs/verification.md (Parsers, "The other parsers, runner by runner").
"""

from __future__ import annotations

import re

from arena_core.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, merge, strip_ansi

SEP = " > "

_TAP_SUBTEST = re.compile(r"^(?P<indent>(?: {4})*)# Subtest: (?P<name>.*)$")
_TAP_RESULT = re.compile(r"^(?P<indent>(?: {4})*)(?P<not>not )?ok \d+(?: - (?P<name>.*?))?(?: # (?P<directive>SKIP|TODO)\b.*)?$")
_TAP_PLAN = re.compile(r"^1\.\.\d+$")
_TAP_TESTS = re.compile(r"^# tests (?P<n>\d+)$")


_TAP_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "v": "\v"}
_TAP_ESCAPE = re.compile(r"\\(.)")


def _unescape_tap(name: str) -> str:
    """Node escapes ``\\``, ``#`` and control characters in TAP names with a backslash."""
    return _TAP_ESCAPE.sub(lambda m: _TAP_ESCAPES.get(m.group(1), m.group(1)), name)


def parse_node_tap(text: str) -> ParsedOutput:
    found: dict[str, TestStatus] = {}
    stack: list[str] = []  # names of the open subtests, one per level
    has_children: list[bool] = []
    plan = total = None
    for line in strip_ansi(text).splitlines():
        if m := _TAP_SUBTEST.match(line):
            level = len(m.group("indent")) // 4
            del stack[level:], has_children[level:]
            for i in range(level):
                if i < len(has_children):
                    has_children[i] = True
            stack.append(_unescape_tap(m.group("name")))
            has_children.append(False)
            continue
        if m := _TAP_RESULT.match(line):
            level = len(m.group("indent")) // 4
            if level >= len(stack):
                continue  # a result without its "# Subtest:" line (not node's TAP)
            leaf = not has_children[level]
            test_id = SEP.join(stack[: level + 1])
            del stack[level:], has_children[level:]
            if not leaf:
                continue
            if m.group("directive"):
                status = TestStatus.SKIPPED
            else:
                status = TestStatus.FAILED if m.group("not") else TestStatus.PASSED
            merge(found, test_id, status)
            continue
        if _TAP_PLAN.match(line):
            plan = line
        elif m := _TAP_TESTS.match(line):
            total = int(m.group("n"))
    complete = plan is not None and total is not None
    return build(found, complete=complete, reported_total=total, source="node_tap",
                 totals={"tests": total} if total is not None else None)


_SPEC_LINE = re.compile(r"^(?P<indent>(?:  )*)(?P<mark>[✔✖﹣▶])\s(?P<rest>.*)$")
_SPEC_DURATION = re.compile(r"^(?P<name>.*?) \([\d.]+m?s\)(?P<tail>.*)$")
_SPEC_TESTS = re.compile(r"^ℹ tests (?P<n>\d+)$")
_SPEC_SUITES = re.compile(r"^ℹ suites (?P<n>\d+)$")
_SPEC_FAILING = "✖ failing tests:"


def _spec_entry(mark: str, rest: str) -> tuple[str, TestStatus] | None:
    """A result line's name and status; ``None`` for a suite's opening line."""
    if mark == "▶":
        return None
    d = _SPEC_DURATION.match(rest)
    if d is None:
        if mark == "✖":
            return rest, TestStatus.FAILED  # cancelled (a failed hook): no duration
        return None
    name, tail = d.group("name"), d.group("tail")
    # "# SKIP"/"# TODO", or a skip's or todo's reason alone ("✖ x (1ms) # not done" is a todo)
    if mark == "﹣" or tail.startswith(" # "):
        return name, TestStatus.SKIPPED
    return name, TestStatus.PASSED if mark == "✔" else TestStatus.FAILED


def parse_node_spec(text: str) -> ParsedOutput:
    lines = strip_ansi(text).splitlines()
    total_at = max((i for i, line in enumerate(lines) if _SPEC_TESTS.match(line)), default=None)
    end = total_at if total_at is not None else len(lines)
    found: dict[str, TestStatus] = {}
    suites: list[str] = []  # open suites, one per level
    for line in lines[:end]:
        m = _SPEC_LINE.match(line)
        if m is None:
            continue
        level = len(m.group("indent")) // 2
        if level > len(suites):
            continue  # deeper than any open suite: printed by a test, not the reporter
        del suites[level:]
        if m.group("mark") == "▶":
            suites.append(m.group("rest"))
            continue
        entry = _spec_entry(m.group("mark"), m.group("rest"))
        if entry is not None:
            merge(found, SEP.join([*suites, entry[0]]), entry[1])
    # A suite closes with its own line at its indentation: "✖ suite (1ms)". It was read as a
    # test named like the suite at the parent level; drop those.
    suite_ids = _suite_ids(lines[:end])
    for sid in suite_ids:
        found.pop(sid, None)
    _apply_failing_section(lines, end, found)
    total = int(_SPEC_TESTS.match(lines[total_at]).group("n")) if total_at is not None else None  # type: ignore[union-attr]
    bound = total
    if total is not None and total_at is not None:
        # "ℹ tests N" counts a test with subtests too, which opens with "▶" like a suite
        # but is not a result here: N minus the "▶" lines that are not suites bounds the leaves.
        suites_n = next((int(m.group("n")) for line in lines[total_at:] if (m := _SPEC_SUITES.match(line))), None)
        if suites_n is not None:
            bound = total - max(0, len(suite_ids) - suites_n)
    return build(found, complete=total_at is not None, reported_total=bound, source="node_spec",
                 totals={"tests": total} if total is not None else None)


def _suite_ids(lines: list[str]) -> list[str]:
    ids: list[str] = []
    suites: list[str] = []
    for line in lines:
        m = _SPEC_LINE.match(line)
        if m is None:
            continue
        level = len(m.group("indent")) // 2
        if level > len(suites):
            continue
        del suites[level:]
        if m.group("mark") == "▶":
            suites.append(m.group("rest"))
            ids.append(SEP.join(suites))
    return ids


def _apply_failing_section(lines: list[str], end: int, found: dict[str, TestStatus]) -> None:
    """``✖ failing tests:`` after the totals lists each failed test by its leaf name."""
    try:
        start = next(i for i in range(end, len(lines)) if lines[i] == _SPEC_FAILING)
    except StopIteration:
        return
    failed_names = set()
    for line in lines[start + 1 :]:
        if line.startswith("✖ ") and (entry := _spec_entry("✖", line[2:])) and entry[1] is TestStatus.FAILED:
            failed_names.add(entry[0])
    for test_id in found:
        if test_id.rsplit(SEP, 1)[-1] in failed_names:
            merge(found, test_id, TestStatus.FAILED)
