"""The ``tests`` verifier: the agent's diff on the pristine task, tests in the task's own environment.

``verify_tests`` runs SWE-bench's order in ONE fresh sandbox: apply the diff, reset the test files,
apply the hidden tests, add the canaries, run, parse, score. See docs/verification.md
("One ``tests`` verification", Flags).
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import random
import re
import secrets
import time
from pathlib import Path, PurePosixPath
from typing import Protocol

import msgspec

from arena_core.errors import VerificationError
from arena_core.schemas import PathSource, TestResult, TestStatus, TestsVerifier, VerificationResult, VerifyJob
from arena_core.sources import GitError, SourceCache, SourceError, prepare_workspace
from arena_sandbox_providers.provider import ExecResult, Sandbox
from arena_verification import guard, internals, patch, protected, reward
from arena_verification.parsed import ParsedOutput
from arena_verification.parsers import get_parser
from arena_verification.restore import InvalidTask, check_workdir, repo_path, snapshot

log = logging.getLogger("arena.verification")

FLAG_PATCH_FAILED = "patch_failed"
FLAG_TESTS_TAMPERED = "tests_tampered"
FLAG_TEST_CONFIG_TOUCHED = protected.FLAG_TEST_CONFIG_TOUCHED
FLAG_TIMEOUT = "timeout"
FLAG_PARSE_FAILED = "parse_failed"
FLAG_PARSE_SUSPECT = "parse_suspect"
FLAG_GIT_TAMPERED = "git_tampered"
#: Flags from the sandbox plane that make the verdict untrustworthy whatever the tests say: reward 0.
ZEROING_FLAGS = frozenset({FLAG_GIT_TAMPERED})

APPLY_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 40
LOG_TAIL_CHARS = 8_000
#: Only the end of a huge test log is parsed: the runners' summaries are at the end.
MAX_LOG_BYTES = 16 * 1024 * 1024
#: Results carried on the wire: the listed tests first, then the others up to this many.
MAX_REPORTED_TESTS = 2_000
MAX_REPORT_FILES = 1_000

DIFF_FILE = "agent.diff"

#: The test command's environment on top of the sandbox's: unbuffered (a killed run keeps
#: what it printed), no colours, and Python's ordinary bytecode cache, written too (the
#: sandbox's ``PYTHONDONTWRITEBYTECODE`` undone: a suite's processes share what one compiled);
#: the workspace's own bytecode was scrubbed before (:func:`restore.scrub_bytecode`).
TEST_ENV = {"PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "CI": "1", "PYTHONDONTWRITEBYTECODE": ""}
#: A task without an image runs on the host's Python environment, which is Arena's own: its
#: pytest plug-ins (asyncio, timeout, ...) are not the task's, so none is loaded by itself there
#: (a task that needs one names it with ``-p``, or runs in its own image).
LOCAL_TEST_ENV = {**TEST_ENV, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def job_budget_s(spec: TestsVerifier) -> float:
    """How long one ``tests`` verification may take, at most, with set-up and a margin."""
    return APPLY_TIMEOUT_S + spec.timeout_s + 120.0


class Sandboxes(Protocol):
    """Where the verifier gets its sandbox: the provider for the task's image."""

    async def sandbox_for(self, image: str, workspace_mount: str = "", services: tuple = (), *,
                          harbor_layout: bool = False) -> Sandbox: ...


