"""Arena's guard: a pytest plug-in the ``tests`` and ``reward_file`` verifiers load (``PYTEST_PLUGINS``)
into the test run before any of the agent's code is imported. Runs inside the sandbox, never in the service.

It records, per test and apart from pytest's reports, what each phase raised, and whether the test
framework's or the interpreter's internals changed under the run; the verifier compares that record
with the runner's report (``guard.py``). Any Python 3 an image has, standard library and pytest only;
it never breaks a run. docs/verification.md ("The guard").
"""

import os as _os
import sys as _sys

_NONCE = "@NONCE@"
_RECORD = "@RECORD@"
_WORKDIR = "@WORKDIR@"
_ROOT = "@ROOT@"

#: Set by a session for the processes it starts: theirs run under it.
_PARENT = "ARENA_GUARD_" + _NONCE
_write = _os.write
_getcwd = _os.getcwd
_FunctionType = type(lambda: None)
_BuiltinType = type(len)
_MethodType = type(object().__str__)
_ours = False
_fd = None
try:
    # no working directory: a test script's runs, wherever it runs them
    _ours = not _WORKDIR or _os.path.realpath(_getcwd()) == _os.path.realpath(_WORKDIR)
    if _ours:
        _fd = _os.open(_RECORD, _os.O_WRONLY | _os.O_CREAT | _os.O_APPEND, 0o600)
        _write(2, ("arena-guard %s\n" % _NONCE).encode())
except Exception:  # noqa: BLE001 - the guard never breaks a run
    _fd = None


def _esc(value):
    return str(value).replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _emit(*fields):
    if _fd is None:
        return
    try:
        _write(_fd, ("\t".join(_esc(f) for f in fields) + "\n").encode("utf-8", "backslashreplace"))
    except Exception:  # noqa: BLE001
        pass


try:
    import pytest as _pytest_mod

    # pytest's public names for what skip() and xfail() raise (``_pytest.outcomes``' Skipped, XFailed)
    _SKIP = (_pytest_mod.skip.Exception,)
    _XFAIL = (_pytest_mod.xfail.Exception,) if hasattr(_pytest_mod.xfail, "Exception") else ()
    try:
        import unittest as _unittest
        _SKIP = _SKIP + (_unittest.SkipTest,)
    except Exception:  # noqa: BLE001
        pass
    _hookimpl = _pytest_mod.hookimpl
except Exception:  # noqa: BLE001
    _pytest_mod = None


def _kind(exc_type):
    """``skipped``, ``xfail`` or ``failed`` for the type of what a phase raised."""
    try:
        if _XFAIL and issubclass(exc_type, _XFAIL):
            return "xfail"
        if issubclass(exc_type, _SKIP):
            return "skipped"
    except Exception:  # noqa: BLE001
        pass
    return "failed"


# --------------------------------------------------------------------------- integrity

_WATCHED = ("_pytest", "pluggy", "unittest")
#: Checked after every test (the rest, at the session's end): where reports are made and written.
_HOT = ("_pytest.reports", "_pytest.runner", "_pytest.terminal", "_pytest.python", "_pytest.unittest",
        "_pytest.skipping", "_pytest.junitxml", "_pytest.main", "_pytest.outcomes", "_pytest._io.terminalwriter",
        "pluggy._callers", "pluggy._hooks", "pluggy._result", "pluggy.callers", "pluggy.hooks")
_state = {"snapshot": None, "hooks": None, "session": None, "reported": set(), "items": {}}
_HOOKS = ("pytest_runtest_protocol", "pytest_runtest_setup", "pytest_runtest_call", "pytest_runtest_teardown",
          "pytest_runtest_makereport", "pytest_runtest_logreport", "pytest_report_teststatus", "pytest_pyfunc_call",
          "pytest_terminal_summary", "pytest_sessionfinish", "pytest_runtest_logfinish", "pytest_collectreport",
          "pytest_collection_modifyitems", "pytest_exception_interact")


def _snapshot():
    """(holder dict, key, object) for every function and class of the watched modules (and the
    functions of their classes), builtins, and the interpreter's exit paths."""
    held, hot = [], []
    for name, module in list(_sys.modules.items()):
        if module is None or not (name == "pytest" or name.split(".")[0] in _WATCHED):
            continue
        if name in _HOT:
            start = len(held)
        held.append((_sys.modules, name, module))
        space = getattr(module, "__dict__", None)
        if not isinstance(space, dict):
            continue
        for key, value in list(space.items()):
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                held.append((space, key, value))
                for attr, member in list(vars(value).items()):
                    if isinstance(member, (_FunctionType, classmethod, staticmethod, property)):
                        held.append((value.__dict__, attr, member))
            elif isinstance(value, (_FunctionType, _BuiltinType)):
                held.append((space, key, value))
        if name in _HOT:
            hot += held[start:]
    import builtins as _builtins
    for key, value in list(vars(_builtins).items()):
        if isinstance(value, (type, _BuiltinType, _FunctionType)):
            held.append((vars(_builtins), key, value))
    exits = [(vars(module), key, getattr(module, key, None)) for module, key in
             ((_os, "_exit"), (_sys, "exit"), (_sys, "excepthook"))]
    try:
        import atexit as _atexit
        exits.append((vars(_atexit), "register", _atexit.register))
    except Exception:  # noqa: BLE001
        pass
    return held + exits, hot + exits, (_sys.gettrace(), _sys.getprofile())


