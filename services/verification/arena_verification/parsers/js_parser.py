"""jest (``--verbose``), vitest (``--reporter=verbose``) and mocha (spec) output -> results. Pure.

Also their JSON reports (``jest_json``, ``vitest_json``, ``mocha_json``). Ids and trusted lines:
docs/verification.md (Parsers, "The other parsers, runner by runner").
"""

from __future__ import annotations

import json
import re

from arena_core.schemas import TestStatus
from arena_verification.parsed import ParsedOutput, build, doubted, merge, strip_ansi

SEP = " > "

# ------------------------------------------------------------------------------ jest

#: ``PASS test/x.test.js (5 s)``; with colours the word is a badge: `` FAIL  test/x.test.js``.
_JEST_FILE = re.compile(r"^ ?(?P<word>PASS|FAIL) +(?P<file>\S+)(?: \(.*\))?$")
_JEST_SUITES = re.compile(r"^Test Suites: ")
_JEST_TEST = re.compile(r"^(?P<indent>(?:  )+)(?P<mark>[✓✕○✎√×]) (?P<rest>.*?)(?: \(\d+(?:\.\d+)? m?s\))?$")
_JEST_DESCRIBE = re.compile(r"^(?P<indent>(?:  )+)(?P<name>\S.*)$")
#: A failed test's header: ``  ● describe › test``. jest's own notices share the bullet and
#: are never tests: ``  ● Test suite failed to run``, ``  ● Console``, ``  ●  process.exit
#: called with "3"`` (two spaces after the bullet).
_JEST_FAILURE = re.compile(r"^  ● (?P<path>\S.*)$")
_JEST_NOTICE = re.compile(r"^  ● (?:Test suite failed to run|Console)$|^  ● {2}|^  ● process\.exit called")
_JEST_TOTAL = re.compile(r"^Tests:\s+.*?(?P<n>\d+) total$")


def parse_jest_output(text: str) -> ParsedOutput:
    lines = strip_ansi(text).splitlines()
    found: dict[str, TestStatus] = {}
    file: str | None = None
    describes: list[str] = []
    in_tree = False
    total = None
    last_file_at = total_at = -1
    for i, line in enumerate(lines):
        if m := _JEST_FILE.match(line):
            file, describes, in_tree = m.group("file"), [], True
            last_file_at = i
            continue
        if (m := _JEST_TOTAL.match(line)) and i > 0 and _JEST_SUITES.match(lines[i - 1]):
            total, total_at = int(m.group("n")), i
            in_tree = False
            continue
        if file is None:
            continue
        if _JEST_NOTICE.match(line):
            in_tree = False
            continue
        if m := _JEST_FAILURE.match(line):
            in_tree = False
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
    # The real summary follows every file's block; a test's console output (a printed
    # "Tests: ..." line) is shown before its file's block.
    complete = total is not None and total_at > last_file_at
    return build(found, complete=complete, reported_total=total, source="jest",
                 totals={"tests": total} if total is not None else None)


# ------------------------------------------------------------------------------ vitest

_VITEST_TEST = re.compile(r"^ (?P<mark>[✓×↓□]) (?P<id>\S+ > .*?)(?: \d+(?:\.\d+)?m?s)?$")
_VITEST_FAIL = re.compile(r"^ FAIL  (?P<id>\S+ > .*)$")
_VITEST_TOTAL = re.compile(r"^\s+Tests\s+.*\((?P<n>\d+)\)$")
_VITEST_FILE_SUMMARY = re.compile(r"^ [✓❯×↓] \S+ \(\d+ tests?\b")  # the default reporter's file line
_VITEST_CONSOLE = re.compile(r"^std(?:out|err) \| ")  # a test's console.log, up to a blank line
_VITEST_SECTION = re.compile(r"^⎯+ (?P<name>Failed Tests|Failed Suites|Unhandled Errors?) \d+ ⎯+$")
_VITEST_MARKS = {"✓": TestStatus.PASSED, "×": TestStatus.FAILED, "↓": TestStatus.SKIPPED, "□": TestStatus.SKIPPED}


