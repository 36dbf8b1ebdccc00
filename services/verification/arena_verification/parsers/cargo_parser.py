"""``cargo test`` output (libtest's text and JSON formats) -> per-test results. Pure.

Parsers ``cargo`` and ``cargo_json``. Ids and trusted lines: docs/verification.md (Parsers,
"The other parsers, runner by runner").
"""

from __future__ import annotations

import re

import msgspec

from arena_core.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, doubted, merge, strip_ansi

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
_PANIC = re.compile(r"^thread '(?P<name>[^']+)'(?: \(\d+\))? panicked at ")
_WORDS = {"ok": TestStatus.PASSED, "FAILED": TestStatus.FAILED, "ignored": TestStatus.SKIPPED}


def _closes(line: str, expected: int) -> bool:
    m = _RESULT.match(line)
    return m is not None and sum(int(m.group(k)) for k in ("passed", "failed", "ignored", "measured")) == expected


class _Binary:
    """One test binary's section, from ``running N tests`` to its ``test result:``."""

    def __init__(self, expected: int) -> None:
        self.expected = expected  # its "running N"
        self.results: dict[str, TestStatus] = {}  # the worse of each id's lines
        self.lines: dict[str, set[TestStatus]] = {}  # every status each id's lines gave
        #: ``test x ... test y ... ok``. With one thread libtest wrote ``test x ... `` when x
        #: started and the rest is x's output. With several (libtest writes a test's line
        #: when it ends) either half may be a test's print glued to libtest's line: y's
        #: result, in doubt, when y has no line of its own.
        self.inner: dict[str, TestStatus] = {}
        #: several threads: a test panicked while another test's line was open, or none
        #: (with one thread a test panics between its own ``test x ... `` and its status)
        self.multithreaded = False

    def put(self, name: str, status: TestStatus) -> None:
        merge(self.results, name, status)
        self.lines.setdefault(name, set()).add(status)

    def put_inner(self, name: str, status: TestStatus) -> None:
        merge(self.inner, name, status)

    def close(self, said: re.Match[str] | None, failure_list: list[str] | None) -> list[str]:
        """Take the inner lines; the ids in doubt against libtest's own summary and list.

        An id not in doubt gets the one status the summary and the list leave it (a printed
        ``ok`` cannot outrank a real ``ignored``, nor a printed ``FAILED`` a test libtest
        did not list as failed)."""
        glued: list[str] = []
        if self.multithreaded:
            for name, status in self.inner.items():
                self.lines.setdefault(name, set()).add(status)
                if name not in self.results:
                    self.results[name] = status
                    glued.append(name)
        if not self.results or said is None:
            return glued  # -q names no passes: nothing to compare
        counted = {st: int(said.group(k)) for k, st in (("passed", TestStatus.PASSED),
                                                           ("failed", TestStatus.FAILED),
                                                           ("ignored", TestStatus.SKIPPED))}
        listed: set[str] | None = set(failure_list or [])
        if len(listed) != counted[TestStatus.FAILED]:  # type: ignore[arg-type]
            listed = None
        doubt, settled = doubted(self.lines, counted, listed)
        self.results.update({t: st for t, st in settled.items() if t in self.results})
        read = {st: sum(1 for v in self.results.values() if v is st) for st in counted}
        if read != counted and not doubt:
            doubt = list(self.results)
        return [*doubt, *(t for t in glued if t not in doubt)]


def parse_cargo_test_output(text: str) -> ParsedOutput:
    found: dict[str, TestStatus] = {}
    expected_total = 0
    binaries = finished = 0
    section: _Binary | None = None  # the running binary
    seen_running = False
    in_failure_list = in_stdout_block = False
    #: libtest's "failures:" / "successes:" header seen in this binary: the captured output
    #: blocks ("---- x stdout ----") follow it; before it such a line is a test's print
    after_header = False
    doubt: list[str] = []  # ids of binaries whose summary disagrees with their lines
    failure_list: list[str] = []  # names under "failures:", taken when the summary follows
    pending: str | None = None  # a test whose status line has not come yet
    announced: list[str] = []  # "test x ... " lines (one thread: printed when x starts)
    unconfirmed: str | None = None  # resolved by a bare status after its output, nothing since

    def result_line(m: re.Match[str], inner: bool = False) -> None:
        nonlocal pending, unconfirmed
        name, rest = m.group("name"), m.group("rest")
        if w := _WORD.match(rest):
            status = _WORDS[w.group("word")]
            if section is not None:
                (section.put_inner if inner else section.put)(name, status)
            elif status is TestStatus.FAILED:
                merge(found, name, status)
            return
        if section is not None and not inner and (n := _LINE.match(rest)):
            result_line(n, inner=True)  # the rest is a whole result line: see _Binary.inner
        pending = name

    for line in strip_ansi(text).splitlines():
        if m := _RUNNING.match(line):
            if section:
                for name, status in section.results.items():
                    merge(found, name, status)
            section, pending, seen_running = _Binary(int(m.group("n"))), None, True
            binaries += 1
            expected_total += section.expected
            in_failure_list = in_stdout_block = after_header = False
            continue
        if not seen_running:
            continue
        if _STDOUT_BLOCK.match(line) and after_header:
            in_stdout_block, pending = True, None
            continue
        if line == "successes:":  # --show-output: the passed tests' blocks, then their names
            in_stdout_block = in_failure_list = False
            after_header = True
            continue
        if line == "failures:":
            after_header = True
            # (a test's print while another is pending: that one's status may still follow)
            in_stdout_block = False
            in_failure_list = True  # the first "failures:" precedes the stdout blocks
            failure_list = []
            continue
        if in_stdout_block:
            continue
        if section is not None and (m := _PANIC.match(line)) and m.group("name") != pending:
            section.multithreaded = True
        if section is not None and _closes(line, section.expected):
            doubt += section.close(_RESULT.match(line), failure_list if in_failure_list else [])
            for name, status in section.results.items():
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
                if section is not None:
                    section.put(pending, status)
                elif status is TestStatus.FAILED:
                    merge(found, pending, status)
                unconfirmed, pending = pending, None
            continue
        if m := _LINE.match(line):
            unconfirmed = None
            if section is not None:
                announced.append(m.group("name"))
            result_line(m)
    if section and unconfirmed is not None:
        # cut after a bare status that no runner line followed (--nocapture, one thread):
        # the running test may have printed it. Unresolved, not passed.
        section.results.pop(unconfirmed, None)
    if section:
        doubt += section.close(None, None)
        for name, status in section.results.items():
            merge(found, name, status)
    complete = binaries > 0 and finished == binaries
    return build(found, complete=complete, reported_total=expected_total if binaries else None, source="cargo",
                 suspect="the runner counted other results than its lines name" if doubt else "",
                 in_doubt=doubt, announced=announced, counted_per_status=True)


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