async def verify_tests(job: VerifyJob, spec: TestsVerifier, root: Path, started: float, *,
                       sandboxes: Sandboxes, sources: SourceCache) -> VerificationResult:
    task = job.task
    try:
        parser = get_parser(spec.parser)
    except KeyError as exc:
        raise InvalidTask(str(exc)) from exc
    check_workdir(task.workdir)
    test_paths = [repo_path(task.workdir, rel) for rel in spec.test_files]
    hidden_paths = [PurePosixPath(patch.normalize(p)) for p in sorted(patch.touched_paths(spec.test_patch))]

    touched = patch.touched_paths(job.diff)
    guarded, flag_only = protected.classify(spec.parser, touched, task.workdir)
    # test code the agent touched besides the named files (helpers, fixtures, data next to
    # the tests) is put back too: the agent's work is the source, never the tests
    test_like = [PurePosixPath(patch.normalize(p)) for p in sorted(touched) if looks_like_test(p)]
    flags: list[str] = []
    if test_like or any(patch.touches(touched, str(p)) for p in [*test_paths, *hidden_paths]):
        flags.append(FLAG_TESTS_TAMPERED)
    flags += [flag for flag in guarded if flag not in flags]
    flags += [flag for flag in flag_only if flag not in flags]
    flags += [flag for flag in job.flags if flag not in flags]
    guarded_paths = [PurePosixPath(p) for paths in guarded.values() for p in paths]

    workspace = root / "workspace"
    async with sources.lease() as lease:  # the cached trees stay until they are copied and read
        try:
            tree = await sources.tree(task.source_of(), lease)
            hidden_tree = await sources.bundle_tree(spec.hidden_files, lease) if spec.hidden_files else None
            await asyncio.to_thread(prepare_workspace, tree, workspace)
        except FileNotFoundError as exc:
            raise InvalidTask(str(exc)) from exc
        except (SourceError, GitError) as exc:
            if isinstance(task.source_of(), PathSource):  # a host path that is not there: the task is wrong
                raise InvalidTask(str(exc)) from exc
            raise VerificationError(f"cannot get the task's source: {exc}") from exc
        hidden = await asyncio.to_thread(_hidden_files, hidden_tree) if hidden_tree is not None else {}
    reset = dict(await asyncio.to_thread(snapshot, workspace, list(dict.fromkeys([*test_paths, *hidden_paths]))))
    reset.update(await asyncio.to_thread(_snapshot_guarded, workspace, [p for p in test_like if p not in reset]))
    reset.update(await asyncio.to_thread(_snapshot_guarded, workspace, guarded_paths))
    canaries = plan_canaries(spec, workspace, hidden_paths, hidden) if spec.canaries else None

    mount = task.workspace_mount() if task.image_of() else ""
    sandbox = await sandboxes.sandbox_for(task.image_of(), mount)
    try:
        await sandbox.put_dir(workspace, WORKSPACE)
        await sandbox.put_files(_setup_files(job.diff, spec, reset, hidden, canaries))
        # an image source's tests run where the image expects the repository (e.g. /testbed)
        workdir = posixpath.normpath(posixpath.join(mount or WORKSPACE, task.workdir or "."))
        if job.diff and not job.diff.isspace():  # (``strip`` would copy the whole diff)
            error = await _apply(sandbox)
            if error is not None:
                return VerificationResult(
                    rollout_id=job.rollout_id, verifier="tests", reward=0.0, passed=False, started_at=started,
                    finished_at=time.time(), components={"tests": 0.0, "partial": 0.0},
                    flags=[FLAG_PATCH_FAILED, *flags], reason=f"the diff does not apply: {error}",
                    log_tail=_tail(error), parser=spec.parser,
                )
        setup = _Output(64 * 1024)
        run = await sandbox.exec(["sh", f"{ARENA_DIR}/{RESET_SCRIPT}"], env=GIT_ENV, timeout_s=APPLY_TIMEOUT_S,
                                 on_output=setup)
        if run.exit_code != 0:
            text = setup.text().strip()
            if "arena: hidden test patch does not apply" in text:
                raise VerificationError(f"the task's hidden test patch does not apply to its source: {text[-1500:]}")
            raise VerificationError(f"cannot reset the test files in the sandbox (exit {run.exit_code}): "
                                    f"{text[-1500:]}")
        output = _Output(MAX_LOG_BYTES)
        env = TEST_ENV if task.image_of() else LOCAL_TEST_ENV
        report_path = f"{ARENA_DIR}/report-{secrets.token_hex(8)}"
        command = spec.command.replace(REPORT, report_path)
        watch = guard.plan(ARENA_DIR) if spec.canaries and spec.parser in CANARY_PARSERS else None
        if watch is not None:  # after the reset, which empties the directory
            await sandbox.put_files(guard.files(watch, workdir=workdir, root=mount or WORKSPACE))
            command = guard.command(watch, command)
        run = await sandbox.exec(["sh", "-c", command], env=env, workdir=workdir,
                                 timeout_s=spec.timeout_s, on_output=output)
        text = output.text()
        record = await sandbox.read_file(watch.record, max_bytes=MAX_LOG_BYTES) if watch is not None else None
        if REPORT in spec.command:
            parsed = await _parse_report(sandbox, report_path, parser, spec, text, run)
        elif spec.report_file:
            own_path = posixpath.normpath(posixpath.join(WORKSPACE, task.workdir or "."))
            parsed = parser(await _read_reports(sandbox, workdir, spec.report_file, own_path))
        else:
            parsed = parser(text)
    finally:
        await asyncio.shield(sandbox.destroy())
    lies: list[str] = []
    if canaries is not None:
        parsed, tampered = check_canaries(parsed, canaries, run.exit_code)
        lies += [tampered] if tampered else []
    if watch is not None:
        seen, _ = guard.check(parsed, guard.read(record.decode("utf-8", "replace")) if record is not None else None,
                              log_text=text, marker=watch.marker, exit_code=run.exit_code,
                              listed=[*spec.fail_to_pass, *spec.pass_to_pass],
                              by_node_id=spec.parser == "pytest" and REPORT not in spec.command
                              and not spec.report_file)
        lies += [f"runner tampered: {p}" for p in seen]
    reached = internals.scan(job.diff, exclude={str(p) for p in [*reset, *test_like]})
    if reached:
        flags.append(internals.FLAG_INTERNALS_TOUCHED)
        novel = await asyncio.to_thread(internals.new_to_project, reached, workspace)
        lies += [f"runner tampered: the diff reaches into {what}, which the project's own code never does"
                 for what in novel]
    if lies:
        if protected.FLAG_RUNNER_TAMPERED not in flags:
            flags.append(protected.FLAG_RUNNER_TAMPERED)
        parsed = msgspec.structs.replace(parsed, notes=[*parsed.notes, "; ".join(lies)])
    return _result(job, spec, parsed, run, text, flags, started)


