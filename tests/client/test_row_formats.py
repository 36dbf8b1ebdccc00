"""The row formats (SWE-smith, R2E-Gym, SWE-Gym) read from their real fixture datasets
(tests/fixtures/datasets, made by its row_fixtures.py from real projects and their test suites): what
each row becomes, what the agent's tree holds and what only the verifier gets."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from arena import datasets
from arena.formats import patches, r2e_gym, swe_gym, swe_smith
from arena_core.errors import InvalidRequest
from arena_core.schemas import BundleSource, PathSource

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "datasets"
MIRRORS = Path(__file__).resolve().parents[2] / "examples" / "swebench-mini" / "repos"
sys.path.insert(0, str(FIXTURES))
import row_fixtures as fixture_build  # noqa: E402

AGENT = datasets.UNSET_AGENT


def tree_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


# ---------------------------------------------------------------------------- SWE-smith

SMITH = swe_smith.read_rows(FIXTURES / "swe-smith" / "dataset.jsonl")
PROFILES = swe_smith.read_profiles(FIXTURES / "swe-smith" / "profiles.json")


def smith_trees(row: swe_smith.SweSmithRow, tmp: Path) -> tuple[Path, Path, Path]:
    """(clean checkout, the agent's tree, the hidden tree) of one row."""
    slug, commit = row.mirror_and_commit()
    clean, tree, hidden = tmp / "clean", tmp / "tree", tmp / "hidden"
    datasets.checkout(swe_smith.mirror_path(MIRRORS, row), commit, clean)
    shutil.copytree(clean, tree)
    swe_smith.prepare_trees(row, tree, hidden)
    return clean, tree, hidden


def test_swe_smith_rows_name_their_repository_commit_and_tests():
    assert len(SMITH) == 3
    for row in SMITH:
        slug, commit = row.mirror_and_commit()
        assert row.repo == f"swesmith/{slug}.{commit}" and len(commit) == 8
        f2p_files, p2p_files = swe_smith.test_files(row)
        assert f2p_files and set(f2p_files) <= {t.split("::")[0] for t in row.FAIL_TO_PASS}
        assert swe_smith.profile_for(PROFILES, row).min_testing


@pytest.mark.parametrize("row", SMITH, ids=lambda r: r.instance_id)
def test_swe_smith_gold_is_the_bug_patch_reversed_and_the_agent_sees_the_bug_without_the_failing_tests(row, tmp_path):
    clean, tree, hidden = smith_trees(row, tmp_path)
    f2p_files, _ = swe_smith.test_files(row)
    # the agent's tree: the bug in, the files of the FAIL_TO_PASS tests out (and only in hidden/)
    for rel in f2p_files:
        assert not (tree / rel).exists() and (hidden / rel).read_bytes() == (clean / rel).read_bytes()
    assert tree_files(tree) != {k: v for k, v in tree_files(clean).items() if k not in f2p_files}
    # the gold patch is what `git apply --reverse` of the bug patch does, and gives back the clean code
    gold = swe_smith.gold_patch(row)
    fixed = tmp_path / "fixed"
    shutil.copytree(tree, fixed)
    patches.apply_patch(fixed, gold)
    by_git = tmp_path / "by-git"
    shutil.copytree(tree, by_git)
    patches.apply_patch(by_git, row.patch, reverse=True)
    assert tree_files(fixed) == tree_files(by_git)
    assert tree_files(fixed) == {k: v for k, v in tree_files(clean).items() if k not in f2p_files}
    assert patches.reverse_patch(gold) == row.patch


def test_a_reversed_patch_undoes_additions_deletions_new_files_and_missing_newlines(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "a.py").write_text("one\ntwo\nthree\nfour\n")
    (base / "gone.py").write_text("bye\n")
    (base / "tail.txt").write_text("no newline")

    def edit(repo: Path) -> None:
        (repo / "a.py").write_text("one\n2\nthree\nfour\nfive\n")
        (repo / "gone.py").unlink()
        (repo / "new.py").write_text("hello\n")
        (repo / "tail.txt").write_text("still no newline, changed")

    before = tree_files(base)
    work = tmp_path / "work"
    shutil.copytree(base, work)
    diff = fixture_build.git_diff_of(work, edit)
    after = tree_files(work)
    assert "\\ No newline at end of file" in diff and "deleted file mode" in diff
    undo = patches.reverse_patch(diff)
    patches.apply_patch(work, undo)
    assert tree_files(work) == before
    patches.apply_patch(work, diff)
    assert tree_files(work) == after


def test_swe_smith_task_keeps_the_tests_private_and_the_statement_public(tmp_path):
    row = SMITH[0]
    task = swe_smith.to_task(row, source=PathSource(path=str(tmp_path)), hidden_files="sha256:" + "0" * 64,
                             profile=swe_smith.profile_for(PROFILES, row), agent=AGENT)
    spec = task.verifier
    assert task.instructions == row.problem_statement and task.metadata["dataset"] == "swe-smith"
    assert spec.fail_to_pass == row.FAIL_TO_PASS and spec.pass_to_pass == row.PASS_TO_PASS
    assert spec.parser == "pytest" and spec.hidden_files and set(spec.test_files) == {"test_inflection.py"}
    assert spec.command.endswith(" test_inflection.py")  # min_testing: the F2P/P2P files only
    assert "FAIL_TO_PASS" not in msgspec.json.encode(task.public()).decode()
    assert task.public().verifier is None


def test_bad_swe_smith_rows_are_one_line_errors(tmp_path):
    good = json.loads((FIXTURES / "swe-smith" / "dataset.jsonl").read_text().splitlines()[0])
    cases = {
        "no-f2p.jsonl": {**good, "FAIL_TO_PASS": []},
        "string-lists.jsonl": {**good, "FAIL_TO_PASS": "[\"a\"]"},
        "no-commit.jsonl": {**good, "repo": "swesmith/owner__name"},
    }
    for name, row in cases.items():
        (tmp_path / name).write_text(json.dumps(row) + "\n")
    with pytest.raises(InvalidRequest, match="FAIL_TO_PASS is empty"):
        swe_smith.read_rows(tmp_path / "no-f2p.jsonl")
    with pytest.raises(InvalidRequest, match=r"row 1: Expected `array`"):
        swe_smith.read_rows(tmp_path / "string-lists.jsonl")
    with pytest.raises(InvalidRequest, match="no commit in repo"):
        swe_smith.read_rows(tmp_path / "no-commit.jsonl")[0].mirror_and_commit()
    with pytest.raises(InvalidRequest, match="not found"):
        swe_smith.read_rows(tmp_path / "missing.jsonl")


def test_a_bug_patch_that_does_not_apply_names_the_instance(tmp_path):
    row = msgspec.structs.replace(SMITH[0], patch=SMITH[1].patch)
    _, commit = row.mirror_and_commit()
    datasets.checkout(swe_smith.mirror_path(MIRRORS, row), commit, tmp_path / "tree")
    with pytest.raises(InvalidRequest, match=f"{row.instance_id}: the bug patch does not apply"):
        swe_smith.prepare_trees(row, tmp_path / "tree", tmp_path / "hidden")


# ---------------------------------------------------------------------------- R2E-Gym

R2E_RECORDS = [json.loads(line) for line in (FIXTURES / "r2e-gym" / "dataset.jsonl").read_text().splitlines()]
R2E = r2e_gym.read_rows(FIXTURES / "r2e-gym" / "dataset.jsonl")


@pytest.fixture(scope="module")
def r2e_roots(tmp_path_factory) -> Path:
    return fixture_build.r2e_roots(R2E_RECORDS, tmp_path_factory.mktemp("r2e-roots"))


def test_r2e_rows_read_their_expected_statuses_and_issue():
    assert len(R2E) == 3
    for row, record in zip(R2E, R2E_RECORDS, strict=True):
        assert row.expected() == json.loads(record["expected_output_json"])
        assert "[ISSUE]" not in row.instructions() and row.instructions() in row.problem_statement
        assert row.instance_id().startswith(row.repo_name + ".")


@pytest.mark.parametrize("index", range(3))
def test_r2e_hidden_tests_and_run_tests_are_out_of_the_agents_tree(index, r2e_roots, tmp_path):
    row = R2E[index]
    files = r2e_gym.image_files(r2e_roots / r2e_gym.image_dir_name(row.docker_image))
    assert (files.testbed / "r2e_tests").is_symlink()  # as in R2E-Gym's images: a link into the repository
    tree, hidden = tmp_path / "tree", tmp_path / "hidden"
    r2e_gym.agent_tree(files, tree, hidden)
    assert not (tree / "r2e_tests").exists() and not (tree / "r2e_tests").is_symlink()
    assert not (tree / "run_tests.sh").exists()
    hidden_tests = tree_files(hidden)
    assert hidden_tests and all(p.startswith("r2e_tests/") for p in hidden_tests)
    # no file the agent gets holds a hidden test's source
    test_bodies = [v for k, v in hidden_tests.items() if k.endswith("test_1.py")]
    assert test_bodies and not any(v == test_bodies[0] for v in tree_files(tree).values())
    task = r2e_gym.to_task(row, source=BundleSource(digest="sha256:" + "1" * 64), hidden_files="sha256:" + "2" * 64,
                           run_tests=files.run_tests, agent=AGENT)
    assert task.verifier.expected_statuses == row.expected() and task.verifier.command.startswith("bash -c ")
    assert "r2e_tests" not in msgspec.json.encode(task.public()).decode()


def test_r2e_gold_is_the_commits_non_test_python_files():
    for row in R2E:
        gold = r2e_gym.gold_patch(row)
        files = datasets.patch_files(gold)
        assert files and not any(f.startswith("test") or "/test" in f for f in files)
    assert r2e_gym.gold_patch(msgspec.structs.replace(R2E[0], parsed_commit_content="")) is None


def test_bad_r2e_rows_are_one_line_errors(tmp_path):
    for name, value in {"not-json": "{", "empty": "{}", "list": "[1]"}.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({**R2E_RECORDS[0], "expected_output_json": value}) + "\n")
        with pytest.raises(InvalidRequest, match="expected_output_json"):
            r2e_gym.read_rows(tmp_path / f"{name}.jsonl")
    with pytest.raises(InvalidRequest, match="no r2e_tests"):
        (tmp_path / "root" / "testbed").mkdir(parents=True)
        r2e_gym.image_files(tmp_path / "root")


