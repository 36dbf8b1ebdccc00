"""``parsed.doubted``: which ids a test's printed line may have given their result, by the
runner's own failure list and per-status counts (docs/verification.md, "Suspect").

The corpus runs (test_parsers_corpus_mimic.py) check it on real output; these pin the rule.
"""

from __future__ import annotations

from arena_core.schemas import TestStatus as Status
from arena_verification.parsed import doubted

P, F, S = Status.PASSED, Status.FAILED, Status.SKIPPED


def test_the_runners_failure_list_settles_failures_and_the_counts_the_rest():
    # "fails" has a printed ok beside its real FAILED, "plain" a printed FAILED beside its ok
    lines = {"plain": {P, F}, "fails": {P, F}, "skipped": {S}}
    doubt, settled = doubted(lines, {P: 1, F: 1, S: 1}, {"fails"})
    assert doubt == []
    assert settled == {"plain": P, "fails": F, "skipped": S}


def test_a_ghost_pass_leaves_the_passes_in_doubt_not_the_failure_or_the_skip():
    lines = {"a": {P}, "ghost": {P}, "b": {P}, "fails": {F}, "skipped": {S}}
    doubt, settled = doubted(lines, {P: 2, F: 1, S: 1}, {"fails"})
    assert doubt == ["a", "ghost", "b"]
    assert settled == {"fails": F, "skipped": S}


def test_the_only_id_that_can_have_a_counted_status_has_it():
    # x printed a pass for itself beside its real skip: the runner counted two skips, and only
    # x and y can be one; z is then the one pass
    doubt, settled = doubted({"x": {P, S}, "y": {S}, "z": {P}}, {P: 1, S: 2})
    assert doubt == [] and settled == {"x": S, "y": S, "z": P}


def test_a_failure_the_list_does_not_name_is_in_doubt_when_it_is_all_an_id_has():
    doubt, _ = doubted({"a": {P}, "ghost": {F}}, {P: 1, F: 0}, set())
    assert doubt == ["ghost"]


def test_without_a_list_more_failures_than_counted_leave_the_failures_in_doubt():
    doubt, settled = doubted({"a": {P, F}, "b": {F}, "c": {P}}, {P: 2, F: 1})
    # two passes counted and two ids can pass: a and c pass; b is the one failure
    assert doubt == [] and settled == {"a": P, "b": F, "c": P}
    doubt, _ = doubted({"a": {F}, "b": {F}, "c": {P}}, {P: 1, F: 1})
    assert doubt == ["a", "b"]


def test_fewer_ids_than_counted_means_a_real_line_was_lost_and_nothing_is_settled():
    doubt, settled = doubted({"a": {P}, "b": {P}, "fails": {F}}, {P: 3, F: 1}, {"fails"})
    assert doubt == ["a", "b"] and settled == {"fails": F}


def test_upper_bounds_check_only_the_excess():
    # node: a suite is counted in no status, so the counts bound the leaves from above
    doubt, settled = doubted({"x": {P, S}, "y": {P}}, {P: 3, S: 1}, exact=False)
    assert doubt == ["x"] and settled == {"y": P}
    doubt, _ = doubted({"x": {P}, "y": {P}, "z": {P}}, {P: 2}, exact=False)
    assert doubt == ["x", "y", "z"]
