"""Parsers on real runs whose tests print lines that look like their runner's result lines.

The runs are in tests/fixtures/corpus/<runner>/mimic_*.txt (tests/fixtures/corpus/capture_mimic.py);
the ground truth of each is the runner's own structured report of the same run where the
runner writes one beside its text (``mimic_*.truth.*``), written out here. The rule checked:
a log the parser does not call suspect gives exactly the truth; a suspect log names its ids
in doubt, and every other id it names agrees with the truth.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arena_verification.parsers import PARSERS
from arena_verification.parsers.js_parser import SANDBOX_ROOT

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus"
P, F, E, S = "passed", "failed", "error", "skipped"

PY = "tests/test_mimic.py::"
PY_TRUTH = {
    PY + "test_plain": P, PY + "test_prints_results_of_other_tests": P, PY + "test_really_fails": F,
    PY + "test_prints_bare_status_words": P, PY + "test_separators[a ... b]": P, PY + "test_separators[x > y]": P,
    PY + "test_separators[m::n]": F, PY + "test_separators[PASSED]": P, PY + "test_separators[ FAIL  f > n]": P,
    PY + "test_separators[--- FAIL: T]": P,
}
UT = "tests.test_mimic.TestMimic."
UT_TRUTH = {
    UT + "test_doc_ends_like_a_result": E, UT + "test_doc_starts_with_fail": P, UT + "test_doc_starts_with_ok": F,
    UT + "test_doc_with_dots": P, UT + "test_plain": P, UT + "test_prints_a_summary": F,
    UT + "test_prints_on_stderr": P,
}
GO = "example.com/mimic::"
GO_TRUTH = {  # go 1.19 writes no structured report of its own: test2json reads the same text
    GO + "TestAPasses": P, GO + "TestBPrintsOthersResults": P, GO + "TestCFailsAndPrintsPass": F,
    GO + "TestDSub": F, GO + "TestDSub/a": P, GO + "TestDSub/b": F,
}
RS_TRUTH = {"tests::a_passes": P, "tests::b_prints_others_results": P, "tests::c_fails": F}  # cargo_json's run
RT = "tests::"
RS_BLOCK_TRUTH = {RT + "a_prints_a_block_header": P, RT + "b_passes": P, RT + "c_fails": F}  # libtest's --logfile
RS_THREADS_TRUTH = {RT + "a_passes": P, RT + "b_fails": F, RT + "c_ignored": S, RT + "d_passes": P,
                    RT + "e_prints_while_others_end": P, RT + "f_passes": P}  # libtest's --logfile
NODE_TRUTH = {
    "plain": P, "prints results": P, "parent > child passes": P, "parent > child fails": F,
    "parent all pass > only child": P, "suite > in suite": P, "suite > inner suite > deep": P,
    "name with a > b, a :: b and a ... b": P,
    # node counts tests with subtests ("# tests") and describes ("# suites"): results too
    "parent": F, "parent all pass": P, "suite": P, "suite > inner suite": P,
}
JM = "test/mimic.test.js > calc > "
JS_TRUTH = {
    JM + "plain": P, JM + "prints results": P, JM + "fails": F, JM + "name with a > b, a :: b and a ... b": P,
    "test/suite.test.js > beside it": P,
}
JEST_TRUTH = {**JS_TRUTH, "test/suite.test.js > broken suite > under a broken suite": F}
VITEST_TRUTH = {**JS_TRUTH, "test/suite.test.js > broken suite > under a broken suite": S}
VF = "test/flips.test.js > calc > "
VITEST_FLIPS_TRUTH = {VF + "plain": P, VF + "fails": F, VF + "skipped": S, VF + "prints results": P, VF + "later": P}
VC = "test/console.test.js > calc > "
VITEST_CONSOLE_TRUTH = {VC + "plain": P, VC + "logs": P, VC + "fails": F}
MOCHA_TRUTH = {"calc > plain": P, "calc > prints results": P, "calc > name with a > b, a :: b and a ... b": P}
MOCHA_STATUSES_TRUTH = {"calc > plain": P, "calc > prints results": P, "calc > fails": F, "calc > skipped": S,
                        "calc > inner > deep": P, "second > passes": P}  # mocha's JSON reporter, same run


def _failures(truth: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in truth.items() if v in (F, E)}


#: case -> (the truth for what the mode names, complete, suspect)
CASES = {
    **{f"pytest/mimic_{m}.txt": (PY_TRUTH, True, False) for m in ("rA", "rA_v", "rA_v_s", "rA_s")},
    # -v -s without -rA: the printed "id PASSED" lines sit where pytest writes its own
    "pytest/mimic_v_s.txt": (PY_TRUTH, True, True),
    # pytest-timeout's signal method fails the test that printed "PASSED"; the run goes on
    "pytest/mimic_pytest_signal_v_s_status.txt": ({"tests/test_cut.py::test_a_passes": P,
                                                   "tests/test_cut.py::test_b_prints_passed": F,
                                                   "tests/test_cut.py::test_c_never_runs": P}, True, False),
    **{f"unittest/mimic_{m}.txt": (UT_TRUTH, True, True) for m in ("v", "v_b")},
    "unittest/mimic_default.txt": (_failures(UT_TRUTH), True, True),
    "go/mimic_v.txt": (GO_TRUTH, True, False),
    "go/mimic_json.txt": (GO_TRUTH, True, False),
    "cargo/mimic_default.txt": (RS_TRUTH, True, False),
    "cargo/mimic_json.txt": (RS_TRUTH, True, False),
    "cargo/mimic_json_nocapture.txt": (RS_TRUTH, True, False),
    "cargo/mimic_nocapture.txt": (RS_TRUTH, True, True),
    # one thread: libtest wrote "test x ... " when x started, so what x printed before its
    # status is x's output, "failures:" included
    "cargo/mimic_nocapture_threads1.txt": (RS_TRUTH, True, False),
    **{f"cargo/mimic_{m}.txt": (RS_THREADS_TRUTH, True, True) for m in ("threads_nocapture", "threads4_nocapture")},
    # a printed "---- tests::b_passes stdout ----" (libtest writes such blocks only after its
    # "failures:"/"successes:" header) swallowed every later line up to "failures:" on
    # several threads: the passes were lost, unflagged
    **{f"cargo/mimic_{m}.txt": (RS_BLOCK_TRUTH, True, False)
       for m in ("block", "block_nocapture", "block_nocapture_threads1")},
    # --show-output with every test passing: the "successes:" blocks never ended (no
    # "failures:" follows), libtest's summary was skipped and the run read as cut
    "cargo/mimic_show_output_all_pass.txt": ({RT + "a_prints": P, RT + "b_passes": P}, True, False),
    "node/mimic_tap.txt": (NODE_TRUTH, True, False),
    "node/mimic_spec.txt": (NODE_TRUTH, True, True),  # spec does not escape what a test prints
    "node/mimic_spec_color.txt": (NODE_TRUTH, True, True),
    **{f"jest/mimic_{m}.txt": (JEST_TRUTH, True, False) for m in ("verbose", "verbose_run_in_band", "verbose_color")},
    "jest/mimic_default.txt": (_failures(JEST_TRUTH), True, False),
    "jest/mimic_exit_verbose.txt": ({}, False, False),  # "● process.exit called" is jest's notice, not a test
    # the same notice after a file's block: still no test (the exit ended jest before its report)
    "jest/mimic_exit_after_a_file_verbose.txt": ({"test/a.test.js > loads and passes": P}, False, False),
    # a file that throws while loading: jest's "● Test suite failed to run", vitest's
    # "Failed Suites" naming the file; no test of either
    "jest/mimic_load_fails_verbose.txt": ({"test/ok.test.js > loads and passes": P}, True, False),
    "vitest/mimic_load_fails_verbose.txt": ({"test/ok.test.js > loads and passes": P}, True, False),
    "vitest/mimic_load_fails_default.txt": ({}, True, False),  # the default reporter names failures only
    **{f"vitest/mimic_{m}.txt": (VITEST_TRUTH, True, True) for m in ("verbose", "verbose_color")},
    # printed "× plain" and "✓ fails" after those tests' own lines (vitest writes a line when
    # its test ends), "↓ later" before later's: vitest's "Failed Tests" and counts settle them
    "vitest/mimic_verbose_flips.txt": (VITEST_FLIPS_TRUTH, True, False),
    # console.log output with an empty line: the rest of the "stdout |" block reads like
    # vitest's lines (a ghost, "× plain"): the counts catch it
    "vitest/mimic_verbose_console_blank.txt": (VITEST_CONSOLE_TRUTH, True, True),
    # the default reporter: "Failed Suites" names the suite, which is no test
    "vitest/mimic_default.txt": (_failures(VITEST_TRUTH), True, False),
    "mocha/mimic_spec.txt": (MOCHA_TRUTH, True, True),
    # printed "1) plain" (mocha numbered "fails" 1), "✔ fails", "- plain": the numbered list
    # and the counts settle every id
    "mocha/mimic_spec_flips.txt": (MOCHA_STATUSES_TRUTH, True, False),
    "mocha/mimic_spec_ghost.txt": ({**MOCHA_STATUSES_TRUTH, "third > prints a ghost": P}, True, True),
    # "  key: value" and "  ✔ root ghost" printed while "calc" is open: mocha ends a top-level
    # suite with an empty line before anything else at the top level (they renamed or lost
    # every later test of calc)
    "mocha/mimic_spec_indented.txt": ({"root test": P, "calc > plain": P, "calc > after": P, "calc > fails": F,
                                       "calc > inner > deep": P, "second > passes": P}, True, False),
    "mocha/mimic_json.txt": ({k.replace(" > ", " ", 1): v for k, v in MOCHA_TRUTH.items()}, True, False),
    "node/mimic_timeout_tap.txt": ({"a fast": P}, False, False),
    "node/mimic_timeout_spec.txt": ({"a fast": P}, False, False),
}
#: Suspect logs whose ids in doubt are narrowed: only those a test's print could have given
#: their result (docs/verification.md, "Suspect"); every other id is settled by the runner's
#: own failure list and per-status counts.
IN_DOUBT = {
    # libtest's failures list names c_fails; a_passes has a printed FAILED beside its ok and
    # the ghost's "ok" makes three passes where libtest counted two: any of them may be printed
    "cargo/mimic_nocapture.txt": [RT + "a_passes", RT + "ghost", RT + "b_prints_others_results"],
    # b_fails is listed; c_ignored is the one id that can be the one test libtest ignored
    # (its printed "ok" aside); five ids can be the four passes libtest counted
    **{f"cargo/mimic_{m}.txt": [RT + "a_passes", RT + "d_passes", RT + "e_prints_while_others_end",
                                RT + "f_passes", RT + "ghost"] for m in ("threads_nocapture", "threads4_nocapture")},
    # "third > ghost" makes six passes where mocha counted five; "- plain" makes two ids that
    # can be the one pending test. "calc > fails" is mocha's numbered failure: settled
    "mocha/mimic_spec_ghost.txt": ["third > ghost", "third > prints a ghost", "calc > plain", "calc > prints results",
                                   "calc > inner > deep", "second > passes", "calc > skipped"],
    # the ghost makes five ids that can be vitest's four passes; "fails" is in "Failed Tests",
    # "under a broken suite" the one id that can be its one skip
    **{f"vitest/mimic_{m}.txt": [JM + "ghost", JM + "plain", JM + "prints results",
                                 JM + "name with a > b, a :: b and a ... b", "test/suite.test.js > beside it"]
       for m in ("verbose", "verbose_color")},
    # three ids can be vitest's two passes; "fails" is in "Failed Tests" (its printed pass aside)
    "vitest/mimic_verbose_console_blank.txt": [VC + "ghost", VC + "plain", VC + "logs"],
    # more leaves passed than node counted passes, less the opened ids that must be tests
    # (three passed, two are suites): the passes are in doubt; not "parent > child fails",
    # nor the parents and suites, whose lines agree
    **{f"node/mimic_{m}.txt": ["ghost", "plain", "prints results", "parent > child passes",
                               "parent all pass > only child", "suite > in suite", "suite > inner suite > deep",
                               "name with a > b, a :: b and a ... b"] for m in ("spec", "spec_color")},
}

#: Runs killed (SIGKILL, SIGTERM, os._exit) while a test the runner had announced was running
#: (capture_mimic.py, "cut runs"): (results, the unresolved ids). Each test that hangs or
#: exits first prints a line shaped like its own passing result; no report of the runner
#: survives a kill, the truth is the program: only the tests before it ran to their end.
PYC, UTC = "tests/test_cut.py::", "tests.test_cut.TestCut."
CUT = {
    "pytest/mimic_cut_kill_v.txt": ({PYC + "test_a_passes": P}, [PYC + "test_b_hangs"]),
    "pytest/mimic_cut_kill_v_s.txt": ({PYC + "test_a_passes": P}, [PYC + "test_b_hangs"]),
    "pytest/mimic_cut_exit_v.txt": ({PYC + "test_a_passes": P}, [PYC + "test_b_exits"]),  # os._exit(0)
    # -s: pytest writes the id, the test's output, then the word (no "[ 66%]" without capture);
    # the test printed "PASSED", a whole progress line or xdist's line (no xdist here), then hung
    "pytest/mimic_cut_kill_v_s_status.txt": ({PYC + "test_a_passes": P}, [PYC + "test_b_prints_passed"]),
    "pytest/mimic_cut_term_v_s_status.txt": ({PYC + "test_a_passes": P}, [PYC + "test_b_prints_passed"]),
    "pytest/mimic_cut_kill_v_s_progress.txt": ({PYC + "test_a_passes": P}, [PYC + "test_b_prints_a_progress_line"]),
    "pytest/mimic_cut_kill_v_s_xdist_line.txt": ({PYC + "test_a_passes": P}, [PYC + "test_b_prints_an_xdist_line"]),
    # pytest-timeout's thread method: stack dumps, then os._exit(1) while the test runs
    "pytest/mimic_cut_pytest_thread_v_s_status.txt": ({PYC + "test_a_passes": P}, [PYC + "test_b_prints_passed"]),
    # "test_b_hangs (...) ... ok": the "ok" is the test's own print; no runner line followed it
    "unittest/mimic_cut_kill_v.txt": ({UTC + "test_a_passes": P}, [UTC + "test_b_hangs"]),
    # node names a test with subtests once one of them ended; a leaf only when it ends
    **{f"node/mimic_cut_{m}.txt": ({"a passes": P, "parent > child passes": P}, ["parent"])
       for m in ("kill_tap", "kill_spec", "term_tap")},
    "cargo/mimic_cut_kill_threads1.txt": ({"tests::a_passes": P}, ["tests::b_hangs"]),
    "cargo/mimic_cut_kill_nocapture_threads1.txt": ({"tests::a_passes": P}, ["tests::b_hangs"]),
    # libtest's JSON: b_hangs "started" and never ended, c_never_runs ran on another thread
    "cargo/mimic_cut_kill_json.txt": ({"tests::a_passes": P, "tests::c_never_runs": P}, ["tests::b_hangs"]),
    # jest writes a file's results when the file is done, vitest a test's when it ends: nothing
    # is announced, so nothing can be unresolved; the log is incomplete
    "jest/mimic_cut_kill_verbose.txt": ({}, []),
    "vitest/mimic_cut_kill_verbose.txt": ({"test/cut.test.js > a passes": P}, []),
    # the hanging test printed its own line first: jest shows a file's tree only when the file
    # ended, so the print is outside any tree; node's "  ✔ child hangs" came before any "▶"
    "jest/mimic_cut_kill_verbose_prints.txt": ({}, []),
    "node/mimic_cut_kill_spec_prints.txt": ({"a passes": P, "parent > child passes": P}, ["parent"]),
}
#: Cut runs whose reporter announces nothing and writes a test's line when it ends (node spec
#: at the top level, vitest verbose, mocha spec): the hanging test printed the line it would
#: get had it passed, and nothing tells it from the runner's (node's and vitest's reporters
#: even wrote it before the line of the test that ran first). The log is incomplete, so the
#: verdict is 0 and says the run was cut; docs/verification.md ("Cut") says to use TAP/JSON.
KNOWN_WRONG_CUT = {
    "node/mimic_cut_kill_spec_prints_top.txt": {"a passes": P, "b hangs": P},
    "vitest/mimic_cut_kill_verbose_prints.txt": {"test/cut.test.js > a passes": P, "test/cut.test.js > b hangs": P},
    "mocha/mimic_cut_kill_spec_prints.txt": {"cut > a passes": P, "cut > b hangs": P},
}
#: Where the text cannot be read right, and why (docs/verification.md, Parsers).
KNOWN_WRONG = {
    # go test without -v announces nothing: a printed "--- FAIL: TestAPasses" cannot be told apart
    "go/mimic_default.txt": {**_failures(GO_TRUTH), GO + "TestAPasses": F, GO + "TestAPasses/sub": F},
}


def _meta(case: str) -> dict:
    return json.loads((CORPUS / f"{case.rsplit('.', 1)[0]}.meta.json").read_text())


def _parse(case: str):
    return PARSERS[_meta(case)["parser"]]((CORPUS / case).read_text(encoding="utf-8"))


def test_every_mimic_capture_has_expectations():
    files = {f"{m.parent.name}/{json.loads(m.read_text())['file']}" for m in CORPUS.glob("*/mimic_*.meta.json")}
    assert files == set(CASES) | set(KNOWN_WRONG) | set(CUT) | set(KNOWN_WRONG_CUT)


@pytest.mark.parametrize("case", sorted(CASES))
def test_printed_result_lines_change_no_result_unless_the_log_is_suspect(case):
    truth, complete, suspect = CASES[case]
    out = _parse(case)
    got = {r.test_id: r.status.value for r in out.results}
    assert out.complete is complete, out.notes
    assert out.suspect is suspect, out.notes
    if not suspect:
        assert got == truth
        assert out.in_doubt == []
        return
    assert out.in_doubt and any("in doubt" in n for n in out.notes)
    trusted = {k: v for k, v in got.items() if k not in out.in_doubt and k in truth}
    assert trusted == {k: truth[k] for k in trusted}
    if case in IN_DOUBT:
        assert sorted(out.in_doubt) == sorted(IN_DOUBT[case])
        assert set(truth) - set(out.in_doubt) <= set(got)  # every settled test is read, as the truth has it


@pytest.mark.parametrize("case", sorted(CUT))
def test_a_test_killed_while_running_is_unresolved_not_passed(case):
    results, unresolved = CUT[case]
    out = _parse(case)
    assert _meta(case)["exit_code"] in (0, 1, 124, 137)  # os._exit(0), pytest-timeout's os._exit(1), SIGTERM, SIGKILL
    assert {r.test_id: r.status.value for r in out.results} == results
    assert not out.complete and not out.suspect
    assert out.unresolved == unresolved
    if unresolved:
        assert any(n.startswith(f"the run was cut: {len(unresolved)} announced tests never resolved") for n in out.notes)


@pytest.mark.parametrize("case", sorted(KNOWN_WRONG_CUT))
def test_a_cut_run_of_a_reporter_that_announces_nothing_is_incomplete_whatever_it_printed(case):
    out = _parse(case)
    assert _meta(case)["exit_code"] == 137
    assert {r.test_id: r.status.value for r in out.results} == KNOWN_WRONG_CUT[case]
    assert not out.complete and not out.suspect and out.unresolved == []
    assert any("summary is missing" in n for n in out.notes)


@pytest.mark.parametrize("case", sorted(KNOWN_WRONG))
def test_known_limits_read_as_documented(case):
    got = {r.test_id: r.status.value for r in _parse(case).results}
    assert got == KNOWN_WRONG[case]


def _truth_of(case: str) -> dict[str, str] | None:
    meta = _meta(case)
    if "truth" not in meta:
        return None
    text = (CORPUS / case.split("/")[0] / meta["truth"]).read_text(encoding="utf-8")
    if meta["truth"].endswith(".json") and case.startswith("unittest/"):
        return json.loads(text)
    if case.startswith("cargo/"):  # libtest's --logfile: "ok tests::x", "failed ...", "ignored ..."
        words = {"ok": P, "failed": F, "ignored": S}
        return {name: words[word] for word, _, name in (line.partition(" ") for line in text.splitlines())}
    parser = {"pytest": "pytest_junit", "node": "node_junit", "jest": "jest_json", "vitest": "vitest_json",
              "mocha": "mocha_json"}[case.split("/")[0]]
    out = PARSERS[parser](text.replace(meta["cwd"] + "/", SANDBOX_ROOT))
    truth = {r.test_id.removeprefix(SANDBOX_ROOT): r.status.value for r in out.results}
    if parser == "node_junit" and out.complete:  # a killed run's report is cut
        truth.update(_node_junit_parents(text))
    return truth


def _node_junit_parents(xml: str) -> dict[str, str]:
    """Node's JUnit report writes a test with subtests and a describe as a ``<testsuite>``
    whose ``failures`` count its failed tests: failed when it has any, else passed."""
    import xml.etree.ElementTree as ET

    out: dict[str, str] = {}

    def walk(elem, path: list[str]) -> None:
        for child in elem.findall("testsuite"):
            here = [*path, child.get("name", "")]
            out[" > ".join(here)] = F if int(child.get("failures", "0")) + int(child.get("errors", "0")) else P
            walk(child, here)

    walk(ET.fromstring(xml), [])
    return out


@pytest.mark.parametrize("case", sorted(c for c in CASES if "truth" in _meta(c)))
def test_the_expectations_are_the_runners_own_report_of_the_same_run(case):
    truth = _truth_of(case)
    if not CASES[case][1]:
        assert truth == {}  # killed before writing its report
        return
    expected = CASES[case][0]
    if case.startswith("mocha/"):  # mocha's JSON names a test by its full title: titles joined by spaces
        expected = {" ".join(k.split(" > ")): v for k, v in expected.items()}
    assert {k: truth[k] for k in expected} == expected
    if "default" not in case:  # the default reporters name failures only
        assert set(truth) == set(expected)


@pytest.mark.parametrize("case", ["jest/mimic_exit_verbose.txt", "jest/mimic_exit_after_a_file_verbose.txt",
                                  "jest/mimic_load_fails_verbose.txt", "vitest/mimic_load_fails_verbose.txt",
                                  "vitest/mimic_load_fails_default.txt", "vitest/mimic_default.txt"])
def test_a_runners_own_notice_is_never_a_test(case):
    text = (CORPUS / case).read_text(encoding="utf-8")
    assert "process.exit called" in text or "Failed Suites" in text or "Test suite failed to run" in text
    ids = [r.test_id for r in _parse(case).results]
    assert not any("process.exit" in i or "Test suite failed" in i or i.endswith("broken.test.js") for i in ids)
    assert "test/suite.test.js > broken suite" not in ids  # vitest's "FAIL  file > suite" under Failed Suites


def test_a_suspect_note_names_the_ids_in_doubt():
    out = _parse("unittest/mimic_v.txt")
    note = next(n for n in out.notes if "in doubt" in n)
    assert "counted" in note and UT + "test_plain" in note


def test_a_test_named_only_by_printed_lines_is_in_doubt_when_the_runner_counted_fewer():
    # test_prints_on_stderr printed "test_ghost (...) ... ok" and a FAIL: block: the failure
    # count names the headers in doubt, the test count every id (any may be the printed one)
    out = _parse("unittest/mimic_v.txt")
    assert UT + "test_ghost" in out.in_doubt and UT + "test_plain" in out.in_doubt
