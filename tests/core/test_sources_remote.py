"""Task sources that come from elsewhere: bundles through a real NATS object store, a git
repository served by a real ``git daemon``, an image on a real Docker-API engine, and the
rollout API's bundle routes and host-path rules (libs/arena_core/sources.py, docs/tasks.md)."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from arena_core import sources, subjects
from arena_stack.natsserver import free_port
from arena_core.runtime import serve
from arena_core.schemas import AgentSpec, BundleSource, GitSource, ImageSource, Task, TestsVerifier
from arena.sdk import ArenaClient
from arena_core.settings import Settings
from arena_core.sources import SourceCache, SourceError
from arena_rollout.app import create_app
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore
from arena_sandbox_providers.testing import built_image


def make_tree(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text("hello\n")
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    run = root / "run.sh"
    run.write_text("#!/bin/sh\necho hi\n")
    run.chmod(0o755)
    os.symlink("src/pkg/mod.py", root / "link.py")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return root


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file/link under ``root`` (directories implied) with its git-like mode and content."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = str(full.relative_to(root))
            if full.is_symlink():
                out[rel] = ("120000", os.readlink(full).encode())
            elif full.is_file():
                out[rel] = ("100755" if full.stat().st_mode & 0o100 else "100644", full.read_bytes())
    return out


# --------------------------------------------------------------------------- bundles over NATS


async def test_push_exists_fetch_through_the_object_store(bus, tmp_path):
    data = sources.pack_dir(make_tree(tmp_path / "repo"))
    digest = sources.digest_of(data)
    assert not await sources.bundle_exists(bus, digest)
    assert await sources.push_bundle(bus, data) == digest
    assert await sources.bundle_exists(bus, digest)
    assert await sources.push_bundle(bus, data) == digest  # storing again is a no-op
    assert await sources.fetch_bundle(bus, digest) == data
    missing = sources.digest_of(b"never stored")
    assert not await sources.bundle_exists(bus, missing)
    with pytest.raises(SourceError, match="not in Arena's object store"):
        await sources.fetch_bundle(bus, missing)


async def test_a_larger_bundle_survives_chunking(bus):
    data = os.urandom(3 * 1024 * 1024 + 17)  # several object-store chunks
    digest = await sources.push_bundle(bus, data)
    assert await sources.fetch_bundle(bus, digest) == data


async def test_bytes_stored_under_another_digest_are_refused(bus, tmp_path):
    good = sources.pack_dir(make_tree(tmp_path / "repo"))
    forged = sources.digest_of(good)
    store = await bus.artifacts()
    await store.put(sources.bundle_object(forged), good + b"tampered")
    assert await sources.bundle_exists(bus, forged)
    with pytest.raises(SourceError, match="do not match their digest"):
        await sources.fetch_bundle(bus, forged)
    cache = SourceCache(tmp_path / "cache", bus=bus)
    with pytest.raises(SourceError, match="do not match"):
        await cache.tree(BundleSource(digest=forged))
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-filled left behind


async def test_source_cache_materializes_and_caches_a_bundle(bus, tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "repo")
    digest = await sources.push_bundle(bus, sources.pack_dir(tree))
    fetches = []
    real_fetch = sources.fetch_bundle

    async def counting_fetch(b, d):
        fetches.append(d)
        return await real_fetch(b, d)

    monkeypatch.setattr(sources, "fetch_bundle", counting_fetch)
    cache = SourceCache(tmp_path / "cache-a", bus=bus)
    # concurrent jobs of one worker fetch once
    first, second = await asyncio.gather(cache.tree(BundleSource(digest=digest)), cache.bundle_tree(digest))
    assert first == second == tmp_path / "cache-a" / ("bundle-" + digest.split(":", 1)[1])
    assert fetches == [digest]
    expected = {k: v for k, v in snapshot(tree).items() if not k.startswith(".git")}
    assert snapshot(first) == expected
    assert not (first / ".git").exists()
    assert os.access(first / "run.sh", os.X_OK) and (first / "link.py").is_symlink()

    # cached: even with the object gone from the store, this worker still has the tree
    await (await bus.artifacts()).delete(sources.bundle_object(digest))
    assert await cache.tree(BundleSource(digest=digest)) == first
    assert fetches == [digest]
    assert not [p for p in (tmp_path / "cache-a").iterdir() if p.name.startswith(".tmp-")]

    # a second machine (another cache dir, same store) gets the same tree from the store
    await sources.push_bundle(bus, sources.pack_dir(tree))
    other = await SourceCache(tmp_path / "cache-b", bus=bus).tree(BundleSource(digest=digest))
    assert other != first and snapshot(other) == snapshot(first)
    assert sources.prepare_workspace(other, tmp_path / "ws-b") == sources.prepare_workspace(first, tmp_path / "ws-a")


async def test_source_cache_missing_bundle_is_a_source_error(bus, tmp_path):
    cache = SourceCache(tmp_path / "cache", bus=bus)
    with pytest.raises(SourceError, match="not in Arena's object store"):
        await cache.tree(BundleSource(digest=sources.digest_of(b"nothing")))
    assert list((tmp_path / "cache").iterdir()) == []


# --------------------------------------------------------------------------- git sources

#: The served repositories are on loopback over git://: a worker allows that only when told to.
LOCAL_GIT = sources.GitPolicy(schemes=frozenset({"git"}), allow_private=True)


def git(cwd: Path, *args: str) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, **sources.GIT_IDENTITY}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, check=True).stdout.decode()


def commit_all(work: Path, message: str) -> str:
    git(work, "add", "-A")
    git(work, "commit", "-qm", message)
    return git(work, "rev-parse", "HEAD").strip()


def tree_of_commit(bare: Path, sha: str) -> dict[str, tuple]:
    """The commit's files as git stores them: path -> (mode, content or link target)."""
    out = {}
    for line in git(bare, "ls-tree", "-r", "-z", sha).split("\0"):
        if not line:
            continue
        meta, path = line.split("\t", 1)
        mode, _, obj = meta.split()
        out[path] = (mode, subprocess.run(["git", "cat-file", "blob", obj], cwd=bare, capture_output=True,
                                          check=True).stdout)
    return out


