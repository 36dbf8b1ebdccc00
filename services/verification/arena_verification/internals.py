"""Which lines of a diff reach into a test framework's or the interpreter's internals. Pure but for
reading the pristine project's sources (``new_to_project``).

A Python file the run keeps (not a reset test file or protected path) whose added lines name pytest's
or unittest's reporting machinery, tracing hooks, import hooks or the hard exit is flagged
``internals_touched``; when the project's own code never names the same thing, no fix needs it and
the verdict is 0. docs/verification.md ("Diffs that reach into the runner").
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from arena_verification import patch

FLAG_INTERNALS_TOUCHED = "internals_touched"

#: What a fix to a library has no business touching, unless the library itself does (a pytest
#: plug-in, a tracer): label -> pattern over one added line.
_REACHES = {
    "pytest's internals": r"\b_pytest\b|\bpluggy\b|\bhook(?:impl|wrapper)\b|\bpluginmanager\b|\bTestReport\b"
                          r"|\bCallInfo\b|\bfrom_item_and_call\b|\bTerminal(?:Reporter|Writer)\b"
                          r"|\bpytest_(?:runtest|report|terminal|session|collect|make|pyfunc|configure|unconfigure"
                          r"|plugin|load|cmdline|addoption|deselected|itemcollected|exception_interact)\w*"
                          r"|\bPYTEST_(?:CURRENT_TEST|ADDOPTS|PLUGINS)\b",
    "unittest's reporting": r"\b(?:Text)?TestResult\b|\bTextTestRunner\b|\badd(?:Success|Failure|Error|Skip"
                            r"|ExpectedFailure|UnexpectedSuccess|SubTest)\b|\bTestCase\.run\b"
                            r"|\bunittest\.(?:result|runner|main)\b",
    "the interpreter's tracing": r"\b(?:sys|threading)\.set(?:trace|profile)(?:_all_threads)?\b",
    "the import system": r"\bsys\.(?:meta_path|path_hooks)\b|\bsys\.addaudithook\b",
    "the hard exit": r"\bos\._exit\b",
    "function code objects": r"\.__code__\s*=[^=]",
    "the garbage collector's object graph": r"\bgc\.get_(?:referrers|objects)\b",
}
#: Flagged, never zeroed: ordinary libraries use these.
_FLAG_ONLY = {
    "the interpreter's start-up and exit hooks": r"\batexit\b|\bsitecustomize\b|\busercustomize\b"
                                                 r"|\bsys\.excepthook\b|\.pth\b",
    "builtins": r"\bbuiltins\b|\b__builtins__\b",
}
_PATTERNS = {label: re.compile(rx) for label, rx in {**_REACHES, **_FLAG_ONLY}.items()}
#: Literal words every match of a label holds: text without any of them is never searched.
_ANCHORS = {
    "pytest's internals": ("pytest", "pluggy", "hook", "pluginmanager", "TestReport", "CallInfo", "from_item",
                           "Terminal", "PYTEST_"),
    "unittest's reporting": ("TestResult", "TestRunner", "addSuccess", "addFailure", "addError", "addSkip",
                             "addExpectedFailure", "addUnexpectedSuccess", "addSubTest", "TestCase.run", "unittest."),
    "the interpreter's tracing": ("settrace", "setprofile"),
    "the import system": ("meta_path", "path_hooks", "addaudithook"),
    "the hard exit": ("_exit",),
    "function code objects": ("__code__",),
    "the garbage collector's object graph": ("gc.get_",),
    "the interpreter's start-up and exit hooks": ("atexit", "sitecustomize", "usercustomize", "excepthook", ".pth"),
    "builtins": ("builtins",),
}
_CHUNK_LINES = 4096
#: Python sources and start-up files the test process may load.
_SOURCES = (".py", ".pyw", ".pth", ".pyi")
#: The project's own sources read by ``new_to_project``: at most this many bytes in all.
MAX_PROJECT_BYTES = 64 * 1024 * 1024
_SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "node_modules", ".tox", ".eggs", "build", "dist"}
_TEST_DIRS = {"test", "tests", "testing", "__tests__"}


def scan(diff: str, *, exclude: set[str] = frozenset()) -> dict[str, list[str]]:
    """label -> paths whose added lines match it (Python files the run keeps; comments aside)."""
    found: dict[str, list[str]] = {}
    chunk: list[str] = []
    current = ""

    def flush() -> None:
        text = "\n".join(chunk)
        for label, rx in _PATTERNS.items():
            if current not in found.get(label, ()) and any(a in text for a in _ANCHORS[label]) and rx.search(text):
                found.setdefault(label, []).append(current)
        chunk.clear()

    for path, line in patch.added_lines(diff):
        if path != current or len(chunk) >= _CHUNK_LINES:
            flush()
            current = path
        if path.endswith(_SOURCES) and path not in exclude and not line.lstrip().startswith("#"):
            chunk.append(line)
    flush()
    return {label: found[label] for label in _PATTERNS if found.get(label)}


def new_to_project(found: dict[str, list[str]], workspace: Path) -> list[str]:
    """The labels of ``found`` that can zero the verdict and that the project's own (non-test)
    Python sources in ``workspace`` (the pristine tree) never match."""
    wanted = {label: _PATTERNS[label] for label in found if label in _REACHES}
    if not wanted:
        return []
    budget = MAX_PROJECT_BYTES
    for top, dirs, names in os.walk(workspace):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and d not in _TEST_DIRS]
        for name in names:
            if not name.endswith(".py") or name == "conftest.py" or name.startswith("test_") \
                    or name.endswith("_test.py"):
                continue
            path = Path(top) / name
            if path.is_symlink():
                continue
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            budget -= len(text)
            for label in [lb for lb, rx in wanted.items() if rx.search(text)]:
                del wanted[label]
            if not wanted:
                return []
            if budget < 0:  # a huge project: what was not seen is not held against the diff
                return []
    return [f"{label} ({', '.join(found[label][:3])})" for label in wanted]
