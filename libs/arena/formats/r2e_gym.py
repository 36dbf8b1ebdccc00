"""``arena tasks import r2e-gym FILE``: R2E-Gym rows as Arena tasks, graded by R2E-Gym's exact-match rule.

An R2E-Gym image holds the repository at ``/testbed``, its hidden tests at ``/r2e_tests`` (linked
into the repository as ``r2e_tests``) and ``run_tests.sh``. The importer takes the tests and the
script out of the agent's view: the agent's source is the repository without them; the verifier
gets the tests as ``hidden_files`` (put back as ``r2e_tests/`` only in the verification sandbox),
runs the script, and scores 1 only when the parsed test statuses equal ``expected_output_json``
exactly. The oracle is the non-test part of ``parsed_commit_content``. docs/tasks.md, "R2E-Gym".
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import msgspec

from arena_core.errors import InvalidRequest
from arena_core.schemas import AgentSpec, Source, Task, TestsVerifier

SUMMARY = "R2E-Gym rows (docker_image, repo_name, problem_statement, expected_output_json, parsed_commit_content)"

#: What R2E-Gym moves out of the repository before the agent starts (``SKIP_FILES_NEW``).
HIDDEN_NAMES = ("r2e_tests", "run_tests.sh")
TESTS_DIR = "r2e_tests"
_ANSI = re.compile(r"\x1b\[\d+m")
_ISSUE = re.compile(r"\[ISSUE\](.*)\[/ISSUE\]", re.S)


class R2eGymRow(msgspec.Struct, kw_only=True):
    """One R2E-Gym row; unknown columns are ignored."""

    docker_image: str
    repo_name: str
    expected_output_json: str | dict[str, str]
    problem_statement: str = ""
    parsed_commit_content: str = ""
    commit_hash: str = ""

    def instance_id(self) -> str:
        """``<repo_name>.<commit>`` (R2E-Gym rows have no id; the image tag is the commit when there is none)."""
        from arena.formats.rows import task_id

        commit = self.commit_hash or self.docker_image.rsplit(":", 1)[-1]
        return task_id(f"{self.repo_name}.{commit[:12]}")

    def expected(self) -> dict[str, str]:
        """The expected statuses as R2E-Gym compares them: colour codes out of the keys."""
        value = self.expected_output_json
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"{self.instance_id()}: expected_output_json is not JSON: {exc}") from None
        if not isinstance(value, dict) or not value or not all(isinstance(v, str) for v in value.values()):
            raise InvalidRequest(f"{self.instance_id()}: expected_output_json is not a non-empty map of test -> status")
        return {_ANSI.sub("", str(k)): v for k, v in value.items()}

    def instructions(self) -> str:
        """R2E-Gym's ``get_task_instruction``: the text inside ``[ISSUE]...[/ISSUE]``, else all of it."""
        m = _ISSUE.search(self.problem_statement)
        text = m.group(1) if m else self.problem_statement
        return text.strip() or f"Fix the issue in {self.repo_name}."


def read_rows(path: str | Path) -> list[R2eGymRow]:
    from arena.formats.rows import read_rows as read

    rows = read(path, R2eGymRow)
    for row in rows:
        row.expected()
    return rows


# ---------------------------------------------------------------------------- the oracle

class _Range(msgspec.Struct):
    start: int
    length: int | None = None

    def text(self) -> str:
        return f"{self.start}" if self.length is None else f"{self.start},{self.length}"


class _Descriptor(msgspec.Struct):
    old_range: _Range
    new_range: _Range
    section: str = ""


class _Line(msgspec.Struct):
    content: str
    type: str


class _LineGroup(msgspec.Struct):
    all_lines: list[_Line] = []


class _Hunk(msgspec.Struct):
    descriptor: _Descriptor
    line_group: _LineGroup


class _Path(msgspec.Struct):
    path: str


class _Header(msgspec.Struct):
    file: _Path
    misc_line: str | None = None


class _Index(msgspec.Struct):
    old_commit_hash: str
    new_commit_hash: str
    mode: str = ""


