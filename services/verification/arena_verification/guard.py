"""The guard's side in the verifiers: the plug-in's files for one run, and its record of the run
checked against the runner's report (``tests``) or a test script's summary and reward
(``reward_file``). Pure but for reading the plug-in's source.

docs/verification.md ("The guard").
"""

from __future__ import annotations

import secrets
import shlex
from pathlib import Path

import msgspec

from arena_core.schemas import TestStatus
from arena_verification.parsed import ParsedOutput

#: What a phase may be recorded as: ran clean, raised a skip, an xfail, anything else, or did not run.
_FAILED = "failed"
#: Reported statuses that score as (or hide) a pass: a test the guard saw fail may not have them.
_NOT_FAILURES = frozenset({TestStatus.PASSED, TestStatus.XFAILED, TestStatus.XPASSED, TestStatus.SKIPPED})
_SOURCE = Path(__file__).with_name("guard_plugin.py")


class Guard(msgspec.Struct, frozen=True, kw_only=True):
    """One run's guard: a module name, a directory and a record path nobody knew before the run."""

    nonce: str
    module: str
    directory: str
    record: str

    @property
    def marker(self) -> str:
        """The line the plug-in writes to stderr when it loads in the tests' directory."""
        return f"arena-guard {self.nonce}"


def plan(arena_dir: str) -> Guard:
    nonce = secrets.token_hex(8)
    return Guard(nonce=nonce, module=f"arena_guard_{nonce}", directory=f"{arena_dir}/guard-{nonce}",
                 record=f"{arena_dir}/guard-{nonce}.rec")


def files(guard: Guard, *, workdir: str, root: str) -> dict[str, bytes]:
    """The plug-in's module, its constants filled in, by absolute path in the sandbox: active in
    pytest runs started in ``workdir`` ("": anywhere), ``root`` the agent's code."""
    source = _SOURCE.read_text()
    for key, value in (("@NONCE@", guard.nonce), ("@RECORD@", guard.record), ("@WORKDIR@", workdir),
                       ("@ROOT@", root)):
        source = source.replace(f'"{key}"', repr(value), 1)
    return {f"{guard.directory}/{guard.module}.py": source.encode()}


def command(guard: Guard, command: str) -> str:
    """``command`` with the plug-in on ``PYTHONPATH`` and in ``PYTEST_PLUGINS`` (kept from the
    image's environment, after ours)."""
    directory, module = shlex.quote(guard.directory), shlex.quote(guard.module)
    return (f'PYTHONPATH={directory}${{PYTHONPATH:+:$PYTHONPATH}}; export PYTHONPATH\n'
            f'PYTEST_PLUGINS={module}${{PYTEST_PLUGINS:+,$PYTEST_PLUGINS}}; export PYTEST_PLUGINS\n'
            f'{command}')


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """What the plug-in wrote: sessions started and ended, per test the phases' outcomes
    (worst first when a test was recorded twice), and the internals it saw change; the same per
    session, with the session each ran under."""

    started: frozenset[str] = frozenset()
    ended: frozenset[str] = frozenset()
    exit_statuses: tuple[int, ...] = ()
    #: test id -> (setup, call, teardown, xfail-marked)
    tests: dict[str, tuple[str, str, str, bool]] = {}
    tampered: tuple[str, ...] = ()
    #: session -> the guarded session whose process started it ("" for none)
    parents: dict[str, str] = {}
    #: session -> the exit status pytest computed at its end
    exits: dict[str, int] = {}
    #: session -> test id -> phases, as ``tests``
    session_tests: dict[str, dict[str, tuple[str, str, str, bool]]] = {}
    #: session -> what it saw replaced
    session_tampered: dict[str, tuple[str, ...]] = {}

    def top_sessions(self) -> set[str]:
        """The sessions a test script started itself: under no session, or under one that ran no
        test (pytest-xdist's controller); not a test's own inner pytest run."""
        return {sid for sid in self.started
                if not (parent := self.parents.get(sid, "")) or parent not in self.started
                or not self.session_tests.get(parent)}


