"""Parse pytest's terminal output into per-test results. Pure: text in, results out.

Only the short test summary info and the ``-v`` progress section are read, so a test cannot
report itself passed by printing result lines. See docs/verification.md ("The pytest parser").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple


from arena_core.schemas import TestResult, TestStatus
from arena_verification.parsed import ParsedOutput, name_ids, strip_ansi

STATUS_WORDS: dict[str, TestStatus] = {
    "PASSED": TestStatus.PASSED,
    "FAILED": TestStatus.FAILED,
    "ERROR": TestStatus.ERROR,
    "SKIPPED": TestStatus.SKIPPED,
    "XFAIL": TestStatus.XFAILED,
    "XPASS": TestStatus.XPASSED,
}

#: When one id is reported twice (a pass followed by a teardown error), the worse wins.
_SEVERITY = {
    TestStatus.SKIPPED: 0,
    TestStatus.XFAILED: 1,
    TestStatus.PASSED: 2,
    TestStatus.XPASSED: 3,
    TestStatus.FAILED: 4,
    TestStatus.ERROR: 5,
}

_SEP_HEADER = re.compile(r"^=+ (?P<title>.+?) =+$")
#: ``N word`` or, for subtests (pytest >= 9, pytest-subtests), ``N subtests passed``.
_COUNT = r"\d+ [a-z]+(?: [a-z]+)?"
_FINAL = re.compile(
    rf"^(?:=+ )?(?P<body>(?:no tests ran|{_COUNT}(?:, {_COUNT})*) in \d+(?:\.\d+)?s(?: \([^)]*\))?)(?: =+)?$"
)
_FINAL_COUNT = re.compile(r"(\d+) ([a-z]+(?: [a-z]+)?)")
_SINGULAR = {"errors": "error", "warnings": "warning"}
_OUTCOME_WORDS = frozenset({"passed", "failed", "error", "skipped", "xfailed", "xpassed"})
_SUMMARY_LINE = re.compile(r"^(?P<word>PASSED|FAILED|ERROR|XFAIL|XPASS) (?P<rest>\S.*)$")
#: A failed subtest folds into its test: ``SUBFAILED[msg] (i=1) tests/x.py::test_a - ...``
#: (pytest >= 9, pytest-subtests >= 0.14) or ``[msg] (i=1) SUBFAIL tests/x.py::test_a - ...``
#: (pytest-subtests <= 0.13).
_SUMMARY_SUB = re.compile(
    r"^(?:[\[(].*? )?SUBFAIL(?:ED)?(?:[\[(].*?)? (?P<rest>[^\s:\[\]]+\.py::.*)$"
)
_SUMMARY_SKIP = re.compile(r"^SKIPPED \[(?P<n>\d+)\] \S")
#: A node id starts with a path to a .py file, then ``::``-separated names.
_ID_HEAD = re.compile(r"(?P<path>[^\s:\[\]]+\.py)(?P<names>(?:::[\w.]+)*)")
_SUMMARY_TAIL = re.compile(r"^(?: .*)?$")
_STATUS = r"(?P<word>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \(.*\))?(?:\s+\[\s*\d+%\])?\s*"
_VERBOSE_TAIL = re.compile(rf"^ {_STATUS}$")
#: ``-v -s``: the test's own output follows its id, its status comes alone on a later line.
_BARE_STATUS = re.compile(rf"^{_STATUS}$")
#: A subtest's progress line (its failure folds into the test): `` SUBFAILED[msg] (i=1)  [ 50%]``
#: or, before pytest 9, `` [msg] (i=1) SUBFAIL  [ 50%]``.
_VERBOSE_SUB_TAIL = re.compile(r"^ (?:[\[(].*? )?SUB(?P<word>FAILED|FAIL|PASSED|PASS|SKIPPED|SKIP)\b.*$")
#: pytest-xdist with ``-v``: ``[gw0] [ 50%] PASSED tests/x.py::test_a``.
_XDIST_LINE = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (?P<word>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?P<rest>\S.*)$")
_XDIST_TAIL = re.compile(r"^\s*$")
#: pytest's banner when a run was stopped early by Ctrl-C / SIGINT (``timeout -s INT``).
_INTERRUPTED = re.compile(r"^!+ (?:KeyboardInterrupt|_pytest\.outcomes\.Exit\b.*) !+$")

SUMMARY_TITLE = "short test summary info"
SESSION_TITLE = "test session starts"


def canonical_id(test_id: str) -> str:
    """``path::name[param]``: forward slashes in the path, no leading ``./``.

    Only the path is touched: a parameter keeps its backslashes (pytest prints ``\\`` for
    one backslash and ``\xe9`` for a non-ASCII character, as in FAIL_TO_PASS lists).
    """
    path, sep, rest = test_id.partition("::")
    test_id = path.replace("\\", "/") + sep + rest
    while test_id.startswith("./"):
        test_id = test_id[2:]
    return test_id


def split_node_id(text: str, tail_ok: Callable[[str], bool]) -> tuple[str, str] | None:
    """Split ``text`` into a node id and the rest, or ``None`` if it does not start with one.

    A parametrized id ends at a ``]`` that is followed by an acceptable tail; ids whose
    brackets balance are preferred, since a parameter may itself hold ``]``, spaces or
    `` - `` (``test_p[x[1]]``, ``test_p[left - right]``).
    """
    head = _ID_HEAD.match(text)
    if head is None:
        return None
    end = head.end()
    if end >= len(text) or text[end] != "[":
        return (text[:end], text[end:]) if tail_ok(text[end:]) else None
    if not head.group("names"):
        return None  # a module id takes no parameter
    candidates: list[tuple[bool, int]] = []
    depth = 0
    balanced_so_far = True
    for i in range(end, len(text)):
        ch = text[i]
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                balanced_so_far = False
            if tail_ok(text[i + 1 :]):
                candidates.append((balanced_so_far and depth == 0, i + 1))
    if not candidates:
        return None
    balanced = [pos for ok, pos in candidates if ok]
    pos = balanced[0] if balanced else candidates[0][1]
    return text[:pos], text[pos:]


def _merge(into: dict[str, TestStatus], test_id: str, status: TestStatus) -> None:
    current = into.get(test_id)
    if current is None or _SEVERITY[status] > _SEVERITY[current]:
        into[test_id] = status


def _summary_tail_ok(tail: str) -> bool:
    return _SUMMARY_TAIL.match(tail) is not None


def _parse_summary(lines: list[str]) -> tuple[dict[str, TestStatus], int]:
    found: dict[str, TestStatus] = {}
    skips = 0
    for line in lines:
        skip = _SUMMARY_SKIP.match(line)
        if skip:
            skips += int(skip.group("n"))
            continue
        if (m := _SUMMARY_LINE.match(line)) is not None:
            status = STATUS_WORDS[m.group("word")]
        elif (m := _SUMMARY_SUB.match(line)) is not None:
            status = TestStatus.FAILED  # a failed subtest fails its test
        else:
            continue
        split = split_node_id(m.group("rest"), _summary_tail_ok)
        if split is None:
            continue
        _merge(found, canonical_id(split[0]), status)
    return found, skips


class _Verbose(NamedTuple):
    found: dict[str, TestStatus]
    announced: list[str]  # ids pytest printed when their test started, in order
    unconfirmed: str | None  # the last id resolved with no line of pytest's after its status


#: pytest-xdist's header, written before any test runs: ``2 workers [37 items]``.
_XDIST_HEADER = re.compile(r"^\d+ workers? \[\d+ items?\]$")


def _parse_verbose(lines: list[str]) -> _Verbose:
    """Progress lines with ``-v``: plain, ``-s`` (status on a later line) and xdist's.

    Also the ids pytest announced, in order: ``-v`` prints a test's id when it starts (its
    status follows on the same line when it ends), so a killed run ends on an id alone.
    xdist's ``[gw0] [ 50%] PASSED id`` lines are read only under xdist's header (written
    before any test ran; without xdist such a line is a test's print). With ``-s`` a test's
    output sits between its id and its status, so a status no line of pytest's followed (the
    next test's id) may be the test's own print: ``unconfirmed``.
    """
    found: dict[str, TestStatus] = {}
    announced: list[str] = []
    pending: str | None = None  # -s: a test whose id was printed, its status not yet
    unconfirmed: str | None = None
    xdist = False
    for line in lines:
        if not announced and not found and _XDIST_HEADER.match(line):
            xdist = True
            continue
        if (m := _XDIST_LINE.match(line)) is not None:
            if xdist:  # the controller's line: workers' output never reaches the log
                split = split_node_id(m.group("rest"), lambda tail: _XDIST_TAIL.match(tail) is not None)
                if split is not None:
                    _merge(found, canonical_id(split[0]), STATUS_WORDS[m.group("word")])
            continue
        if pending is not None and (m := _BARE_STATUS.match(line)) is not None:
            _merge(found, pending, STATUS_WORDS[m.group("word")])
            unconfirmed, pending = pending, None
            continue
        split = split_node_id(line, lambda tail: tail == "" or tail.startswith(" "))
        if split is None:
            continue
        test_id, tail = canonical_id(split[0]), split[1]
        if "::" in test_id:  # (without -v a module's line carries its tests' progress dots)
            announced.append(test_id)
            unconfirmed = None
        if (m := _VERBOSE_TAIL.match(tail)) is not None:
            _merge(found, test_id, STATUS_WORDS[m.group("word")])
            if "::" in test_id and not xdist:
                unconfirmed = test_id
            if test_id == pending:
                pending = None
        elif (m := _VERBOSE_SUB_TAIL.match(tail)) is not None:
            if m.group("word").startswith("FAIL"):
                _merge(found, test_id, TestStatus.FAILED)
        else:
            pending = test_id  # "id " then the test's own output (-s) or a crash
    return _Verbose(found, announced, unconfirmed)


def _progress_end(lines: list[str], start: int, headers: list[int], finals: list[int]) -> int:
    """Where the ``-v`` progress section ends: pytest's first section header or final line.

    pytest puts an empty line before them; with ``-s`` a test may print header-like lines
    into the progress section, without one before them as a rule.
    """
    marks = sorted(i for i in {*headers, *finals} if i > start)
    return next((i for i in marks if lines[i - 1] == ""), marks[0] if marks else len(lines))


def parse_pytest_output(text: str) -> ParsedOutput:
    """Parse one pytest run's combined stdout/stderr (``--color=yes`` codes are ignored)."""
    lines = strip_ansi(text).splitlines()
    headers = [(i, m.group("title")) for i, line in enumerate(lines) if (m := _SEP_HEADER.match(line))]
    finals = [i for i, line in enumerate(lines) if _FINAL.match(line)]

    summary_at = max((i for i, title in headers if title == SUMMARY_TITLE), default=None)
    summary: dict[str, TestStatus] = {}
    skips = 0
    if summary_at is not None:
        end = next((i for i in finals if i > summary_at), len(lines))
        summary, skips = _parse_summary(lines[summary_at + 1 : end])

    session_at = next((i for i, title in headers if title == SESSION_TITLE), None)
    verbose: dict[str, TestStatus] = {}
    announced: list[str] = []
    unconfirmed: str | None = None
    if session_at is not None:
        end = _progress_end(lines, session_at, [i for i, _ in headers], finals)
        verbose, announced, unconfirmed = _parse_verbose(lines[session_at + 1 : end])

    summary_lists_passes = any(s in (TestStatus.PASSED, TestStatus.XPASSED) for s in summary.values())
    merged = dict(summary)
    for test_id, status in verbose.items():
        if test_id in merged:
            continue
        if summary_lists_passes and status is not TestStatus.SKIPPED:
            continue  # -rA names every outcome but skips; progress lines only fill those in
        merged[test_id] = status

    last_final = finals[-1] if finals else None
    anchor = summary_at if summary_at is not None else session_at
    complete = last_final is not None and (anchor is None or last_final > anchor)
    notes: list[str] = []
    if complete and any(_INTERRUPTED.match(line) for line in lines[anchor or 0 : last_final]):
        complete = False  # Ctrl-C / SIGINT: pytest still prints its summary of the tests so far
        notes.append("the run was interrupted (KeyboardInterrupt)")
    totals: dict[str, int] = {}
    if complete and last_final is not None:
        body = _FINAL.match(lines[last_final]).group("body")  # type: ignore[union-attr]
        for n, word in _FINAL_COUNT.findall(body.rsplit(" in ", 1)[0]):
            word = _SINGULAR.get(word, word)
            totals[word] = totals.get(word, 0) + int(n)

    # A log naming more tests than pytest's own final counts had result lines printed into it.
    counted = sum(n for word, n in totals.items() if word in _OUTCOME_WORDS)
    suspect = complete and len(merged) > counted
    in_doubt: list[str] = []
    if suspect:
        in_doubt = list(merged)
        notes.append(f"the log names {len(merged)} tests but the runner counted {counted}; in doubt: {name_ids(in_doubt)}")
    elif complete:
        # More tests of one outcome than pytest counted: a printed line changed a result.
        over = [st for st in set(merged.values())
                if st.value in totals and sum(1 for v in merged.values() if v is st) > totals[st.value]]
        in_doubt = [k for k, v in merged.items() if v in over]
        if in_doubt:
            suspect = True
            notes.append(f"the log names more {'/'.join(sorted(o.value for o in over))} tests than the runner "
                         f"counted; in doubt: {name_ids(in_doubt)}")
    if not complete and unconfirmed is not None and unconfirmed not in summary:
        # Cut right after a status no line of pytest's followed: with -s the test may have
        # printed it ("PASSED", or a whole progress line) and been killed while still running.
        merged.pop(unconfirmed, None)
    unresolved = [] if complete else [t for t in dict.fromkeys(announced) if t not in merged]
    if not complete:
        if not notes:
            notes.append("the runner's end-of-run summary is missing (crash, kill or timeout)")
        if unresolved:
            notes.append(f"the run was cut: {len(unresolved)} announced tests never resolved: {name_ids(unresolved)}")
    used_summary = bool(summary)
    used_verbose = any(test_id not in summary for test_id in merged)
    source = "+".join(name for name, used in (("summary", used_summary), ("verbose", used_verbose)) if used)
    return ParsedOutput(
        results=[TestResult(test_id=k, status=v) for k, v in merged.items()],
        complete=complete,
        totals=totals,
        unattributed_skips=skips,
        source=source or "none",
        suspect=suspect,
        notes=notes,
        in_doubt=in_doubt,
        unresolved=unresolved,
    )
