"""``cargo test`` output -> per-test results. Pure.

Canonical id: the test's path inside its crate as libtest prints it (``tests::adds``).
Each test binary prints ``running N tests``, one ``test <path> ... ok|FAILED|ignored``
line per test, then (on failure) a ``failures:`` list of the failed paths, and finally
``test result: ok|FAILED. P passed; F failed; I ignored; ...``. The failures list is
authoritative (worse wins) and each binary's own ``running N`` bounds how many results it
may have: more means a test (run with ``--nocapture``) printed result lines, and the log
is ``suspect``. With ``--nocapture`` a test's output sits between ``... `` and its status:
while a test is pending, only a bare status word is read. Result lines inside ``---- <test> stdout ----`` blocks are never read.
"""

from __future__ import annotations

import re

from arena.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, merge, strip_ansi

_RUNNING = re.compile(r"^running (?P<n>\d+) tests?$")
_LINE = re.compile(r"^test (?P<path>\S+)(?: - should panic)? \.\.\. ?(?P<rest>.*)$")
_WORD = re.compile(r"^(?P<word>ok|FAILED|ignored)(?:, .*)?$")
_RESULT = re.compile(r"^test result: (?:ok|FAILED)\. (?P<passed>\d+) passed; (?P<failed>\d+) failed; (?P<ignored>\d+) ignored")
_STDOUT_BLOCK = re.compile(r"^---- \S+ std(?:out|err) ----$")
_WORDS = {"ok": TestStatus.PASSED, "FAILED": TestStatus.FAILED, "ignored": TestStatus.SKIPPED}


def parse_cargo_test_output(text: str) -> ParsedOutput:
    found: dict[str, TestStatus] = {}
    expected_total = 0
    binaries = finished = 0
    section: dict[str, TestStatus] | None = None  # the running binary's results
    in_failure_list = in_stdout_block = False
    pending: str | None = None  # a test whose status line has not come yet
    notes: list[str] = []
    for line in strip_ansi(text).splitlines():
        if m := _RUNNING.match(line):
            section, pending = {}, None
            binaries += 1
            expected_total += int(m.group("n"))
            in_failure_list = in_stdout_block = False
            continue
        if section is None:
            continue
        if _STDOUT_BLOCK.match(line):
            in_stdout_block = True
            continue
        if line == "failures:":
            in_stdout_block, pending = False, None
            in_failure_list = True  # the first "failures:" precedes the stdout blocks
            continue
        if m := _RESULT.match(line):
            for path, status in section.items():
                merge(found, path, status)
            finished += 1
            section = None
            continue
        if in_failure_list and line.startswith("    ") and not in_stdout_block:
            path = line.strip()
            if path and " " not in path:
                merge(section, path, TestStatus.FAILED)
            continue
        if in_stdout_block or in_failure_list:
            continue
        if pending is not None:  # with --nocapture a test's output sits before its status
            if w := _WORD.match(line):
                merge(section, pending, _WORDS[w.group("word")])
                pending = None
            continue
        if m := _LINE.match(line):
            if w := _WORD.match(m.group("rest")):
                merge(section, m.group("path"), _WORDS[w.group("word")])
            else:
                pending = m.group("path")
    if section:
        for path, status in section.items():
            merge(found, path, status)
    complete = binaries > 0 and finished == binaries
    return build(found, complete=complete, reported_total=expected_total if binaries else None,
                 source="cargo", notes=notes)