_VITEST_COUNT = re.compile(r"(\d+) (failed|passed|expected fail|skipped|todo)\b")
#: vitest's counts by the mark of a test's line: an expected failure (``test.fails``) is ``✓``
_VITEST_WORDS = {"failed": TestStatus.FAILED, "passed": TestStatus.PASSED, "expected fail": TestStatus.PASSED,
                 "skipped": TestStatus.SKIPPED, "todo": TestStatus.SKIPPED}


def parse_vitest_output(text: str) -> ParsedOutput:
    """``vitest run --reporter=verbose``; the default reporter names failures only.

    A test's ``console.log`` comes in ``stdout |``/``stderr |`` blocks (skipped); what it
    writes to ``process.stdout`` directly lands among the result lines (vitest writes a
    test's line when it ends, the test's own writes come while it runs, before or after
    other tests' lines). ``FAIL  file > name`` is read in "Failed Tests" only ("Failed
    Suites" names suites, which are not tests): vitest's own list of its failed tests.
    """
    lines = strip_ansi(text).splitlines()
    total_at = max((i for i, line in enumerate(lines) if _VITEST_TOTAL.match(line)), default=None)
    end = total_at if total_at is not None else len(lines)
    verbose = not any(_VITEST_FILE_SUMMARY.match(line) for line in lines[:end])
    found: dict[str, TestStatus] = {}
    seen: dict[str, set[TestStatus]] = {}  # every status each id's lines gave
    failed: set[str] = set()
    section = ""
    in_console = False
    for line in lines[:end]:
        if in_console:
            in_console = bool(line.strip())
            continue
        if _VITEST_CONSOLE.match(line):
            in_console = True
        elif m := _VITEST_SECTION.match(line):
            section = m.group("name")
        elif (m := _VITEST_TEST.match(line)) and verbose and not section:
            status = _VITEST_MARKS[m.group("mark")]
            merge(found, m.group("id"), status)
            seen.setdefault(m.group("id"), set()).add(status)
        elif (m := _VITEST_FAIL.match(line)) and section == "Failed Tests":
            failed.add(m.group("id"))
    for test_id in failed:
        merge(found, test_id, TestStatus.FAILED)
    total = int(_VITEST_TOTAL.match(lines[total_at]).group("n")) if total_at is not None else None  # type: ignore[union-attr]
    suspect, doubt = "", None
    if total is not None and verbose and seen:
        counted = dict.fromkeys((TestStatus.PASSED, TestStatus.FAILED, TestStatus.SKIPPED), 0)
        for n, word in _VITEST_COUNT.findall(lines[total_at]):  # type: ignore[index]
            counted[_VITEST_WORDS[word]] += int(n)
        doubt, settled = doubted(seen, counted, failed if len(failed) == counted[TestStatus.FAILED] else None)
        found.update({t: st for t, st in settled.items() if t in found})
        named = {st: sum(1 for v in found.values() if v is st) for st in counted}
        if doubt or named != counted:
            suspect = "; ".join(f"the runner counted {counted[st]} {st.value}, the log names {named[st]}"
                                for st in counted if named[st] != counted[st]) or "an id's result lines disagree"
            doubt = doubt or list(found)
    return build(found, complete=total is not None, reported_total=total, source="vitest",
                 totals={"tests": total} if total is not None else None, suspect=suspect, in_doubt=doubt,
                 counted_per_status=doubt is not None)


# ------------------------------------------------------------------------------ mocha

_MOCHA_LINE = re.compile(r"^(?P<indent>  (?:  )*)(?P<mark>✔ |✓ |\d+\) |- )?(?P<name>\S.*?)(?: \(\d+ms\))?$")
_MOCHA_COUNT = re.compile(r"^  (?P<n>\d+) (?P<word>passing|failing|pending)(?: \(.*\))?$")
_MOCHA_FAILURE = re.compile(r"^  (?P<num>\d+)\) (?P<first>.*)$")