#: Directories whose files are test code in every ecosystem Arena parses.
TEST_DIRS = frozenset({"test", "tests", "__tests__"})
_TEST_FILE = re.compile(r"(^test_.*\.py$|_test\.py$|_test\.go$|\.(test|spec)\.[cm]?[jt]sx?$)")


def looks_like_test(path: str) -> bool:
    """Whether ``path`` is test code: under a ``test``/``tests``/``__tests__`` directory, or
    named like a test file of pytest, go or the JavaScript runners."""
    parts = PurePosixPath(path).parts
    return bool(parts) and (any(p in TEST_DIRS for p in parts[:-1]) or bool(_TEST_FILE.search(parts[-1])))


# --------------------------------------------------------------------------- the sandbox's set-up

WORKSPACE = "/sandbox/workspace"
ARENA_DIR = "/sandbox/.arena"
RESET_SCRIPT = "reset.sh"
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/tmp"}

#: Runs as the sandbox user before any of the agent's code: puts every listed path back to its
#: base version (a parent the diff turned into a link or a file becomes a real directory again),
#: applies the hidden test patch, copies the hidden files, appends the canaries, removes
#: compiled bytecode and everything it was given.
_RESET = r"""set -u
cd /sandbox/workspace || exit 1
A=/sandbox/.arena
realdir() {  # make every parent of $1 a real directory
  d=""; rest="$1"
  while [ "${rest#*/}" != "$rest" ]; do
    d="${d:+$d/}${rest%%/*}"; rest="${rest#*/}"
    if [ -L "$d" ] || { [ -e "$d" ] && [ ! -d "$d" ]; }; then rm -f -- "$d"; fi
    [ -d "$d" ] || mkdir -- "$d" || exit 1
  done
}
while IFS= read -r p; do
  [ -n "$p" ] || continue
  realdir "$p"; rm -rf -- "$p"
  if [ -e "$A/pristine/$p" ] || [ -L "$A/pristine/$p" ]; then cp -a -- "$A/pristine/$p" "$p" || exit 1; fi
done < "$A/reset.list"
tab="$(printf '\t')"
while IFS="$tab" read -r p t; do
  [ -n "$p" ] || continue
  realdir "$p"; rm -rf -- "$p"; ln -s -- "$t" "$p" || exit 1
done < "$A/links.list"
if [ -s "$A/test.patch" ]; then
  git apply --whitespace=nowarn "$A/test.patch" 2>&1 || { echo "arena: hidden test patch does not apply"; exit 3; }
fi
if [ -d "$A/hidden" ]; then
  (cd "$A/hidden" && find . -type f) | while IFS= read -r f; do
    f="${f#./}"; realdir "$f"; rm -rf -- "$f"; cp -- "$A/hidden/$f" "$f" || exit 1
  done
fi
if [ -s "$A/canary.list" ]; then
  while IFS= read -r p; do
    [ -f "$p" ] && [ ! -L "$p" ] || continue
    cat "$A/canary/$p" >> "$p"
  done < "$A/canary.list"
fi
# a fresh repository holding the tree as it is now: what the test process finds in .git is
# this tree, so comparing against the base reveals neither the hidden tests nor the canaries
if command -v git >/dev/null 2>&1 && [ -d .git ]; then
  rm -rf .git && git init -q && git add -A >/dev/null 2>&1 &&
    git -c user.name=arena -c user.email=arena@localhost -c commit.gpgsign=false commit -q --no-verify -m base \
      >/dev/null 2>&1
fi
find . -name .git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null
find . -name .git -prune -o \( -name '*.pyc' -o -name '*.pyo' \) -type f -exec rm -f {} + 2>/dev/null
rm -rf -- "$A"/* 2>/dev/null
exit 0
"""