class _FileDiff(msgspec.Struct):
    header: _Header
    index_line: _Index | None = None
    is_binary_file: bool = False
    minus_file: _Path | None = None
    plus_file: _Path | None = None
    hunks: list[_Hunk] = []

    def is_test_file(self) -> bool:
        """R2E-Gym's ``FileDiff.is_test_file``."""
        parts = self.header.file.path.split("/")
        return (self.header.file.path.endswith("_test.py") or parts[-1].startswith("test_")
                or any(p in ("tests", "Tests", "test", "Test") for p in parts))

    def patch(self) -> str:
        """R2E-Gym's ``FileDiff.get_patch``."""
        out = [f"diff --git a/{self.header.file.path} b/{self.header.file.path}\n"]
        if self.header.misc_line:
            out.append(self.header.misc_line + "\n")
        if self.index_line:
            mode = self.index_line.mode
            out.append(f"index {self.index_line.old_commit_hash}..{self.index_line.new_commit_hash}"
                       f"{' ' if mode else ''}{mode}\n")
        if self.minus_file and self.plus_file:
            out.append(f"--- {self.minus_file.path}\n+++ {self.plus_file.path}\n")
        for hunk in self.hunks:
            d = hunk.descriptor
            out.append(f"@@ -{d.old_range.text()} +{d.new_range.text()} @@{' ' + d.section if d.section else ''}\n")
            marks = {"context": " ", "added": "+", "deleted": "-", "note": "\\ "}
            for line in hunk.line_group.all_lines:
                out.append(f"{marks[line.type]}{line.content}\n")
        return "".join(out)


class _ParsedCommit(msgspec.Struct):
    file_diffs: list[_FileDiff]


def gold_patch(row: R2eGymRow) -> str | None:
    """The oracle: the commit's non-test Python files (``ParsedCommit.get_patch(test_file=False)``);
    ``None`` when the row carries no commit."""
    if not row.parsed_commit_content:
        return None
    try:
        commit = msgspec.json.decode(row.parsed_commit_content, type=_ParsedCommit)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"{row.instance_id()}: parsed_commit_content: {exc}") from None
    if any(d.is_binary_file for d in commit.file_diffs if not d.is_test_file()):
        raise InvalidRequest(f"{row.instance_id()}: the commit changes a binary file")
    return "".join(d.patch() for d in commit.file_diffs
                   if not d.is_test_file() and d.header.file.path.endswith(".py"))


# ---------------------------------------------------------------------------- the image's files

class ImageFiles(msgspec.Struct, kw_only=True):
    """What the importer takes from an R2E-Gym image (or a directory laid out like its root)."""

    testbed: Path  # the repository (what the agent gets, once the hidden files are out)
    tests: Path  # the hidden tests (``/r2e_tests``)
    run_tests: str  # ``run_tests.sh``


def image_files(root: Path) -> ImageFiles:
    """An image's root (``testbed/``, ``r2e_tests/`` or ``root/r2e_tests/``, ``run_tests.sh`` in
    ``testbed/`` or ``root/``) as :class:`ImageFiles`; a one-line error for what is missing."""
    testbed = root / "testbed"
    if not testbed.is_dir():
        raise InvalidRequest(f"{root}: no testbed/ (the repository)")
    for tests in (root / "r2e_tests", root / "root" / "r2e_tests", testbed / TESTS_DIR):
        if tests.is_dir() and not tests.is_symlink():
            break
    else:
        raise InvalidRequest(f"{root}: no r2e_tests/ (the hidden tests)")
    for script in (root / "root" / "run_tests.sh", testbed / "run_tests.sh"):
        if script.is_file():
            break
    else:
        raise InvalidRequest(f"{root}: no run_tests.sh")
    return ImageFiles(testbed=testbed, tests=tests, run_tests=script.read_text())


