"""Scratch directories a killed verification worker left are removed when the next one starts."""

from __future__ import annotations

from arena_verification.__main__ import _reap_scratch


def test_a_restarted_worker_removes_the_scratch_a_killed_one_left(tmp_path):
    scratch = tmp_path / "verify"
    for name in ("arena-verify-a1", "arena-verify-own-b2"):
        (scratch / name / "repo").mkdir(parents=True)
        (scratch / name / "repo" / "f.py").write_text("x = 1\n")
    assert _reap_scratch(scratch) == 2
    assert list(scratch.iterdir()) == []
    assert _reap_scratch(tmp_path / "missing") == 0
