"""Node's built-in test runner (``node --test``), spec and TAP reporters -> results. Pure.

Canonical id: the names from the outermost suite down, joined by `` > ``
(``suite > inner fails``). Only leaf tests are results; a suite's own line is not.

- **TAP** (``--test-reporter=tap``): ``# Subtest: name`` opens a test at its indentation
  (4 spaces per level), ``ok N - name`` / ``not ok N - name`` closes it, ``# SKIP`` and
  ``# TODO`` mean skipped. What tests print is escaped as ``# ...`` comments by the runner,
  so it cannot look like a result. Complete when the top-level plan ``1..N`` and
  ``# tests N`` follow.
- **spec** (the default on a terminal, ``--test-reporter=spec``): ``✔ name (1ms)``,
  ``✖ name``, ``﹣ name # SKIP``, ``▶ suite`` opening a suite two spaces per level. What
  tests print is *not* escaped, so the ``✖ failing tests:`` section is authoritative for
  failures and ``ℹ tests N`` bounds the count (more: ``suspect``). Prefer TAP.
"""

from __future__ import annotations

import re

from arena.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, merge, strip_ansi

SEP = " > "

_TAP_SUBTEST = re.compile(r"^(?P<indent>(?: {4})*)# Subtest: (?P<name>.*)$")
_TAP_RESULT = re.compile(r"^(?P<indent>(?: {4})*)(?P<not>not )?ok \d+(?: - (?P<name>.*?))?(?: # (?P<directive>SKIP|TODO)\b.*)?$")
_TAP_PLAN = re.compile(r"^1\.\.\d+$")
_TAP_TESTS = re.compile(r"^# tests (?P<n>\d+)$")


def _unescape_tap(name: str) -> str:
    return name.replace("\\#", "#").replace("\\\\", "\\")


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
_SPEC_FAILING = "✖ failing tests:"


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
        mark, rest = m.group("mark"), m.group("rest")
        if mark == "▶":
            suites.append(rest)
            continue
        d = _SPEC_DURATION.match(rest)
        if d is None:
            continue
        name, tail = d.group("name"), d.group("tail")
        if mark == "﹣" or "# SKIP" in tail or "# TODO" in tail:
            status = TestStatus.SKIPPED
        else:
            status = TestStatus.PASSED if mark == "✔" else TestStatus.FAILED
        merge(found, SEP.join([*suites, name]), status)
    # A suite closes with its own line at its indentation: "✖ suite (1ms)". It was read as a
    # test named like the suite at the parent level; drop those.
    suite_ids = _suite_ids(lines[:end])
    for sid in suite_ids:
        found.pop(sid, None)
    _apply_failing_section(lines, end, found)
    total = int(_SPEC_TESTS.match(lines[total_at]).group("n")) if total_at is not None else None  # type: ignore[union-attr]
    return build(found, complete=total_at is not None, reported_total=total, source="node_spec",
                 totals={"tests": total} if total is not None else None)


def _suite_ids(lines: list[str]) -> set[str]:
    ids: set[str] = set()
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
            ids.add(SEP.join(suites))
    return ids


def _apply_failing_section(lines: list[str], end: int, found: dict[str, TestStatus]) -> None:
    """``✖ failing tests:`` after the totals lists each failed test by its leaf name."""
    try:
        start = next(i for i in range(end, len(lines)) if lines[i] == _SPEC_FAILING)
    except StopIteration:
        return
    failed_names = set()
    for line in lines[start + 1 :]:
        if line.startswith("✖ ") and (d := _SPEC_DURATION.match(line[2:])):
            failed_names.add(d.group("name"))
    for test_id in found:
        if test_id.rsplit(SEP, 1)[-1] in failed_names:
            merge(found, test_id, TestStatus.FAILED)