def _unescape(field: str) -> str:
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        ch = field[i]
        if ch == "\\" and i + 1 < len(field):
            out.append({"t": "\t", "n": "\n", "r": "\r", "\\": "\\"}.get(field[i + 1], field[i + 1]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _failed(phases: tuple[str, str, str, bool]) -> bool:
    setup, call, teardown, xfail_marked = phases
    return setup == _FAILED or teardown == _FAILED or (call == _FAILED and not xfail_marked)


def _merge(tests: dict[str, tuple[str, str, str, bool]], test_id: str, phases: tuple[str, str, str, bool]) -> None:
    old = tests.get(test_id)
    if old is None or (_failed(phases) and not _failed(old)):
        tests[test_id] = phases  # a failure recorded anywhere wins


def read(text: str) -> Record:
    """The record's lines (``kind<TAB>session<TAB>...``); lines it cannot read are skipped."""
    started, ended, statuses, tampered = set(), set(), [], []
    tests: dict[str, tuple[str, str, str, bool]] = {}
    parents: dict[str, str] = {}
    exits: dict[str, int] = {}
    session_tests: dict[str, dict[str, tuple[str, str, str, bool]]] = {}
    session_tampered: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = [_unescape(f) for f in line.split("\t")]
        kind = fields[0]
        if kind == "start" and len(fields) >= 2:
            started.add(fields[1])
            parents[fields[1]] = fields[3] if len(fields) >= 4 else ""
        elif kind == "end" and len(fields) >= 3:
            ended.add(fields[1])
            status = int(fields[2]) if fields[2].lstrip("-").isdigit() else -1
            statuses.append(status)
            exits[fields[1]] = status
        elif kind == "tampered" and len(fields) >= 3:
            tampered.append(fields[2])
            session_tampered.setdefault(fields[1], []).append(fields[2])
        elif kind == "test" and len(fields) >= 7:
            phases = (fields[3], fields[4], fields[5], fields[6] == "1")
            _merge(tests, fields[2], phases)
            _merge(session_tests.setdefault(fields[1], {}), fields[2], phases)
    return Record(started=frozenset(started), ended=frozenset(ended), exit_statuses=tuple(statuses),
                  tests=tests, tampered=tuple(dict.fromkeys(tampered)), parents=parents, exits=exits,
                  session_tests=session_tests,
                  session_tampered={sid: tuple(dict.fromkeys(what)) for sid, what in session_tampered.items()})


def check(parsed: ParsedOutput, record: Record | None, *, log_text: str, marker: str, exit_code: int | None,
          listed: list[str], by_node_id: bool) -> tuple[list[str], bool]:
    """(what contradicts the runner's report, whether the run was guarded at all).

    Contradictions: the plug-in loaded (its marker is in the log) but left no record; internals
    replaced under the run; a test reported passed, skipped or xfailed that the plug-in saw fail;
    with ``by_node_id`` (the log names tests by pytest's node ids), a listed test reported passed
    that never ran while others did; a session that never finished although the run's report
    did; a run that exited 0 although a test failed.
    """
    if record is None or not record.started:
        if marker in log_text:
            return ["the guard's record of the run is missing (deleted or never written)"], True
        return [], False
    problems = [f"{what} during the run" for what in record.tampered]
    lying = []
    for result in parsed.results:
        phases = record.tests.get(result.test_id)
        if phases is not None and _failed(phases) and result.status in _NOT_FAILURES:
            setup, call, teardown, _ = phases
            where = "setup" if setup == _FAILED else "the test" if call == _FAILED else "teardown"
            lying.append(f"{result.test_id} was reported {result.status.value} but raised in {where}")
    if lying:
        problems.append(f"{len(lying)} test(s) reported as not failed that failed: " + "; ".join(lying[:5]))
    if by_node_id and record.tests:
        reported = {r.test_id: r.status for r in parsed.results}
        if any(t in record.tests for t in reported):
            ghosts = [t for t in listed if reported.get(t) is TestStatus.PASSED and t not in record.tests]
            if ghosts:
                problems.append(f"{len(ghosts)} listed test(s) reported passed never ran: " + "; ".join(ghosts[:5]))
    unfinished = record.started - record.ended
    if unfinished and parsed.complete:
        problems.append("a test process ended before pytest finished its session, yet its report is complete")
    if exit_code == 0 and any(_failed(p) for p in record.tests.values()):
        failed = next(t for t, p in record.tests.items() if _failed(p))
        problems.append(f"the runner exited 0 although {failed} failed")
    return problems, True


#: Statuses of pytest's short test summary that score as a pass (Terminal-Bench's reading).
_SUMMARY_NOT_FAILURES = frozenset({"PASSED", "SKIPPED", "XFAIL"})


def check_script(record: Record | None, *, log_text: str, marker: str, summary: dict[str, str] | None,
                 rewarded: bool) -> tuple[list[str], bool]:
    """(what contradicts a test script's pytest runs, whether they were guarded at all): the
    ``reward_file`` verifier's reading, where the script, not Arena, runs pytest and turns it into
    a reward. Only the sessions the script started count (:meth:`Record.top_sessions`).

    ``summary``: pytest's short test summary by test name (without its file), ``None`` without one;
    ``rewarded``: the script's reward is above 0. Contradictions: the plug-in loaded but left no
    record; internals replaced under a run; a test the plug-in saw fail that the summary lists
    PASSED, SKIPPED or XFAIL; a session that exited 0 although one of its tests failed (the status
    a script turns into its reward); a session that never finished while the summary is there or
    the script rewarded the run.
    """
    if record is None or not record.started:
        if marker in log_text:
            return ["the guard's record of the run is missing (deleted or never written)"], True
        return [], False
    top = sorted(record.top_sessions())
    problems = [f"{what} during the run" for what in
                dict.fromkeys(what for sid in top for what in record.session_tampered.get(sid, ()))]
    lying, zero = [], []
    for sid in top:
        failed = [t for t, phases in record.session_tests.get(sid, {}).items() if _failed(phases)]
        for test_id in failed:
            said = (summary or {}).get(test_id.split("::", 1)[-1])
            if said in _SUMMARY_NOT_FAILURES:
                lying.append(f"{test_id} was listed {said} but failed")
        if failed and record.exits.get(sid) == 0:
            zero.append(failed[0])
    if lying:
        problems.append(f"{len(lying)} test(s) listed as not failed that failed: " + "; ".join(lying[:5]))
    if zero:
        problems.append(f"pytest exited 0 although {zero[0]} failed")
    if any(sid not in record.ended for sid in top) and (summary is not None or rewarded):
        problems.append("a test process ended before pytest finished its session, yet "
                        + ("its summary is there" if summary is not None else "the script rewarded the run"))
    return problems, True
