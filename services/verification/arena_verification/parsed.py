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
) -> ParsedOutput:
    """A ``ParsedOutput``.

    ``suspect`` when ``found`` names more tests than the runner counted (``reported_total``)
    or the parser saw another disagreement with the runner's own count (``suspect``: what);
    ``in_doubt`` then names the ids concerned (all of them when not given). ``announced``:
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
        over = reported_total is not None and len(found) > reported_total
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
