"""Score a test run against a ``TestsVerifier`` by SWE-bench's rules. Pure: spec and results in, score out.

Reward 1.0 only when every FAIL_TO_PASS and PASS_TO_PASS test passed; ``partial`` is a shaping
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
