"""Which files a diff touches, and the symlink-safe restore of pristine test files."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from arena_verification.patch import touched_paths, touches, unquote
from arena_verification.restore import InvalidTask, check_workdir, repo_path, restore, snapshot


def git_diff(tmp_path: Path, before: dict[str, str], after: dict[str, str | None], *args: str) -> str:
    """A real ``git diff`` between two trees."""
    repo = tmp_path / "repo"
    repo.mkdir(parents=True)
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=repo, env=env, check=True, capture_output=True).stdout.decode()

    git("init", "-q")
    for rel, text in before.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git("add", "-A")
    git("commit", "-qm", "base")
    for rel, text in after.items():
        if text is None:
            (repo / rel).unlink()
        else:
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
    git("add", "-A")
    return git("diff", "--cached", *args)


def test_modify_add_delete(tmp_path):
    diff = git_diff(tmp_path, {"src/a.py": "a\n", "tests/test_a.py": "t\n"},
                    {"src/a.py": "b\n", "src/new.py": "n\n", "tests/test_a.py": None})
    assert touched_paths(diff) == {"src/a.py", "src/new.py", "tests/test_a.py"}


def test_rename_reports_both_names(tmp_path):
    diff = git_diff(tmp_path, {"tests/test_a.py": "x\n" * 20}, {"tests/test_a.py": None, "tests/moved.py": "x\n" * 20},
                    "-M")
    assert "rename from tests/test_a.py" in diff
    assert touched_paths(diff) == {"tests/test_a.py", "tests/moved.py"}


def test_quoted_and_spaced_names(tmp_path):
    diff = git_diff(tmp_path, {"dir x/caf\u00e9 1.py": "a\n"}, {"dir x/caf\u00e9 1.py": "b\n"})
    assert '"a/dir x/caf\\303\\251 1.py"' in diff  # git quotes non-ASCII names
    assert touched_paths(diff) == {"dir x/caf\u00e9 1.py"}
    plain = git_diff(tmp_path / "p", {"my tests/t.py": "a\n"}, {"my tests/t.py": "b\n"})
    assert touched_paths(plain) == {"my tests/t.py"}


def test_hunk_lines_that_look_like_headers_are_not_files(tmp_path):
    diff = git_diff(tmp_path, {"q.sql": "-- a comment\n++ b\nselect 1;\n"}, {"q.sql": "select 2;\n"})
    assert "\n--- a comment\n" in diff and "\n-++ b\n" in diff
    assert touched_paths(diff) == {"q.sql"}


def test_plain_unified_diff_without_git_headers():
    diff = "--- a/pkg/m.py\t2024-01-01 00:00:00\n+++ b/pkg/m.py\t2024-01-01 00:00:01\n@@ -1 +1 @@\n-x\n+y\n"
    assert touched_paths(diff) == {"pkg/m.py"}
    assert touched_paths("") == set()


def test_touches_matches_the_file_its_dirs_and_its_contents():
    assert touches({"tests/test_a.py"}, "tests/test_a.py")
    assert touches({"tests"}, "tests/test_a.py")  # the directory replaced by a file
    assert touches({"tests/test_a.py/x"}, "tests/test_a.py")
    assert not touches({"tests/test_ab.py", "src/a.py"}, "tests/test_a.py")


def test_unquote():
    assert unquote('"a\\tb\\"c\\\\d"') == 'a\tb"c\\d'
    assert unquote("plain name") == "plain name"


def test_repo_paths_must_stay_inside():
    assert repo_path(".", "tests/t.py") == PurePosixPath("tests/t.py")
    assert repo_path("sub", "./tests/t.py") == PurePosixPath("sub/tests/t.py")
    for workdir, rel in ((".", "../t.py"), (".", "/etc/passwd"), ("sub", "../../t.py"), (".", ".")):
        with pytest.raises(InvalidTask):
            repo_path(workdir, rel)
    check_workdir("sub/dir")
    with pytest.raises(InvalidTask):
        check_workdir("../elsewhere")


def make_workspace(tmp_path: Path) -> tuple[Path, dict]:
    ws = tmp_path / "ws"
    (ws / "tests").mkdir(parents=True)
    (ws / "tests" / "test_a.py").write_text("pristine a\n")
    (ws / "tests" / "test_b.py").write_text("pristine b\n")
    os.chmod(ws / "tests" / "test_b.py", 0o755)
    paths = [PurePosixPath("tests/test_a.py"), PurePosixPath("tests/test_b.py"), PurePosixPath("tests/test_new.py")]
    return ws, snapshot(ws, paths)


def test_restore_undoes_edits_deletions_and_additions(tmp_path):
    ws, saved = make_workspace(tmp_path)
    (ws / "tests" / "test_a.py").write_text("tampered\n")
    (ws / "tests" / "test_b.py").unlink()
    (ws / "tests" / "test_new.py").write_text("agent's own test\n")
    restore(ws, saved)
    assert (ws / "tests" / "test_a.py").read_text() == "pristine a\n"
    assert (ws / "tests" / "test_b.py").read_text() == "pristine b\n"
    assert os.stat(ws / "tests" / "test_b.py").st_mode & 0o777 == 0o755
    assert not (ws / "tests" / "test_new.py").exists()


def test_restore_never_writes_through_symlinks(tmp_path):
    ws, saved = make_workspace(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "test_a.py").write_text("host file\n")
    for f in (ws / "tests").iterdir():
        f.unlink()
    (ws / "tests").rmdir()
    (ws / "tests").symlink_to(outside)  # the diff made tests/ a link out of the workspace
    restore(ws, saved)
    assert (outside / "test_a.py").read_text() == "host file\n"
    assert sorted(p.name for p in outside.iterdir()) == ["test_a.py"]
    assert not (ws / "tests").is_symlink()
    assert (ws / "tests" / "test_a.py").read_text() == "pristine a\n"


def test_restore_replaces_a_file_link_and_a_directory(tmp_path):
    ws, saved = make_workspace(tmp_path)
    target = tmp_path / "secret"
    target.write_text("secret\n")
    (ws / "tests" / "test_a.py").unlink()
    (ws / "tests" / "test_a.py").symlink_to(target)
    (ws / "tests" / "test_b.py").unlink()
    (ws / "tests" / "test_b.py").mkdir()
    (ws / "tests" / "test_b.py" / "inner").write_text("x")
    restore(ws, saved)
    assert target.read_text() == "secret\n"
    assert (ws / "tests" / "test_a.py").read_text() == "pristine a\n"
    assert (ws / "tests" / "test_b.py").read_text() == "pristine b\n"