# ---------------------------------------------------------------------------- SWE-Gym

def test_swe_gym_rows_carry_real_lists_and_read_alike_from_jsonl_json_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = FIXTURES / "swe-gym" / "dataset.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 3 and all(isinstance(r["FAIL_TO_PASS"], list) for r in records)
    (tmp_path / "rows.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "rows.parquet")
    assert pa.Table.from_pylist(records).schema.field("FAIL_TO_PASS").type == pa.list_(pa.string())
    read = [datasets.read_rows(p) for p in (path, tmp_path / "rows.json", tmp_path / "rows.parquet")]
    assert read[0] == read[1] == read[2]
    for row, record in zip(read[0], records, strict=True):
        assert row.tests("FAIL_TO_PASS") == record["FAIL_TO_PASS"]
    assert swe_gym.SUMMARY


def test_every_row_format_is_a_module_with_the_import_interface():
    for module in (swe_smith, r2e_gym, swe_gym):
        assert module.SUMMARY and callable(module.add_arguments) and callable(module.run)


def test_the_fixture_builder_reads_logs_as_r2e_gym_does():
    """row_fixtures.py's copy of R2E-Gym's parser keys tests by the node id after the file."""
    log = ("===== short test summary info =====\nPASSED r2e_tests/test_1.py::TestA::test_x[1]\n"
           "FAILED r2e_tests/test_1.py::test_y - assert 1 == 2\n")
    assert fixture_build.r2e_parse_log_pytest(log) == {"TestA.test_x[1]": "PASSED", "test_y": "FAILED"}
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0
