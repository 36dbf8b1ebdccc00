"""``cargo test`` output (libtest's text and JSON formats) -> per-test results. Pure.

Parsers ``cargo`` and ``cargo_json``. Ids and trusted lines: docs/verification.md (Parsers,
"The other parsers, runner by runner").
"""

from __future__ import annotations

import re

import msgspec

from arena_core.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, merge, strip_ansi

_RUNNING = re.compile(r"^running (?P<n>\d+) tests?$")
_KIND = r"(?: - (?:should panic|compile fail|compile))?"
_LINE = re.compile(rf"^test (?P<name>\S.*?){_KIND} \.\.\. ?(?P<rest>.*)$")
_WORD = re.compile(r"^(?P<word>ok|FAILED|ignored)(?:, .*)?$")
_QUIET_FAILED = re.compile(rf"^(?P<name>\S.*?){_KIND} --- FAILED$")
_RESULT = re.compile(
    r"^test result: (?:ok|FAILED)\. (?P<passed>\d+) passed; (?P<failed>\d+) failed; (?P<ignored>\d+) ignored;"
    r" (?P<measured>\d+) measured"
)
_FAILURE_NAME = re.compile(r"^    \S+$")
_STDOUT_BLOCK = re.compile(r"^---- .+ std(?:out|err) ----$")
_WORDS = {"ok": TestStatus.PASSED, "FAILED": TestStatus.FAILED, "ignored": TestStatus.SKIPPED}


def _closes(line: str, expected: int) -> bool:
    m = _RESULT.match(line)
    return m is not None and sum(int(m.group(k)) for k in ("passed", "failed", "ignored", "measured")) == expected


def parse_cargo_test_output(text: str) -> ParsedOutput:
    found: dict[str, TestStatus] = {}
    expected_total = 0
    binaries = finished = 0
    section: dict[str, TestStatus] | None = None  # the running binary's results
    expected = 0  # its "running N"
    seen_running = False
    in_failure_list = in_stdout_block = False
    mismatched: list[str] = []  # tests of binaries whose summary disagrees with their lines
    failure_list: list[str] = []  # names under "failures:", taken when the summary follows
    pending: str | None = None  # a test whose status line has not come yet
    announced: list[str] = []  # "test x ... " lines (one thread: printed when x starts)
    unconfirmed: str | None = None  # resolved by a bare status after its output, nothing since
    for line in strip_ansi(text).splitlines():
        if m := _RUNNING.match(line):
            if section:
                for name, status in section.items():
                    merge(found, name, status)
            section, pending, seen_running = {}, None, True
            expected = int(m.group("n"))
            binaries += 1
            expected_total += expected
            in_failure_list = in_stdout_block = False
            continue
        if not seen_running:
            continue
        if _STDOUT_BLOCK.match(line):
            in_stdout_block, pending = True, None
            continue
        if line == "failures:":
            in_stdout_block, pending = False, None
            in_failure_list = True  # the first "failures:" precedes the stdout blocks
            failure_list = []
            continue
        if in_stdout_block:
            continue
        if section is not None and _closes(line, expected):
            said = _RESULT.match(line)
            read = [sum(1 for st in section.values() if st is w) for w in _WORDS.values()]
            if section and said is not None and read != [int(said.group(k)) for k in ("passed", "failed", "ignored")]:
                mismatched += list(section)  # (-q names no passes: nothing to compare)
            for name, status in section.items():
                merge(found, name, status)
            if in_failure_list:  # the list libtest wrote right before its summary
                for name in failure_list:
                    merge(found, name, TestStatus.FAILED)
            finished += 1
            section, pending = None, None
            in_failure_list, failure_list = False, []
            continue
        if in_failure_list:
            if _FAILURE_NAME.match(line):
                failure_list.append(line.strip())
                continue
            if not line.strip():
                continue
            in_failure_list, failure_list = False, []  # printed by a test (--nocapture): not the list
        if m := _QUIET_FAILED.match(line):
            merge(found, m.group("name"), TestStatus.FAILED)
            continue
        if pending is not None:  # with --nocapture a test's output sits before its status
            if w := _WORD.match(line):
                status = _WORDS[w.group("word")]
                if section is not None or status is TestStatus.FAILED:
                    merge(section if section is not None else found, pending, status)
                unconfirmed, pending = pending, None
            continue
        if m := _LINE.match(line):
            unconfirmed = None
            if section is not None:
                announced.append(m.group("name"))
            if w := _WORD.match(m.group("rest")):
                status = _WORDS[w.group("word")]
                if section is not None:
                    merge(section, m.group("name"), status)
                elif status is TestStatus.FAILED:
                    merge(found, m.group("name"), status)
            else:
                pending = m.group("name")
    if section and unconfirmed is not None:
        # cut after a bare status that no runner line followed (--nocapture, one thread):
        # the running test may have printed it. Unresolved, not passed.
        section.pop(unconfirmed, None)
    if section:
        for name, status in section.items():
            merge(found, name, status)
    complete = binaries > 0 and finished == binaries
    return build(found, complete=complete, reported_total=expected_total if binaries else None, source="cargo",
                 suspect="the runner counted other results than its lines name" if mismatched else "",
                 in_doubt=mismatched, announced=announced)


class _Event(msgspec.Struct):
    type: str
    event: str
    name: str = ""
    test_count: int | None = None


_decoder = msgspec.json.Decoder(_Event)
_JSON_WORDS = {"ok": TestStatus.PASSED, "failed": TestStatus.FAILED, "ignored": TestStatus.SKIPPED}


def parse_cargo_json(text: str) -> ParsedOutput:
    """libtest's JSON events (``--format json``), with cargo's text lines around them."""
    found: dict[str, TestStatus] = {}
    started: set[str] = set()  # tests started in the running suite
    suites = finished = 0
    expected_total = 0
    open_suite = False
    announced: list[str] = []  # "started" events
    for line in strip_ansi(text).splitlines():
        if not line.startswith("{"):
            continue
        try:
            ev = _decoder.decode(line)
        except msgspec.DecodeError:
            continue
        if ev.type == "suite":
            if ev.event == "started":
                suites += 1
                expected_total += ev.test_count or 0
                started, open_suite = set(), True
            elif ev.event in ("ok", "failed") and open_suite:
                finished += 1
                open_suite = False
            continue
        if ev.type != "test" or not ev.name:
            continue
        if ev.event == "started":
            started.add(ev.name)
            announced.append(ev.name)
        elif ev.event in _JSON_WORDS and (ev.name in started or ev.event == "failed"):
            merge(found, ev.name, _JSON_WORDS[ev.event])
    complete = suites > 0 and finished == suites
    return build(found, complete=complete, reported_total=expected_total if suites else None, source="cargo_json",
                 announced=announced)
