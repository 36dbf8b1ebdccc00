"""Node's built-in test runner (``node --test``), spec and TAP reporters -> results. Pure.

Parsers ``node_spec`` and ``node_tap`` (prefer TAP: spec does not escape test output). Ids and
trusted lines: docs/verification.md (Parsers, "The other parsers, runner by runner").
"""

from __future__ import annotations

import re

from arena_core.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, doubted, merge, strip_ansi

SEP = " > "

_TAP_SUBTEST = re.compile(r"^(?P<indent>(?: {4})*)# Subtest: (?P<name>.*)$")
_TAP_RESULT = re.compile(r"^(?P<indent>(?: {4})*)(?P<not>not )?ok \d+(?: - (?P<name>.*?))?(?: # (?P<directive>SKIP|TODO)\b.*)?$")
_TAP_PLAN = re.compile(r"^1\.\.\d+$")
_TAP_TESTS = re.compile(r"^# tests (?P<n>\d+)$")
_TAP_SUITES = re.compile(r"^# suites (?P<n>\d+)$")


_TAP_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "v": "\v"}
_TAP_ESCAPE = re.compile(r"\\(.)")


def _unescape_tap(name: str) -> str:
    """Node escapes ``\\``, ``#`` and control characters in TAP names with a backslash."""
    return _TAP_ESCAPE.sub(lambda m: _TAP_ESCAPES.get(m.group(1), m.group(1)), name)


def parse_node_tap(text: str) -> ParsedOutput:
    """Every test point is a result: leaves, tests with subtests and ``describe`` suites alike
    (node counts the first two in ``# tests N`` and suites in ``# suites N``)."""
    found: dict[str, TestStatus] = {}
    announced: list[str] = []  # "# Subtest:" lines, in order
    stack: list[str] = []  # names of the open subtests, one per level
    plan = total = suites = None
    for line in strip_ansi(text).splitlines():
        if m := _TAP_SUBTEST.match(line):
            level = len(m.group("indent")) // 4
            if level > len(stack):
                continue  # deeper than any open test: not node's layout
            del stack[level:]
            stack.append(_unescape_tap(m.group("name")))
            announced.append(SEP.join(stack))
            continue
        if m := _TAP_RESULT.match(line):
            level = len(m.group("indent")) // 4
            if level >= len(stack):
                continue  # a result without its "# Subtest:" line (not node's TAP)
            test_id = SEP.join(stack[: level + 1])
            del stack[level:]
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
        elif m := _TAP_SUITES.match(line):
            suites = int(m.group("n"))
    complete = plan is not None and total is not None
    return build(found, complete=complete, reported_total=_bound(total, suites), source="node_tap",
                 totals=_totals(total, suites), announced=announced)


def _bound(tests: int | None, suites: int | None) -> int | None:
    return None if tests is None else tests + (suites or 0)


def _totals(tests: int | None, suites: int | None) -> dict[str, int] | None:
    if tests is None:
        return None
    return {"tests": tests, **({"suites": suites} if suites is not None else {})}


_SPEC_LINE = re.compile(r"^(?P<indent>(?:  )*)(?P<mark>[✔✖﹣▶])\s(?P<rest>.*)$")
_SPEC_DURATION = re.compile(r"^(?P<name>.*?) \([\d.]+m?s\)(?P<tail>.*)$")
_SPEC_TESTS = re.compile(r"^ℹ tests (?P<n>\d+)$")
_SPEC_SUITES = re.compile(r"^ℹ suites (?P<n>\d+)$")
_SPEC_COUNT = re.compile(r"^ℹ (?P<word>pass|fail|cancelled|skipped|todo) (?P<n>\d+)$")
#: node's own counts, by the status the parser gives a line: a cancelled test's line is ``✖``,
#: a todo's ``✔``/``✖ ... # TODO`` (skipped)
_SPEC_STATUS = {"pass": TestStatus.PASSED, "fail": TestStatus.FAILED, "cancelled": TestStatus.FAILED,
                "skipped": TestStatus.SKIPPED, "todo": TestStatus.SKIPPED}
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
    """``▶ name`` opens a test with subtests or a suite, which its own ``✔``/``✖`` line at
    the same indentation closes: it is a result too, as node counts it."""
    lines = strip_ansi(text).splitlines()
    total_at = max((i for i, line in enumerate(lines) if _SPEC_TESTS.match(line)), default=None)
    end = total_at if total_at is not None else len(lines)
    found: dict[str, TestStatus] = {}
    seen: dict[str, set[TestStatus]] = {}  # every status each id's lines gave
    announced: list[str] = []  # "▶" lines: the only tests spec names before they end
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
            announced.append(SEP.join(suites))
            continue
        entry = _spec_entry(m.group("mark"), m.group("rest"))
        if entry is not None:
            test_id = SEP.join([*suites, entry[0]])
            merge(found, test_id, entry[1])
            seen.setdefault(test_id, set()).add(entry[1])
    _apply_failing_section(lines, end, found)
    total = suites_n = None
    suspect, doubt = "", None
    if total_at is not None:
        total = int(_SPEC_TESTS.match(lines[total_at]).group("n"))  # type: ignore[union-attr]
        suites_n = next((int(m.group("n")) for line in lines[total_at:] if (m := _SPEC_SUITES.match(line))), None)
        counted: dict[TestStatus, int] = {}
        for line in lines[total_at:]:
            if m := _SPEC_COUNT.match(line):
                status = _SPEC_STATUS[m.group("word")]
                counted[status] = counted.get(status, 0) + int(m.group("n"))
        suspect, doubt = _spec_doubt(seen, set(announced), counted, suites_n or 0, total + (suites_n or 0))
    return build(found, complete=total_at is not None, reported_total=_bound(total, suites_n), source="node_spec",
                 totals=_totals(total, suites_n), announced=announced, suspect=suspect, in_doubt=doubt,
                 counted_per_status=doubt is not None)


def _spec_doubt(seen: dict[str, set[TestStatus]], opened: set[str], counted: dict[TestStatus, int], suites: int,
                total: int) -> tuple[str, list[str] | None]:
    """The ids a test's print may have given their result, by node's own counts.

    ``ℹ pass``/``fail``/``cancelled``/``skipped``/``todo`` count tests, not suites, and spec
    opens both with ``▶``: of the opened ids with one status at least that many minus the
    suites are tests, so the leaves with it can number no more than node counted with it,
    less those. More leaves than that (or lines of one id that disagree) are in doubt; an
    opened id only when its lines disagree. ``None`` when the check cannot name any: then,
    if the log names more tests than node counted, every id is in doubt.
    """
    if not counted:
        return "", None
    bounds = {}
    for status, n in counted.items():
        opened_with = sum(1 for t in opened if seen.get(t) == {status})
        bounds[status] = max(0, n - max(0, opened_with - suites))
    leaves = {t: sts for t, sts in seen.items() if t not in opened}
    doubt, _ = doubted(leaves, bounds, exact=False)
    doubt += [t for t in seen if t in opened and len(seen[t]) > 1]
    over = [f"{sum(1 for sts in leaves.values() if st in sts)} {st.value}" for st, n in bounds.items()
            if sum(1 for sts in leaves.values() if st in sts) > n]
    if not doubt:
        return "", None if len(seen) > total else []
    what = f"the log names more tests of a status than node counted ({', '.join(over)})" if over else \
        "an id's result lines disagree"
    return what, doubt


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