@pytest.fixture(scope="module")
def git_server(tmp_path_factory):
    """``git daemon`` on a free port serving ``proj.git`` (main, a tag, an annotated tag, another
    branch), ``attrs.git`` (a .gitattributes with export-ignore/export-subst) and
    ``abslink.git`` (an absolute symlink); stopped by PID at the end."""
    base = tmp_path_factory.mktemp("git-served")
    work = tmp_path_factory.mktemp("git-work") / "proj"
    work.mkdir()
    git(work, "init", "-q", "-b", "main")
    (work / "a.txt").write_text("one\n")
    (work / "dir").mkdir()
    (work / "dir" / "tool.sh").write_text("#!/bin/sh\n")
    (work / "dir" / "tool.sh").chmod(0o755)
    os.symlink("a.txt", work / "link")
    c1 = commit_all(work, "c1")
    git(work, "tag", "v1")
    git(work, "tag", "-a", "v1-annotated", "-m", "annotated")
    (work / "a.txt").write_text("two\n")
    (work / "b.txt").write_text("b\n")
    c2 = commit_all(work, "c2")
    git(work, "checkout", "-qb", "other", c1)
    (work / "other.txt").write_text("other\n")
    (work / "dir" / "tool.sh").unlink()
    c3 = commit_all(work, "c3")
    git(work, "checkout", "-q", "main")
    git(base, "clone", "-q", "--bare", str(work), "proj.git")

    attrs = work.parent / "attrs"
    attrs.mkdir()
    git(attrs, "init", "-q", "-b", "main")
    (attrs / ".gitattributes").write_text("secret.txt export-ignore\nver.txt export-subst\n")
    (attrs / "secret.txt").write_text("kept\n")
    (attrs / "ver.txt").write_text("v=$Format:%H$\n")
    c_attrs = commit_all(attrs, "attrs")
    git(base, "clone", "-q", "--bare", str(attrs), "attrs.git")

    abslink = work.parent / "abslink"
    abslink.mkdir()
    git(abslink, "init", "-q", "-b", "main")
    (abslink / "f.txt").write_text("f\n")
    os.symlink("/etc/hostname", abslink / "abs")
    c_abs = commit_all(abslink, "abs")
    git(base, "clone", "-q", "--bare", str(abslink), "abslink.git")

    port = free_port()
    log = open(base.parent / "git-daemon.log", "wb")
    proc = subprocess.Popen(["git", "daemon", "--reuseaddr", f"--base-path={base}", "--export-all",
                             f"--port={port}", "--listen=127.0.0.1", str(base)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"git daemon did not start: {(base.parent / 'git-daemon.log').read_text()}")
                time.sleep(0.05)
        yield {"url": f"git://127.0.0.1:{port}", "bare": base / "proj.git", "c1": c1, "c2": c2, "c3": c3,
               "attrs": c_attrs, "abslink": c_abs, "base": base}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.parametrize("which", ["c1", "c2", "c3"], ids=["tagged-non-tip", "main-tip", "other-branch"])
def test_git_source_is_exactly_the_commits_tree(git_server, tmp_path, which):
    sha = git_server[which]
    dest = tmp_path / "tree"
    dest.mkdir()
    sources.fetch_git(GitSource(url=f"{git_server['url']}/proj.git", commit=sha), dest, policy=LOCAL_GIT)
    assert snapshot(dest) == tree_of_commit(git_server["bare"], sha)
    assert not (dest / ".git").exists()


def test_git_source_abbreviated_sha(git_server, tmp_path):
    dest = tmp_path / "tree"
    dest.mkdir()
    sources.fetch_git(GitSource(url=f"{git_server['url']}/proj.git", commit=git_server["c1"][:8]), dest, policy=LOCAL_GIT)
    assert snapshot(dest) == tree_of_commit(git_server["bare"], git_server["c1"])
    assert (dest / "a.txt").read_text() == "one\n" and not (dest / "b.txt").exists()


@pytest.mark.parametrize("commit", ["0123456789abcdef0123456789abcdef01234567", "deadbee"])
def test_git_source_unknown_commit(git_server, tmp_path, commit):
    with pytest.raises(SourceError, match=commit):
        sources.fetch_git(GitSource(url=f"{git_server['url']}/proj.git", commit=commit), tmp_path / "tree", policy=LOCAL_GIT)


def test_git_source_unknown_repository(git_server, tmp_path):
    with pytest.raises(SourceError):
        sources.fetch_git(GitSource(url=f"{git_server['url']}/nope.git", commit=git_server["c1"]), tmp_path / "t", policy=LOCAL_GIT)


async def test_git_source_through_the_cache(git_server, tmp_path, monkeypatch):
    calls = []
    real = sources.fetch_git
    monkeypatch.setattr(sources, "fetch_git", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1])
    cache = SourceCache(tmp_path / "cache", git=LOCAL_GIT)
    source = GitSource(url=f"{git_server['url']}/proj.git", commit=git_server["c2"])
    tree = await cache.tree(source)
    assert snapshot(tree) == tree_of_commit(git_server["bare"], git_server["c2"])
    assert await cache.tree(source) == tree and len(calls) == 1
    # file:// is a host path: refused here, before git runs
    with pytest.raises(SourceError, match="ARENA_ALLOW_HOST_PATHS"):
        await cache.tree(GitSource(url=f"file://{git_server['bare']}", commit=git_server["c2"]))
    allowed = SourceCache(tmp_path / "cache-allowed", allow_paths=True)
    local = await allowed.tree(GitSource(url=f"file://{git_server['bare']}", commit=git_server["c2"]))
    assert snapshot(local) == snapshot(tree)