def _setup_files(diff: str, spec: TestsVerifier, reset: dict, hidden: dict[str, bytes],
                 canaries: Canaries | None) -> dict[str, bytes]:
    files: dict[str, bytes] = {
        f"{ARENA_DIR}/{DIFF_FILE}": diff.encode("utf-8"),
        f"{ARENA_DIR}/test.patch": spec.test_patch.encode("utf-8"),
        f"{ARENA_DIR}/{RESET_SCRIPT}": _RESET.encode(),
        f"{ARENA_DIR}/reset.list": "".join(f"{p}\n" for p in reset).encode(),
    }
    links = []
    for rel, saved in reset.items():
        if saved is None:
            continue
        if saved.link is not None:
            links.append(f"{rel}\t{saved.link}\n")
            continue
        files[f"{ARENA_DIR}/pristine/{rel}"] = saved.data
    files[f"{ARENA_DIR}/links.list"] = "".join(links).encode()
    for rel, data in hidden.items():
        files[f"{ARENA_DIR}/hidden/{rel}"] = data
    if canaries is not None:
        files[f"{ARENA_DIR}/canary.list"] = "".join(f"{p}\n" for p in canaries.files).encode()
        for path, (_, _, source) in canaries.files.items():
            files[f"{ARENA_DIR}/canary/{path}"] = source.encode()
    return files


def _hidden_files(tree: Path) -> dict[str, bytes]:
    """The hidden test files of a bundle, by path inside the repository (regular files only)."""
    out: dict[str, bytes] = {}
    for top, dirs, files in os.walk(tree, followlinks=False):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            path = Path(top) / name
            if path.is_symlink() or not path.is_file():
                continue
            rel = str(PurePosixPath(*path.relative_to(tree).parts))
            repo_path(".", rel)  # rejects escapes
            out[rel] = path.read_bytes()
    return out


async def _apply(sandbox: Sandbox) -> str | None:
    """``git apply`` the agent's diff in the sandbox; ``None`` on success, else git's complaint."""
    output = _Output(64 * 1024)
    run = await sandbox.exec(["git", "apply", "--whitespace=nowarn", f"{ARENA_DIR}/{DIFF_FILE}"], env=GIT_ENV,
                             timeout_s=APPLY_TIMEOUT_S, on_output=output)
    text = output.text().strip()
    if run.timed_out:
        return f"git apply timed out after {APPLY_TIMEOUT_S:g}s"
    if run.exit_code != 0:
        return text or f"git apply exited {run.exit_code}"
    return None


