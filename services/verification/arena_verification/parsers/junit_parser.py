"""JUnit XML (Maven Surefire, Gradle, ``pytest --junitxml``) -> per-test results. Pure.

Parsers ``junit``, ``node_junit`` and ``pytest_junit``; read incrementally with expat. Ids and
outcomes: docs/verification.md (Parsers, "The other parsers, runner by runner").
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Callable

import msgspec

from arena_core.schemas import TestStatus
from arena_verification.parsed import SEVERITY, ParsedOutput, build, merge

_XML_DECL = re.compile(r"<\?xml[^>]*\?>")
_NODE_TESTS = re.compile(r"<!-- tests (\d+) -->")


def junit_id(classname: str, name: str) -> str:
    return f"{classname}#{name}" if classname else name


def pytest_id(classname: str, name: str) -> str:
    parts = classname.split(".") if classname else []
    classes: list[str] = []
    while parts and parts[-1][:1].isupper():
        classes.insert(0, parts.pop())
    if not parts:
        return "::".join([*classes, name])
    return "::".join(["/".join(parts) + ".py", *classes, name])


def _documents(text: str) -> list[str]:
    """Split concatenated XML documents at their ``<?xml ...?>`` declarations."""
    starts = [m.start() for m in _XML_DECL.finditer(text)]
    if not starts:
        return [text] if text.strip() else []
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def _events(parser: ET.XMLPullParser):
    """The parser's events up to the first error (which it raises from ``read_events``)."""
    events = parser.read_events()
    while True:
        try:
            yield next(events)
        except (StopIteration, ET.ParseError):
            return


def node_id(suites: list[str], name: str) -> str:
    return " > ".join([*suites, name])


def _parse_document(doc: str, make_id: Callable[[str, str], str], found: dict[str, TestStatus],
                    nested: Callable[[list[str], str], str] | None = None) -> tuple[bool, int | None, int]:
    """Parse one document into ``found``; (complete, declared total, passing cases seen).

    ``nested``: ids from the names of the enclosing ``<testsuite>`` elements (node's
    reporter nests a test's subtests and ``describe`` blocks so) instead of ``classname``;
    a ``<skipped type="todo">`` case is then skipped even when it failed, as node counts it.
    """
    parser = ET.XMLPullParser(events=("start", "end"))
    suites: list[str] = []
    todo = False
    declared: int | None = None
    seen = 0
    case_status: TestStatus | None = None
    complete = False
    try:
        parser.feed(doc)
        parser.close()
        complete = True
    except ET.ParseError:
        complete = False
    depth = 0
    for event, elem in _events(parser):
        tag = elem.tag.rsplit("}", 1)[-1]
        depth += 1 if event == "start" else -1
        if event == "end" and depth == 0:
            complete = True  # the root element closed: text after it (a runner's own lines) is not a cut
        if tag == "testsuite":
            if event == "start":
                suites.append(elem.get("name", ""))
            elif suites:
                suites.pop()
        if event == "start":
            if tag == "testsuite" and elem.get("tests", "").isdigit() and nested is None:
                declared = (declared or 0) + int(elem.get("tests", "0"))
            elif tag == "testcase":
                case_status, todo = TestStatus.PASSED, False
            elif case_status is not None and tag in ("failure", "error", "skipped"):
                status = {"failure": TestStatus.FAILED, "error": TestStatus.ERROR, "skipped": TestStatus.SKIPPED}[tag]
                if tag == "skipped" and elem.get("type") == "pytest.xfail":
                    status = TestStatus.XFAILED  # pytest writes an expected failure as a skip
                todo = todo or (tag == "skipped" and elem.get("type") == "todo")
                if case_status is TestStatus.PASSED or SEVERITY[status] > SEVERITY[case_status]:
                    case_status = status  # a case's worst child wins (a failure, then an error)
            continue
        if tag == "testcase" and case_status is not None:
            if nested is not None:
                test_id = nested(suites[1:] if suites and suites[0] == "" else suites, elem.get("name", ""))
                if todo:
                    case_status = TestStatus.SKIPPED
            else:
                test_id = make_id(elem.get("classname", ""), elem.get("name", ""))
            merge(found, test_id, case_status)
            if case_status in (TestStatus.PASSED, TestStatus.XFAILED):
                seen += 1  # reporters leave todo cases and failed hooks out of tests="N"
            case_status = None
    return complete, declared, seen


def _parse(text: str, make_id: Callable[[str, str], str], source: str,
           nested: Callable[[list[str], str], str] | None = None) -> ParsedOutput:
    found: dict[str, TestStatus] = {}
    docs = _documents(text)
    complete = bool(docs)
    suspect_notes: list[str] = []
    declared_total: int | None = 0
    for doc in docs:
        ok, declared, seen = _parse_document(doc, make_id, found, nested)
        if nested is not None and (m := _NODE_TESTS.search(doc)):
            declared = int(m.group(1))  # node's "<!-- tests N -->" (tests with subtests count too)
        complete = complete and ok
        if declared is None or declared_total is None:
            declared_total = None
        else:
            declared_total += declared
        if declared is not None and seen > declared:
            suspect_notes.append(f"a report declares {declared} tests and holds {seen} passing")
    parsed = build(found, complete=complete, reported_total=None, source=source, notes=suspect_notes,
                   totals={"tests": declared_total} if declared_total else None)
    if suspect_notes and not parsed.suspect:
        parsed = msgspec.structs.replace(parsed, suspect=True)
    return parsed


def parse_junit_xml(text: str) -> ParsedOutput:
    return _parse(text, junit_id, "junit")


def parse_pytest_junit_xml(text: str) -> ParsedOutput:
    return _parse(text, pytest_id, "pytest_junit")


def parse_node_junit_xml(text: str) -> ParsedOutput:
    """``node --test --test-reporter=junit --test-reporter-destination=report.xml``."""
    return _parse(text, junit_id, "node_junit", nested=node_id)