def test_git_source_ignores_export_attributes(git_server, tmp_path):
    dest = tmp_path / "tree"
    dest.mkdir()
    sources.fetch_git(GitSource(url=f"{git_server['url']}/attrs.git", commit=git_server["attrs"]), dest, policy=LOCAL_GIT)
    assert snapshot(dest) == tree_of_commit(git_server["base"] / "attrs.git", git_server["attrs"])


async def test_git_source_with_an_absolute_symlink_is_a_source_error(git_server, tmp_path):
    cache = SourceCache(tmp_path / "cache", git=LOCAL_GIT)
    with pytest.raises(SourceError):
        await cache.tree(GitSource(url=f"{git_server['url']}/abslink.git", commit=git_server["abslink"]))


# --------------------------------------------------------------------------- image sources


@pytest.fixture(scope="module")
def test_image(docker_url, tmp_path_factory):
    """An image FROM arena/quickstart with /testbed (files, a symlink, an executable and a
    .git) and /abslink (an absolute symlink); removed at the end."""
    docker = pytest.importorskip("docker")
    client = docker.DockerClient(base_url=docker_url)  # the tests look at its containers
    files = {
        "Containerfile": (b"FROM arena/quickstart:latest\nCOPY testbed /testbed\nCOPY abslink /abslink\n", 0o644),
        "testbed/README.md": (b"hello\n", 0o644),
        "testbed/src/mod.py": (b"x = 1\n", 0o644),
        "testbed/run.sh": (b"#!/bin/sh\n", 0o755),
        "testbed/.git/HEAD": (b"ref: refs/heads/main\n", 0o644),
        "testbed/.git/config": (b"[core]\n", 0o644),
        "abslink/f.txt": (b"f\n", 0o644),
    }
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, (content, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(content), mode
            tar.addfile(info, io.BytesIO(content))
        for name, target in (("testbed/link", "README.md"), ("abslink/abs", "/etc/hostname")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    try:
        with built_image(docker_url, raw.getvalue(), "arena-test-sources") as tag:
            yield {"image": tag, "client": client}
    except docker.errors.DockerException as exc:
        pytest.skip(f"cannot build a test image on the engine: {exc}")
    finally:
        client.close()


async def test_image_source_is_its_directory_without_git(test_image, docker_url, tmp_path):
    cache = SourceCache(tmp_path / "cache", docker_url=docker_url)
    tree = await cache.tree(ImageSource(image=test_image["image"]))
    assert snapshot(tree) == {
        "README.md": ("100644", b"hello\n"),
        "src/mod.py": ("100644", b"x = 1\n"),
        "run.sh": ("100755", b"#!/bin/sh\n"),
        "link": ("120000", b"README.md"),
    }
    assert not (tree / ".git").exists()
    assert await cache.tree(ImageSource(image=test_image["image"])) == tree
    # the container it was read from is gone (created, never started, removed)
    assert test_image["client"].containers.list(all=True, filters={"ancestor": test_image["image"]}) == []


def test_image_source_missing_image_or_path(test_image, docker_url, tmp_path):
    with pytest.raises(SourceError, match="arena-test-missing"):
        sources.extract_image(ImageSource(image="localhost/arena-test-missing:nope"), tmp_path / "a", docker_url)
    with pytest.raises(SourceError):
        sources.extract_image(ImageSource(image=test_image["image"], path="/no/such/dir"), tmp_path / "b",
                              docker_url)
    assert test_image["client"].containers.list(all=True, filters={"ancestor": test_image["image"]}) == []


def test_image_source_with_an_absolute_symlink_is_a_source_error(test_image, docker_url, tmp_path):
    with pytest.raises(SourceError):
        sources.extract_image(ImageSource(image=test_image["image"], path="/abslink"), tmp_path / "t", docker_url)


# --------------------------------------------------------------------------- the rollout API

MAX_BUNDLE = 256 * 1024


@pytest.fixture
async def rollout(bus):
    settings = Settings(allow_host_paths=False, nats_url="nats://127.0.0.1:1", backend_url="http://127.0.0.1:9/v1",
                        public_url="http://arena:9090", max_bundle_bytes=MAX_BUNDLE)
    store = RolloutStore(await bus.kv(subjects.KV_ROLLOUTS))
    http = httpx.AsyncClient()
    service = RolloutService(bus=bus, store=store, settings=settings, http=http)
    api = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)), base_url="http://arena")
    try:
        yield api, service
    finally:
        await api.aclose()
        await service.upstream.aclose()
        await http.aclose()


