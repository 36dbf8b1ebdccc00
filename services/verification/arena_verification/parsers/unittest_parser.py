"""``python -m unittest -v`` output -> per-test results. Pure.

Parser ``unittest``. Ids and trusted lines: docs/verification.md (Parsers, "The other parsers,
runner by runner").
"""

from __future__ import annotations

import re

from arena_core.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, merge, strip_ansi

_TEST = r"(?P<name>[\w.]+) \((?P<id>[\w.]+)\)(?P<params> \(.*?\))?"
_PROGRESS = re.compile(rf"^(?P<indent>\s*){_TEST} \.\.\. ?(?P<rest>.*)$")
#: ``-v`` with a docstring: ``name (id)`` alone, then ``<first docstring line> ... ok``.
_DESCRIBED = re.compile(rf"^{_TEST}$")
_FAIL_HEADER = re.compile(r"^(?P<word>FAIL|ERROR|UNEXPECTED SUCCESS): (?P<name>[\w.]+) \((?P<id>[\w.]+)\)")
_RAN = re.compile(r"^Ran (?P<n>\d+) tests? in [\d.]+s$")
_VERDICT = re.compile(r"^(OK|FAILED)(?: \((?P<counts>.*)\))?$")
_RULE = "=" * 70
#: Class and module fixtures: an error in one is reported like a test but not counted as one.
_FIXTURES = frozenset({"setUpClass", "tearDownClass", "setUpModule", "tearDownModule"})


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


class _Progress:
    """The ``-v`` progress lines, one at a time."""

    def __init__(self) -> None:
        self.found: dict[str, TestStatus] = {}
        self.pending: str | None = None  # a test whose status has not been printed yet
        self.pending_has_subtests = False
        self.described: str | None = None  # "name (id)" printed, its docstring line next
        self.announced: list[str] = []  # tests whose line the runner printed when they started
        #: the last test resolved, until the runner's next line: a test's own output lands
        #: after its "... ", so a status the runner never followed up may be printed output
        self.unconfirmed: str | None = None

    def line(self, line: str) -> None:
        m = _PROGRESS.match(line)
        if m and m.group("indent"):  # a subtest result: "  test_x (id) (i=1) ... FAIL"
            status = _status(m.group("rest"))
            tid = _test_id(m.group("name"), m.group("id"))
            if status is not None and tid == self.pending:
                merge(self.found, tid, status)
                self.pending_has_subtests = True
            return
        if m and (self.pending is None or self.pending_has_subtests):
            self.described = None
            self._started(_test_id(m.group("name"), m.group("id")), m.group("rest"))
            return
        if self.pending is None:
            if d := _DESCRIBED.match(line):
                self.described = _test_id(d.group("name"), d.group("id"))
                self.announced.append(self.described)
                return
            if self.described is not None:
                # the docstring line may hold " ... " itself: the runner's comes last
                _doc, sep, rest = line.rpartition(" ... ")
                tid, self.described = self.described, None
                if sep:
                    self._started(tid, rest)
                return
        if self.pending is not None and not line.startswith(" "):
            status = _status(line)
            if status is not None:
                merge(self.found, self.pending, status)
                self.unconfirmed = self.pending
                self.pending, self.pending_has_subtests = None, False

    def _started(self, tid: str, rest: str) -> None:
        self.pending, self.pending_has_subtests = None, False
        self.announced.append(tid)
        self.unconfirmed = None
        status = _status(rest)
        if status is not None:
            merge(self.found, tid, status)
            self.unconfirmed = tid
        elif (n := _PROGRESS.match(rest)) and not n.group("indent"):
            # Python < 3.11 prints nothing for a test whose subtests failed: the next
            # test's line follows on the same line (its FAIL: header names it).
            self.line(rest)
        else:
            self.pending = tid  # the test's own output sits between "... " and its status


def parse_unittest_output(text: str) -> ParsedOutput:
    lines = strip_ansi(text).splitlines()
    ran_at = max((i for i, line in enumerate(lines) if _RAN.match(line)), default=None)
    end = ran_at if ran_at is not None else len(lines)
    progress = _Progress()
    found = progress.found
    headers: dict[TestStatus, list[str]] = {}  # "FAIL: x" / "ERROR: x" blocks, in order
    for i in range(end):
        line = lines[i]
        progress.line(line)
        if line == _RULE and i + 1 < end:
            header = _FAIL_HEADER.match(lines[i + 1])
            if header and header.group("word") != "UNEXPECTED SUCCESS":
                word = TestStatus.FAILED if header.group("word") == "FAIL" else TestStatus.ERROR
                tid = _test_id(header.group("name"), header.group("id"))
                headers.setdefault(word, []).append(tid)
                merge(found, tid, word)
    verdict = next((m for line in lines[ran_at + 1 :] if (m := _VERDICT.match(line))), None) if ran_at is not None else None
    complete = verdict is not None
    total = int(_RAN.match(lines[ran_at]).group("n")) if ran_at is not None else None  # type: ignore[union-attr]
    if verdict is None and progress.unconfirmed is not None and not headers:
        # Cut right after a status no runner line followed: the test may have printed it
        # ("... ok") and been killed while still running. Unresolved, not passed.
        found.pop(progress.unconfirmed, None)
    fixtures = sum(1 for tid in found if tid.rsplit(".", 1)[-1] in _FIXTURES)
    # "FAILED (failures=2, errors=1)": a test that printed a "FAIL: x" block named one more.
    counted = dict(re.findall(r"(?:^|, )(failures|errors)=(\d+)", (verdict.group("counts") or "") if verdict else ""))
    doubt: list[str] = []
    for word, key in ((TestStatus.FAILED, "failures"), (TestStatus.ERROR, "errors")):
        named = headers.get(word, [])
        if verdict is not None and len(named) > int(counted.get(key, 0)):
            doubt += named
    return build(found, complete=complete, reported_total=None if total is None else total + fixtures,
                 source="unittest", totals={"tests": total} if total is not None else None,
                 suspect="the runner counted fewer failures and errors than the log names" if doubt else "",
                 in_doubt=doubt, announced=progress.announced)
