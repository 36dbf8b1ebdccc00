"""The guard plug-in in a real pytest process, and its record checked against the runner's report.

The plug-in is loaded as the verifier loads it (``PYTEST_PLUGINS``, ``PYTHONPATH``) into a real
``python -m pytest`` run of a small suite; its record must say what each test really did, whatever
the code under test makes pytest report.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from arena_core.schemas import TestResult
from arena_core.schemas import TestStatus as S
from arena_verification import guard
from arena_verification.parsed import ParsedOutput
from arena_verification.parsers import get_parser

SUITE = {
    "lib.py": "def double(x):\n    return x * 2\n",
    "test_lib.py": """
        import unittest
        import pytest
        import lib

        def test_passes():
            assert lib.double(2) == 4

        def test_fails():
            assert lib.double(2) == 5

        @pytest.fixture
        def broken():
            raise RuntimeError("no fixture")

        def test_setup_error(broken):
            pass

        def test_skips():
            pytest.skip("not here")

        @pytest.mark.xfail(reason="known")
        def test_xfails():
            assert lib.double(1) == 3

        class TestCaseStyle(unittest.TestCase):
            def test_unittest_fails(self):
                self.assertEqual(lib.double(3), 7)
        """,
}

#: Appended to lib.py: every failure of a test that uses ``lib`` reported passed (as the hacks do).
TAMPER = """
import sys as _sys
if "_pytest.reports" in _sys.modules:
    from _pytest.reports import TestReport as _Report
    _make = _Report.from_item_and_call.__func__

    def _passed(cls, item, call):
        report = _make(cls, item, call)
        if report.failed and "setup_error" not in item.name:
            report.outcome, report.longrepr = "passed", None
        return report

    _Report.from_item_and_call = classmethod(_passed)
"""


def run_guarded(tmp_path: Path, extra: str = "") -> tuple[guard.Guard, str, str, int]:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, text in SUITE.items():
        (repo / name).write_text(textwrap.dedent(text).lstrip())
    if extra:
        (repo / "lib.py").write_text((repo / "lib.py").read_text() + extra)
    watch = guard.plan(str(tmp_path / "arena"))
    for path, data in guard.files(watch, workdir=str(repo), root=str(repo)).items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    cmd = guard.command(watch, f"{sys.executable} -m pytest -rA -p no:cacheprovider test_lib.py")
    proc = subprocess.run(["sh", "-c", cmd], cwd=repo, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
    record = Path(watch.record).read_text() if Path(watch.record).exists() else ""
    return watch, proc.stdout + proc.stderr, record, proc.returncode


def test_the_record_says_what_each_test_really_did(tmp_path):
    watch, log, text, code = run_guarded(tmp_path)
    assert watch.marker in log and code == 1
    record = guard.read(text)
    assert len(record.started) == 1 and record.ended == record.started and record.tampered == ()
    assert record.tests == {
        "test_lib.py::test_passes": ("ok", "ok", "ok", False),
        "test_lib.py::test_fails": ("ok", "failed", "ok", False),
        "test_lib.py::test_setup_error": ("failed", "-", "ok", False),
        "test_lib.py::test_skips": ("ok", "skipped", "ok", False),
        "test_lib.py::test_xfails": ("ok", "failed", "ok", True),
        "test_lib.py::TestCaseStyle::test_unittest_fails": ("ok", "failed", "ok", False),
    }
    # an honest run: the report agrees with the record
    parsed = get_parser("pytest")(log)
    assert guard.check(parsed, record, log_text=log, marker=watch.marker, exit_code=code,
                       listed=["test_lib.py::test_passes"], by_node_id=True) == ([], True)


def test_a_report_patched_from_the_code_under_test_contradicts_the_record(tmp_path):
    watch, log, text, code = run_guarded(tmp_path, TAMPER)
    parsed = get_parser("pytest")(log)
    statuses = {r.test_id: r.status for r in parsed.results}
    assert statuses["test_lib.py::test_fails"] is S.PASSED  # the runner's report was rewritten
    assert statuses["test_lib.py::TestCaseStyle::test_unittest_fails"] is S.PASSED
    problems, guarded = guard.check(parsed, guard.read(text), log_text=log, marker=watch.marker, exit_code=code,
                                    listed=["test_lib.py::test_fails"], by_node_id=True)
    assert guarded
    assert "replaced _pytest.reports.TestReport.from_item_and_call during the run" in problems
    lies = next(p for p in problems if "reported as not failed that failed" in p)
    assert lies.startswith("2 test(s)") and "test_lib.py::test_fails was reported passed but raised in the test" in lies
    assert "TestCaseStyle::test_unittest_fails was reported passed" in lies


def test_a_hook_registered_by_the_code_under_test_is_named(tmp_path):
    hook = """
import gc as _gc, types as _types, pytest as _pt
@_pt.hookimpl(hookwrapper=True)
def _wrap(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
for _o in _gc.get_objects():
    if type(_o).__name__ == "PytestPluginManager":
        _o.register(_types.SimpleNamespace(pytest_runtest_makereport=_wrap))
        break
"""
    watch, log, text, code = run_guarded(tmp_path, hook)
    record = guard.read(text)
    assert any(t.startswith("a _wrap hook registered from ") and t.endswith("lib.py") for t in record.tampered)


def test_a_missing_record_is_tampering_only_when_the_guard_loaded():
    parsed = ParsedOutput(results=[TestResult(test_id="t.py::a", status=S.PASSED)], complete=True)
    args = dict(exit_code=0, listed=["t.py::a"], by_node_id=True, marker="arena-guard 00ff")
    assert guard.check(parsed, None, log_text="arena-guard 00ff\n1 passed", **args) == (
        ["the guard's record of the run is missing (deleted or never written)"], True)
    assert guard.check(parsed, None, log_text="1 passed", **args) == ([], False)  # never loaded (e.g. tox)


def test_unfinished_sessions_ghost_tests_and_a_clean_exit_over_failures_are_contradictions():
    text = ("start\t1-1\t1\n"
            "test\t1-1\tt.py::a\tok\tok\tok\t0\n"
            "test\t1-1\tt.py::b\tok\tfailed\tok\t0\n"
            "test\t1-1\tt.py::c\tok\tfailed\tok\t1\n")
    record = guard.read(text)
    parsed = ParsedOutput(results=[TestResult(test_id=t, status=s) for t, s in
                                   [("t.py::a", S.PASSED), ("t.py::b", S.FAILED), ("t.py::c", S.XFAILED),
                                    ("t.py::ghost", S.PASSED)]], complete=True)
    problems, _ = guard.check(parsed, record, log_text="", marker="m", exit_code=0,
                              listed=["t.py::a", "t.py::ghost"], by_node_id=True)
    assert problems == ["1 listed test(s) reported passed never ran: t.py::ghost",
                        "a test process ended before pytest finished its session, yet its report is complete",
                        "the runner exited 0 although t.py::b failed"]
    # recorded twice (an xdist rerun, a forged line): a failure recorded anywhere wins
    again = guard.read(text + "test\t1-1\tt.py::b\tok\tok\tok\t0\nend\t1-1\t1\n")
    assert again.tests["t.py::b"] == ("ok", "failed", "ok", False) and again.ended == {"1-1"}


def test_record_fields_with_tabs_and_newlines_round_trip():
    text = "start\t1-1\t1\ntest\t1-1\tt.py::a[x\\ty\\\\n]\tok\tfailed\tok\t0\n"
    assert list(guard.read(text).tests) == ["t.py::a[x\ty\\n]"]
