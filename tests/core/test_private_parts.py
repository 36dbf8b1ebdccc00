"""Tasks' private parts in NATS: stored apart under their digest, a large hidden test patch
through the object store, read back whole by the verification plane."""

from __future__ import annotations

import pytest

from arena_core import private, subjects
from arena_core.schemas import TestsVerifier


async def test_small_and_large_verifiers_round_trip(bus):
    small = TestsVerifier(fail_to_pass=["t.py::a"])
    big = TestsVerifier(fail_to_pass=["t.py::a"], test_patch="+x = 1\n" * 200_000)  # ~1.4 MB
    keys = [await private.put_verifier(bus, v) for v in (small, big, small)]
    assert keys[0] == keys[2] != keys[1]  # content-addressed: one entry per verifier
    assert await private.get_verifier(bus, keys[0]) == small
    assert await private.get_verifier(bus, keys[1]) == big
    entry = await (await bus.kv(subjects.KV_VERIFIERS)).get(keys[1])
    assert len(entry.value) < 1024  # the bucket holds a pointer, the object store the patch
    with pytest.raises(private.VerifierMissing):
        await private.get_verifier(bus, "0" * 64)


async def test_a_large_verifier_lives_in_the_private_store_and_an_older_one_in_the_artifacts_is_still_read(bus):
    """Only rollout and verification may use ``arena_private`` (``arena_core.access``); the artifacts,
    which every service reads, never hold a new one. One stored before that store existed (its
    pointer names an object of ``arena_artifacts``) is still read."""
    import msgspec
    from nats.js.errors import ObjectNotFoundError

    big = TestsVerifier(fail_to_pass=["t.py::b"], test_patch="+y = 2\n" * 200_000)
    key = await private.put_verifier(bus, big)
    name = private.OBJECT_PREFIX + key
    assert (await (await bus.objects(subjects.OBJECT_PRIVATE)).get_info(name)).size > private.INLINE_MAX
    with pytest.raises(ObjectNotFoundError):
        await (await bus.artifacts()).get_info(name)
    older = TestsVerifier(fail_to_pass=["t.py::c"], test_patch="+z = 3\n" * 200_000)
    data = msgspec.json.encode(older)
    old_key = "1" * 64
    await (await bus.artifacts()).put(private.OBJECT_PREFIX + old_key, data)
    await (await bus.kv(subjects.KV_VERIFIERS)).put(old_key, msgspec.json.encode(private.Pointer(
        object=private.OBJECT_PREFIX + old_key)))
    assert await private.get_verifier(bus, old_key) == older
