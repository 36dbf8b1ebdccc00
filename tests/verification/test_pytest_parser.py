"""The pytest output parser on real pytest logs (tests/fixtures/pytest, see make_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from arena_core.schemas import TestStatus as Status
from arena_verification.pytest_parser import canonical_id, parse_pytest_output, split_node_id

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pytest"

P, F, E, S = Status.PASSED, Status.FAILED, Status.ERROR, Status.SKIPPED
XF, XP = Status.XFAILED, Status.XPASSED
M = "tests/test_mixed.py::"

#: The true outcome of every test in the "mixed" suite.
MIXED = {
    "tests/test_clean.py::test_one": P,
    M + "test_pass": P,
    M + "test_fail": F,
    M + "test_setup_error": E,
    M + "test_pass_then_teardown_error": E,  # passed, then its teardown errored: the worse wins
    M + "test_skip_marker": S,
    M + "test_skip_inside": S,
    M + "test_xfail": XF,
    M + "test_xpass": XP,
    M + "test_param[a b]": P,
    M + "test_param[x[1]]": P,
    M + "test_param[left - right]": F,
    M + "test_param[plain]": P,
    M + "TestGroup::test_method": P,
    M + "TestGroup::test_method_param[1]": P,
    M + "TestGroup::test_method_param[2]": F,
    M + "test_prints_fake_lines": P,
    M + "test_prints_fake_lines_and_fails": F,
}
MIXED_TOTALS = {"failed": 4, "passed": 9, "skipped": 2, "xfailed": 1, "xpassed": 1, "error": 2}
SKIPS = {M + "test_skip_marker", M + "test_skip_inside"}


def parse(name: str):
    return parse_pytest_output((FIXTURES / name).read_text())


@pytest.mark.parametrize("name", ["mixed_rA.txt", "mixed_rA_q.txt"])
def test_rA_summary_names_every_outcome_but_skips(name):
    out = parse(name)
    assert out.by_id() == {k: v for k, v in MIXED.items() if k not in SKIPS}
    assert out.complete and not out.truncated
    assert out.totals == MIXED_TOTALS
    assert out.unattributed_skips == 2
    assert out.source == "summary"


def test_rA_with_verbose_attributes_the_skips():
    out = parse("mixed_rA_v.txt")
    assert out.by_id() == MIXED
    assert out.complete
    assert out.source == "summary+verbose"


def test_verbose_without_rA_reads_progress_lines_and_default_summary():
    out = parse("mixed_v.txt")
    assert out.by_id() == MIXED
    assert out.complete
    assert out.unattributed_skips == 0


@pytest.mark.parametrize("name", ["mixed_rA.txt", "mixed_rA_v.txt", "mixed_v.txt", "mixed_rA_q.txt"])
def test_printed_result_lines_do_not_count(name):
    text = (FIXTURES / name).read_text()
    assert "PASSED tests/fake.py::test_x" in text or "tests/fake.py::test_w PASSED" in text
    ids = parse(name).by_id()
    assert not [i for i in ids if i.startswith("tests/fake.py")]


def test_collection_error_reports_the_module():
    out = parse("collection_error_rA.txt")
    assert out.by_id() == {"tests/test_broken.py": E}
    assert out.complete
    assert out.totals == {"error": 1}


def test_killed_run_verbose_keeps_what_finished_and_is_truncated():
    out = parse("truncated_rA_v.txt")
    assert out.by_id() == {"tests/test_slow.py::test_a_fast": P, "tests/test_slow.py::test_b_fast": P}
    assert out.truncated
    assert out.totals == {}


def test_killed_run_without_verbose_has_nothing():
    out = parse("truncated_rA.txt")
    assert out.results == []
    assert out.truncated
    assert out.source == "none"


@pytest.mark.parametrize("name", ["quickstart_rA.txt", "quickstart_rA_color.txt"])
def test_quickstart_task_log(name):
    out = parse(name)
    q = "tests/test_textstats.py::"
    assert out.by_id() == {
        q + "test_word_count": P,
        q + "test_top_words": P,
        q + "test_slugify": P,
        q + "test_median_odd": P,
        q + "test_median_empty_raises": P,
        q + "test_median_even": F,
        q + "test_median_two_values": F,
    }
    assert out.totals == {"failed": 2, "passed": 5}


def test_summary_cut_mid_way_is_truncated_and_a_printed_final_line_does_not_complete_it():
    text = (FIXTURES / "mixed_rA.txt").read_text()
    cut = text[: text.index("FAILED tests/test_mixed.py::test_fail")]
    out = parse_pytest_output(cut)
    assert out.truncated  # the "99 passed" line a test printed is before the real summary
    assert M + "test_pass" in out.by_id()


def test_empty_and_garbage_output():
    for text in ("", "sh: 1: pytest: not found\n", "PASSED\nFAILED - x\n"):
        out = parse_pytest_output(text)
        assert out.results == [] and out.truncated


def test_split_node_id_prefers_balanced_brackets():
    summary_tail = lambda tail: tail == "" or tail.startswith(" ")  # noqa: E731
    assert split_node_id("t.py::test_p[x[1]] - assert x[0] - 1", summary_tail) == (
        "t.py::test_p[x[1]]",
        " - assert x[0] - 1",
    )
    assert split_node_id("t.py::test_p[a]b] - m", summary_tail) == ("t.py::test_p[a]b]", " - m")
    assert split_node_id("t.py::test_p[open", summary_tail) is None
    assert split_node_id("not a node id", summary_tail) is None


def test_canonical_id():
    assert canonical_id("./tests\\x.py::test_a[1]") == "tests/x.py::test_a[1]"
