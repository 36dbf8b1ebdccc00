"""jest (``--verbose``), vitest (``--reporter=verbose``) and mocha (spec) output -> results. Pure.

Canonical id: the test file (when the runner prints it), the describe blocks and the test
name, joined by `` > ``: ``t/calc.test.js > calc > adds`` (jest, vitest) or
``calc > nested > deep passes`` (mocha's spec reporter does not name files).

None of these reporters escapes what tests print, so each parser reads the runner's
failure section as authoritative (worse wins) and bounds the count by the runner's own
total (``Tests: ... N total``, vitest's ``Tests ... (N)``, mocha's passing + failing +
pending): a log naming more tests is ``suspect``.
"""

from __future__ import annotations

import re

from arena.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, merge, strip_ansi

SEP = " > "

# ------------------------------------------------------------------------------ jest

_JEST_FILE = re.compile(r"^(?P<word>PASS|FAIL) (?P<file>\S+)(?: \(.*\))?$")
_JEST_TEST = re.compile(r"^(?P<indent>(?:  )+)(?P<mark>[✓✕○✎√×]) (?P<rest>.*?)(?: \(\d+(?:\.\d+)? m?s\))?$")
_JEST_DESCRIBE = re.compile(r"^(?P<indent>(?:  )+)(?P<name>\S.*)$")
_JEST_FAILURE = re.compile(r"^  ● (?P<path>.+)$")
_JEST_TOTAL = re.compile(r"^Tests:\s+.*?(?P<n>\d+) total$")


def parse_jest_output(text: str) -> ParsedOutput:
    lines = strip_ansi(text).splitlines()
    found: dict[str, TestStatus] = {}
    file: str | None = None
    describes: list[str] = []
    in_tree = False
    total = None
    for line in lines:
        if m := _JEST_FILE.match(line):
            file, describes, in_tree = m.group("file"), [], True
            continue
        if m := _JEST_TOTAL.match(line):
            total = int(m.group("n"))
            in_tree = False
            continue
        if file is None:
            continue
        if m := _JEST_FAILURE.match(line):
            in_tree = False
            if m.group("path") != "Test suite failed to run":
                merge(found, SEP.join([file, *m.group("path").split(" › ")]), TestStatus.FAILED)
            continue
        if not in_tree:
            continue
        if not line.strip():
            in_tree = False
            continue
        if m := _JEST_TEST.match(line):
            level = len(m.group("indent")) // 2 - 1
            if level > len(describes):
                continue
            del describes[level:]
            mark, rest = m.group("mark"), m.group("rest")
            if mark in "○✎":
                rest = re.sub(r"^(skipped|todo) ", "", rest)
                status = TestStatus.SKIPPED
            else:
                status = TestStatus.PASSED if mark in "✓√" else TestStatus.FAILED
            merge(found, SEP.join([file, *describes, rest]), status)
        elif m := _JEST_DESCRIBE.match(line):
            level = len(m.group("indent")) // 2 - 1
            if level <= len(describes):
                del describes[level:]
                describes.append(m.group("name"))
    return build(found, complete=total is not None, reported_total=total, source="jest",
                 totals={"tests": total} if total is not None else None)


# ------------------------------------------------------------------------------ vitest

_VITEST_TEST = re.compile(r"^ (?P<mark>[✓×↓□]) (?P<id>\S+ > .*?)(?: \d+(?:\.\d+)?m?s)?$")
_VITEST_FAIL = re.compile(r"^ FAIL  (?P<id>\S+ > .*)$")
_VITEST_TOTAL = re.compile(r"^\s+Tests\s+.*\((?P<n>\d+)\)$")
_VITEST_MARKS = {"✓": TestStatus.PASSED, "×": TestStatus.FAILED, "↓": TestStatus.SKIPPED, "□": TestStatus.SKIPPED}


def parse_vitest_output(text: str) -> ParsedOutput:
    found: dict[str, TestStatus] = {}
    total = None
    for line in strip_ansi(text).splitlines():
        if m := _VITEST_TEST.match(line):
            merge(found, m.group("id"), _VITEST_MARKS[m.group("mark")])
        elif m := _VITEST_FAIL.match(line):
            merge(found, m.group("id"), TestStatus.FAILED)
        elif m := _VITEST_TOTAL.match(line):
            total = int(m.group("n"))
    return build(found, complete=total is not None, reported_total=total, source="vitest",
                 totals={"tests": total} if total is not None else None)


# ------------------------------------------------------------------------------ mocha

_MOCHA_LINE = re.compile(r"^(?P<indent>  (?:  )*)(?P<mark>✔ |✓ |\d+\) |- )?(?P<name>\S.*?)(?: \(\d+ms\))?$")
_MOCHA_COUNT = re.compile(r"^  (?P<n>\d+) (?P<word>passing|failing|pending)(?: \(.*\))?$")
_MOCHA_FAILURE = re.compile(r"^  (?P<num>\d+)\) (?P<first>.*)$")


def parse_mocha_output(text: str) -> ParsedOutput:
    lines = strip_ansi(text).splitlines()
    counts_at = next((i for i, line in enumerate(lines) if _MOCHA_COUNT.match(line)), None)
    end = counts_at if counts_at is not None else len(lines)
    found: dict[str, TestStatus] = {}
    suites: list[str] = []
    for line in lines[:end]:
        m = _MOCHA_LINE.match(line)
        if m is None:
            continue
        level = len(m.group("indent")) // 2 - 1
        if level > len(suites):
            continue
        del suites[level:]
        mark = (m.group("mark") or "").strip()
        if not mark:
            suites.append(m.group("name"))
            continue
        if mark in ("✔", "✓"):
            status = TestStatus.PASSED
        elif mark == "-":
            status = TestStatus.SKIPPED
        else:
            status = TestStatus.FAILED
        merge(found, SEP.join([*suites, m.group("name")]), status)
    totals: dict[str, int] = {}
    i = end
    while i < len(lines) and (m := _MOCHA_COUNT.match(lines[i])):
        totals[m.group("word")] = int(m.group("n"))
        i += 1
    _apply_mocha_failures(lines[i:], found)
    total = sum(totals.values()) if totals else None
    return build(found, complete=counts_at is not None, reported_total=total, source="mocha", totals=totals)


def _apply_mocha_failures(lines: list[str], found: dict[str, TestStatus]) -> None:
    """``  1) suite\\n       nested\\n         test name:`` -- the path ends at the ``:`` line."""
    i = 0
    while i < len(lines):
        m = _MOCHA_FAILURE.match(lines[i])
        i += 1
        if m is None:
            continue
        parts = [m.group("first")]
        while not parts[-1].endswith(":") and i < len(lines) and lines[i].startswith("     "):
            parts.append(lines[i].strip())
            i += 1
        if parts[-1].endswith(":"):
            parts[-1] = parts[-1][:-1]
            merge(found, SEP.join(parts), TestStatus.FAILED)
