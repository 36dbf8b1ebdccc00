"""``python -m unittest -v`` output -> per-test results. Pure.

Canonical id: the dotted id unittest prints in parentheses (``pkg.test_mod.TestCls.test_x``),
which ``python -m unittest <id>`` accepts. Subtests fold into their test (worse wins).

Trusted places: progress lines ``name (id) ... <status>`` at column 0, the
``FAIL: name (id)`` / ``ERROR: name (id)`` headers after a ``=====`` rule (authoritative
for failures), and the final ``Ran N tests`` + ``OK`` / ``FAILED (...)`` lines. A test's
output lands between its ``... `` and its status, so while a test is running (its line
has no status yet) progress-shaped lines are ignored; a printed ``ok`` can still resolve
it, but the real ``FAIL:`` header overrides that. Run with ``-b`` to keep test output out
of the log entirely.
"""

from __future__ import annotations

import re

from arena.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, merge, strip_ansi

_PROGRESS = re.compile(r"^(?P<indent>\s*)(?P<name>\w+) \((?P<id>[\w.]+)\)(?P<params> \(.*?\))? \.\.\. ?(?P<rest>.*)$")
_FAIL_HEADER = re.compile(r"^(?P<word>FAIL|ERROR|UNEXPECTED SUCCESS): (?P<name>\w+) \((?P<id>[\w.]+)\)")
_RAN = re.compile(r"^Ran (?P<n>\d+) tests? in [\d.]+s$")
_VERDICT = re.compile(r"^(OK|FAILED)(?: \((?P<counts>.*)\))?$")
_RULE = "=" * 70


def _status(word: str) -> TestStatus | None:
    word = word.strip()
    if word == "ok":
        return TestStatus.PASSED
    if word == "FAIL":
        return TestStatus.FAILED
    if word == "ERROR":
        return TestStatus.ERROR
    if word.startswith("skipped"):
        return TestStatus.SKIPPED
    if word == "expected failure":
        return TestStatus.XFAILED
    if word == "unexpected success":
        return TestStatus.XPASSED
    return None


def _test_id(name: str, paren: str) -> str:
    """Python >= 3.11 prints the full id; older versions print ``module.Class``."""
    return paren if paren.endswith("." + name) else f"{paren}.{name}"


def parse_unittest_output(text: str) -> ParsedOutput:
    lines = strip_ansi(text).splitlines()
    ran_at = max((i for i, line in enumerate(lines) if _RAN.match(line)), default=None)
    end = ran_at if ran_at is not None else len(lines)
    found: dict[str, TestStatus] = {}
    pending: str | None = None  # a test whose status has not been printed yet
    pending_has_subtests = False
    for i in range(end):
        line = lines[i]
        m = _PROGRESS.match(line)
        if m and m.group("indent"):  # a subtest result: "  test_x (id) (i=1) ... FAIL"
            status = _status(m.group("rest"))
            tid = _test_id(m.group("name"), m.group("id"))
            if status is not None and tid == pending:
                merge(found, tid, status)
                pending_has_subtests = True
            continue
        if m and (pending is None or pending_has_subtests):
            tid = _test_id(m.group("name"), m.group("id"))
            status = _status(m.group("rest"))
            pending, pending_has_subtests = None, False
            if status is None:
                pending = tid
            else:
                merge(found, tid, status)
            continue
        if pending is not None and not line.startswith(" "):
            status = _status(line)
            if status is not None:
                merge(found, pending, status)
                pending, pending_has_subtests = None, False
        if line == _RULE and i + 1 < end:
            header = _FAIL_HEADER.match(lines[i + 1])
            if header and header.group("word") != "UNEXPECTED SUCCESS":
                word = TestStatus.FAILED if header.group("word") == "FAIL" else TestStatus.ERROR
                merge(found, _test_id(header.group("name"), header.group("id")), word)
    if pending is not None and pending_has_subtests:
        pending = None
    complete = ran_at is not None and any(_VERDICT.match(line) for line in lines[ran_at + 1 :])
    total = int(_RAN.match(lines[ran_at]).group("n")) if ran_at is not None else None  # type: ignore[union-attr]
    return build(found, complete=complete, reported_total=total, source="unittest",
                 totals={"tests": total} if total is not None else None)