REPORT = "{report}"


async def _parse_report(sandbox: Sandbox, path: str, parser, spec: TestsVerifier, log_text: str,
                        run: ExecResult) -> ParsedOutput:
    """The structured report the run wrote at ``path`` (outside the workspace), cross-checked
    with the exit code; the log with ``fallback_parser`` when the report is missing or cut."""
    data = await sandbox.read_file(path, max_bytes=MAX_LOG_BYTES)
    parsed = parser(data.decode("utf-8", errors="replace")) if data else None
    if parsed is None or not parsed.complete:
        note = "the structured report is missing" if parsed is None else "the structured report is incomplete"
        if spec.fallback_parser is None:
            empty = ParsedOutput(results=[], complete=False, notes=[note])
            return parsed if parsed is not None else empty
        fallback = get_parser(spec.fallback_parser)(log_text)
        return msgspec.structs.replace(fallback, notes=[*fallback.notes, f"{note}: the log was parsed instead"])
    failing = any(r.status in (TestStatus.FAILED, TestStatus.ERROR) for r in parsed.results)
    if run.exit_code is not None and not run.timed_out and (run.exit_code == 0) == failing:
        said = "failures" if failing else "no failure"
        return msgspec.structs.replace(parsed, suspect=True, notes=[
            *parsed.notes, f"the report counted {said} but the runner exited {run.exit_code}"])
    return parsed


async def _read_reports(sandbox: Sandbox, workdir: str, pattern: str, own_path: str) -> str:
    """The report files the run wrote (``pattern`` may be a glob), concatenated; regular files
    inside the workspace only, each up to ``MAX_LOG_BYTES``."""
    if os.path.isabs(pattern) or ".." in PurePosixPath(pattern).parts:
        raise InvalidTask(f"report_file {pattern!r} is not a path inside the working directory")
    if not any(ch in pattern for ch in "*?["):
        data = await sandbox.read_file(posixpath.join(own_path, pattern), max_bytes=MAX_LOG_BYTES)
        return (data or b"")[:MAX_LOG_BYTES].decode("utf-8", errors="replace")
    output = _Output(MAX_LOG_BYTES)
    script = ('n=0; for f in $1; do [ -f "$f" ] && [ ! -L "$f" ] || continue; n=$((n+1)); '
              f'[ $n -le {MAX_REPORT_FILES} ] || break; head -c {MAX_LOG_BYTES} -- "$f"; done')
    await sandbox.exec(["sh", "-c", script, "sh", pattern], env={}, workdir=workdir, timeout_s=60.0,
                       on_output=output)
    return output.text()


