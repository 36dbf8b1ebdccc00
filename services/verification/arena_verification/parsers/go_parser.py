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
_PAUSE = re.compile(r"^=== (?P<word>PAUSE|CONT)\s+(?P<name>\S+)$")
_RESULT = re.compile(r"^\s*--- (?P<word>PASS|FAIL|SKIP): (?P<name>\S+) \([\d.]+s\)$")
_PKG_DONE = re.compile(r"^(?P<word>ok|FAIL|\?)\s+(?P<pkg>\S+)(?:\s|$)")
_WORDS = {"PASS": TestStatus.PASSED, "FAIL": TestStatus.FAILED, "SKIP": TestStatus.SKIPPED,
          "pass": TestStatus.PASSED, "fail": TestStatus.FAILED, "skip": TestStatus.SKIPPED}


def _id(pkg: str | None, name: str) -> str:
    return f"{pkg}::{name}" if pkg else name


def _top(name: str) -> str:
    return name.split("/", 1)[0]


class _Package:
    """One test binary's ``-v`` lines: which tests are open, and each one's last result line."""

    def __init__(self) -> None:
        self.announced: list[str] = []
        self.open: set[str] = set()  # announced, and their result line may still come
        self.paused: set[str] = set()  # top-level tests that called t.Parallel
        self.current: str | None = None  # the top-level test running alone
        self.results: dict[str, TestStatus] = {}  # the last result line of each open test
        self.doubt: set[str] = set()
        self.conflicts: set[str] = set()  # results the text cannot attribute for sure
        self.verbose: bool | None = None  # decided by the package's first test line

    def run(self, name: str) -> None:
        if self.verbose is None:
            self.verbose = True
        if not self.verbose:
            return  # without -v go announces nothing: a test printed this
        top = _top(name)
        if name != top:  # a subtest: only of an open test
            if top in self.open:
                self._announce(name)
            return
        running = self.current
        if running is not None and running not in self.paused and running not in self.results:
            # Go starts a top-level test after the previous one ended or paused: this line
            # was printed by the running test.
            self.doubt.add(name)
            return
        # The next top-level test: every test before it that did not pause is closed.
        for open_name in list(self.open):
            if _top(open_name) not in self.paused:
                self.open.discard(open_name)
        self.current = name
        self._announce(name)

    def _announce(self, name: str) -> None:
        if name not in self.announced:
            self.announced.append(name)
        self.open.add(name)

    def result(self, name: str, word: str) -> None:
        if self.verbose is None:
            self.verbose = False
        if name in self.open:
            if name in self.results and self.results[name] is not _WORDS[word]:
                self.doubt.add(name)  # a test printed a result line for itself; the last is the runner's
            self.results[name] = _WORDS[word]
        elif not self.verbose and word == "FAIL":
            self.results[name] = TestStatus.FAILED  # without -v only failures are named, unannounced
        elif self.verbose and name in self.announced:
            running = self.current
            if running is not None and running not in self.results:
                self.doubt.add(name)  # the running test printed a result line of a closed one
                return
            # Either the running test printed this line, or the closed test printed the
            # "=== RUN" that closed it: the text cannot tell; the worse status stands.
            self.conflicts |= {name, running or name}
            merge(self.results, name, _WORDS[word])
        else:
            self.doubt.add(name)  # never announced: printed by a test