def parse_mocha_output(text: str) -> ParsedOutput:
    """mocha's spec reporter: a suite's title when it starts, ``✔ name`` / ``N) name`` /
    ``- name`` when a test ends, then ``N passing`` / ``N failing`` / ``N pending`` and the
    numbered failures, each with its suite path.

    A numbered line in the tree is mocha's only where the numbered list after the counts
    names that very test under that number (a printed ``1) plain`` or ``  1) calc`` is
    skipped, and opens or closes no suite); with no counts (a cut run) every one is taken.
    mocha runs a suite's own tests before its child suites and ends a top-level suite with
    an empty line, so while a top-level suite is open a line at the top level (a suite's
    title, a root test's result) is mocha's only right after an empty line: a test printing
    ``  key: value`` does not rename the tests after it.
    """
    lines = strip_ansi(text).splitlines()
    # The last block of counts is mocha's own: a test may print "  99 passing" before it.
    counts_at = None
    for i, line in enumerate(lines):
        if _MOCHA_COUNT.match(line) and (i == 0 or not _MOCHA_COUNT.match(lines[i - 1])):
            counts_at = i
    end = counts_at if counts_at is not None else len(lines)
    totals: dict[str, int] = {}
    i = end
    while i < len(lines) and (m := _MOCHA_COUNT.match(lines[i])):
        totals[m.group("word")] = int(m.group("n"))
        i += 1
    numbered = _mocha_failures(lines[i:]) if counts_at is not None else None
    found: dict[str, TestStatus] = {}
    seen: dict[str, set[TestStatus]] = {}  # every status each id's lines gave
    suites: list[str] = []
    top_open = False  # a top-level suite's title was mocha's, its closing empty line not seen
    for at, line in enumerate(lines[:end]):
        m = _MOCHA_LINE.match(line)
        if m is None or _MOCHA_COUNT.match(line):
            continue  # a count line before mocha's own counts was printed by a test
        level = len(m.group("indent")) // 2 - 1
        if level > len(suites):
            continue
        mark = (m.group("mark") or "").strip()
        test_id = SEP.join([*suites[:level], m.group("name")])
        if mark.endswith(")") and numbered is not None and numbered.get(int(mark[:-1])) != test_id:
            continue  # not the failure mocha numbered so: printed
        if level == 0:
            if top_open and at > 0 and lines[at - 1].strip():
                continue  # the open top-level suite has not ended: printed
            top_open = not mark
        del suites[level:]
        if not mark:
            suites.append(m.group("name"))
            continue
        if mark in ("✔", "✓"):
            status = TestStatus.PASSED
        elif mark == "-":
            status = TestStatus.SKIPPED
        else:
            status = TestStatus.FAILED
        merge(found, test_id, status)
        seen.setdefault(test_id, set()).add(status)
    for test_id in (numbered or {}).values():
        merge(found, test_id, TestStatus.FAILED)
    total = sum(totals.values()) if totals else None
    suspect, doubt = "", None
    if counts_at is not None:
        counted = {st: totals.get(word, 0) for word, st in _MOCHA_WORDS.items()}
        listed = set((numbered or {}).values())
        doubt, settled = doubted(seen, counted, listed if len(listed) == counted[TestStatus.FAILED] else None)
        found.update({t: st for t, st in settled.items() if t in found})
        named = {st: sum(1 for v in found.values() if v is st) for st in counted}
        if doubt or named != counted:
            suspect = "; ".join(f"the runner counted {counted[st]} {word}, the log names {named[st]}"
                                for word, st in _MOCHA_WORDS.items() if named[st] != counted[st]) or \
                "an id's result lines disagree"
            doubt = doubt or list(found)
    return build(found, complete=counts_at is not None, reported_total=total, source="mocha", totals=totals,
                 suspect=suspect, in_doubt=doubt, counted_per_status=True)


_MOCHA_WORDS = {"passing": TestStatus.PASSED, "failing": TestStatus.FAILED, "pending": TestStatus.SKIPPED}


def _mocha_failures(lines: list[str]) -> dict[int, str]:
    """``  1) suite\n       nested\n         test name:`` -- the path ends at the ``:`` line."""
    out: dict[int, str] = {}
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
            out.setdefault(int(m.group("num")), SEP.join(parts))
    return out


