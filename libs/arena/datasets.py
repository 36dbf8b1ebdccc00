"""SWE-bench-format datasets as Arena tasks: read rows, check out each repository from a
local mirror, and write one task file (public part + verifier) per instance plus its gold patch.

The row format is SWE-bench's / SWE-Gym's (``instance_id, repo, base_commit, patch,
test_patch, FAIL_TO_PASS, PASS_TO_PASS``; the lists as JSON strings or lists). docs/tasks.md.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from arena_core.errors import InvalidRequest
from arena_core.schemas import AgentSpec, Budget, ImageSource, Source, Task, TestsVerifier
from arena_core.sources import GitError, SourceError, host_git, safe_extractall

#: The test command SWE-bench's harness runs for pytest repositories; ``{test_files}`` is
#: replaced by the files the instance's test patch touches.
DEFAULT_COMMAND = "python -m pytest -rA -p no:cacheprovider {test_files}"
#: Until a task names its agent, running it says so.
UNSET_AGENT = AgentSpec(command=["sh", "-c", "echo 'arena: this task has no agent yet: set task.agent "
                                             "(arena tasks import --agent-command ...)' >&2; exit 2"])


class SwebenchRow(msgspec.Struct, kw_only=True):
    """One dataset row; unknown columns are ignored."""

    instance_id: str
    repo: str
    base_commit: str
    patch: str = ""
    test_patch: str = ""
    FAIL_TO_PASS: str | list[str] = "[]"
    PASS_TO_PASS: str | list[str] = "[]"
    version: str = ""
    problem_statement: str = ""
    image_name: str | None = None

    def tests(self, field: str) -> list[str]:
        value = getattr(self, field)
        if isinstance(value, list):
            return [str(v) for v in value]
        try:
            parsed = json.loads(value or "[]")
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{self.instance_id}: {field} is not a JSON list: {exc}") from None
        if not isinstance(parsed, list):
            raise InvalidRequest(f"{self.instance_id}: {field} is not a JSON list")
        return [str(v) for v in parsed]


def read_rows(path: str | Path) -> list[SwebenchRow]:
    """Rows of a JSONL, JSON (a list) or Parquet file."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"dataset file {path} not found")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InvalidRequest("reading Parquet needs pyarrow (pip install 'arena[export]')") from None
        records: list[Any] = pq.read_table(path).to_pylist()
    elif path.suffix == ".json":
        records = json.loads(path.read_text())
    else:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, record in enumerate(records):
        try:
            rows.append(msgspec.convert(record, SwebenchRow))
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"{path} row {i + 1}: {exc}") from None
    return rows


def patch_files(diff: str) -> list[str]:
    """The files a git diff touches (new names), in order."""
    files: list[str] = []
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            parts = shlex.split(line[len("diff --git "):]) if '"' in line else line.split(" ")[-2:]
            name = parts[-1]
            name = name[2:] if name.startswith("b/") else name
            if name not in files:
                files.append(name)
    return files


class RepoSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one repository's tests run (SWE-bench keeps these per repository and version)."""

    test_cmd: str = DEFAULT_COMMAND
    #: Test files reset to the base besides those the test patch touches.
    test_files: list[str] = []


def read_specs(path: str | Path | None) -> dict[str, Any]:
    """``{"owner/name": {"test_cmd": ...}}`` or ``{"owner/name": {"<version>": {...}}}``."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"specs file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"specs file {path}: not a JSON object")
    return data


def spec_for(specs: dict[str, Any], row: SwebenchRow, default_command: str = DEFAULT_COMMAND) -> RepoSpec:
    entry = specs.get(row.repo)
    if isinstance(entry, dict) and "test_cmd" not in entry and "test_files" not in entry:
        entry = entry.get(row.version, entry.get("*"))
    if entry is None:
        return RepoSpec(test_cmd=default_command)
    try:
        return msgspec.convert(entry, RepoSpec)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"spec of {row.repo} {row.version}: {exc}") from None


def to_task(row: SwebenchRow, *, source: Source, command: str = DEFAULT_COMMAND, agent: AgentSpec = UNSET_AGENT,
            budget: Budget = Budget(), timeout_s: float = 900.0, image: str | None = None,
            extra_test_files: list[str] = ()) -> Task:
    """The Arena task of one row: the problem statement public, the tests private."""
    test_files = patch_files(row.test_patch)
    reset = [*test_files, *(f for f in extra_test_files if f not in test_files)]
    verifier = TestsVerifier(
        command=command.replace("{test_files}", " ".join(shlex.quote(f) for f in test_files)),
        parser="pytest",
        fail_to_pass=row.tests("FAIL_TO_PASS"),
        pass_to_pass=row.tests("PASS_TO_PASS"),
        test_files=reset,
        test_patch=row.test_patch,
        timeout_s=timeout_s,
    )
    if not verifier.fail_to_pass and not verifier.pass_to_pass:
        raise InvalidRequest(f"{row.instance_id}: FAIL_TO_PASS and PASS_TO_PASS are both empty")
    return Task(
        id=row.instance_id,
        instructions=row.problem_statement or f"Resolve {row.instance_id} in {row.repo}.",
        agent=agent,
        source=source,
        verifier=verifier,
        budget=budget,
        image=image or row.image_name or None,
        metadata={"dataset": "swebench", "repo": row.repo, "version": row.version},
    )


def mirror_of(mirrors: Path, repo: str) -> Path:
    """The local mirror of ``owner/name``: ``owner__name.bundle`` (a git bundle),
    ``owner__name.git`` or ``owner__name`` (a repository), or ``owner/name``."""
    slug = repo.replace("/", "__")
    for candidate in (mirrors / f"{slug}.bundle", mirrors / f"{slug}.git", mirrors / slug, mirrors / repo):
        if candidate.exists():
            return candidate
    raise InvalidRequest(f"no local mirror of {repo} in {mirrors} (expected {slug}.bundle, {slug}.git or {slug}/)")


def checkout(mirror: Path, commit: str, dest: Path) -> None:
    """The tree of ``commit`` from a local mirror into ``dest`` (no ``.git``)."""
    import tarfile

    with tempfile.TemporaryDirectory(prefix="arena-mirror-") as tmp:
        work = Path(tmp)
        try:
            host_git(["init", "-q", "--bare"], work)
            host_git(["fetch", "-q", "--no-tags", str(mirror.resolve()), "+refs/*:refs/mirror/*"], work,
                     env={"GIT_ALLOW_PROTOCOL": "file"})
            host_git(["archive", "--format=tar", "-o", str(work / "tree.tar"), f"{commit}^{{commit}}"], work)
        except GitError as exc:
            raise SourceError(f"cannot check out {commit} from {mirror}: {exc}") from exc
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(work / "tree.tar") as tar:
            safe_extractall(tar, dest)


def image_source(row: SwebenchRow, image: str, path: str = "/testbed") -> ImageSource:
    return ImageSource(image=row.image_name or image, path=path)


def iter_task_files(path: Path) -> Iterator[Path]:
    """The task files of an import's output directory (or one task file)."""
    if path.is_file():
        yield path
        return
    yield from sorted(p for p in path.glob("*.json") if p.is_file())
