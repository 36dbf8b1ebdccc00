"""The attack: rollouts on many (or large) sources. A worker's source cache was never
evicted (one rollout left 5.7 GB behind). Now it holds at most ``ARENA_SOURCE_CACHE_BYTES``
(default 4 GiB) beyond the sources jobs are using: the least recently used go first, and a
source a job holds (a lease: a shared flock, seen by every process) is never evicted."""

from __future__ import annotations

import os

from arena_core import sources
from arena_core.schemas import BundleSource
from arena_core.settings import Settings

MIB = 1024 * 1024


def bundle_of(tmp_path, name: str, size: int) -> bytes:
    repo = tmp_path / name
    repo.mkdir()
    (repo / "blob.bin").write_bytes(os.urandom(size))  # incompressible: its bytes are on the disk
    return sources.pack_dir(repo)


def test_the_default_budget_is_a_setting():
    assert Settings().source_cache_bytes == 4 * 1024**3
    assert Settings.from_env({"ARENA_SOURCE_CACHE_BYTES": "1000"}).source_cache_bytes == 1000


async def test_the_cache_stays_within_its_budget_least_recently_used_first(bus, tmp_path):
    digests = [await sources.push_bundle(bus, bundle_of(tmp_path, f"r{i}", 2 * MIB)) for i in range(6)]
    cache = sources.SourceCache(tmp_path / "cache", bus=bus, budget_bytes=5 * MIB)
    for digest in digests:
        async with cache.lease() as lease:
            tree = await cache.tree(BundleSource(digest=digest), lease)
            assert (tree / "blob.bin").stat().st_size == 2 * MIB
        assert cache.usage() <= 5 * MIB
    kept = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir() and not p.name.startswith("."))
    # two 2 MiB sources fit in 5 MiB: the two used last
    assert kept == sorted(sources.source_key(BundleSource(digest=d)) for d in digests[-2:])


async def test_a_source_in_use_is_never_evicted(bus, tmp_path):
    digests = [await sources.push_bundle(bus, bundle_of(tmp_path, f"r{i}", 2 * MIB)) for i in range(5)]
    cache = sources.SourceCache(tmp_path / "cache", bus=bus, budget_bytes=3 * MIB)
    # another process on the same directory (another worker) holds the first source
    other = sources.SourceCache(tmp_path / "cache", bus=bus, budget_bytes=3 * MIB)
    held = other.lease()
    first = await other.tree(BundleSource(digest=digests[0]), held)
    workspace, _ = await other.workspace(BundleSource(digest=digests[0]), held)
    for digest in digests[1:]:
        async with cache.lease() as lease:
            await cache.tree(BundleSource(digest=digest), lease)
    assert (first / "blob.bin").is_file() and (workspace / "blob.bin").is_file()  # still there, whole
    assert (first / "blob.bin").stat().st_size == 2 * MIB
    # only the held one and the last one are left: everything else went
    assert cache.usage() <= 3 * MIB + cache._size(cache._entries()[sources.source_key(BundleSource(digest=digests[0]))])
    held.release()
    async with cache.lease() as lease:
        await cache.tree(BundleSource(digest=digests[1]), lease)
    assert not first.exists()  # released, and the least recently used: evicted
    assert cache.usage() <= 3 * MIB
