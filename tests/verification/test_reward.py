"""SWE-bench scoring of parsed test results."""

from __future__ import annotations

import pytest

from arena_core.schemas import TestCounts as Counts
from arena_core.schemas import TestResult as Result
from arena_core.schemas import TestStatus as Status
from arena_core.schemas import TestsVerifier as Spec
from arena_verification.reward import score

SPEC = Spec(fail_to_pass=["t.py::f1", "t.py::f2"], pass_to_pass=["t.py::p1", "t.py::p2"])


def results(**statuses: Status) -> list[Result]:
    return [Result(test_id=f"t.py::{name}", status=status) for name, status in statuses.items()]


def test_all_listed_pass_is_reward_one():
    s = score(SPEC, results(f1=Status.PASSED, f2=Status.PASSED, p1=Status.PASSED, p2=Status.PASSED,
                            other=Status.FAILED))
    assert (s.reward, s.passed) == (1.0, True)
    assert s.counts == Counts(f2p_passed=2, p2p_passed=2)
    assert s.components == {"tests": 1.0, "partial": 1.0}
    assert s.flags == [] and s.missing == []
    assert s.reason == "all 4 listed tests passed"


def test_one_f2p_failing_is_zero_with_partial_credit():
    s = score(SPEC, results(f1=Status.PASSED, f2=Status.FAILED, p1=Status.PASSED, p2=Status.PASSED))
    assert (s.reward, s.passed) == (0.0, False)
    assert s.counts == Counts(f2p_passed=1, f2p_failed=1, p2p_passed=2)
    assert s.components == {"tests": 0.0, "partial": 0.75}
    assert s.reason == "1 of 2 FAIL_TO_PASS failed"


def test_broken_p2p_is_zero():
    s = score(SPEC, results(f1=Status.PASSED, f2=Status.PASSED, p1=Status.ERROR, p2=Status.PASSED))
    assert s.reward == 0.0
    assert s.counts == Counts(f2p_passed=2, p2p_passed=1, p2p_failed=1)
    assert s.reason == "1 of 2 PASS_TO_PASS failed"


def test_missing_listed_test_counts_failed_and_is_flagged():
    s = score(SPEC, results(f1=Status.PASSED, f2=Status.PASSED, p1=Status.PASSED))
    assert s.reward == 0.0
    assert s.counts == Counts(f2p_passed=2, p2p_passed=1, p2p_failed=1)
    assert s.missing == ["t.py::p2"]
    assert s.flags == ["tests_missing"]
    assert s.reason == "1 of 2 PASS_TO_PASS failed; 1 listed tests did not run"


@pytest.mark.parametrize("status,ok", [
    (Status.PASSED, True), (Status.XFAILED, True),
    (Status.SKIPPED, False), (Status.XPASSED, False), (Status.FAILED, False), (Status.ERROR, False),
])
def test_which_statuses_count_as_passing(status, ok):
    s = score(Spec(fail_to_pass=["t.py::f1"]), results(f1=status))
    assert s.passed is ok


def test_nothing_ran():
    s = score(SPEC, [])
    assert s.reward == 0.0
    assert s.counts == Counts(f2p_failed=2, p2p_failed=2)
    assert s.components["partial"] == 0.0
    assert len(s.missing) == 4


def test_duplicate_listing_counts_once_in_partial():
    spec = Spec(fail_to_pass=["t.py::f1", "t.py::f1"], pass_to_pass=["t.py::f1", "t.py::p1"])
    s = score(spec, results(f1=Status.PASSED, p1=Status.FAILED))
    assert s.counts == Counts(f2p_passed=1, p2p_passed=1, p2p_failed=1)
    assert s.components["partial"] == 0.5


def test_no_listed_tests_scores_the_whole_run():
    spec = Spec()
    assert score(spec, results(a=Status.PASSED, b=Status.SKIPPED)).reward == 1.0
    failing = score(spec, results(a=Status.PASSED, b=Status.FAILED))
    assert failing.reward == 0.0 and failing.components["partial"] == 0.5
    assert score(spec, []).reward == 0.0
