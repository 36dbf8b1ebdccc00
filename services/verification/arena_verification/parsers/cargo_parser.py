"""``cargo test`` output (libtest's text and JSON formats) -> per-test results. Pure.

Canonical id: the test's path inside its crate as libtest names it (``tests::adds``,
``integration_adds``); a doctest by libtest's name for it, ``src/lib.rs - add (line 3)``
(the `` - compile`` / `` - compile fail`` / `` - should panic`` kind that the text format
appends is not part of the name, as in the JSON format).

Text (``cargo``): each test binary prints ``running N tests``, one ``test <name> ... ok|
FAILED|ignored`` line per test, then (on failure) a ``failures:`` list of the failed names,
and finally ``test result: ok|FAILED. P passed; F failed; I ignored; M measured; ...``. A
binary's section ends only at a ``test result:`` line whose P + F + I + M equals its N, so a
summary printed by a test (``--nocapture``) with other counts does not end it. A failure is
taken from anywhere after the first ``running`` line -- a ``FAILED`` result line, the
``failures:`` list, quiet mode's ``name --- FAILED`` -- since printing one can only hurt; a
pass or skip only inside its binary's section. Each binary's own ``running N`` bounds how
many results it may have: more means a test printed result lines (``--nocapture``), and the
log is ``suspect``. With ``--nocapture`` a test's output sits between ``... `` and its status:
while a test is pending only a bare status word is read. Result lines inside
``---- <test> stdout ----`` blocks are never read. ``cargo test -q`` names only failures.

JSON (``cargo_json``; ``cargo test -- -Z unstable-options --format json``, which needs
``RUSTC_BOOTSTRAP=1`` on a stable toolchain): one event per line, ``{"type": "suite",
"event": "started", "test_count": N}``, ``{"type": "test", "event": "started"|"ok"|
"failed"|"ignored", "name": ...}``, ``{"type": "suite", "event": "ok"|"failed", ...}``;
cargo's own lines and (with ``--nocapture``) the tests' output are plain text around them.
A pass or skip counts only for a test that has a ``started`` event in its suite; complete
when every started suite has its closing event; ``test_count`` bounds the results.
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
    pending: str | None = None  # a test whose status line has not come yet
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
            continue
        if in_stdout_block:
            continue
        if section is not None and _closes(line, expected):
            for name, status in section.items():
                merge(found, name, status)
            finished += 1
            section, pending = None, None
            in_failure_list = False
            continue
        if in_failure_list:
            if line.startswith("    ") and line.strip():
                merge(found, line.strip(), TestStatus.FAILED)
            continue
        if m := _QUIET_FAILED.match(line):
            merge(found, m.group("name"), TestStatus.FAILED)
            continue
        if pending is not None:  # with --nocapture a test's output sits before its status
            if w := _WORD.match(line):
                status = _WORDS[w.group("word")]
                if section is not None or status is TestStatus.FAILED:
                    merge(section if section is not None else found, pending, status)
                pending = None
            continue
        if m := _LINE.match(line):
            if w := _WORD.match(m.group("rest")):
                status = _WORDS[w.group("word")]
                if section is not None:
                    merge(section, m.group("name"), status)
                elif status is TestStatus.FAILED:
                    merge(found, m.group("name"), status)
            else:
                pending = m.group("name")
    if section:
        for name, status in section.items():
            merge(found, name, status)
    complete = binaries > 0 and finished == binaries
    return build(found, complete=complete, reported_total=expected_total if binaries else None, source="cargo")


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
        elif ev.event in _JSON_WORDS and (ev.name in started or ev.event == "failed"):
            merge(found, ev.name, _JSON_WORDS[ev.event])
    complete = suites > 0 and finished == suites
    return build(found, complete=complete, reported_total=expected_total if suites else None, source="cargo_json")
