"""Task sources without a network: reproducible bundles, the bundle checks, extraction,
base workspaces, git URL rules and the cache's refusal of host paths (libs/arena_core/sources.py)."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import stat
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from arena_core import sources
from arena_core.schemas import BundleSource, PathSource
from arena_core.sources import SourceCache, SourceError


def make_tree(root: Path) -> Path:
    """A small repository tree: nested dirs, an executable, a symlink, and a .git dir."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text("hello\n")
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "__init__.py").write_text("")
    (root / "src" / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    run = root / "run.sh"
    run.write_text("#!/bin/sh\necho hi\n")
    run.chmod(0o755)
    os.symlink("src/pkg/mod.py", root / "link.py")
    (root / "empty").mkdir()
    git = root / ".git"
    (git / "objects").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "config").write_text("[core]\n")
    return root


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        return {m.name: m for m in tar.getmembers()}


def tar_of(*infos: tuple[tarfile.TarInfo, bytes | None], gz: bool = False) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for info, content in infos:
            if content is not None:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
            else:
                tar.addfile(info)
    return gzip.compress(raw.getvalue()) if gz else raw.getvalue()


def file_info(name: str) -> tarfile.TarInfo:
    return tarfile.TarInfo(name)


def link_info(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` (but .git) with its kind, content / link target and exec bit."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = str(full.relative_to(root))
            if full.is_symlink():
                out[rel] = ("link", os.readlink(full))
            elif full.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", full.read_bytes(), bool(full.stat().st_mode & 0o100))
    return out


# --------------------------------------------------------------------------- pack_dir


def test_pack_dir_is_byte_identical_for_the_same_tree_and_a_copy_with_other_mtimes(tmp_path):
    tree = make_tree(tmp_path / "a")
    first = sources.pack_dir(tree)
    assert sources.pack_dir(tree) == first

    copy = tmp_path / "b"
    shutil.copytree(tree, copy, symlinks=True)  # copystat keeps mtimes: change them below
    later = time.time() + 12345
    for dirpath, dirnames, filenames in os.walk(copy):
        for name in dirnames + filenames:
            os.utime(Path(dirpath) / name, (later, later), follow_symlinks=False)
    os.utime(copy, (later, later))
    # a different .git does not matter either
    (copy / ".git" / "HEAD").write_text("ref: refs/heads/other\n")
    assert sources.pack_dir(copy) == first
    assert sources.digest_of(sources.pack_dir(copy)) == sources.digest_of(first)


def test_pack_dir_changes_with_content(tmp_path):
    tree = make_tree(tmp_path / "a")
    before = sources.pack_dir(tree)
    (tree / "README.md").write_text("hello!\n")
    assert sources.pack_dir(tree) != before


def test_pack_dir_excludes_git_and_keeps_symlinks_and_exec_bits(tmp_path):
    tree = make_tree(tmp_path / "a")
    (tree / "src" / ".git").mkdir()  # a nested .git directory too
    (tree / "src" / ".git" / "HEAD").write_text("x")
    data = sources.pack_dir(tree)
    found = members(data)
    assert not [n for n in found if ".git" in Path(n).parts]
    assert {"README.md", "src", "src/pkg", "src/pkg/mod.py", "run.sh", "link.py", "empty"} <= set(found)
    assert found["link.py"].issym() and found["link.py"].linkname == "src/pkg/mod.py"
    assert found["run.sh"].mode & 0o111 and not found["README.md"].mode & 0o111
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" for m in found.values())
    # gzip header carries no time either
    assert data[:2] == b"\x1f\x8b" and data[4:8] == b"\0\0\0\0"


def test_pack_dir_refuses_a_non_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SourceError):
        sources.pack_dir(tmp_path / "f")
    with pytest.raises(SourceError):
        sources.pack_dir(tmp_path / "missing")


def test_pack_dir_keeps_both_names_of_a_hard_linked_file(tmp_path):
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "a.txt").write_text("same\n")
    os.link(tree / "a.txt", tree / "b.txt")
    out = tmp_path / "out"
    sources.extract_bundle(sources.pack_dir(tree), out)
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "b.txt"]
    assert (out / "b.txt").read_text() == "same\n"


def test_digest_of():
    assert sources.digest_of(b"") == "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert sources.DIGEST.fullmatch(sources.digest_of(b"abc"))
    assert sources.digest_of(b"abc") != sources.digest_of(b"abd")
    assert sources.bundle_object(sources.digest_of(b"")) == "bundles/" + sources.digest_of(b"")


# --------------------------------------------------------------------------- check_bundle


def test_check_bundle_accepts_pack_dir_output_and_plain_tars(tmp_path):
    data = sources.pack_dir(make_tree(tmp_path / "a"))
    assert sources.check_bundle(data) == len(members(data))
    plain = tar_of((file_info("a.txt"), b"x"), (link_info("b", "a.txt"), None))
    assert sources.check_bundle(plain) == 2
    # a link inside the tree, and a hard link to a member, are fine
    assert sources.check_bundle(tar_of((file_info("d/a"), b"x"), (link_info("d/l", "../d/a"), None),
                                       (link_info("h", "d/a", tarfile.LNKTYPE), None), gz=True)) == 3


@pytest.mark.parametrize("data", [b"", b"hello, not a tar", gzip.compress(b"gzipped but not a tar"), b"\0" * 100,
                                  os.urandom(4096)], ids=["empty", "text", "gzip-text", "short-zeros", "random"])
def test_check_bundle_refuses_what_is_not_a_tar(data):
    with pytest.raises(SourceError, match="not a valid tar"):
        sources.check_bundle(data)


def test_check_bundle_refuses_a_truncated_tar(tmp_path):
    data = gzip.decompress(sources.pack_dir(make_tree(tmp_path / "a")))
    with pytest.raises(SourceError):
        sources.check_bundle(data[:700])


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tar.gz"])
@pytest.mark.parametrize("infos", [
    [(file_info("../evil"), b"x")],
    [(file_info("ok/../../evil"), b"x")],
    [(link_info("out", "../../.."), None), (file_info("out/evil"), b"x")],
    [(link_info("out", "/etc"), None), (file_info("out/passwd"), b"x")],
    [(link_info("hard", "/etc/passwd", tarfile.LNKTYPE), None)],
    [(link_info("hard", "../outside", tarfile.LNKTYPE), None)],
], ids=["dotdot", "nested-dotdot", "symlink-out-then-through", "symlink-absolute",
        "hardlink-absolute", "hardlink-out"])
def test_check_bundle_refuses_unsafe_members(infos, gz):
    with pytest.raises(SourceError, match="unsafe member"):
        sources.check_bundle(tar_of(*infos, gz=gz))


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tar.gz"])
def test_check_bundle_refuses_an_absolute_path(gz):
    with pytest.raises(SourceError, match="unsafe member"):
        sources.check_bundle(tar_of((file_info("/etc/evil"), b"x"), gz=gz))


def test_extract_bundle_keeps_an_absolute_name_inside_dest(tmp_path):
    sources.extract_bundle(tar_of((file_info("/tmp-arena-evil/evil"), b"x")), tmp_path / "dest")
    assert (tmp_path / "dest" / "tmp-arena-evil" / "evil").read_bytes() == b"x"
    assert not Path("/tmp-arena-evil").exists()


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_check_bundle_refuses_device_files(kind):
    info = tarfile.TarInfo("dev/thing")
    info.type = kind
    info.devmajor, info.devminor = 1, 3
    with pytest.raises(SourceError, match="unsafe member"):
        sources.check_bundle(tar_of((file_info("a"), b"x"), (info, None)))


def test_check_bundle_refuses_a_symlink_chain_that_escapes():
    data = tar_of((link_info("d", "."), None), (link_info("e", "d/.."), None), (file_info("e/evil"), b"x"))
    with pytest.raises(SourceError):
        sources.check_bundle(data)


def test_check_bundle_bounds_members_and_bytes():
    data = tar_of(*[(file_info(f"f{i}"), b"x" * 10) for i in range(5)])
    assert sources.check_bundle(data) == 5
    with pytest.raises(sources.BundleTooLarge, match="more than 4 files"):
        sources.check_bundle(data, sources.UnpackLimits(max_files=4))
    with pytest.raises(sources.BundleTooLarge, match="ARENA_MAX_BUNDLE_UNPACKED_BYTES"):
        sources.check_bundle(data, sources.UnpackLimits(max_bytes=45, max_files=100))


def test_check_bundle_bounds_a_gzip_bomb():
    bomb = tar_of((file_info("zeros"), b"\0" * (4 * 1024 * 1024)), gz=True)
    assert len(bomb) < 64 * 1024
    with pytest.raises(sources.BundleTooLarge):
        sources.check_bundle(bomb, sources.UnpackLimits(max_bytes=1024 * 1024))


# --------------------------------------------------------------------------- extract_bundle


def test_extract_bundle_round_trip(tmp_path):
    tree = make_tree(tmp_path / "a")
    data = sources.pack_dir(tree)
    out = tmp_path / "out"
    sources.extract_bundle(data, out)
    assert snapshot(out) == snapshot(tree)
    assert not (out / ".git").exists()
    assert os.access(out / "run.sh", os.X_OK) and not os.access(out / "README.md", os.X_OK)
    assert (out / "link.py").is_symlink() and (out / "link.py").read_text() == "def f():\n    return 1\n"
    # and packing the extracted tree gives the same bytes
    assert sources.pack_dir(out) == data


def test_extract_bundle_refuses_unsafe_and_non_tars(tmp_path):
    with pytest.raises(SourceError):
        sources.extract_bundle(b"not a tar", tmp_path / "x")
    with pytest.raises(SourceError):
        sources.extract_bundle(tar_of((file_info("../evil"), b"x")), tmp_path / "y" / "dest")
    assert not (tmp_path / "y" / "evil").exists()
    with pytest.raises(SourceError):
        sources.extract_bundle(tar_of((link_info("out", str(tmp_path)), None), (file_info("out/evil2"), b"x")),
                               tmp_path / "z")
    assert not (tmp_path / "evil2").exists()


# --------------------------------------------------------------------------- prepare_workspace


def git(cwd: Path, *args: str) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, **sources.GIT_IDENTITY}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout


def make_repo_with_history(root: Path) -> Path:
    make_tree(root)
    shutil.rmtree(root / ".git")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "one")
    git(root, "tag", "v1")
    git(root, "tag", "-a", "v1-annotated", "-m", "annotated")
    git(root, "checkout", "-qb", "feature")
    (root / "feature.txt").write_text("feature\n")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "two")
    git(root, "remote", "add", "origin", "https://example.invalid/repo.git")
    git(root, "update-ref", "refs/remotes/origin/main", "HEAD")
    git(root, "stash", "list")
    git(root, "notes", "add", "-m", "a note")
    return root


def test_prepare_workspace_is_one_commit_and_nothing_else(tmp_path):
    repo = make_repo_with_history(tmp_path / "repo")
    dest = tmp_path / "ws"
    sha = sources.prepare_workspace(repo, dest)
    assert len(sha) == 40
    assert git(dest, "rev-parse", "HEAD").strip() == sha
    assert git(dest, "rev-list", "--all", "--count").strip() == "1"
    assert git(dest, "for-each-ref", "--format=%(refname)").split() == ["refs/heads/main"]
    assert git(dest, "symbolic-ref", "HEAD").strip() == "refs/heads/main"
    assert git(dest, "tag").strip() == "" and git(dest, "remote").strip() == ""
    assert git(dest, "stash", "list").strip() == ""
    assert git(dest, "reflog", "--all").strip() == ""
    # no template's sample hooks or description (each file is copied into every sandbox); an empty hooks dir
    assert sorted(p.name for p in (dest / ".git").iterdir()) == ["HEAD", "config", "hooks", "index", "objects", "refs"]
    assert not any((dest / ".git" / "hooks").iterdir())
    assert not (dest / ".git" / "packed-refs").exists() or not (dest / ".git" / "packed-refs").read_text().strip()
    assert git(dest, "status", "--porcelain").strip() == ""
    # the base holds the tree (with the branch's extra file), its symlink and exec bit
    files = git(dest, "ls-files", "-s").splitlines()
    modes = {line.split("\t")[1]: line.split()[0] for line in files}
    assert modes["run.sh"] == "100755" and modes["README.md"] == "100644" and modes["link.py"] == "120000"
    assert "feature.txt" in modes
    assert git(dest, "log", "--format=%an <%ae> %ad", "--date=iso-strict").strip() == (
        "arena <arena@localhost> 2000-01-01T00:00:00+00:00")


def test_prepare_workspace_sha_depends_only_on_the_tree(tmp_path):
    repo = make_repo_with_history(tmp_path / "repo")
    a = sources.prepare_workspace(repo, tmp_path / "ws1")
    b = sources.prepare_workspace(repo, tmp_path / "ws2")
    assert a == b
    # a copy without history, from a bundle, gives the same base
    extracted = tmp_path / "extracted"
    sources.extract_bundle(sources.pack_dir(repo), extracted)
    assert sources.prepare_workspace(extracted, tmp_path / "ws3") == a
    (extracted / "README.md").write_text("changed\n")
    assert sources.prepare_workspace(extracted, tmp_path / "ws4") != a


def test_prepare_workspace_refuses_a_missing_repo(tmp_path):
    with pytest.raises(FileNotFoundError):
        sources.prepare_workspace(tmp_path / "nope", tmp_path / "ws")


# --------------------------------------------------------------------------- git URLs


@pytest.mark.parametrize("url", ["https://github.com/org/repo.git", "http://host/repo", "git://host/repo",
                                 "ssh://git@host/repo.git", "HTTPS://HOST/REPO"])
def test_check_git_url_accepts_network_transports_a_policy_allows(url):
    every = sources.GitPolicy(schemes=sources.GIT_SCHEMES)
    assert sources.check_git_url(url, allow_file=False, policy=every, resolve=False) == []


@pytest.mark.parametrize("url", ["http://host/repo", "git://host/repo", "ssh://git@host/repo.git"])
def test_check_git_url_allows_only_https_by_default(url):
    with pytest.raises(SourceError, match="ARENA_GIT_ALLOWED_SCHEMES"):
        sources.check_git_url(url, allow_file=False, resolve=False)
    sources.check_git_url("HTTPS://HOST/REPO", allow_file=False, resolve=False)


def test_check_git_url_file_only_with_allow_file():
    with pytest.raises(SourceError, match="ARENA_ALLOW_HOST_PATHS"):
        sources.check_git_url("file:///srv/repo", allow_file=False)
    with pytest.raises(SourceError):
        sources.check_git_url("FILE:///srv/repo", allow_file=False)
    sources.check_git_url("file:///srv/repo", allow_file=True)


@pytest.mark.parametrize("url", ["ext::sh -c touch% /tmp/pwned", "ext::ssh://host/x", "/srv/repo", "../repo",
                                 "fd::17", "git@github.com:org/repo.git", "ftp://host/repo", "", "-uhttps://x"])
@pytest.mark.parametrize("allow_file", [False, True])
def test_check_git_url_refuses_other_transports(url, allow_file):
    with pytest.raises(SourceError):
        sources.check_git_url(url, allow_file=allow_file)


def test_fetch_git_refuses_a_file_url_before_running_git(tmp_path):
    from arena_core.schemas import GitSource

    with pytest.raises(SourceError, match="ARENA_ALLOW_HOST_PATHS"):
        sources.fetch_git(GitSource(url=f"file://{tmp_path}", commit="a" * 40), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the cache


async def test_source_cache_refuses_path_sources_unless_allowed(tmp_path):
    tree = make_tree(tmp_path / "repo")
    cache = SourceCache(tmp_path / "cache", allow_paths=False)
    with pytest.raises(SourceError, match="ARENA_ALLOW_HOST_PATHS") as info:
        await cache.tree(PathSource(path=str(tree)))
    assert "bundle" in str(info.value)
    with pytest.raises(SourceError, match="no source"):
        await cache.tree(None)

    allowed = SourceCache(tmp_path / "cache", allow_paths=True)
    assert await allowed.tree(PathSource(path=str(tree))) == tree
    with pytest.raises(SourceError, match="not a directory"):
        await allowed.tree(PathSource(path=str(tmp_path / "missing")))


async def test_source_cache_without_a_bus_cannot_read_bundles(tmp_path):
    cache = SourceCache(tmp_path / "cache")
    with pytest.raises(SourceError, match="object store"):
        await cache.tree(BundleSource(digest=sources.digest_of(b"x")))
    # nothing half-filled is left behind
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-")]


def test_source_cache_reap_removes_half_filled_trees(tmp_path):
    cache = SourceCache(tmp_path / "cache")
    (tmp_path / "cache" / ".tmp-bundle-x-1234").mkdir(parents=True)
    (tmp_path / "cache" / "bundle-kept").mkdir()
    cache.reap()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["bundle-kept"]


def test_source_keys_are_distinct():
    from arena_core.schemas import GitSource, ImageSource

    keys = {sources.source_key(s) for s in [
        BundleSource(digest=sources.digest_of(b"a")), BundleSource(digest=sources.digest_of(b"b")),
        GitSource(url="https://h/r", commit="a" * 40), GitSource(url="https://h/r", commit="b" * 40),
        GitSource(url="https://h/s", commit="a" * 40), ImageSource(image="x"), ImageSource(image="x", path="/src"),
    ]}
    assert len(keys) == 7
    assert all("/" not in k for k in keys)
    with pytest.raises(SourceError):
        sources.source_key(PathSource(path="/x"))


def test_mode_bits_never_include_setuid(tmp_path):
    tree = tmp_path / "t"
    tree.mkdir()
    f = tree / "suid"
    f.write_text("x")
    f.chmod(0o4755)
    info = members(sources.pack_dir(tree))["suid"]
    assert info.mode == 0o755 and not info.mode & stat.S_ISUID


async def test_a_sources_base_repository_is_committed_once_per_worker(tmp_path):
    """``SourceCache.workspace``: the same directory and sha for every job of a source; a host
    path is never cached (it may change between jobs)."""
    import subprocess

    from arena_core.schemas import BundleSource, PathSource
    from arena_core.sources import SourceCache, prepare_workspace, source_key

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    cache = SourceCache(tmp_path / "cache")
    source = BundleSource(digest="sha256:" + "0" * 64)
    (cache.dir / source_key(source)).mkdir(parents=True)  # as if fetched
    (cache.dir / source_key(source) / "a.py").write_text("x = 1\n")
    first = await cache.workspace(source)
    second = await cache.workspace(source)
    assert first == second and first[0].name.endswith(".workspace")
    assert first[1] == prepare_workspace(repo, tmp_path / "fresh")  # the deterministic base commit
    log = subprocess.run(["git", "log", "--format=%H"], cwd=first[0], capture_output=True, text=True).stdout.split()
    assert log == [first[1]]  # one commit: no history
    assert await cache.workspace(PathSource(path=str(repo))) is None
