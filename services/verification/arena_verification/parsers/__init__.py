"""Test-output parsers by name: the ``parser`` field of a ``tests`` verifier picks one.

Every parser is pure (text in, :class:`~arena_verification.parsed.ParsedOutput` out) and
tested on real output of its runner (``tests/fixtures/corpus/<runner>/``, every common mode,
and ``tests/fixtures/<runner>/``).
"""

from __future__ import annotations

from collections.abc import Callable

from arena_verification.parsed import ParsedOutput
from arena_verification.parsers.cargo_parser import parse_cargo_json, parse_cargo_test_output
from arena_verification.parsers.go_parser import parse_go_test_json, parse_go_test_output
from arena_verification.parsers.js_parser import (
    parse_jest_json,
    parse_jest_output,
    parse_mocha_json,
    parse_mocha_output,
    parse_vitest_json,
    parse_vitest_output,
)
from arena_verification.parsers.junit_parser import parse_junit_xml, parse_node_junit_xml, parse_pytest_junit_xml
from arena_verification.parsers.node_parser import parse_node_spec, parse_node_tap
from arena_verification.parsers.tap_parser import parse_tap
from arena_verification.parsers.unittest_parser import parse_unittest_output
from arena_verification.pytest_parser import parse_pytest_output

Parser = Callable[[str], ParsedOutput]

PARSERS: dict[str, Parser] = {
    "pytest": parse_pytest_output,
    "pytest_junit": parse_pytest_junit_xml,
    "unittest": parse_unittest_output,
    "go_test": parse_go_test_output,
    "go_test_json": parse_go_test_json,
    "cargo": parse_cargo_test_output,
    "cargo_json": parse_cargo_json,
    "node_spec": parse_node_spec,
    "node_tap": parse_node_tap,
    "jest": parse_jest_output,
    "jest_json": parse_jest_json,
    "vitest": parse_vitest_output,
    "vitest_json": parse_vitest_json,
    "mocha": parse_mocha_output,
    "mocha_json": parse_mocha_json,
    "tap": parse_tap,
    "junit": parse_junit_xml,
    "node_junit": parse_node_junit_xml,
}

#: Parsers that read an XML report file rather than the console log.
XML_PARSERS = frozenset({"pytest_junit", "junit", "node_junit"})



def get_parser(name: str) -> Parser:
    """The parser called ``name``; ``KeyError`` with the known names otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown test-output parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
