"""``go test -v`` text and ``go test -json`` output -> per-test results. Pure.

Parsers ``go_test`` and ``go_test_json``. Ids and trusted lines: docs/verification.md (Parsers,
"The other parsers, runner by runner").
"""

from __future__ import annotations

import re

import msgspec

from arena_core.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, merge, strip_ansi

_RUN = re.compile(r"^=== RUN\s+(?P<name>\S+)$")
_RESULT = re.compile(r"^\s*--- (?P<word>PASS|FAIL|SKIP): (?P<name>\S+) \([\d.]+s\)$")
_PKG_DONE = re.compile(r"^(?P<word>ok|FAIL|\?)\s+(?P<pkg>\S+)(?:\s|$)")
_WORDS = {"PASS": TestStatus.PASSED, "FAIL": TestStatus.FAILED, "SKIP": TestStatus.SKIPPED,
          "pass": TestStatus.PASSED, "fail": TestStatus.FAILED, "skip": TestStatus.SKIPPED}


def _id(pkg: str | None, name: str) -> str:
    return f"{pkg}::{name}" if pkg else name


def parse_go_test_output(text: str) -> ParsedOutput:
    """``go test -v ./...`` (text); without ``-v`` only failures are named."""
    found: dict[str, TestStatus] = {}
    announced: set[str] = set()
    current: dict[str, TestStatus] = {}  # results of the package still running
    packages_done = 0
    for line in strip_ansi(text).splitlines():
        if m := _RUN.match(line):
            announced.add(m.group("name"))
        elif m := _RESULT.match(line):
            # A failure is taken even unannounced (go test without -v prints no "=== RUN");
            # a pass or skip only for a test that was announced.
            if m.group("name") in announced or m.group("word") == "FAIL":
                merge(current, m.group("name"), _WORDS[m.group("word")])
        elif m := _PKG_DONE.match(line):
            if m.group("word") == "?" and not current:
                packages_done += 1  # "?   pkg [no test files]"
                continue
            unresolved = announced - current.keys()
            if m.group("word") == "FAIL":
                for name in unresolved:
                    current[name] = TestStatus.FAILED  # the binary died in it (os.Exit, -timeout)
                unresolved = set()
            for name, status in current.items():
                merge(found, _id(m.group("pkg"), name), status)
            # Tests still running after an "ok" line: a test printed it; they go on.
            current, announced = {}, unresolved
            packages_done += 1
    for name, status in current.items():
        merge(found, _id(None, name), status)  # a package that never finished
    complete = packages_done > 0 and not current and not announced
    return build(found, complete=complete, reported_total=None, source="go_test")


class _Event(msgspec.Struct):
    Action: str
    Package: str = ""
    Test: str = ""


_decoder = msgspec.json.Decoder(_Event)


def parse_go_test_json(text: str) -> ParsedOutput:
    """``go test -json ./...``: one JSON event per line; other lines are ignored."""
    found: dict[str, TestStatus] = {}
    announced: set[tuple[str, str]] = set()
    running: set[str] = set()  # packages with events but no final pass/fail yet
    finished: set[str] = set()
    failed: set[str] = set()  # packages that ended with a package-level fail
    resolved: set[tuple[str, str]] = set()
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            ev = _decoder.decode(line)
        except msgspec.DecodeError:
            continue
        if ev.Package:
            running.add(ev.Package)
        if not ev.Test:
            if ev.Action in ("pass", "fail", "skip") and ev.Package:
                finished.add(ev.Package)
                if ev.Action == "fail":
                    failed.add(ev.Package)
            continue
        key = (ev.Package, ev.Test)
        if ev.Action == "run":
            announced.add(key)
        elif ev.Action in _WORDS and (key in announced or ev.Action == "fail"):
            merge(found, _id(ev.Package, ev.Test), _WORDS[ev.Action])
            resolved.add(key)
    for pkg, test in announced - resolved:
        if pkg in failed:  # the test binary died in this test (os.Exit, -timeout)
            merge(found, _id(pkg, test), TestStatus.FAILED)
    complete = bool(finished) and running <= finished
    return build(found, complete=complete, reported_total=None, source="go_test_json")
