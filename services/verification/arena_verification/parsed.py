"""What a test log says about its tests: ``ParsedOutput``, the one result type of every parser.

Pure. The shared rules (worse wins, ``complete``, ``suspect``) are in docs/verification.md (Parsers).
"""

from __future__ import annotations

import re

import msgspec

from arena_core.schemas import TestResult, TestStatus

#: Higher is worse.
SEVERITY = {
    TestStatus.SKIPPED: 0,
    TestStatus.XFAILED: 1,
    TestStatus.PASSED: 2,
    TestStatus.XPASSED: 3,
    TestStatus.FAILED: 4,
    TestStatus.ERROR: 5,
}

#: Terminal escapes: CSI (colours, ``\x1b[31m``), charset selection (``\x1b(B``, which
#: terminfo's ``sgr0`` emits after colour: libtest with ``--color always``) and OSC
#: (hyperlinks, titles).
ANSI = re.compile(r"\x1b(?:\[[0-9;?]*[ -/]*[@-~]|[()*+][0-9A-Za-z]|\][^\x07\x1b]*(?:\x07|\x1b\\))")


class ParsedOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What one test log says about its tests."""

    results: list[TestResult]  # one per canonical test id, in the order first seen
    complete: bool  # the runner's end-of-run summary follows the results
    totals: dict[str, int] = {}  # the runner's own counts, e.g. {"passed": 5, "failed": 1}
    unattributed_skips: int = 0  # skips the log counts but does not name (pytest -rA)
    source: str = "none"  # which part of the log the results came from
    suspect: bool = False  # the runner's own count disagrees with what was read: a test printed results
    notes: list[str] = []  # why the log is incomplete or suspect
    in_doubt: list[str] = []  # when suspect: the ids whose result may come from a test's output
    unresolved: list[str] = []  # announced by the runner but never resolved (the run was cut)

    @property
    def truncated(self) -> bool:
        return not self.complete

    def by_id(self) -> dict[str, TestStatus]:
        return {r.test_id: r.status for r in self.results}


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


def merge(into: dict[str, TestStatus], test_id: str, status: TestStatus) -> None:
    """Record ``status`` for ``test_id``; the worse of two reports wins."""
    current = into.get(test_id)
    if current is None or SEVERITY[status] > SEVERITY[current]:
        into[test_id] = status


def results_of(found: dict[str, TestStatus]) -> list[TestResult]:
    return [TestResult(test_id=k, status=v) for k, v in found.items()]


#: How many ids a note names before it says "and N more".
NOTE_IDS = 20


def name_ids(ids: list[str]) -> str:
    shown = ", ".join(ids[:NOTE_IDS])
    return shown + (f" and {len(ids) - NOTE_IDS} more" if len(ids) > NOTE_IDS else "")


def doubted(
    lines: dict[str, set[TestStatus]],
    counted: dict[TestStatus, int],
    failed_list: set[str] | None = None,
    *,
    exact: bool = True,
) -> tuple[list[str], dict[str, TestStatus]]:
    """The ids whose result may come from a line a test printed, by the runner's own counts,
    and the status of every other id (the only one its lines, the list and the counts leave).

    ``lines``: every status the result lines read gave each id, a printed one included (the
    parser's result keeps the worse). ``counted``: the runner's own count per status (a
    status it does not count is not checked). ``failed_list``: the runner's own list of its
    failed tests, when it writes one and it holds as many as it counted failed: a listed id
    is failed whatever its lines say, an unlisted one has no failure of the runner's.

    An id is in doubt when its lines disagree and the list does not settle it (one of them
    was printed), when it has only a failure the list does not name, or when more ids could
    have one status than the runner counted with it: any of those may be the one a test
    printed. Where exactly as many ids can have a status as the runner counted with it, each
    of them has it (every real test has its real line), and the others are checked again
    without it. Where fewer can than it counted, a real line was lost (a test's output cut
    into it): nothing is settled by elimination, every id the list does not settle is in doubt.
    Not ``exact``: ``counted`` holds upper bounds (node counts a suite in none of its
    statuses, and spec does not say which ids are suites): only the excess is checked.
    """
    possible: dict[str, set[TestStatus]] = {}
    for test_id, statuses in lines.items():
        if failed_list is not None:
            if test_id in failed_list:
                continue
            statuses = statuses - {TestStatus.FAILED}
        possible[test_id] = set(statuses)
    need = dict(counted)
    if failed_list is not None:
        need.pop(TestStatus.FAILED, None)
    listed = {t: TestStatus.FAILED for t in lines if t not in possible}
    if exact and any(sum(1 for sts in possible.values() if status in sts) < n for status, n in need.items()):
        return [t for t in lines if t in possible], listed
    changed = exact
    while changed:  # exactly as many candidates as the runner counted: each is the real one
        changed = False
        for status, n in need.items():
            could = [t for t, sts in possible.items() if status in sts]
            if len(could) == n and any(len(possible[t]) > 1 for t in could):
                for t in could:
                    possible[t] = {status}
                changed = True
    doubt = {t for t, sts in possible.items() if len(sts) != 1}
    for status, n in need.items():
        could = [t for t, sts in possible.items() if status in sts]
        if len(could) > n:
            doubt.update(could)
    settled = {t: next(iter(sts)) for t, sts in possible.items() if t not in doubt}
    return [t for t in lines if t in doubt], {**listed, **settled}


def build(
    found: dict[str, TestStatus],
    *,
    complete: bool,
    reported_total: int | None,
    source: str,
    totals: dict[str, int] | None = None,
    notes: list[str] | None = None,
    suspect: str = "",
    in_doubt: list[str] | None = None,
    announced: list[str] | None = None,
    counted_per_status: bool = False,
) -> ParsedOutput:
    """A ``ParsedOutput``.

    ``suspect`` when ``found`` names more tests than the runner counted (``reported_total``)
    or the parser saw another disagreement with the runner's own count (``suspect``: what);
    ``in_doubt`` then names the ids concerned (all of them when not given; with
    ``counted_per_status`` it already accounts for the runner's total, by its per-status
    counts: :func:`doubted`, and names more than ``found`` only when empty). ``announced``:
    tests the runner announced in order; those not in ``found`` when the run was cut
    (``complete`` false) are ``unresolved``.
    """
    notes = list(notes or [])
    reasons = [suspect] if suspect else []
    if reported_total is not None and len(found) > reported_total:
        reasons.insert(0, f"the log names {len(found)} tests but the runner counted {reported_total}")
    doubt: list[str] = []
    if reasons:
        # more tests than the runner counted: any of them may be one a test printed
        over = reported_total is not None and len(found) > reported_total and not counted_per_status
        doubt = [t for t in dict.fromkeys([*(in_doubt or []), *(found if over else [])]) if t] or list(found)
        notes.append(f"{'; '.join(reasons)}; in doubt: {name_ids(doubt)}")
    unresolved = [] if complete else [t for t in dict.fromkeys(announced or []) if t not in found]
    if not complete:
        notes.append("the runner's end-of-run summary is missing (crash, kill or timeout)")
        if unresolved:
            notes.append(f"the run was cut: {len(unresolved)} announced tests never resolved: {name_ids(unresolved)}")
    return ParsedOutput(
        results=results_of(found),
        complete=complete,
        totals=totals or {},
        source=source if found else "none",
        suspect=bool(reasons),
        notes=notes,
        in_doubt=doubt,
        unresolved=unresolved,
    )
