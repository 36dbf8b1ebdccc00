"""``arena tasks import swe-smith FILE``: SWE-smith rows as Arena tasks, graded as SWE-smith grades.

A row's ``patch`` introduces the bug; the gold fix is its reverse. The agent gets the repository
with the bug and without the files of the FAIL_TO_PASS tests (SWE-smith's instance branch); the
verifier puts those files back (``hidden_files``), resets every F2P/P2P test file, runs the repo
profile's test command and passes only when every FAIL_TO_PASS and PASS_TO_PASS test passed
(``PASSED`` or ``XFAIL``; a test that did not run fails). docs/tasks.md, "SWE-smith".
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import msgspec

from arena_core.errors import InvalidRequest
from arena_core.schemas import AgentSpec, Source, Task, TestsVerifier

SUMMARY = "SWE-smith rows (instance_id, repo, patch = the bug, FAIL_TO_PASS, PASS_TO_PASS, image_name)"

#: SWE-smith's PythonProfile.test_cmd after its conda activation.
DEFAULT_TEST_CMD = "pytest --disable-warnings --color=no --tb=no --verbose"
DEFAULT_PARSER = "pytest"
_SHORT_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


class SweSmithRow(msgspec.Struct, kw_only=True):
    """One SWE-smith row; unknown columns are ignored."""

    instance_id: str
    repo: str
    patch: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str] = []
    image_name: str = ""
    problem_statement: str = ""
    #: Older rows name the repository's commit; newer ones carry it in ``repo`` (``owner__name.<commit>``).
    base_commit: str = ""

    def repo_name(self) -> str:
        """``owner__name.<commit>`` (the repo profile's key), from ``swesmith/owner__name.<commit>``."""
        return self.repo.rsplit("/", 1)[-1]

    def mirror_and_commit(self) -> tuple[str, str]:
        """(``owner__name``, the clean commit the bug patch applies to)."""
        name = self.repo_name()
        slug, dot, commit = name.rpartition(".")
        if not dot or not _SHORT_COMMIT.match(commit):
            slug, commit = name, ""
        commit = self.base_commit or commit
        if not commit:
            raise InvalidRequest(f"{self.instance_id}: no commit in repo {self.repo!r} (owner__name.<commit>) "
                                 "and no base_commit")
        return slug, commit


class RepoProfile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one repository's tests run (SWE-smith keeps a profile per repository)."""

    test_cmd: str = DEFAULT_TEST_CMD
    #: Arena's parser for the command's output (SWE-smith's profile log parser: pytest's verbose
    #: lines for Python; ``go_test``, ``cargo``, ``jest``... for the others).
    parser: str = DEFAULT_PARSER
    #: Run only the F2P/P2P test files (SWE-smith's ``min_testing``), else the whole suite.
    min_testing: bool = False


def read_rows(path: str | Path) -> list[SweSmithRow]:
    from arena.formats.rows import read_rows as read

    rows = read(path, SweSmithRow)
    for row in rows:
        if not row.FAIL_TO_PASS:
            raise InvalidRequest(f"{row.instance_id}: FAIL_TO_PASS is empty")
        if not row.patch.strip():
            raise InvalidRequest(f"{row.instance_id}: no bug patch")
    return rows


def read_profiles(path: str | Path | None) -> dict[str, RepoProfile]:
    """``{"<repo or owner__name.commit>": {"test_cmd": ..., "parser": ..., "min_testing": ...}}``."""
    if path is None:
        return {}
    import json

    try:
        data = json.loads(Path(path).read_text())
        return msgspec.convert(data, dict[str, RepoProfile])
    except (OSError, json.JSONDecodeError, msgspec.ValidationError) as exc:
        raise InvalidRequest(f"profiles file {path}: {exc}") from None


def profile_for(profiles: dict[str, RepoProfile], row: SweSmithRow) -> RepoProfile:
    for key in (row.repo, row.repo_name(), row.mirror_and_commit()[0]):
        if key in profiles:
            return profiles[key]
    return RepoProfile()


def test_files(row: SweSmithRow) -> tuple[list[str], list[str]]:
    """SWE-smith's ``get_test_files``: the files of the F2P and of the P2P tests."""
    def files(tests: list[str]) -> list[str]:
        return sorted({t.split("::", 1)[0] for t in tests})

    return files(row.FAIL_TO_PASS), files(row.PASS_TO_PASS)


def gold_patch(row: SweSmithRow) -> str:
    """The oracle: the bug patch reversed (SWE-smith applies it with ``git apply --reverse``)."""
    from arena.formats.patches import reverse_patch

    return reverse_patch(row.patch)


def prepare_trees(row: SweSmithRow, tree: Path, hidden: Path) -> None:
    """Turn ``tree`` (the clean repository) into the agent's view: the bug applied, the F2P test
    files moved to ``hidden`` (what the verifier puts back)."""
    from arena.formats.patches import apply_patch
    from arena.formats.rows import move_out

    try:
        apply_patch(tree, row.patch, what="bug patch")
    except InvalidRequest as exc:
        raise InvalidRequest(f"{row.instance_id}: {exc}") from None
    f2p_files, _ = test_files(row)
    hidden.mkdir(parents=True, exist_ok=True)
    if not move_out(tree, f2p_files, hidden):
        raise InvalidRequest(f"{row.instance_id}: none of the FAIL_TO_PASS test files is in the repository "
                             f"({', '.join(f2p_files)})")


def to_task(row: SweSmithRow, *, source: Source, hidden_files: str | None, profile: RepoProfile = RepoProfile(),
            agent: AgentSpec, timeout_s: float = 900.0, image: str | None = None) -> Task:
    """The Arena task of one row: the bug public, the F2P test files and the grading private."""
    from arena.formats.rows import task_id

    f2p_files, p2p_files = test_files(row)
    files = list(dict.fromkeys([*f2p_files, *p2p_files]))
    command = profile.test_cmd
    if profile.min_testing:
        command += " " + " ".join(shlex.quote(f) for f in files)
    verifier = TestsVerifier(command=command, parser=profile.parser, fail_to_pass=list(row.FAIL_TO_PASS),
                             pass_to_pass=list(row.PASS_TO_PASS), test_files=files, hidden_files=hidden_files,
                             timeout_s=timeout_s)
    return Task(
        id=task_id(row.instance_id),
        instructions=row.problem_statement or f"A change broke {row.repo_name()}: find the bug and fix it "
                                              "so that its tests pass.",
        agent=agent,
        source=source,
        verifier=verifier,
        image=image or None,
        metadata={"dataset": "swe-smith", "repo": row.repo, "instance_id": row.instance_id,
                  **({"image_name": row.image_name} if row.image_name else {})},
    )


# ---------------------------------------------------------------------------- the command

def add_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("file", help="JSONL, JSON or Parquet rows (instance_id, repo, patch, FAIL_TO_PASS, PASS_TO_PASS, "
                                "image_name, problem_statement)")
    q.add_argument("--out", required=True, help="directory for <instance_id>.json and gold/<instance_id>.patch")
    where = q.add_mutually_exclusive_group(required=True)
    where.add_argument("--mirrors",
                       help="directory of local mirrors: owner__name.<commit>.bundle, owner__name.bundle, .git or a "
                            "directory (the clean repository the bug patch applies to)")
    where.add_argument("--from-images", action="store_true",
                       help="read each row's repository from its image_name (/testbed, in the local store) and "
                            "derive the agent's image from it with Podman (the bug in, the F2P test files out)")
    q.add_argument("--image", help="tasks run in this image (default: the provider's; a row's image_name is kept "
                                   "in the task's metadata)")
    q.add_argument("--profiles", help="JSON of repo profiles: {\"owner__name.<commit>\": {\"test_cmd\": ..., "
                                      "\"parser\": ..., \"min_testing\": true}}")
    q.add_argument("--agent-command", help="the agent (sh -c) every task runs; default: none yet")
    q.add_argument("--test-timeout", type=float, default=900.0)


def mirror_path(mirrors: Path, row: SweSmithRow) -> Path:
    from arena import datasets

    slug, _ = row.mirror_and_commit()
    for candidate in (mirrors / f"{row.repo_name()}.bundle", mirrors / f"{row.repo_name()}.git",
                      mirrors / row.repo_name()):
        if candidate.exists():
            return candidate
    return datasets.mirror_of(mirrors, slug)


def image_source(row: SweSmithRow, work: Path) -> tuple[Source, Path]:
    """The row's image made the agent's: its ``/testbed`` read, the bug applied and the F2P test
    files moved out (to the returned directory), and an image derived with that tree at ``/testbed``."""
    import shutil

    from arena.formats import row_images
    from arena_core.schemas import ImageSource

    if not row.image_name:
        raise InvalidRequest(f"{row.instance_id}: no image_name (give --mirrors instead)")
    root = row_images.read_paths(row.image_name, ["/testbed"], work / "root")
    tree, hidden = root / "testbed", work / "hidden"
    if not tree.is_dir():
        raise InvalidRequest(f"{row.instance_id}: image {row.image_name} has no /testbed")
    shutil.rmtree(tree / ".git", ignore_errors=True)  # the agent's copy has no history
    prepare_trees(row, tree, hidden)
    tag = row_images.derive(row.image_name, ["RUN rm -rf /testbed", "COPY testbed /testbed"], context=root,
                            label=row.instance_id)
    return ImageSource(image=tag, path="/testbed"), hidden


def run(args: argparse.Namespace, connect) -> int:
    import tempfile

    from arena import datasets
    from arena.formats.rows import write_task
    from arena.progress import WaitProgress
    from arena_core.schemas import BundleSource

    rows = read_rows(args.file)
    profiles = read_profiles(args.profiles)
    out = Path(args.out)
    agent = AgentSpec(command=["sh", "-c", args.agent_command]) if args.agent_command else datasets.UNSET_AGENT
    with connect() as client, WaitProgress(len(rows), "import") as progress:
        for i, row in enumerate(rows, 1):
            _, commit = row.mirror_and_commit()
            with tempfile.TemporaryDirectory(prefix="arena-import-") as tmp:
                if args.from_images:
                    source, hidden = image_source(row, Path(tmp))
                else:
                    tree, hidden = Path(tmp) / "repo", Path(tmp) / "hidden"
                    datasets.checkout(mirror_path(Path(args.mirrors), row), commit, tree)
                    prepare_trees(row, tree, hidden)
                    source = BundleSource(digest=client.push_bundle(tree))
                hidden_digest = client.push_bundle(hidden)
            task = to_task(row, source=source, hidden_files=hidden_digest, profile=profile_for(profiles, row),
                           agent=agent, timeout_s=args.test_timeout, image=args.image)
            write_task(out, task, gold_patch(row))
            print(f"[{i}/{len(rows)}] {task.id}: {len(row.FAIL_TO_PASS)} FAIL_TO_PASS, {len(row.PASS_TO_PASS)} "
                  f"PASS_TO_PASS, F2P test files hidden, source {source.__struct_config__.tag}"
                  + (f" {source.image}" if args.from_images else ""), flush=True)
            progress.finished(task.id, "completed")
    print(f"wrote {len(rows)} task(s) to {out}")
    return 0