class _Output:
    """A command's output as it streams: the last ``max_bytes`` kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.chunks: list[bytes] = []
        self.size = 0

    def __call__(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        while self.size > self.max_bytes and len(self.chunks) > 1:
            self.size -= len(self.chunks.pop(0))

    def text(self) -> str:
        return b"".join(self.chunks)[-self.max_bytes:].decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- canaries

#: Parsers whose runner is pytest: the canaries are pytest tests.
CANARY_PARSERS = frozenset({"pytest", "pytest_junit"})


class Canaries(msgspec.Struct, frozen=True, kw_only=True):
    """Two tests appended to each of the listed test files: one must fail, one must pass.
    Named from the file's own tests and written like them, so code running inside the test
    process cannot tell them from the hidden tests."""

    #: test file -> (must-fail name, must-pass name, source appended to it)
    files: dict[str, tuple[str, str, str]]


_TEST_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(test_\w+)[ \t]*\(", re.M)
_SUFFIXES = ("basic", "edge_case", "regression", "roundtrip", "empty", "unicode", "large_input", "repr",
             "types", "default", "nested", "order", "idempotent", "none", "twice", "mixed")
_WORDS = ("alpha", "value", "token", "field", "item", "word", "key", "name", "node", "chunk", "entry", "label")


def _canary_name(existing: set[str], rng: random.Random) -> str:
    stems = sorted(existing) or ["test_" + rng.choice(_WORDS)]
    for _ in range(100):
        name = f"{rng.choice(stems)}_{rng.choice(_SUFFIXES)}"
        if name not in existing:
            existing.add(name)
            return name
    name = f"test_{rng.choice(_WORDS)}_{secrets.token_hex(3)}"
    existing.add(name)
    return name


def _canary_body(rng: random.Random, *, fail: bool) -> str:
    word = rng.choice(_WORDS)
    n, m = rng.randint(2, 97), rng.randint(2, 97)
    bodies = [
        (f"assert sorted([{m}, {n}, {n + m}]) == [{n + m}, {m}, {n}]", f"assert sorted([{n + m}, {n}]) == [{n}, {n + m}]"),
        (f'assert "{word}".upper() == "{word}"', f'assert "{word}".upper() == "{word.upper()}"'),
        (f'assert len("{word}") == {len(word) + 1}', f'assert len("{word}") == {len(word)}'),
        (f"assert {n} + {m} == {n + m + 1}", f"assert {n} + {m} == {n + m}"),
        (f'assert "{word}"[::-1] == "{word}"', f'assert "{word}"[::-1][::-1] == "{word}"'),
    ]
    bad, good = rng.choice(bodies)
    return bad if fail else good


def plan_canaries(spec: TestsVerifier, workspace: Path, hidden_paths: list[PurePosixPath],
                  hidden: dict[str, bytes]) -> Canaries | None:
    """Canaries for a pytest task, for (at most three of) the Python files the listed tests
    live in; ``None`` for other runners or when no listed test names its file."""
    if spec.parser not in CANARY_PARSERS:
        return None
    files: list[str] = []
    for test_id in [*spec.fail_to_pass, *spec.pass_to_pass]:
        path = test_id.split("::", 1)[0]
        if "::" not in test_id or not path.endswith(".py") or path in files:
            continue
        try:
            rel = repo_path(".", path)
        except InvalidTask:
            continue
        exists = (workspace / rel).is_file() or rel in hidden_paths or str(rel) in hidden
        if exists:
            files.append(str(rel))
        if len(files) == 3:
            break
    if not files and spec.expected_statuses:
        # exact-match tasks (R2E-Gym) name their tests without a file: the hidden test files host them
        files = sorted(rel for rel in hidden if _TEST_FILE.search(PurePosixPath(rel).name)
                       and rel.endswith(".py"))[:3]
    if not files:
        return None
    rng = random.Random(secrets.randbits(64))
    listed = {t.split("::")[-1].split("[")[0] for t in [*spec.fail_to_pass, *spec.pass_to_pass]}
    # R2E-Gym's keys: ``Class.test[param]`` (a parameter may hold dots): the name before the parameter
    listed |= {k.split("[")[0].split(".")[-1] for k in spec.expected_statuses}
    planned: dict[str, tuple[str, str, str]] = {}
    for rel in files:
        path = workspace / rel
        text = path.read_text(errors="replace") if path.is_file() and not path.is_symlink() else ""
        text += hidden.get(rel, b"").decode(errors="replace") + spec.test_patch
        existing = {name for name in set(_TEST_DEF.findall(text)) | listed if name.isidentifier()}
        must_fail, must_pass = _canary_name(existing, rng), _canary_name(existing, rng)
        tests = [(must_fail, _canary_body(rng, fail=True)), (must_pass, _canary_body(rng, fail=False))]
        rng.shuffle(tests)
        source = "\n\n".join(f"def {name}():\n    {body}\n" for name, body in tests)
        planned[rel] = (must_fail, must_pass, "\n" + source)
    return Canaries(files=planned)


def check_canaries(parsed: ParsedOutput, canaries: Canaries, exit_code: int | None) -> tuple[ParsedOutput, str]:
    """The results without the canaries, and why the runner is not telling the truth ("" if it is).

    The runner lies when a must-fail canary is reported as anything but a failure, when it is
    missing while its must-pass sibling passed, or when the run exited 0 although a canary failed.
    """
    statuses = {}
    rest = []
    for result in parsed.results:
        path, name = result.test_id.split("::", 1)[0], result.test_id.split("::")[-1]
        if path in canaries.files and name in canaries.files[path][:2] and "::" in result.test_id:
            statuses[(path, name)] = result.status
        else:
            rest.append(result)
    cleaned = msgspec.structs.replace(parsed, results=rest)
    failing = {TestStatus.FAILED, TestStatus.ERROR}
    problems = []
    ran_failing_canary = False
    for path, (must_fail, must_pass, _) in canaries.files.items():
        bad = statuses.get((path, must_fail))
        good = statuses.get((path, must_pass))
        if bad is not None and bad not in failing:
            problems.append(f"a test that must fail was reported {bad.value} ({path})")
        elif bad is None and good is TestStatus.PASSED:
            problems.append(f"a test that must fail was missing from the report while its sibling passed ({path})")
        if bad in failing:
            ran_failing_canary = True
    if ran_failing_canary and exit_code == 0:
        problems.append("the runner exited 0 although a test failed")
    return cleaned, "; ".join(f"runner tampered: {p}" for p in problems)


def _result(job: VerifyJob, spec: TestsVerifier, parsed: ParsedOutput, run: ExecResult, text: str,
            flags: list[str], started: float) -> VerificationResult:
    score = reward.score(spec, parsed.results)
    flags = flags + score.flags
    reasons = [score.reason]
    if run.timed_out:
        flags.append(FLAG_TIMEOUT)
        reasons.insert(0, f"the test command timed out after {spec.timeout_s:g}s")
    if parsed.truncated or not parsed.results:
        flags.append(FLAG_PARSE_FAILED)
        if not run.timed_out:
            what = f"report {spec.report_file}" if spec.report_file else "log"
            reasons.insert(0, f"no complete {spec.parser} report in the {what} (exit code {run.exit_code})")
    if parsed.suspect:
        flags.append(FLAG_PARSE_SUSPECT)
        reasons.insert(0, "; ".join(n for n in parsed.notes if "counted" in n or "declares" in n or "in doubt" in n))
    if parsed.unresolved:  # the run was cut: these tests started and never ended
        reasons.insert(0, next(n for n in parsed.notes if n.startswith("the run was cut")))
    # A runner caught lying (the canaries) or a doctored repository: the tests' word is worthless.
    # (A shadow runner or a conftest in the diff is neutralised by the reset, and only flagged.)
    lied = [n for n in parsed.notes if n.startswith("runner tampered")]
    cheated = lied or [f for f in flags if f in ZEROING_FLAGS]
    if cheated:
        reasons.insert(0, "; ".join(lied) or f"flagged {', '.join(cheated)}")
    trusted = not run.timed_out and parsed.complete and not parsed.suspect and not cheated
    final_reward = score.reward if trusted else 0.0
    return VerificationResult(
        rollout_id=job.rollout_id,
        verifier="tests",
        reward=final_reward,
        passed=final_reward == 1.0,
        started_at=started,
        finished_at=time.time(),
        components={**score.components, "tests": final_reward},
        tests=_reported(parsed.results, spec),
        counts=score.counts,
        flags=flags,
        reason="; ".join(r for r in reasons if r),
        log_tail=_tail(text),
        parser=spec.parser,
    )


def _snapshot_guarded(workspace: Path, paths: list[PurePosixPath]):
    """Pristine copies of protected paths; a directory in the pristine repo is left alone."""
    keep = [p for p in paths if not (workspace / p).is_dir() or (workspace / p).is_symlink()]
    return snapshot(workspace, keep)


def _tail(text: str) -> str:
    tail = "\n".join(text.splitlines()[-LOG_TAIL_LINES:])
    return tail[-LOG_TAIL_CHARS:]


def _reported(results: list[TestResult], spec: TestsVerifier) -> list[TestResult]:
    listed = set(spec.fail_to_pass) | set(spec.pass_to_pass)
    first = [r for r in results if r.test_id in listed]
    rest = [r for r in results if r.test_id not in listed]
    return (first + rest)[: max(MAX_REPORTED_TESTS, len(first))]
