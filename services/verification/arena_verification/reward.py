"""Score a test run against a ``TestsVerifier`` by SWE-bench's rules. Pure: spec and results in, score out.

Reward 1.0 only when every FAIL_TO_PASS and PASS_TO_PASS test passed (or, with
``expected_statuses``, when the statuses equal them exactly: R2E-Gym); ``partial`` is a shaping
signal, never the reward. See docs/verification.md ("Reward (SWE-bench rules)").
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from arena_core.schemas import TestCounts, TestResult, TestStatus, TestsVerifier

PASSING = frozenset({TestStatus.PASSED, TestStatus.XFAILED})
FAILING = frozenset({TestStatus.FAILED, TestStatus.ERROR})

FLAG_TESTS_MISSING = "tests_missing"


class Score(msgspec.Struct, frozen=True, kw_only=True):
    reward: float
    passed: bool
    counts: TestCounts
    components: dict[str, float]
    missing: list[str] = []  # listed tests absent from the results
    flags: list[str] = []
    reason: str = ""


def _dedupe(ids: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(ids))


def score(spec: TestsVerifier, results: Iterable[TestResult]) -> Score:
    if spec.expected_statuses:
        return score_exact(spec.expected_statuses, results)
    statuses = {r.test_id: r.status for r in results}
    f2p = _dedupe(spec.fail_to_pass)
    p2p = _dedupe(spec.pass_to_pass)
    if not f2p and not p2p:
        return _score_unlisted(statuses)

    def ok(test_id: str) -> bool:
        return statuses.get(test_id) in PASSING

    counts = TestCounts(
        f2p_passed=sum(ok(t) for t in f2p),
        f2p_failed=sum(not ok(t) for t in f2p),
        p2p_passed=sum(ok(t) for t in p2p),
        p2p_failed=sum(not ok(t) for t in p2p),
    )
    listed = _dedupe(f2p + p2p)
    missing = [t for t in listed if t not in statuses]
    passed = counts.f2p_failed == 0 and counts.p2p_failed == 0
    reward = 1.0 if passed else 0.0
    partial = sum(ok(t) for t in listed) / len(listed)
    if passed:
        reason = f"all {len(listed)} listed tests passed"
    else:
        parts = []
        if counts.f2p_failed:
            parts.append(f"{counts.f2p_failed} of {len(f2p)} FAIL_TO_PASS failed")
        if counts.p2p_failed:
            parts.append(f"{counts.p2p_failed} of {len(p2p)} PASS_TO_PASS failed")
        if missing:
            parts.append(f"{len(missing)} listed tests did not run")
        reason = "; ".join(parts)
    return Score(
        reward=reward,
        passed=passed,
        counts=counts,
        components={"tests": reward, "partial": partial},
        missing=missing,
        flags=[FLAG_TESTS_MISSING] if missing else [],
        reason=reason,
    )


#: The statuses R2E-Gym's log parser records (others, e.g. skipped, are not in its map).
R2E_WORDS = {TestStatus.PASSED: "PASSED", TestStatus.FAILED: "FAILED", TestStatus.ERROR: "ERROR"}


def r2e_key(test_id: str) -> str:
    """A test's key in R2E-Gym's status map: its node id after the file, ``::`` read as ``.``,
    cut at `` - `` (``r2e_tests/test_1.py::TestX::test_a`` -> ``TestX.test_a``)."""
    return ".".join(test_id.split("::")[1:]).split(" - ")[0]


def score_exact(expected: dict[str, str], results: Iterable[TestResult]) -> Score:
    """R2E-Gym's rule: 1 only when the run's tests and statuses equal ``expected`` exactly
    (as many tests, each with the same status); ``partial`` is the share of expected tests matched."""
    got: dict[str, str] = {}
    for r in results:
        if r.status in R2E_WORDS:
            got[r2e_key(r.test_id)] = R2E_WORDS[r.status]
    wanted = {k.split(" - ")[0]: v for k, v in expected.items()}
    matched = sum(got.get(k) == v for k, v in wanted.items())
    missing = [k for k in wanted if k not in got]
    extra = [k for k in got if k not in wanted]
    passed = len(got) == len(wanted) and all(not k or (k in wanted and wanted[k] == v) for k, v in got.items())
    reward = 1.0 if passed else 0.0
    if passed:
        reason = f"the {len(wanted)} tests' statuses equal the expected ones"
    else:
        parts = [f"{len(wanted) - matched - len(missing)} of {len(wanted)} tests with another status"]
        if missing:
            parts.append(f"{len(missing)} expected tests did not run")
        if extra:
            parts.append(f"{len(extra)} tests ran that are not expected")
        reason = "statuses differ from the expected ones: " + "; ".join(parts)
    return Score(
        reward=reward,
        passed=passed,
        counts=TestCounts(),
        components={"tests": reward, "partial": matched / len(wanted)},
        missing=missing,
        flags=[FLAG_TESTS_MISSING] if missing else [],
        reason=reason,
    )


def _score_unlisted(statuses: dict[str, TestStatus]) -> Score:
    ran = len(statuses)
    good = sum(s not in FAILING for s in statuses.values())
    passed = ran > 0 and good == ran
    reward = 1.0 if passed else 0.0
    if ran == 0:
        reason = "no tests listed and none ran"
    elif passed:
        reason = f"no tests listed; all {ran} tests that ran passed"
    else:
        reason = f"no tests listed; {ran - good} of {ran} tests that ran failed"
    return Score(
        reward=reward,
        passed=passed,
        counts=TestCounts(),
        components={"tests": reward, "partial": good / ran if ran else 0.0},
        reason=reason,
    )
