"""Diffs that reach into a test framework's or the interpreter's internals: which added lines are
flagged, and which are zeroed because the project's own code never does the same."""

from __future__ import annotations

import textwrap

from arena_verification import internals, patch


def diff(path: str, added: str, removed: str = "") -> str:
    plus = [f"+{line}" for line in textwrap.dedent(added).strip("\n").splitlines()]
    minus = [f"-{line}" for line in removed.splitlines()]
    return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
            f"@@ -1,{len(minus) + 1} +1,{len(plus) + 1} @@\n context\n" + "\n".join(minus + plus) + "\n")


def test_added_lines_are_read_by_hunk_counts():
    text = diff("pkg/a.py", "x = 1\n+++ not a header\n", removed="--- not a header either")
    assert list(patch.added_lines(text)) == [("pkg/a.py", "x = 1"), ("pkg/a.py", "+++ not a header")]


def test_framework_internals_interpreter_hooks_and_builtins_are_told_apart():
    text = (diff("pkg/__init__.py", """
                 from _pytest.reports import TestReport
                 import atexit, os
                 atexit.register(lambda: os._exit(0))
                 # sys.settrace in a comment is not code
                 """)
            + diff("pkg/util.py", "import builtins\nsys.setprofile(f)\n")
            + diff("pkg/runner.py", "class R(unittest.TextTestResult):\n    def addFailure(self, t, e): pass\n")
            + diff("tests/test_a.py", "import _pytest\n")      # reset before the run: not scanned
            + diff("README.md", "mentions _pytest and os._exit\n"))  # not Python
    found = internals.scan(text, exclude={"tests/test_a.py"})
    assert found == {
        "pytest's internals": ["pkg/__init__.py"],
        "unittest's reporting": ["pkg/runner.py"],
        "the interpreter's tracing": ["pkg/util.py"],
        "the hard exit": ["pkg/__init__.py"],
        "the interpreter's start-up and exit hooks": ["pkg/__init__.py"],
        "builtins": ["pkg/util.py"],
    }


def test_a_fix_that_does_what_the_project_already_does_is_only_flagged(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "debugger.py").write_text("import sys\nsys.settrace(trace)\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import _pytest\nos._exit(1)\n")  # tests do not count
    (tmp_path / "conftest.py").write_text("def pytest_runtest_makereport(item, call): pass\n")
    found = internals.scan(diff("pkg/a.py", "sys.settrace(None)\nimport _pytest\nos._exit(0)\nimport atexit\n"))
    assert set(found) == {"the interpreter's tracing", "pytest's internals", "the hard exit",
                          "the interpreter's start-up and exit hooks"}
    # tracing is the project's business; pytest's internals and the hard exit are not; atexit is never zeroed
    assert internals.new_to_project(found, tmp_path) == ["pytest's internals (pkg/a.py)", "the hard exit (pkg/a.py)"]
    assert internals.new_to_project({"builtins": ["pkg/a.py"]}, tmp_path) == []