def agent_tree(files: ImageFiles, dest: Path, hidden: Path) -> None:
    """The agent's repository in ``dest`` (the testbed without the hidden tests and the script) and
    the hidden tests in ``hidden/r2e_tests``."""
    import shutil

    shutil.copytree(files.testbed, dest, symlinks=True,
                    ignore=lambda d, names: [n for n in names if Path(d) == files.testbed and n in (*HIDDEN_NAMES, ".git")])
    shutil.copytree(files.tests, hidden / TESTS_DIR, symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def to_task(row: R2eGymRow, *, source: Source, hidden_files: str, run_tests: str, agent: AgentSpec,
            timeout_s: float = 300.0, image: str | None = None) -> Task:
    """The Arena task of one row: the issue public; the tests, the script and the expected statuses private."""
    verifier = TestsVerifier(command=f"bash -c {shlex.quote(run_tests)}", parser="pytest",
                             expected_statuses=row.expected(), test_files=[TESTS_DIR], hidden_files=hidden_files,
                             timeout_s=timeout_s)
    return Task(
        id=row.instance_id(),
        instructions=row.instructions(),
        agent=agent,
        source=source,
        verifier=verifier,
        image=image or None,
        metadata={"dataset": "r2e-gym", "repo": row.repo_name, "docker_image": row.docker_image},
    )


# ---------------------------------------------------------------------------- the command

def image_dir_name(image: str) -> str:
    """``owner/name:tag`` -> ``owner__name--tag`` (a root directory's name under ``--roots``)."""
    return image.replace("/", "__").replace(":", "--")


def add_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("file", help="JSONL, JSON or Parquet rows (docker_image, repo_name, problem_statement, "
                                "expected_output_json, parsed_commit_content)")
    q.add_argument("--out", required=True, help="directory for <id>.json and gold/<id>.patch")
    where = q.add_mutually_exclusive_group(required=True)
    where.add_argument("--roots",
                       help="directory of image roots, one per docker_image (owner/name:tag -> owner__name--tag/), "
                            "each with testbed/, r2e_tests/ and run_tests.sh as in the image")
    where.add_argument("--from-images", action="store_true",
                       help="read each row's docker_image (local store) and derive the agent's image from it "
                            "with Podman, without /r2e_tests and run_tests.sh")
    q.add_argument("--image", help="tasks run in this image (default: the provider's)")
    q.add_argument("--agent-command", help="the agent (sh -c) every task runs; default: none yet")
    q.add_argument("--test-timeout", type=float, default=300.0, help="R2E-Gym's own is 300 s")


#: Every place an R2E-Gym image (or its set-up) keeps what the agent must not see.
HIDDEN_PATHS = ("/r2e_tests", "/root/r2e_tests", "/testbed/r2e_tests", "/testbed/run_tests.sh", "/root/run_tests.sh")


def image_root(row: R2eGymRow, work: Path) -> tuple[Path, Source]:
    """The row's image read into a root directory, and the agent's image derived from it without
    the hidden tests and the script (an :class:`ImageSource` at ``/testbed``)."""
    from arena.formats import row_images
    from arena_core.schemas import ImageSource

    root = row_images.read_paths(row.docker_image, ["/testbed", "/r2e_tests", "/root/r2e_tests",
                                                    "/root/run_tests.sh"], work / "root")
    tag = row_images.derive(row.docker_image, ["RUN rm -rf " + " ".join(HIDDEN_PATHS)], label=row.instance_id())
    return root, ImageSource(image=tag, path="/testbed")


def run(args: argparse.Namespace, connect) -> int:
    import tempfile

    from arena import datasets
    from arena.formats.rows import write_task
    from arena.progress import WaitProgress
    from arena_core.schemas import BundleSource

    rows = read_rows(args.file)
    roots = Path(args.roots) if args.roots else None
    agent = AgentSpec(command=["sh", "-c", args.agent_command]) if args.agent_command else datasets.UNSET_AGENT
    out = Path(args.out)
    with connect() as client, WaitProgress(len(rows), "import") as progress:
        for i, row in enumerate(rows, 1):
            with tempfile.TemporaryDirectory(prefix="arena-import-") as tmp:
                if roots is None:
                    root, image_source = image_root(row, Path(tmp))
                else:
                    root, image_source = roots / image_dir_name(row.docker_image), None
                    if not root.is_dir():
                        raise InvalidRequest(f"{row.instance_id()}: no root of {row.docker_image} in {roots} "
                                             f"(expected {image_dir_name(row.docker_image)}/)")
                files = image_files(root)
                tree, hidden = Path(tmp) / "repo", Path(tmp) / "hidden"
                agent_tree(files, tree, hidden)
                source = image_source or BundleSource(digest=client.push_bundle(tree))
                hidden_digest = client.push_bundle(hidden)
            task = to_task(row, source=source, hidden_files=hidden_digest, run_tests=files.run_tests, agent=agent,
                           timeout_s=args.test_timeout, image=args.image)
            write_task(out, task, gold_patch(row))
            print(f"[{i}/{len(rows)}] {task.id}: {len(task.verifier.expected_statuses)} expected statuses, "
                  f"r2e_tests and run_tests.sh hidden", flush=True)
            progress.finished(task.id, "completed")
    print(f"wrote {len(rows)} task(s) to {out}")
    return 0