def _changed(full):
    """What changed since the snapshot (``full``: everything watched, else where reports are made):
    names of replaced objects, a trace/profile function set from the repository's code, hook
    implementations registered from it (not from a ``conftest.py``)."""
    snap = _state["snapshot"]
    if snap is None:
        return []
    held, hot, (trace, profile) = snap
    out = []
    for space, key, value in (held if full else hot):
        try:
            now = space.get(key)
        except Exception:  # noqa: BLE001
            now = None
        if now is not value:
            owner = getattr(value, "__qualname__", None) or key
            out.append("replaced %s" % owner if key in ("_exit", "exit", "excepthook", "register")
                       else "replaced %s" % (getattr(value, "__module__", "") + "." + owner).lstrip("."))
    for what, before, now in (("sys.settrace", trace, _sys.gettrace()), ("sys.setprofile", profile, _sys.getprofile())):
        if now is not before and now is not None and _in_repo(now):
            out.append("%s from %s" % (what, _file_of(now)))
    out += _new_hooks()
    return out[:20]


def _file_of(obj):
    obj = getattr(obj, "__func__", obj)
    code = getattr(obj, "__code__", None)
    if code is not None:
        return code.co_filename
    module = _sys.modules.get(getattr(obj, "__module__", None) or getattr(type(obj), "__module__", ""), None)
    return getattr(module, "__file__", "") or ""


def _in_repo(obj):
    path = _file_of(obj)
    if not path:
        return False
    try:
        path = _os.path.realpath(path)
        root = _os.path.realpath(_ROOT)
    except Exception:  # noqa: BLE001
        return False
    return (path + _os.sep).startswith(root + _os.sep) and _os.path.basename(path) != "conftest.py"


def _hook_impls(config):
    found = set()
    hook = getattr(getattr(config, "pluginmanager", None), "hook", None)
    for name in _HOOKS:
        caller = getattr(hook, name, None)
        try:
            for impl in caller.get_hookimpls():
                found.add(impl.function)
        except Exception:  # noqa: BLE001
            continue
    return found


def _new_hooks():
    config, before = _state["session"], _state["hooks"]
    if config is None or before is None:
        return []
    return ["a %s hook registered from %s" % (getattr(f, "__name__", "?"), _file_of(f))
            for f in _hook_impls(config) - before if _in_repo(f)]


def _report_changes(sid, full):
    for what in _changed(full):
        if what not in _state["reported"]:
            _state["reported"].add(what)
            _emit("tampered", sid, what)


# --------------------------------------------------------------------------- hooks

def _sid(config):
    return "%d-%d" % (_os.getpid(), id(config))


def _is_ours(config):
    if not _ours:
        return False
    if not _WORKDIR:
        return True
    try:
        where = str(config.invocation_params.dir)
    except Exception:  # noqa: BLE001 - pytest < 5.1
        where = str(getattr(config, "invocation_dir", _getcwd()))
    return _os.path.realpath(where) == _os.path.realpath(_WORKDIR)


if _pytest_mod is not None and _ours:

    @_hookimpl(trylast=True)
    def pytest_sessionstart(session):
        config = session.config
        if not _is_ours(config) or _state["session"] is not None:
            return
        _state["session"] = config
        # the guarded session this one runs under (a test's own pytest run, an xdist worker's controller)
        _emit("start", _sid(config), _os.getpid(), _os.environ.get(_PARENT, ""))
        try:
            _os.environ[_PARENT] = _sid(config)
        except Exception:  # noqa: BLE001
            pass
        try:
            _state["snapshot"] = _snapshot()
            _state["hooks"] = _hook_impls(config)
        except Exception:  # noqa: BLE001
            _state["snapshot"] = None

    def _phase(item, phase, outcome):
        if _state["session"] is not item.config:
            return
        try:
            excinfo = outcome.excinfo
            got = "ok" if excinfo is None else _kind(excinfo[0])
            pending = getattr(item, "_excinfo", None)  # unittest.TestCase failures, kept by pytest
            if got == "ok" and pending:
                got = _kind(pending[0].type)
            _state["items"].setdefault(item.nodeid, {})[phase] = got
        except Exception:  # noqa: BLE001
            pass

    @_hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_setup(item):
        outcome = yield
        _phase(item, "setup", outcome)

    @_hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_call(item):
        outcome = yield
        _phase(item, "call", outcome)

    @_hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_teardown(item, nextitem):
        outcome = yield
        _phase(item, "teardown", outcome)

    @_hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(item, nextitem):
        yield
        config = item.config
        if _state["session"] is not config:
            return
        try:
            seen = _state["items"].pop(item.nodeid, {})
            marked = 1 if item.get_closest_marker("xfail") is not None else 0
            _emit("test", _sid(config), item.nodeid, seen.get("setup", "-"), seen.get("call", "-"),
                  seen.get("teardown", "-"), marked)
            _report_changes(_sid(config), False)
        except Exception:  # noqa: BLE001
            pass

    @_hookimpl(tryfirst=True)
    def pytest_sessionfinish(session, exitstatus):
        config = session.config
        if _state["session"] is not config:
            return
        try:
            _report_changes(_sid(config), True)
        except Exception:  # noqa: BLE001
            pass
        _emit("end", _sid(config), int(exitstatus))