def task_json(**fields) -> dict:
    fields.setdefault("agent", AgentSpec(command=["true"]))
    task = Task(id="t1", instructions="fix it", verifier=TestsVerifier(fail_to_pass=["tests/test_a.py::test_a"]),
                **fields)
    return msgspec.to_builtins(task)


async def test_post_bundle_stores_it_under_its_digest(rollout, bus, tmp_path):
    api, _ = rollout
    data = sources.pack_dir(make_tree(tmp_path / "repo"))
    resp = await api.post("/v1/bundles", content=data, headers={"content-type": "application/gzip"})
    assert resp.status_code == 201, resp.text
    assert resp.json() == {"digest": sources.digest_of(data), "size": len(data)}
    assert await sources.fetch_bundle(bus, sources.digest_of(data)) == data
    again = await api.post("/v1/bundles", content=data)
    assert again.status_code == 201 and again.json()["digest"] == sources.digest_of(data)
    # a plain (not gzipped) tar is a bundle too
    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w") as tar:
        info = tarfile.TarInfo("x.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    assert (await api.post("/v1/bundles", content=plain.getvalue())).status_code == 201

    got = await api.get(f"/v1/bundles/{sources.digest_of(data)}")
    assert got.status_code == 200 and got.json() == {"digest": sources.digest_of(data)}
    missing = await api.get(f"/v1/bundles/{sources.digest_of(b'nope')}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    for bad in ("sha256:xyz", "sha256:" + "A" * 64, "md5:" + "a" * 32, "a" * 64):
        resp = await api.get(f"/v1/bundles/{bad}")
        assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_request", bad


async def test_post_bundle_refuses_bad_bundles(rollout, bus):
    api, _ = rollout
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:gz") as tar:
        info = tarfile.TarInfo("../evil")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    linked = io.BytesIO()
    with tarfile.open(fileobj=linked, mode="w") as tar:
        info = tarfile.TarInfo("out")
        info.type, info.linkname = tarfile.SYMTYPE, "../../etc"
        tar.addfile(info)
    for body, words in ((b"definitely not a tar", "not a valid tar"), (evil.getvalue(), "unsafe"),
                        (linked.getvalue(), "unsafe"), (b"", "empty")):
        resp = await api.post("/v1/bundles", content=body)
        assert resp.status_code == 422, resp.text
        assert resp.json()["error"]["code"] == "invalid_request" and words in resp.json()["error"]["message"]
        if body:
            assert not await sources.bundle_exists(bus, sources.digest_of(body))


async def test_post_bundle_over_the_limit_is_413(rollout, bus):
    api, _ = rollout
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        content = os.urandom(MAX_BUNDLE)
        info = tarfile.TarInfo("big.bin")
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    data = raw.getvalue()
    resp = await api.post("/v1/bundles", content=data)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "payload_too_large"

    async def chunked():  # no content-length: counted while read
        for i in range(0, len(data), 64 * 1024):
            yield data[i:i + 64 * 1024]

    resp = await api.post("/v1/bundles", content=chunked())
    assert resp.status_code == 413
    assert not await sources.bundle_exists(bus, sources.digest_of(data))


async def test_submissions_refuse_host_paths(rollout, tmp_path):
    api, _ = rollout
    repo = make_tree(tmp_path / "repo")
    cases = [
        task_json(repo=str(repo)),
        {**task_json(), "source": {"type": "path", "path": str(repo)}},
        task_json(source=BundleSource(digest=sources.digest_of(b"x")), agent=AgentSpec(command=["true"],
                                                                                         path=str(repo))),
    ]
    for task in cases:
        resp = await api.post("/v1/rollouts", json={"task": task})
        assert resp.status_code == 422, resp.text
        error = resp.json()["error"]
        assert error["code"] == "invalid_request"
        assert "ARENA_ALLOW_HOST_PATHS" in error["message"] and "bundle" in error["message"]
    resp = await api.post("/v1/rollouts", json={"task": task_json(source=GitSource(url=f"file://{repo}",
                                                                                     commit="a" * 40))})
    assert resp.status_code == 422 and "file://" in resp.json()["error"]["message"]
    group = await api.post("/v1/rollout-groups", json={"task": task_json(repo=str(repo)), "n": 2})
    assert group.status_code == 422 and "bundle" in group.json()["error"]["message"]


async def test_submissions_naming_a_missing_bundle_are_refused(rollout, bus, tmp_path):
    api, service = rollout
    stored = await sources.push_bundle(bus, sources.pack_dir(make_tree(tmp_path / "repo")))
    missing = sources.digest_of(b"not stored")
    for task in (task_json(source=BundleSource(digest=missing)),
                 task_json(source=BundleSource(digest=stored), agent=AgentSpec(command=["true"], bundle=missing))):
        resp = await api.post("/v1/rollouts", json={"task": task})
        assert resp.status_code == 422, resp.text
        assert missing in resp.json()["error"]["message"] and "/v1/bundles" in resp.json()["error"]["message"]
    assert await service.store.list() == []


async def test_a_submission_with_a_stored_bundle_is_accepted(rollout, bus, tmp_path):
    api, service = rollout
    data = sources.pack_dir(make_tree(tmp_path / "repo"))
    digest = (await api.post("/v1/bundles", content=data)).json()["digest"]
    resp = await api.post("/v1/rollouts", json={"task": task_json(source=BundleSource(digest=digest))})
    assert resp.status_code == 201, resp.text
    record, _ = await service.store.get(resp.json()["rollout_id"])
    assert record.task.source == BundleSource(digest=digest) and record.task.repo == ""
    group = await api.post("/v1/rollout-groups", json={"task": task_json(source=BundleSource(digest=digest)), "n": 2})
    assert group.status_code == 201 and len(group.json()["rollout_ids"]) == 2


async def test_sdk_uploads_local_directories_as_bundles(bus, tmp_path):
    """ArenaClient.submit against a real server that takes no host paths: ``repo`` and
    ``agent.path`` go up as bundles, and the submission names them."""
    settings = Settings(allow_host_paths=False, nats_url="nats://127.0.0.1:1", backend_url="http://127.0.0.1:9/v1")
    store = RolloutStore(await bus.kv(subjects.KV_ROLLOUTS))
    http = httpx.AsyncClient()
    service = RolloutService(bus=bus, store=store, settings=settings, http=http)
    port, stop = free_port(), asyncio.Event()
    server = asyncio.create_task(serve(stop, app=create_app(service), port=port))
    try:
        for _ in range(200):
            try:
                if (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200:
                    break
            except httpx.TransportError:
                await asyncio.sleep(0.02)
        repo = make_tree(tmp_path / "repo")
        agent_dir = tmp_path / "agent"
        agent_dir.mkdir()
        (agent_dir / "agent.py").write_text("print('hi')\n")
        task = Task(id="t1", repo=str(repo), instructions="fix it", agent=AgentSpec(command=["python", "agent.py"],
                                                                                     path=str(agent_dir)),
                    verifier=TestsVerifier(fail_to_pass=["tests/test_a.py::test_a"]))

        def use_sdk():
            with ArenaClient(f"http://127.0.0.1:{port}") as client:
                digest = client.push_bundle(repo)
                assert client.push_bundle(repo) == digest  # already stored: not sent again
                return digest, client.submit(task)

        digest, view = await asyncio.to_thread(use_sdk)
        assert digest == sources.digest_of(sources.pack_dir(repo))
        record, _ = await service.store.get(view.rollout_id)
        assert record.task.source == BundleSource(digest=digest) and record.task.repo == ""
        assert record.task.agent.path is None
        assert record.task.agent.bundle == sources.digest_of(sources.pack_dir(agent_dir))
        assert await sources.bundle_exists(bus, record.task.agent.bundle)
    finally:
        stop.set()
        await server
        await service.upstream.aclose()
        await http.aclose()