# ------------------------------------------------------------------------------ JSON reports

#: The repository root inside the verification sandbox: JSON reports name test files by
#: absolute path, made relative to it (as the text reporters print them when the tests run
#: at the repository root).
SANDBOX_ROOT = "/sandbox/workspace/"


def _last_json_object(text: str, key: str) -> dict | None:
    """The last JSON object in ``text`` (a report file, or a log around it) holding ``key``.

    The runner writes its report after the tests ran, so a report-like object a test
    printed comes before the real one.
    """
    decoder = json.JSONDecoder()
    found = None
    for m in _JSON_START.finditer(text):
        try:
            value, _end = decoder.raw_decode(text, m.start())
        except ValueError:
            continue
        if isinstance(value, dict) and key in value:
            found = value
    return found


_JSON_START = re.compile(r"^\{", re.MULTILINE)


def _relative(path: str) -> str:
    return path[len(SANDBOX_ROOT):] if path.startswith(SANDBOX_ROOT) else path


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _parse_jest_like_json(text: str, source: str) -> ParsedOutput:
    """jest's ``--json`` and vitest's ``--reporter=json`` (the same shape)."""
    report = _last_json_object(text, "testResults")
    found: dict[str, TestStatus] = {}
    if report is None:
        return build(found, complete=False, reported_total=None, source=source)
    for file_result in report.get("testResults") or []:
        if not isinstance(file_result, dict):
            continue
        file = _relative(str(file_result.get("name", "")))
        for case in file_result.get("assertionResults") or []:
            if not isinstance(case, dict):
                continue
            titles = [str(t) for t in case.get("ancestorTitles") or []]
            status = {"passed": TestStatus.PASSED, "failed": TestStatus.FAILED}.get(
                str(case.get("status")), TestStatus.SKIPPED)  # pending, skipped, todo, disabled
            merge(found, SEP.join([file, *titles, str(case.get("title", ""))]), status)
    total = _int(report.get("numTotalTests"))
    notes = ["the run was interrupted"] if report.get("wasInterrupted") else []
    return build(found, complete=not notes, reported_total=total, source=source,
                 totals={"tests": total} if total is not None else None, notes=notes)


def parse_jest_json(text: str) -> ParsedOutput:
    """``jest --json [--outputFile=report.json]``: the report file, or the log holding it."""
    return _parse_jest_like_json(text, "jest_json")


def parse_vitest_json(text: str) -> ParsedOutput:
    """``vitest run --reporter=json [--outputFile=report.json]``."""
    return _parse_jest_like_json(text, "vitest_json")


def parse_mocha_json(text: str) -> ParsedOutput:
    """``mocha --reporter json``: ids are mocha's ``fullTitle`` (suite and test titles
    joined by spaces, as ``--grep`` and the TAP reporter name them); a failed hook is a
    failure of its own (``suite "before each" hook for "test"``)."""
    report = _last_json_object(text, "stats")
    found: dict[str, TestStatus] = {}
    if report is None or not isinstance(report.get("stats"), dict):
        return build(found, complete=False, reported_total=None, source="mocha_json")
    for key, status in (("passes", TestStatus.PASSED), ("pending", TestStatus.SKIPPED),
                        ("failures", TestStatus.FAILED)):
        for case in report.get(key) or []:
            if isinstance(case, dict) and "fullTitle" in case:
                merge(found, str(case["fullTitle"]), status)
    tests = _int(report["stats"].get("tests"))
    listed = {str(c.get("fullTitle")) for c in report.get("tests") or [] if isinstance(c, dict)}
    hooks = sum(1 for c in report.get("failures") or [] if isinstance(c, dict) and str(c.get("fullTitle")) not in listed)
    total = None if tests is None else tests + hooks
    return build(found, complete="end" in report["stats"], reported_total=total, source="mocha_json",
                 totals={k: v for k in ("tests", "passes", "pending", "failures") if (v := _int(report["stats"].get(k))) is not None})
