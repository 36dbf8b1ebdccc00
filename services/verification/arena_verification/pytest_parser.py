"""Parse pytest's terminal output into per-test results. Pure: text in, results out.

Two trusted places in a pytest log carry test ids and outcomes:

- the *short test summary info* section (``-r`` flags; ``-rA`` lists every outcome):
  ``PASSED tests/x.py::test_a``, ``FAILED tests/x.py::test_b - AssertionError...``,
  ``ERROR ...``, ``XFAIL ...``, ``XPASS ...``. Skips appear as
  ``SKIPPED [1] tests/x.py:12: reason`` without a test id; they are counted in
  ``unattributed_skips`` and attributed only when ``-v`` lines name them;
- the progress section with ``-v``: ``tests/x.py::test_a PASSED    [ 50%]``.

Everything else is ignored, so a test cannot report itself as passed by printing result
lines: lines must start at column 0 with a status word or a node id of the right shape,
only the *last* summary header counts (pytest prints the real one after all captured
output), and the progress section ends at the first ``=== ... ===`` header. When the
summary lists passes (``-rA``), progress lines may only add skips the summary cannot name.

The log is ``complete`` when pytest's final ``=== N passed, M failed in Xs ===`` line comes
after the results; a killed or timed-out run lacks it.
"""

from __future__ import annotations

import re
from collections.abc import Callable


from arena.schemas import TestResult, TestStatus
from arena_verification.parsed import ParsedOutput

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

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SEP_HEADER = re.compile(r"^=+ (?P<title>.+?) =+$")
_FINAL = re.compile(
    r"^(?:=+ )?(?P<body>(?:no tests ran|\d+ [a-z]+(?:, \d+ [a-z]+)*) in \d+(?:\.\d+)?s(?: \([^)]*\))?)(?: =+)?$"
)
_FINAL_COUNT = re.compile(r"(\d+) ([a-z]+)")
_SINGULAR = {"errors": "error", "warnings": "warning"}
_OUTCOME_WORDS = frozenset({"passed", "failed", "error", "skipped", "xfailed", "xpassed"})
_SUMMARY_LINE = re.compile(r"^(?P<word>PASSED|FAILED|ERROR|XFAIL|XPASS) (?P<rest>\S.*)$")
_SUMMARY_SKIP = re.compile(r"^SKIPPED \[(?P<n>\d+)\] \S")
#: A node id starts with a path to a .py file, then ``::``-separated names.
_ID_HEAD = re.compile(r"(?P<path>[^\s:\[\]]+\.py)(?P<names>(?:::[\w.]+)*)")
_SUMMARY_TAIL = re.compile(r"^(?: .*)?$")
_VERBOSE_TAIL = re.compile(
    r"^ (?P<word>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \(.*\))?(?:\s+\[\s*\d+%\])?\s*$"
)

SUMMARY_TITLE = "short test summary info"
SESSION_TITLE = "test session starts"


def canonical_id(test_id: str) -> str:
    """``path::name[param]`` with forward slashes and no leading ``./``."""
    test_id = test_id.replace("\\", "/")
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


def _parse_summary(lines: list[str]) -> tuple[dict[str, TestStatus], int]:
    found: dict[str, TestStatus] = {}
    skips = 0
    for line in lines:
        skip = _SUMMARY_SKIP.match(line)
        if skip:
            skips += int(skip.group("n"))
            continue
        m = _SUMMARY_LINE.match(line)
        if m is None:
            continue
        split = split_node_id(m.group("rest"), lambda tail: _SUMMARY_TAIL.match(tail) is not None)
        if split is None:
            continue
        _merge(found, canonical_id(split[0]), STATUS_WORDS[m.group("word")])
    return found, skips


def _parse_verbose(lines: list[str]) -> dict[str, TestStatus]:
    found: dict[str, TestStatus] = {}
    for line in lines:
        split = split_node_id(line, lambda tail: _VERBOSE_TAIL.match(tail) is not None)
        if split is None:
            continue
        word = _VERBOSE_TAIL.match(split[1]).group("word")  # type: ignore[union-attr]
        _merge(found, canonical_id(split[0]), STATUS_WORDS[word])
    return found


def parse_pytest_output(text: str) -> ParsedOutput:
    """Parse one pytest run's combined stdout/stderr (``--color=yes`` codes are ignored)."""
    lines = _ANSI.sub("", text).splitlines()
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
    if session_at is not None:
        end = next((i for i, _ in headers if i > session_at), len(lines))
        end = min(end, next((i for i in finals if i > session_at), len(lines)))
        verbose = _parse_verbose(lines[session_at + 1 : end])

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
    totals: dict[str, int] = {}
    if complete and last_final is not None:
        body = _FINAL.match(lines[last_final]).group("body")  # type: ignore[union-attr]
        for n, word in _FINAL_COUNT.findall(body.rsplit(" in ", 1)[0]):
            word = _SINGULAR.get(word, word)
            totals[word] = totals.get(word, 0) + int(n)

    # A log naming more tests than pytest's own final counts had result lines printed into it.
    counted = sum(n for word, n in totals.items() if word in _OUTCOME_WORDS)
    suspect = complete and len(merged) > counted
    notes = [f"the log names {len(merged)} tests but the runner counted {counted}"] if suspect else []
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
    )
