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