def parse_go_test_output(text: str) -> ParsedOutput:
    """``go test -v ./...`` (text); without ``-v`` only failures are named.

    A result is the last ``--- X: name`` line of a test while it is open: from its
    ``=== RUN`` until the next top-level test starts (a paused, parallel test stays open
    until its package ends).
    """
    found: dict[str, TestStatus] = {}
    announced: list[str] = []
    pkg = _Package()
    packages_done = 0
    doubt: set[str] = set()
    conflicts: list[str] = []
    lines = strip_ansi(text).splitlines()
    # go prints a package's "ok"/"FAIL" line once, after its tests: an earlier one was printed
    last_done = {m.group("pkg"): i for i, line in enumerate(lines) if (m := _PKG_DONE.match(line))}
    for i, line in enumerate(lines):
        if m := _RUN.match(line):
            pkg.run(m.group("name"))
        elif m := _PAUSE.match(line):
            if m.group("name") in pkg.open and m.group("word") == "PAUSE":
                pkg.paused.add(m.group("name"))
        elif m := _RESULT.match(line):
            pkg.result(m.group("name"), m.group("word"))
        elif m := _PKG_DONE.match(line):
            if m.group("word") == "?" and not pkg.results:
                packages_done += 1  # "?   pkg [no test files]"
                continue
            if last_done[m.group("pkg")] != i:
                continue  # a test printed it; its package goes on
            for name, status in pkg.results.items():
                merge(found, _id(m.group("pkg"), name), status)
            # A package that ended in FAIL with tests never resolved: the binary died in them
            # (os.Exit, -timeout): they are unresolved, not failures.
            announced += [_id(m.group("pkg"), n) for n in pkg.announced]
            doubt |= {_id(m.group("pkg"), n) for n in pkg.doubt}
            conflicts += [_id(m.group("pkg"), n) for n in sorted(pkg.conflicts)]
            pkg = _Package()
            packages_done += 1
    for name, status in pkg.results.items():
        merge(found, name, status)  # a package that never finished
    announced += pkg.announced
    complete = packages_done > 0 and not pkg.announced and not pkg.results
    cut = [n for n in announced if n not in found]
    return build(found, complete=complete and not cut, reported_total=None, source="go_test", announced=announced,
                 notes=[f"go printed no result for {len(cut)} announced tests"] if cut and complete else None,
                 suspect=_CONFLICT if conflicts else "", in_doubt=conflicts)


_CONFLICT = "a result line of a test came after the next test started, as the runner never writes it"


class _Event(msgspec.Struct):
    Action: str
    Package: str = ""
    Test: str = ""


_decoder = msgspec.json.Decoder(_Event)


def parse_go_test_json(text: str) -> ParsedOutput:
    """``go test -json ./...``: one JSON event per line; other lines are ignored.

    Before Go 1.20, test2json reads the ``-v`` text, so a line a test printed becomes an
    event too: the events go through the same open-test rules as the text.
    """
    packages: dict[str, _Package] = {}
    found: dict[str, TestStatus] = {}
    announced: list[str] = []
    doubt: set[str] = set()
    conflicts: list[str] = []
    finished: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            ev = _decoder.decode(line)
        except msgspec.DecodeError:
            continue
        if ev.Package in finished:
            continue
        pkg = packages.setdefault(ev.Package, _Package())
        if not ev.Test:
            if ev.Action in ("pass", "fail", "skip") and ev.Package:
                finished.add(ev.Package)
                for name, status in pkg.results.items():
                    merge(found, _id(ev.Package, name), status)
                announced += [_id(ev.Package, n) for n in pkg.announced]
                doubt |= {_id(ev.Package, n) for n in pkg.doubt}
                conflicts += [_id(ev.Package, n) for n in sorted(pkg.conflicts)]
            continue
        if ev.Action == "run":
            pkg.run(ev.Test)
        elif ev.Action == "pause" and ev.Test in pkg.open:
            pkg.paused.add(ev.Test)
        elif ev.Action in _WORDS:
            pkg.result(ev.Test, ev.Action.upper())
    running = [p for p in packages if p and p not in finished]
    for p in running:
        for name, status in packages[p].results.items():
            merge(found, _id(p, name), status)
        announced += [_id(p, n) for n in packages[p].announced]
    complete = bool(finished) and not running
    cut = [n for n in announced if n not in found]
    return build(found, complete=complete and not cut, reported_total=None, source="go_test_json",
                 announced=announced,
                 notes=[f"go printed no result for {len(cut)} announced tests"] if cut and complete else None,
                 suspect=_CONFLICT if conflicts else "", in_doubt=conflicts)
