"""The attack: a 1.9 MB bundle that unpacks to 1.9 GiB was accepted, and one rollout on it
filled the worker's disk. Now ``POST /v1/bundles`` answers 413 in the API's error shape
past ``ARENA_MAX_BUNDLE_UNPACKED_BYTES`` / ``ARENA_MAX_BUNDLE_FILES`` (defaults: 512 MiB,
50,000 files), from the archive's headers (the bomb is not decompressed past its first
header), and a worker never unpacks one that got into the store another way."""

from __future__ import annotations

import gzip
import io
import tarfile

from arena_core import sources
from arena_core.schemas import BundleSource
from arena_core.settings import Settings

CHUNK = 64 * 1024 * 1024


def bomb(chunks: int = 30) -> bytes:
    """A gzipped tar of one file of ``chunks`` x 64 MiB of zeros (30: 1.9 GiB), as
    concatenated gzip members (the same compressed chunk repeated: made in a second)."""
    header = tarfile.TarInfo("zeros")
    header.size = chunks * CHUNK
    zeros = gzip.compress(bytes(CHUNK), compresslevel=9, mtime=0)
    return b"".join([gzip.compress(header.tobuf(format=tarfile.PAX_FORMAT), mtime=0), *[zeros] * chunks,
                     gzip.compress(bytes(1024), mtime=0)])


def many_files(n: int) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for i in range(n):
            tar.addfile(tarfile.TarInfo(f"f{i}"), io.BytesIO(b""))
    return gzip.compress(raw.getvalue(), mtime=0)


def disk_usage(path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*")) if path.exists() else 0


async def test_the_bomb_is_a_413_and_is_not_stored(api):
    data = bomb()
    assert len(data) < 2_100_000  # 1.9 MB on the wire
    r = await api.post("/v1/bundles", content=data, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "payload_too_large"
    assert "ARENA_MAX_BUNDLE_UNPACKED_BYTES" in error["message"] and "512.0 MiB" in error["message"]
    assert (await api.get(f"/v1/bundles/{sources.digest_of(data)}")).status_code == 404


async def test_too_many_files_is_a_413(api):
    over = Settings().max_bundle_files + 1
    r = await api.post("/v1/bundles", content=many_files(over))
    assert r.status_code == 413, r.text
    assert "ARENA_MAX_BUNDLE_FILES" in r.json()["error"]["message"]


async def test_a_bundle_within_the_limits_is_stored(api, tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "a.py").write_text("x = 1\n")
    data = sources.pack_dir(tmp_path / "repo")
    r = await api.post("/v1/bundles", content=data)
    assert r.status_code == 201, r.text
    assert (await api.get(f"/v1/bundles/{r.json()['digest']}")).status_code == 200


async def test_a_stored_bomb_is_never_unpacked_by_a_worker(bus, tmp_path):
    """One that reached the object store another way (before the limits; by hand): the
    worker refuses it before writing any of it."""
    digest = await sources.push_bundle(bus, bomb())
    cache = sources.SourceCache(tmp_path / "cache", bus=bus, limits=sources.unpack_limits(Settings()))
    try:
        await cache.tree(BundleSource(digest=digest))
        raise AssertionError("the bomb was unpacked")
    except sources.BundleTooLarge as exc:
        assert "ARENA_MAX_BUNDLE_UNPACKED_BYTES" in str(exc)
    assert disk_usage(tmp_path / "cache") < 1024 * 1024
