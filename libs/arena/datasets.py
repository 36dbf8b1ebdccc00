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


#: The fields of a spec Arena uses; every other one (SWE-bench's ``python``, ``packages``,
#: ``pip_packages``, ``pre_install``, ``install``, ``build``, ``apt-pkgs``, ``docker_specs``,
#: ``env_patches``, ``reqs_path``, ...) describes how to build the environment, which an
#: import does not: it is kept in the task's metadata (``swebench_spec``), never an error.
SPEC_FIELDS_USED = frozenset({"test_cmd", "eval_commands", "test_files"})
#: Files SWE-bench's harness never passes to the test command (``NON_TEST_EXTS``).
NON_TEST_EXTS = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")


class _UsedSpecFields(msgspec.Struct, kw_only=True):
    test_cmd: str | list[str] | None = None
    eval_commands: list[str] = []
    test_files: list[str] = []


class RepoSpec(msgspec.Struct, kw_only=True):
    """How one row's tests run, from its repository's spec as SWE-bench keeps it per repository
    and version (``MAP_REPO_VERSION_TO_SPECS[repo][version]``); docs/tasks.md, "SWE-bench-format
    datasets"."""

    #: The shell text the verifier runs, ``{test_files}`` still to be replaced by the test patch's
    #: files: SWE-bench's eval script from ``eval_commands`` to the test command (see :func:`spec_for`).
    test_cmd: str = DEFAULT_COMMAND
    #: Test files reset to the base besides those the test patch touches (Arena's).
    test_files: list[str] = []
    #: The spec's fields Arena does not use, as given (kept in the task's metadata).
    kept: dict[str, Any] = {}

    @property
    def python(self) -> str | None:
        """SWE-bench's ``python``: the Python version the environment was built with."""
        value = self.kept.get("python")
        return str(value) if value is not None else None


def read_specs(path: str | Path | None) -> dict[str, Any]:
    """``{"owner/name": {<spec>}}`` or, as SWE-bench keeps them (``MAP_REPO_VERSION_TO_SPECS``),
    ``{"owner/name": {"<version>": {<spec>}}}`` (``"*"``: any other version)."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"specs file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"specs file {path}: not a JSON object")
    return data


def _keyed_by_version(entry: dict[str, Any]) -> bool:
    """SWE-bench's shape (version -> spec) rather than one spec for every version: every value a
    spec (an object) and no key a field Arena reads."""
    return bool(entry) and not (SPEC_FIELDS_USED & entry.keys()) and all(isinstance(v, dict) for v in entry.values())


def spec_for(specs: dict[str, Any], row: SwebenchRow, default_command: str = DEFAULT_COMMAND) -> RepoSpec:
    """The spec of ``row``'s repository and version; ``default_command`` as given for a repository
    the table does not name. A table that names the repository but not the row's version (nor
    ``"*"``) is an error: some other command would grade the row by tests it was not made for.

    The spec's ``test_cmd`` runs as SWE-bench's harness runs it: a string gets the row's
    :func:`test_directives` appended, unless it says where the test files go with ``{test_files}``
    (Arena's form); a list runs line by line as given. ``eval_commands`` run first."""
    entry = specs.get(row.repo)
    where = f"spec of {row.repo} {row.version}".rstrip()
    if entry is None:
        return RepoSpec(test_cmd=default_command)
    if not isinstance(entry, dict):
        raise InvalidRequest(f"{where}: not a JSON object")
    if _keyed_by_version(entry):
        versions = entry
        entry = versions.get(row.version, versions.get("*"))
        if entry is None:
            raise InvalidRequest(f"{where}: the specs file has versions {sorted(versions)} of {row.repo}, "
                                 f"not {row.version!r} (add it, or a \"*\" entry)")
        if not isinstance(entry, dict):
            raise InvalidRequest(f"{where}: not a JSON object")
    try:
        used = msgspec.convert({k: v for k, v in entry.items() if k in SPEC_FIELDS_USED}, _UsedSpecFields)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{where}: {exc}") from None
    if used.test_cmd is None:
        lines = [default_command]
    elif isinstance(used.test_cmd, list):
        lines = used.test_cmd
    elif "{test_files}" in used.test_cmd:
        lines = [used.test_cmd]
    else:
        lines = [" ".join([used.test_cmd, *(shlex.quote(d) for d in test_directives(row))])]
    return RepoSpec(test_cmd="\n".join([*used.eval_commands, *lines]), test_files=used.test_files,
                    kept={k: v for k, v in entry.items() if k not in SPEC_FIELDS_USED})


def test_directives(row: SwebenchRow) -> list[str]:
    """What SWE-bench's harness appends to a repository's ``test_cmd``: the files the test patch
    touches that are tests (not data: ``NON_TEST_EXTS``), for Django as ``runtests.py`` module
    labels (``tests/a/b.py`` -> ``a.b``)."""
    directives = [f for f in patch_files(row.test_patch) if not f.endswith(NON_TEST_EXTS)]
    if row.repo == "django/django":
        directives = [d.removesuffix(".py").removeprefix("tests/").replace("/", ".") for d in directives]
    return directives


def to_task(row: SwebenchRow, *, source: Source, command: str = DEFAULT_COMMAND, agent: AgentSpec = UNSET_AGENT,
            budget: Budget = Budget(), timeout_s: float = 900.0, image: str | None = None,
            extra_test_files: list[str] = (), spec: RepoSpec | None = None) -> Task:
    """The Arena task of one row: the problem statement public, the tests private. ``spec``: its
    fields Arena does not use are kept in ``metadata["swebench_spec"]`` (JSON), its ``python`` in
    ``metadata["python"]``."""
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
        metadata=_metadata(row, spec),
    )


def _metadata(row: SwebenchRow, spec: RepoSpec | None) -> dict[str, str]:
    metadata = {"dataset": "swebench", "repo": row.repo, "version": row.version}
    if spec is not None and spec.kept:
        metadata["swebench_spec"] = json.dumps(spec.kept, sort_keys=True)
        if spec.python:
            metadata["python"] = spec.python
    return metadata


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
