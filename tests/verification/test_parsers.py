"""Every test-output parser on real logs of its real runner (tests/fixtures/<runner>/)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from arena_core.schemas import TestsVerifier
from arena_verification.protected import FAMILY
from arena_verification.parsers import PARSERS, get_parser

F = Path(__file__).resolve().parents[1] / "fixtures"
P, FA, E, S, XF = "passed", "failed", "error", "skipped", "xfailed"


def parse(parser: str, fixture: str):
    out = PARSERS[parser]((F / fixture).read_text())
    return out, {r.test_id: r.status.value for r in out.results}


#: Parsers registered here that the schema's ``parser`` Literal (libs/arena_core/schemas.py) is
#: to list too; once it does, this set can go and the test below is an equality again.
def test_registry_matches_the_schema_literal():
    field = next(f for f in msgspec.inspect.type_info(TestsVerifier).fields if f.name == "parser")
    assert set(field.type.values) == set(PARSERS)
    assert set(PARSERS) <= set(FAMILY)  # each parser's runner family decides which files are protected
    with pytest.raises(KeyError, match="known: cargo"):
        get_parser("nope")


def test_unittest_mixed_log_names_a_ghost_so_it_is_suspect():
    out, got = parse("unittest", "unittest/mixed_v.txt")
    m = "test_calc.TestCalc."
    assert got == {m + "test_add": P, m + "test_error": E, m + "test_fail": FA, m + "test_ghost": P,
                   m + "test_prints_ok": P, m + "test_skip": S, m + "test_sub": FA, m + "test_xfail": XF,
                   "test_calc.TestOther.test_one": P}
    # test_fail printed "ok" before failing: the FAIL: header still wins; the printed ghost
    # line makes the log name 9 tests while unittest ran 8.
    assert out.complete and out.suspect and out.totals == {"tests": 8}


def test_unittest_killed_run_gives_tests_so_far():
    out, got = parse("unittest", "unittest/killed_v.txt")
    assert got == {"test_slow.TestSlow.test_a_fast": P, "test_slow.TestSlow.test_b_fast": P}
    assert not out.complete and out.truncated and not out.suspect


@pytest.mark.parametrize("parser,fixture", [("go_test", "go/mixed_v.txt"), ("go_test_json", "go/mixed_json.txt")])
def test_go_printed_pass_lines_cannot_hide_a_failure_or_invent_a_test(parser, fixture):
    out, got = parse(parser, fixture)
    c = "example.com/calc::"
    assert got == {c + "TestAdd": P, c + "TestFail": FA, c + "TestSkip": S, c + "TestSub": FA,
                   c + "TestSub/one": P, c + "TestSub/two_words": FA, "example.com/calc/strs::TestTwice": P}
    assert out.complete and not out.suspect


def test_go_killed_runs():
    out, got = parse("go_test", "go/killed_v.txt")
    assert got == {"TestAFast": P, "TestBFast": P} and not out.complete  # package unknown: never finished
    out, got = parse("go_test_json", "go/killed_json.txt")
    assert got == {"example.com/slow::TestAFast": P, "example.com/slow::TestBFast": P} and not out.complete


@pytest.mark.parametrize("fixture", ["cargo/mixed.txt", "cargo/nocapture.txt"])
def test_cargo_with_and_without_capture(fixture):
    out, got = parse("cargo", fixture)
    assert got == {"tests::adds": P, "tests::fails": FA, "tests::ignored": S, "tests::panics": P,
                   "integration_adds": P}
    assert out.complete and not out.suspect


def test_cargo_killed():
    out, got = parse("cargo", "cargo/killed.txt")
    assert got == {"tests::a_fast": P} and not out.complete


NODE = {"adds": P, "fails": FA, "skipped": S, "todo": S, "suite > inner passes": P,
        "suite > inner fails": FA, "suite > deeper > deep passes": P,
        "suite": FA, "suite > deeper": P}  # describes are results too, as node reports them


def test_node_tap_escapes_test_output():
    out, got = parse("node_tap", "node/mixed_tap.txt")
    assert got == NODE and out.complete and not out.suspect and out.totals == {"tests": 7, "suites": 2}


def test_node_spec_shows_printed_lines_and_is_suspect():
    out, got = parse("node_spec", "node/mixed_spec.txt")
    assert got == {**NODE, "ghost": P}
    assert out.complete and out.suspect


@pytest.mark.parametrize("parser", ["node_tap", "node_spec"])
def test_node_killed(parser):
    out, got = parse(parser, f"node/killed_{parser[5:]}.txt")
    assert got == {"a fast": P, "b fast": P} and not out.complete


def test_jest_verbose():
    out, got = parse("jest", "js/jest_verbose.txt")
    f = "jest/calc.test.js > "
    assert got == {f + "top level": P, f + "calc > adds": P, f + "calc > fails": FA, f + "calc > skipped": S,
                   f + "calc > todo later": S, f + "calc > nested > deep passes": P}
    assert out.complete and not out.suspect  # the ghosts were printed outside the file's block


def test_jest_killed_prints_nothing_per_test():
    out, got = parse("jest", "js/jest_killed.txt")
    assert got == {} and not out.complete


def test_vitest_verbose():
    out, got = parse("vitest", "js/vitest_verbose.txt")
    f = "vitest/calc.test.js > "
    assert got == {f + "calc > adds": P, f + "calc > fails": FA, f + "calc > skipped": S,
                   f + "calc > todo later": S, f + "calc > nested > deep passes": P, f + "top level": P}
    assert out.complete and not out.suspect
    out, got = parse("vitest", "js/vitest_killed.txt")
    assert got == {"vitest_slow/slow.test.js > a fast": P} and not out.complete


def test_mocha_spec():
    out, got = parse("mocha", "js/mocha_spec.txt")
    assert got == {"calc > adds": P, "calc > ghost": P, "calc > fails": FA, "calc > skipped": S,
                   "calc > nested > deep passes": P}
    assert out.complete and out.suspect and out.totals == {"passing": 2, "pending": 1, "failing": 1}
    out, got = parse("mocha", "js/mocha_killed.txt")
    assert got == {"slow > a fast": P} and not out.complete


def test_surefire_junit_xml():
    out, got = parse("junit", "junit/surefire_TEST-calc.CalcTest.xml")
    assert got == {"calc.CalcTest#errors": E, "calc.CalcTest#adds": P, "calc.CalcTest#fails": FA,
                   "calc.CalcTest#ignored": S}
    assert out.complete and not out.suspect  # the <testcase> printed to stdout is text in <system-out>


def test_surefire_reports_concatenated_and_cut():
    both = "".join((F / "junit" / n).read_text() for n in ("surefire_TEST-calc.CalcTest.xml",
                                                           "surefire_TEST-calc.StrTest.xml"))
    out = PARSERS["junit"](both)
    assert len(out.results) == 5 and out.by_id()["calc.StrTest#concat"].value == P and out.complete
    out, got = parse("junit", "junit/surefire_cut.xml")  # hand-cut, see make_fixtures.py
    assert got == {"calc.CalcTest#errors": E, "calc.CalcTest#adds": P} and not out.complete


def test_pytest_junit_xml_ids_are_pytest_node_ids():
    out, got = parse("pytest_junit", "junit/pytest_junit.xml")
    t = "tests/test_calc.py::"
    assert got == {t + "test_pass": P, t + "test_fail": FA, t + "test_skip": S, t + "test_param[1]": P,
                   t + "test_param[2]": FA, t + "TestGroup::test_method": P}
    assert out.complete


def test_a_junit_report_holding_more_cases_than_it_declares_is_suspect():
    xml = (F / "junit" / "surefire_TEST-calc.StrTest.xml").read_text()
    forged = xml.replace("</testsuite>", '<testcase name="ghost" classname="calc.StrTest"/></testsuite>')
    out = PARSERS["junit"](forged)
    assert out.suspect and out.by_id()["calc.StrTest#ghost"].value == P


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_every_parser_survives_garbage(parser):
    out = PARSERS[parser]("\x00garbage\n<<<\n{not json\n" * 50)
    assert out.results == [] and not out.complete


def test_pytest_summary_naming_more_tests_than_pytest_counted_is_suspect():
    text = (F / "pytest" / "quickstart_rA.txt").read_text()
    out = PARSERS["pytest"](text)
    assert out.complete and not out.suspect and len(out.results) == 7
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "short test summary info" in line)
    forged = "\n".join([*lines[: at + 1], "PASSED tests/test_textstats.py::test_ghost", *lines[at + 1 :]])
    out = PARSERS["pytest"](forged)
    assert out.suspect and out.notes[0].startswith("the log names 8 tests but the runner counted 7; in doubt: ")
    assert "tests/test_textstats.py::test_ghost" in out.in_doubt
